/* pool.h - a small persistent pthread pool for the CPU kernels.
 *
 * A pool of n threads is the calling thread plus n-1 workers that sleep on a
 * condition variable between jobs.  mr_pool_run() splits a job into `ntasks`
 * tasks, hands them out in index order to whichever thread is free, and
 * returns when all are done; the calling thread works too.  A pool runs one
 * job at a time and must be driven from one thread at a time (the rank's
 * compute thread); communication threads never call into it, and a task
 * never starts another job on its own pool (that would deadlock).
 *
 * Each thread has a scratch buffer that kernels use for block-local data
 * (attention tiles, partial sums); it grows on demand and lives as long as
 * the pool. */
#ifndef MR_CPU_POOL_H
#define MR_CPU_POOL_H

#include <stddef.h>

struct mr_pool;

/* One task: `task` in [0, ntasks), `thread` in [0, nthreads) says whose
 * scratch to use.  Returns 0 or a negative MR_E* code; the first failure is
 * what mr_pool_run() returns (the remaining tasks still run). */
typedef int (*mr_pool_task_fn)(void *arg, int task, int thread);

/* Starts a pool of nthreads >= 1 threads (nthreads - 1 new ones); nthreads
 * <= 0 reads the MESHRUN_THREADS tunable.  Also sets OpenBLAS to one thread,
 * since the kernels split matmuls across this pool themselves.  *out is owned
 * by the caller: free with mr_pool_free().  Returns 0, MR_ENOMEM or MR_ESYS. */
int mr_pool_new(int nthreads, struct mr_pool **out);

/* Joins the workers and frees everything.  NULL is a no-op. */
void mr_pool_free(struct mr_pool *pool);

/* Number of threads, the caller included. */
int mr_pool_threads(const struct mr_pool *pool);

/* Runs fn(arg, t, thread) for every t in [0, ntasks) and waits for all.
 * ntasks <= 0 returns 0 at once; ntasks == 1 runs on the caller only. */
int mr_pool_run(struct mr_pool *pool, int ntasks, mr_pool_task_fn fn, void *arg);

/* The scratch buffer of `thread`, at least `bytes` long and 64-byte aligned,
 * or NULL when it cannot grow (out of memory).  Valid until the next call for
 * the same thread.  Borrowed: the pool owns it. */
void *mr_pool_scratch(struct mr_pool *pool, int thread, size_t bytes);

/* A buffer shared by all tasks of one job (partial results indexed by task),
 * at least `bytes`, 64-byte aligned; NULL when out of memory.  Get it before
 * mr_pool_run(); valid until the next call.  Borrowed. */
void *mr__pool_shared_scratch(struct mr_pool *pool, size_t bytes);

/* A buffer kept for the pool's life under a key (up to 64 bytes, compared
 * bytewise), for tables that depend only on a few parameters (RoPE's cos
 * and sin): returns at least `bytes`, 64-byte aligned, with *fresh = 1 when
 * the key or the size changed, so the caller must fill it, else 0 and the
 * contents left by the last caller with this key.  One slot: a new key
 * replaces the old.  A NULL key forgets the slot (call it when filling
 * failed).  NULL when out of memory or the key is too long.  Borrowed. */
void *mr__pool_keyed_scratch(struct mr_pool *pool, const void *key,
                             size_t key_bytes, size_t bytes, int *fresh);

#endif
