/* cpu_backend.h - the CPU device backend: host memory, synchronous streams,
 * and kernels run on the rank's thread pool (kernels.h). */
#ifndef MR_CPU_BACKEND_H
#define MR_CPU_BACKEND_H

#include "worker/backend/backend.h"
#include "worker/backend/cpu/pool.h"

/* Makes a CPU backend with a pool of nthreads (<= 0: MESHRUN_THREADS).
 * *out is owned by the caller: mr_backend_free().  Returns 0, MR_ENOMEM or
 * MR_ESYS. */
int mr_cpu_backend_new(int nthreads, struct mr_backend **out);

/* A CPU backend over an existing pool (borrowed: it must outlive the
 * backend) whose kernels get kernel_ctx (borrowed; NULL: the pool), e.g.
 * the executor's struct mr_cpu_ctx for the op registry's kernels. */
int mr_cpu_backend_wrap(struct mr_pool *pool, void *kernel_ctx, struct mr_backend **out);

/* The backend's pool (= its kernel context).  Borrowed. */
struct mr_pool *mr_cpu_backend_pool(struct mr_backend *be);

#endif
