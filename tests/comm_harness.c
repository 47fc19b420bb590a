/* comm_harness.c - forked ranks over mr_bootstrap_local. */
#include "comm_harness.h"

#include <dirent.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/error.h"
#include "common/shm_name.h"
#include "common/tunable.h"

#define REPORT 2048

struct shared_area {
  _Atomic uint64_t counters[64];
  char report[][REPORT]; /* (world) */
};

static struct shared_area *area;
static int failures;

double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

void rank_fail(struct rank_ctx *rc, const char *fmt, ...) {
  failures++;
  char *r = area->report[rc->rank];
  size_t used = strlen(r);
  if (used + 200 > REPORT)
    return;
  va_list ap;
  va_start(ap, fmt);
  int k = snprintf(r + used, REPORT - used, "rank %d: ", rc->rank);
  used += (size_t)k;
  vsnprintf(r + used, REPORT - used - 2, fmt, ap);
  va_end(ap);
  strcat(r, "\n");
}

int rank_failures(const struct rank_ctx *rc) { return failures; }

int shm_leftovers(const char *job_id) {
  char prefix[128];
  snprintf(prefix, sizeof prefix, "meshrun-%s-", job_id);
  int n = 0;
  DIR *d = opendir("/dev/shm");
  if (d == NULL)
    return 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
  closedir(d);
  return n;
}

static void child(int rank, int world, const struct run_opts *o,
                  struct mr_bootstrap_local *bl, const char *job_id,
                  void (*body)(struct rank_ctx *), void *arg) {
  char tmo[32];
  snprintf(tmo, sizeof tmo, "%d", o->timeout_ms);
  mr_tunable_override(MR_TUNABLE_COMM_TIMEOUT_MS, tmo);
  mr_tunable_override(MR_TUNABLE_COMM_TRANSPORT, o->transport);
  /* room for the mem_alloc buffers of the zero-copy cases */
  mr_tunable_override(MR_TUNABLE_COMM_SHM_HEAP_BYTES, "33554432");
  struct mr_bootstrap bs;
  mr_bootstrap_local_rank(bl, rank, "host0", job_id, o->timeout_ms, &bs);
  struct rank_ctx rc = {rank, world, NULL, job_id, area->counters, arg};
  const struct mr_comm_ops *ops = mr_comm_cpu_ops();
  if (ops->open(&bs, &rc.comm) != 0) {
    rank_fail(&rc, "open: %s", mr_error_message());
    _exit(1);
  }
  body(&rc);
  ops->close(rc.comm);
  mr_bootstrap_local_free(bl);
  _exit(failures ? 1 : 0);
}

int run_ranks(int world, const struct run_opts *o,
              void (*body)(struct rank_ctx *rc), void *arg, char *msg,
              size_t len) {
  static int serial;
  char job_id[64];
  snprintf(job_id, sizeof job_id, "t%d-%d", (int)getpid(), serial++);
  size_t bytes = sizeof(struct shared_area) + (size_t)world * REPORT;
  area = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
              -1, 0);
  struct mr_bootstrap_local *bl = mr_bootstrap_local_new(world, 512);
  if (area == MAP_FAILED || bl == NULL) {
    snprintf(msg, len, "harness: out of memory");
    return world;
  }
  pid_t *pids = calloc((size_t)world, sizeof *pids);
  fflush(stdout);
  fflush(stderr);
  for (int r = 0; r < world; r++) {
    pids[r] = fork();
    if (pids[r] == 0)
      child(r, world, o, bl, job_id, body, arg);
  }
  int bad = 0, left = world;
  size_t off = 0;
  msg[0] = '\0';
  double deadline = now_s() + o->deadline_s;
  int *status = calloc((size_t)world, sizeof *status);
  while (left > 0) {
    int any = 0;
    for (int r = 0; r < world; r++) {
      if (pids[r] <= 0)
        continue;
      int st;
      if (waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        status[r] = st;
        pids[r] = -1;
        left--;
        any = 1;
      }
    }
    if (left > 0 && now_s() > deadline) {
      for (int r = 0; r < world; r++)
        if (pids[r] > 0) {
          kill(pids[r], SIGKILL);
          waitpid(pids[r], NULL, 0);
          off += (size_t)snprintf(msg + off, off < len ? len - off : 0,
                                  "rank %d hung past %d s (killed)\n", r,
                                  o->deadline_s);
          pids[r] = -1;
          status[r] = -1;
          bad++;
        }
      break;
    }
    if (!any)
      usleep(2000);
  }
  for (int r = 0; r < world; r++) {
    int st = status[r];
    if (st == -1)
      continue;
    int killed_ok = r == o->expect_killed && WIFSIGNALED(st) &&
                    WTERMSIG(st) == SIGKILL;
    int ok = killed_ok || (WIFEXITED(st) && WEXITSTATUS(st) == 0);
    if (!ok) {
      bad++;
      off += (size_t)snprintf(msg + off, off < len ? len - off : 0,
                              "rank %d %s %d\n%s", r,
                              WIFSIGNALED(st) ? "died of signal" : "exited",
                              WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st),
                              area->report[r]);
    }
  }
  int leftover = shm_leftovers(job_id);
  if (leftover > 0) {
    bad++;
    snprintf(msg + off, off < len ? len - off : 0,
             "%d segment(s) of job %s left in /dev/shm\n", leftover, job_id);
    mr_shm_sweep(job_id);
  }
  free(status);
  free(pids);
  munmap(area, bytes);
  mr_bootstrap_local_free(bl);
  return bad;
}
