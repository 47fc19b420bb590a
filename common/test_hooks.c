/* test_hooks.c - the tests' faults and delays (common/test_hooks.h); built
 * only with -Dtest_hooks=true. */
#include "common/test_hooks.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"

static struct {
  int64_t ckpt_delay_ms, comm_wait_ms, start_delay_ms, plan_delay_ms;
  double ckpt_bytes_per_s;
  int stall_rank, exit_rank, digest_rank;
  long long stall_step, exit_step;
  const char *slow, *comm_trace;
} hooks;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static int64_t env_int(const char *name, int64_t none) {
  const char *v = getenv(name);
  char *end;
  if (v == NULL || v[0] == '\0')
    return none;
  long long x = strtoll(v, &end, 10);
  return *end == '\0' ? x : none;
}

/* "RANK:STEP" into rank and step; rank -1 when unset or malformed. */
static void rank_step(const char *name, int *rank, long long *step) {
  const char *v = getenv(name);
  if (v == NULL || sscanf(v, "%d:%lld", rank, step) != 2)
    *rank = -1;
}

static void read_env(void) {
  hooks.ckpt_delay_ms = env_int("MESHRUN_TEST_CKPT_DELAY_MS", 0);
  hooks.ckpt_bytes_per_s = (double)env_int("MESHRUN_TEST_CKPT_BYTES_PER_S", 0);
  hooks.comm_wait_ms = env_int("MESHRUN_TEST_COMM_WAIT_MS", 0);
  hooks.start_delay_ms = env_int("MESHRUN_TEST_START_DELAY_MS", 0);
  hooks.plan_delay_ms = env_int("MESHRUN_TEST_PLAN_DELAY_MS", 0);
  hooks.digest_rank = (int)env_int("MESHRUN_TEST_PLAN_DIGEST", -1);
  rank_step("MESHRUN_TEST_STALL", &hooks.stall_rank, &hooks.stall_step);
  rank_step("MESHRUN_TEST_EXIT", &hooks.exit_rank, &hooks.exit_step);
  hooks.slow = getenv("MESHRUN_TEST_SLOW");
  const char *t = getenv("MESHRUN_TEST_COMM_TRACE");
  hooks.comm_trace = t != NULL && t[0] != '\0' ? t : NULL;
}

static void init(void) { pthread_once(&once, read_env); }

static void sleep_ms(int64_t ms) {
  if (ms > 0)
    usleep((useconds_t)ms * 1000u);
}

struct mr_hook_slow mr_hook_slow_of(int rank) {
  init();
  struct mr_hook_slow s = {0, 0, 0};
  for (const char *p = hooks.slow; p != NULL && *p != '\0';
       p = strchr(p, ',') != NULL ? strchr(p, ',') + 1 : NULL) {
    int r = -1, ms = 0;
    double f = 0;
    if (sscanf(p, "%d:x%lf", &r, &f) == 2 && r == rank)
      s.factor = f;
    else if (sscanf(p, "%d:%d", &r, &ms) == 2 && r == rank)
      s.step_ms = ms;
  }
  return s;
}

void mr_hook_slow_step(const struct mr_hook_slow *s) { sleep_ms(s->step_ms); }

double mr_hook_kernel_begin(const struct mr_hook_slow *s) {
  return s->factor > 1 ? mr_clock_s() : 0;
}

/* Each sleep costs tens of µs more than asked; what it took is counted. */
void mr_hook_kernel_end(struct mr_hook_slow *s, double t0) {
  if (s->factor <= 1)
    return;
  s->debt_s += (s->factor - 1) * (mr_clock_s() - t0);
  if (s->debt_s >= 1e-3) {
    double s0 = mr_clock_s(), d = s->debt_s;
    struct timespec ts = {(time_t)d, (long)((d - floor(d)) * 1e9)};
    nanosleep(&ts, NULL);
    s->debt_s -= mr_clock_s() - s0;
  }
}

void mr_hook_comm_wait(void) {
  init();
  sleep_ms(hooks.comm_wait_ms);
}

void mr_hook_start(void) {
  init();
  sleep_ms(hooks.start_delay_ms);
}

void mr_hook_step(int rank, int64_t step, int (*stopped)(void *ctx), void *ctx) {
  init();
  if (hooks.exit_rank == rank && hooks.exit_step == step)
    _exit(0); /* a job that returned early: nothing reported, nothing closed */
  while (hooks.stall_rank == rank && hooks.stall_step == step &&
         (stopped == NULL || !stopped(ctx)))
    sleep_ms(10);
}

int mr_hook_stalls(int rank, int64_t step) {
  init();
  return hooks.stall_rank == rank && hooks.stall_step == step;
}

void mr_hook_ckpt_file_written(void) {
  init();
  sleep_ms(hooks.ckpt_delay_ms);
}

double mr_hook_ckpt_bytes_per_s(void) {
  init();
  return hooks.ckpt_bytes_per_s;
}

uint64_t mr_hook_plan_digest(int rank, uint64_t digest) {
  init();
  return rank == hooks.digest_rank ? digest ^ 1 : digest;
}

void mr_hook_plan_delay(void) {
  init();
  sleep_ms(hooks.plan_delay_ms);
}

const char *mr_hook_comm_trace(void) {
  init();
  return hooks.comm_trace;
}
