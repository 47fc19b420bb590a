/* test_gpu_nccl.c - the NCCL comm backend on 1..N local GPUs, one forked
 * rank per GPU with the local bootstrap: every collective against a serial
 * reduction computed in each rank from the same inputs (small integers, so
 * NCCL's summation order cannot change a bit), and a rank that never
 * arrives: its peer's operation times out, naming the operation and the
 * missing peer, and the communicator is aborted instead of hanging.
 * Skips (77) where there is no GPU. */
#include "check_main.h"
#include "test_gpu_common.h"

#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "worker/backend/backend.h"
#include "worker/comm/comm.h"
#include "worker/device.h"

static int failures;

static void rank_fail(int rank, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void rank_fail(int rank, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "rank %d: ", rank);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  failures++;
}

#define CHECK(rank, cond, ...)                                               \
  do {                                                                       \
    if (!(cond))                                                             \
      rank_fail(rank, __VA_ARGS__);                                               \
  } while (0)

struct rank_env {
  int rank, world;
  struct mr_backend *be;
  const struct mr_comm_ops *ops;
  struct mr_comm *comm;
  struct mr_comm_group *g;
};

static float value(int rank, size_t i) { return (float)((rank + 1) * (int)(i % 7) - 3); }

static void *dev_from(struct rank_env *e, const void *host, size_t bytes) {
  void *d = NULL;
  if (e->be->ops->alloc(e->be, bytes, &d) < 0 ||
      e->be->ops->copy(e->be, NULL, d, host, bytes, MR_COPY_HOST_TO_DEVICE) < 0)
    rank_fail(e->rank, "upload: %s", mr_error_message());
  return d;
}

static void to_host(struct rank_env *e, void *host, const void *dev, size_t bytes) {
  if (e->be->ops->copy(e->be, NULL, host, dev, bytes, MR_COPY_DEVICE_TO_HOST) < 0)
    rank_fail(e->rank, "download: %s", mr_error_message());
}

/* req is read only after the operation's call has filled it: C leaves the
 * order in which a call's arguments are evaluated open, so passing the
 * request itself beside the call that sets it could pass the old value */
static int run(struct rank_env *e, const char *what, int rc, struct mr_comm_req **req) {
  if (rc == 0)
    rc = e->ops->wait(*req);
  if (rc < 0)
    rank_fail(e->rank, "%s: %s", what, mr_error_message());
  return rc;
}

static void collectives(struct rank_env *e) {
  int me = e->rank, w = e->world;
  size_t n = 1000;
  float *x = malloc(n * w * sizeof(float)), *y = malloc(n * w * sizeof(float));
  for (size_t i = 0; i < n * w; i++)
    x[i] = value(me, i);
  struct mr_comm_req *req = NULL;

  /* AllReduce sum, max, avg in fp32; sum in bf16; avg in int32 */
  const enum mr_red_op reds[] = {MR_RED_SUM, MR_RED_MAX, MR_RED_AVG};
  for (size_t k = 0; k < 3; k++) {
    float *d = dev_from(e, x, n * 4);
    if (run(e, "AllReduce", mr_comm_all_reduce(e->g, d, d, n, MR_F32, reds[k], &req), &req) == 0) {
      to_host(e, y, d, n * 4);
      for (size_t i = 0; i < n; i++) {
        double want = reds[k] == MR_RED_MAX ? -1e30 : 0;
        for (int r = 0; r < w; r++)
          want = reds[k] == MR_RED_MAX ? fmax(want, value(r, i)) : want + value(r, i);
        if (reds[k] == MR_RED_AVG)
          want /= w;
        CHECK(me, fabs(y[i] - want) <= 1e-6 * (1 + fabs(want)),
              "AllReduce op %d [%zu]: %g, expected %g", (int)reds[k], i, (double)y[i], want);
      }
    }
    e->be->ops->free(e->be, d);
  }
  {
    uint16_t *hb = malloc(n * 2);
    for (size_t i = 0; i < n; i++)
      hb[i] = mr_f32_to_bf16(value(me, i));
    void *d = dev_from(e, hb, n * 2);
    if (run(e, "AllReduce bf16", mr_comm_all_reduce(e->g, d, d, n, MR_BF16, MR_RED_SUM, &req), &req) == 0) {
      to_host(e, hb, d, n * 2);
      for (size_t i = 0; i < n; i++) {
        float want = 0;
        for (int r = 0; r < w; r++)
          want += value(r, i);
        CHECK(me, mr_bf16_to_f32(hb[i]) == want, "AllReduce bf16 [%zu]: %g, expected %g", i,
              (double)mr_bf16_to_f32(hb[i]), (double)want);
      }
    }
    e->be->ops->free(e->be, d);
    free(hb);
  }
  {
    int32_t *hi = malloc(n * 4);
    for (size_t i = 0; i < n; i++)
      hi[i] = (int32_t)value(me, i) * 10 + me;
    void *d = dev_from(e, hi, n * 4);
    if (run(e, "AllReduce int avg", mr_comm_all_reduce(e->g, d, d, n, MR_I32, MR_RED_AVG, &req), &req) == 0) {
      to_host(e, hi, d, n * 4);
      for (size_t i = 0; i < n; i++) {
        int32_t s = 0;
        for (int r = 0; r < w; r++)
          s += (int32_t)value(r, i) * 10 + r;
        CHECK(me, hi[i] == s / w, "AllReduce int32 avg [%zu]: %d, expected %d", i, hi[i], s / w);
      }
    }
    e->be->ops->free(e->be, d);
    free(hi);
  }

  /* ReduceScatter: block me of the sum */
  {
    float *ds = dev_from(e, x, n * w * 4), *dr = NULL;
    e->be->ops->alloc(e->be, n * 4, (void **)&dr);
    if (run(e, "ReduceScatter", mr_comm_reduce_scatter(e->g, ds, dr, n, MR_F32, MR_RED_SUM, &req), &req) == 0) {
      to_host(e, y, dr, n * 4);
      for (size_t i = 0; i < n; i++) {
        float want = 0;
        for (int r = 0; r < w; r++)
          want += value(r, (size_t)me * n + i);
        CHECK(me, y[i] == want, "ReduceScatter [%zu]: %g, expected %g", i, (double)y[i],
              (double)want);
      }
    }
    e->be->ops->free(e->be, ds);
    e->be->ops->free(e->be, dr);
  }

  /* AllGather, equal and unequal counts */
  for (int uneq = 0; uneq < 2; uneq++) {
    size_t counts[8], total = 0, mine = 0;
    for (int r = 0; r < w; r++) {
      counts[r] = uneq ? (size_t)(r + 1) * 37 : n;
      if (r < me)
        mine += counts[r];
      total += counts[r];
    }
    float *ds = dev_from(e, x, counts[me] * 4), *dr = NULL;
    e->be->ops->alloc(e->be, total * 4, (void **)&dr);
    int rc = mr_comm_all_gather(e->g, ds, dr, counts[me], uneq ? counts : NULL, MR_F32, &req);
    if (run(e, uneq ? "AllGather (unequal)" : "AllGather", rc, &req) == 0) {
      float *all = malloc(total * 4);
      to_host(e, all, dr, total * 4);
      size_t off = 0;
      for (int r = 0; r < w; r++)
        for (size_t i = 0; i < counts[r]; i++, off++)
          CHECK(me, all[off] == value(r, i), "AllGather%s rank %d [%zu]: %g, expected %g",
                uneq ? " (unequal)" : "", r, i, (double)all[off], (double)value(r, i));
      free(all);
    }
    (void)mine;
    e->be->ops->free(e->be, ds);
    e->be->ops->free(e->be, dr);
  }

  /* Broadcast from the last rank */
  {
    float *d = dev_from(e, x, n * 4);
    if (run(e, "Broadcast", mr_comm_broadcast(e->g, d, n, MR_F32, w - 1, &req), &req) == 0) {
      to_host(e, y, d, n * 4);
      for (size_t i = 0; i < n; i++)
        CHECK(me, y[i] == value(w - 1, i), "Broadcast [%zu]: %g", i, (double)y[i]);
    }
    e->be->ops->free(e->be, d);
  }

  /* AllToAll: block j of rank r lands in block r of rank j */
  {
    float *ds = dev_from(e, x, n * w * 4), *dr = NULL;
    e->be->ops->alloc(e->be, n * w * 4, (void **)&dr);
    if (run(e, "AllToAll", mr_comm_all_to_all(e->g, ds, dr, n, MR_F32, &req), &req) == 0) {
      to_host(e, y, dr, n * w * 4);
      for (int r = 0; r < w; r++)
        for (size_t i = 0; i < n; i++)
          CHECK(me, y[(size_t)r * n + i] == value(r, (size_t)me * n + i),
                "AllToAll from %d [%zu]: %g", r, i, (double)y[(size_t)r * n + i]);
    }
    e->be->ops->free(e->be, ds);
    e->be->ops->free(e->be, dr);
  }

  /* Send / Recv around the ring (even ranks send first) */
  if (w > 1) {
    int next = (me + 1) % w, prev = (me + w - 1) % w;
    float *ds = dev_from(e, x, n * 4), *dr = NULL;
    e->be->ops->alloc(e->be, n * 4, (void **)&dr);
    struct mr_comm_req *rs = NULL, *rr = NULL;
    int rc;
    if (me % 2 == 0) {
      rc = mr_comm_send(e->g, ds, n, MR_F32, next, &rs);
      if (rc == 0)
        rc = mr_comm_wait(rs);
      if (rc == 0)
        rc = mr_comm_recv(e->g, dr, n, MR_F32, prev, &rr);
      if (rc == 0)
        rc = mr_comm_wait(rr);
    } else {
      rc = mr_comm_recv(e->g, dr, n, MR_F32, prev, &rr);
      if (rc == 0)
        rc = mr_comm_wait(rr);
      if (rc == 0)
        rc = mr_comm_send(e->g, ds, n, MR_F32, next, &rs);
      if (rc == 0)
        rc = mr_comm_wait(rs);
    }
    if (rc < 0)
      rank_fail(me, "Send/Recv: %s", mr_error_message());
    to_host(e, y, dr, n * 4);
    for (size_t i = 0; i < n && rc == 0; i++)
      CHECK(me, y[i] == value(prev, i), "Recv from %d [%zu]: %g", prev, i, (double)y[i]);
    e->be->ops->free(e->be, ds);
    e->be->ops->free(e->be, dr);
  }

  /* Send and Recv posted together before either is waited on (a pipeline
   * stage's exchange), 4 MiB each way: batched, so no deadlock */
  if (w > 1) {
    size_t big = (size_t)1 << 20;
    float *hb = malloc(big * 4);
    for (size_t i = 0; i < big; i++)
      hb[i] = value(me, i);
    int next = (me + 1) % w, prev = (me + w - 1) % w;
    float *ds = dev_from(e, hb, big * 4), *dr = NULL;
    e->be->ops->alloc(e->be, big * 4, (void **)&dr);
    struct mr_comm_req *rs = NULL, *rr = NULL;
    int rc = mr_comm_send(e->g, ds, big, MR_F32, next, &rs);
    if (rc == 0)
      rc = mr_comm_recv(e->g, dr, big, MR_F32, prev, &rr);
    if (rc == 0)
      rc = mr_comm_wait(rs);
    if (rc == 0)
      rc = mr_comm_wait(rr);
    if (rc < 0)
      rank_fail(me, "Send+Recv together: %s", mr_error_message());
    to_host(e, hb, dr, big * 4);
    for (size_t i = 0; i < big && rc == 0; i += 997)
      CHECK(me, hb[i] == value(prev, i), "Send+Recv from %d [%zu]: %g", prev, i, (double)hb[i]);
    e->be->ops->free(e->be, ds);
    e->be->ops->free(e->be, dr);
    free(hb);
  }

  /* Barrier, test() until done, nothing left in flight */
  if (mr_comm_barrier(e->g, &req) == 0) {
    int done = 0;
    for (int spin = 0; spin < 2000000 && !done; spin++)
      e->ops->test(req, &done);
    CHECK(me, done, "Barrier never completed");
    run(e, "Barrier", 0, &req);
  } else {
    rank_fail(me, "Barrier: %s", mr_error_message());
  }
  char buf[256];
  e->ops->blocked(e->comm, buf, sizeof buf);
  CHECK(me, buf[0] == '\0', "blocked() with nothing in flight: \"%s\"", buf);
  free(x);
  free(y);
}

/* rank 1 never joins the AllReduce; rank 0 must fail, not hang */
static void straggler(struct rank_env *e) {
  if (e->rank == 1) {
    sleep(12);
    return;
  }
  float *d = NULL;
  e->be->ops->alloc(e->be, 4096, (void **)&d);
  e->be->ops->memset(e->be, NULL, d, 0, 4096);
  struct mr_comm_req *req = NULL;
  if (mr_comm_all_reduce(e->g, d, d, 1024, MR_F32, MR_RED_SUM, &req) < 0) {
    rank_fail(0, "AllReduce start: %s", mr_error_message());
    return;
  }
  sleep(1);
  char buf[256];
  e->ops->blocked(e->comm, buf, sizeof buf);
  CHECK(0, strstr(buf, "AllReduce #") != NULL && strstr(buf, "rank 1") != NULL,
        "blocked(): \"%s\"", buf);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int rc = mr_comm_wait(req);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double s = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
  CHECK(0, rc == MR_ETIMEDOUT, "wait returned %d (%s), expected MR_ETIMEDOUT", rc,
        mr_error_message());
  CHECK(0, strstr(mr_error_message(), "AllReduce") != NULL &&
               strstr(mr_error_message(), "rank 1") != NULL &&
               strstr(mr_error_message(), "aborted") != NULL,
        "message: %s", mr_error_message());
  CHECK(0, s < 8.0, "the timeout took %.1f s", s);
  /* the group is broken now: later operations fail at once */
  CHECK(0, mr_comm_barrier(e->g, &req) == MR_EPEER, "barrier after the abort");
}

static void rank_main(int rank, int world, struct mr_bootstrap_local *bl,
                      void (*body)(struct rank_env *), int timeout_ms) {
  char tmo[32];
  snprintf(tmo, sizeof tmo, "%d", timeout_ms);
  setenv("MESHRUN_COMM_TIMEOUT_MS", tmo, 1);
  struct rank_env e = {.rank = rank, .world = world};
  if (mr_device_open("cuda", rank, 0, 0, &e.be) < 0 ||
      mr_device_comm_ops("cuda", &e.ops) < 0) {
    rank_fail(rank, "device: %s", mr_error_message());
    _exit(1);
  }
  struct mr_bootstrap bs;
  char job[64];
  snprintf(job, sizeof job, "gputest%d", (int)getppid());
  mr_bootstrap_local_rank(bl, rank, "host0", job, 60000, &bs);
  if (e.ops->open(&bs, &e.comm) < 0) {
    rank_fail(rank, "open: %s", mr_error_message());
    _exit(1);
  }
  int ranks[8];
  for (int i = 0; i < world; i++)
    ranks[i] = i;
  if (e.ops->group_new(e.comm, "all", ranks, world, &e.g) < 0) {
    rank_fail(rank, "group: %s", mr_error_message());
    _exit(1);
  }
  if (e.ops->group_rank(e.g) != rank || e.ops->group_size(e.g) != world)
    rank_fail(rank, "group rank %d size %d", e.ops->group_rank(e.g), e.ops->group_size(e.g));
  body(&e);
  if (body != straggler) {
    e.ops->group_free(e.g);
    e.ops->close(e.comm);
  }
  mr_backend_free(e.be);
  fflush(stderr);
  _exit(failures ? 1 : 0);
}

/* Forks world ranks running body; fails the test if one fails or they do
 * not finish within deadline_s. */
static void run_world(int world, void (*body)(struct rank_env *), int timeout_ms,
                      int deadline_s) {
  struct mr_bootstrap_local *bl = mr_bootstrap_local_new(world, 4096);
  ck_assert_ptr_nonnull(bl);
  pid_t pids[8];
  fflush(NULL);
  for (int r = 0; r < world; r++) {
    pids[r] = fork();
    ck_assert_int_ge(pids[r], 0);
    if (pids[r] == 0)
      rank_main(r, world, bl, body, timeout_ms);
  }
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int left = world, bad = 0;
  int codes[8];
  for (int r = 0; r < world; r++)
    codes[r] = -1;
  while (left > 0) {
    int st = 0;
    pid_t p = waitpid(-1, &st, WNOHANG);
    if (p > 0) {
      for (int r = 0; r < world; r++)
        if (pids[r] == p) {
          codes[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
          bad += codes[r] != 0;
          left--;
        }
      continue;
    }
    clock_gettime(CLOCK_MONOTONIC, &t);
    if (t.tv_sec - t0.tv_sec > deadline_s) {
      for (int r = 0; r < world; r++)
        if (codes[r] < 0)
          kill(pids[r], SIGKILL);
      while (waitpid(-1, NULL, 0) > 0) {
      }
      ck_abort_msg("%d ranks still running after %d s (a hang)", left, deadline_s);
    }
    usleep(20000);
  }
  mr_bootstrap_local_free(bl);
  ck_assert_msg(bad == 0, "%d of %d ranks failed (their messages are above)", bad, world);
}

START_TEST(test_gpu_nccl_collectives_match_serial_reduction) {
  int n = gpu_count();
  for (int world = 1; world <= n && world <= 8; world = world < 2 ? 2 : world * 2)
    run_world(world, collectives, 60000, 240);
  if (n > 2 && (n & (n - 1)) != 0)
    run_world(n > 8 ? 8 : n, collectives, 60000, 240);
}
END_TEST

START_TEST(test_gpu_nccl_missing_rank_times_out_and_aborts) {
  if (gpu_count() < 2) {
    fprintf(stderr, "one GPU: the two-rank timeout case needs two\n");
    return;
  }
  run_world(2, straggler, 3000, 60);
}
END_TEST

static Suite *gpu_nccl_suite(void) {
  Suite *s = suite_create("gpu_nccl");
  TCase *tc = tcase_create("nccl");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, test_gpu_nccl_collectives_match_serial_reduction);
  tcase_add_test(tc, test_gpu_nccl_missing_rank_times_out_and_aborts);
  suite_add_tcase(s, tc);
  return s;
}

MR_GPU_TEST_MAIN(gpu_nccl_suite)
