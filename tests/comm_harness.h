/* comm_harness.h - runs a test body in N forked ranks with a real local
 * bootstrap and collects what each rank found wrong.
 *
 * Every rank opens the CPU communicator (transport as given), runs body,
 * and records failures with rank_fail(); the parent waits for all of them
 * (killing them after a deadline), and afterwards checks that the job left
 * no segment in /dev/shm. */
#ifndef MR_TEST_COMM_HARNESS_H
#define MR_TEST_COMM_HARNESS_H

#include <stddef.h>
#include <stdint.h>

#include "worker/comm/comm.h"

struct rank_ctx {
  int rank, world;
  struct mr_comm *comm;
  const char *job_id;
  _Atomic uint64_t *shared; /* (64) counters every rank can see */
  void *arg;
};

/* Records a failure of this rank (first few kept). */
void rank_fail(struct rank_ctx *rc, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Failures recorded so far by this rank. */
int rank_failures(const struct rank_ctx *rc);

struct run_opts {
  const char *transport;  /* "shm" or "tcp" */
  int timeout_ms;         /* MESHRUN_COMM_TIMEOUT_MS in the ranks */
  int deadline_s;         /* the parent kills ranks after this */
  int expect_killed;      /* rank that is expected to die by SIGKILL, or -1 */
};

/* Runs body in world ranks.  Returns 0 when every rank passed (and no
 * segment was left), else writes a report into msg (len bytes) and
 * returns the number of failing ranks. */
int run_ranks(int world, const struct run_opts *o,
              void (*body)(struct rank_ctx *rc), void *arg, char *msg,
              size_t len);

/* Entries in /dev/shm whose name starts with "meshrun-<job_id>-". */
int shm_leftovers(const char *job_id);

/* Wall time in seconds. */
double now_s(void);

#endif
