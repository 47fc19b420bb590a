/* test_hooks.h - the faults and delays the tests inject, in one place.
 *
 * The end-to-end tests play a slow disk, a slow network, a slow or stalled
 * rank, a rank that quits early, a slow plan and a worker that lowers
 * another program.  Each is an environment variable read here, once per
 * process, and a call at the one place in meshrun where it acts:
 *
 *   MESHRUN_TEST_CKPT_DELAY_MS=MS        a checkpoint file's write ends with
 *                                        a pause (a save left half done)
 *   MESHRUN_TEST_CKPT_BYTES_PER_S=B      checkpoints written no faster
 *   MESHRUN_TEST_COMM_WAIT_MS=MS         each wait on a collective sleeps
 *                                        first (a slow network whose
 *                                        operations still complete)
 *   MESHRUN_TEST_STALL=RANK:STEP         that rank stops working at that
 *                                        step, its heartbeats going on
 *   MESHRUN_TEST_EXIT=RANK:STEP          that rank exits 0 there, unreported
 *   MESHRUN_TEST_SLOW=RANK:MS|RANK:xF,.. that rank MS ms slower a step, or
 *                                        each of its kernels F times slower
 *   MESHRUN_TEST_START_DELAY_MS=MS       each rank starts this much later
 *   MESHRUN_TEST_PLAN_DELAY_MS=MS        the launcher's re-plans take longer
 *   MESHRUN_TEST_PLAN_DIGEST=RANK        that rank is sent a wrong digest
 *   MESHRUN_TEST_COMM_TRACE=PATH         each rank appends every collective
 *                                        it issues to PATH.RANK
 *
 * They are built only with -Dtest_hooks=true (scripts/test builds so);
 * otherwise every hook below is an empty inline, the variables are never
 * read, and no production path sleeps, exits or flips a digest for a test. */
#ifndef MR_TEST_HOOKS_H
#define MR_TEST_HOOKS_H

#include <stdint.h>

/* A rank's slowness (MESHRUN_TEST_SLOW) and the kernel time it owes. */
struct mr_hook_slow {
  int step_ms;
  double factor;
  double debt_s;
};

#ifdef MR_TEST_HOOKS

/* 1: built with the hooks (tests that need them may ask). */
#define MR_HOOKS_BUILT 1

/* The slowness MESHRUN_TEST_SLOW gives `rank` (none: zeros). */
struct mr_hook_slow mr_hook_slow_of(int rank);
/* At the start of a step: sleeps its step_ms. */
void mr_hook_slow_step(const struct mr_hook_slow *s);
/* Around each kernel: begin returns its start time (0 when not slowed);
 * end sleeps what the kernel owes, in sleeps of 1 ms or more. */
double mr_hook_kernel_begin(const struct mr_hook_slow *s);
void mr_hook_kernel_end(struct mr_hook_slow *s, double t0);
/* Before each wait on a communication operation. */
void mr_hook_comm_wait(void);
/* Before a rank's first step. */
void mr_hook_start(void);
/* At the top of each training step: stalls while `rank` is told to stall
 * at `step` and stopped(ctx) is 0; exits the process (0, unreported) when
 * it is told to quit there. */
void mr_hook_step(int rank, int64_t step, int (*stopped)(void *ctx), void *ctx);
/* 1 when MESHRUN_TEST_STALL names rank and step (the self-check's stall). */
int mr_hook_stalls(int rank, int64_t step);
/* After each checkpoint file is written. */
void mr_hook_ckpt_file_written(void);
/* The checkpoint writer's rate cap, bytes a second (0: none). */
double mr_hook_ckpt_bytes_per_s(void);
/* The digest the launcher sends rank: its own, or one flipped. */
uint64_t mr_hook_plan_digest(int rank, uint64_t digest);
/* On the planner's thread, before each re-plan. */
void mr_hook_plan_delay(void);
/* The collective trace's path prefix, or NULL. */
const char *mr_hook_comm_trace(void);

#else

#define MR_HOOKS_BUILT 0

static inline struct mr_hook_slow mr_hook_slow_of(int rank) {
  (void)rank;
  struct mr_hook_slow s = {0, 0, 0};
  return s;
}
static inline void mr_hook_slow_step(const struct mr_hook_slow *s) { (void)s; }
static inline double mr_hook_kernel_begin(const struct mr_hook_slow *s) {
  (void)s;
  return 0;
}
static inline void mr_hook_kernel_end(struct mr_hook_slow *s, double t0) { (void)s, (void)t0; }
static inline void mr_hook_comm_wait(void) {}
static inline void mr_hook_start(void) {}
static inline void mr_hook_step(int rank, int64_t step, int (*stopped)(void *ctx), void *ctx) {
  (void)rank, (void)step, (void)stopped, (void)ctx;
}
static inline int mr_hook_stalls(int rank, int64_t step) {
  (void)rank, (void)step;
  return 0;
}
static inline void mr_hook_ckpt_file_written(void) {}
static inline double mr_hook_ckpt_bytes_per_s(void) { return 0; }
static inline uint64_t mr_hook_plan_digest(int rank, uint64_t digest) {
  (void)rank;
  return digest;
}
static inline void mr_hook_plan_delay(void) {}
static inline const char *mr_hook_comm_trace(void) { return (const char *)0; }

#endif
#endif
