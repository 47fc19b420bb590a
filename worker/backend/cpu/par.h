/* par.h - private to the CPU kernels: a parallel for over [0, n) in chunks
 * of fixed size, so how the range is cut never depends on the thread count. */
#ifndef MR_CPU_PAR_H
#define MR_CPU_PAR_H

#include <stddef.h>

#include "worker/backend/cpu/pool.h"

/* fn(arg, lo, hi, thread) covers elements [lo, hi). */
typedef int (*mr__range_fn)(void *arg, size_t lo, size_t hi, int thread);

struct mr__range_job {
  mr__range_fn fn;
  void *arg;
  size_t n, chunk;
};

static inline int mr__range_task(void *arg, int task, int thread) {
  const struct mr__range_job *j = arg;
  size_t lo = (size_t)task * j->chunk;
  size_t hi = lo + j->chunk < j->n ? lo + j->chunk : j->n;
  return j->fn(j->arg, lo, hi, thread);
}

/* Runs fn over [0, n) in ceil(n / chunk) tasks. */
static inline int mr__par_range(struct mr_pool *pool, size_t n, size_t chunk,
                                mr__range_fn fn, void *arg) {
  if (n == 0)
    return 0;
  struct mr__range_job j = {fn, arg, n, chunk};
  size_t ntasks = (n + chunk - 1) / chunk;
  if (ntasks > (size_t)1 << 30)
    return fn(arg, 0, n, 0);
  return mr_pool_run(pool, (int)ntasks, mr__range_task, &j);
}

/* Elements per task of a streaming (memory-bound) kernel: big enough that
 * the hand-out costs nothing, small enough to balance 2-16 threads. */
#define MR__STREAM_CHUNK 16384

#endif
