/* cuda_internal.h - private to the CUDA module: the backend's state, its
 * kernel context, the memory pool and the helpers that turn CUDA results
 * into MR_E* codes.  C and CUDA types live here and in the module's own
 * files only. */
#ifndef MR_CUDA_INTERNAL_H
#define MR_CUDA_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "common/model_config.h"
#include "worker/backend/backend.h"
#include "worker/backend/cuda/kernels.h"

/* ---- errors ---- */

/* Converts a CUDA runtime result: 0 on success, else MR_ENOMEM (out of
 * memory) or MR_EIO with "cuda: CALL: name (description)" recorded. */
int mr__cuda_check(cudaError_t e, const char *call);

#define MR_CUDA_TRY(call) MR_TRY(mr__cuda_check((call), #call))

/* ---- memory pool: a caching allocator over cudaMalloc ---- */

struct mr__cuda_block;

struct mr__cuda_pool {
  pthread_mutex_t lock;
  int device;
  struct mr__cuda_block **live;  // blocks in use, hashed by address
  struct mr__cuda_block *cached; // free blocks kept for reuse
  size_t bytes_live;             // in use, for the out-of-memory message
};

int mr__cuda_pool_init(struct mr__cuda_pool *p, int device);
/* Releases every block (the device must be idle). */
void mr__cuda_pool_close(struct mr__cuda_pool *p);
/* Device memory of at least bytes (0 allowed), 256-byte aligned. */
int mr__cuda_pool_alloc(struct mr__cuda_pool *p, size_t bytes, void **out);
/* Returns ptr to the cache; NULL is a no-op.  Work already queued on the
 * compute stream may still use it: stream order makes reuse safe there. */
void mr__cuda_pool_free(struct mr__cuda_pool *p, void *ptr);

/* ---- streams, scratch, the kernel context ---- */

struct mr_stream {
  cudaStream_t s;
  void *scratch;        // device scratch for kernels queued on this stream
  size_t scratch_bytes;
};

struct mr_event {
  cudaEvent_t e;
};

struct mr__cuda_lt;     // cublaslt.c: handle, workspace, plan cache

struct mr__rope_table {
  int T, D;
  struct mr_rope rope;
  float *cs, *sn;       // device [T, D/2] each, one allocation (cs)
};

/* The kernel context: what every registry kernel and launched function
 * receives on the CUDA backend. */
struct mr__cuda_ctx {
  struct mr__cuda *be;
  int device;
  int amp;                          // enum mr_amp_mode
  struct mr_stream *cur;            // the stream kernels go to now
  struct mr__cuda_status *status;   // device: the first kernel error
  struct mr__cuda_lt *lt;
  struct mr__rope_table rope[4];    // small cache of RoPE tables
  int rope_next;
};

struct mr__cuda {
  struct mr_backend base;
  int device;
  struct mr__cuda_pool pool;
  struct mr_stream compute;
  struct mr__cuda_ctx ctx;
  pthread_mutex_t ctx_lock;         // launch swaps ctx.cur
  double *sumsq_host;               // page-locked partial sums, grown
  size_t sumsq_cap;                 // doubles
};

/* Scratch of at least bytes on the context's current stream (grown, after
 * synchronizing that stream, when too small).  Valid until the next call
 * from a kernel on the same stream. */
int mr__cuda_scratch(struct mr__cuda_ctx *c, size_t bytes, void **out);

/* Makes the calling thread use the context's device. */
int mr__cuda_set_device(int device);

/* The compute stream of the last backend made for device (NULL: none);
 * the NCCL backend orders its collectives after it. */
cudaStream_t mr__cuda_compute_stream(int device);

/* The device of the last backend made in this process, or -1: the NCCL
 * communicator's device, whichever thread opens it. */
int mr__cuda_backend_device(void);

/* Reads and clears the device status word; a kernel's recorded error
 * becomes MR_ERANGE / MR_EINVAL with its message.  Synchronous. */
int mr__cuda_status_check(struct mr__cuda_ctx *c);

/* ---- cuBLASLt ---- */

int mr__cuda_lt_new(struct mr__cuda_ctx *c, struct mr__cuda_lt **out);
void mr__cuda_lt_free(struct mr__cuda_ctx *c, struct mr__cuda_lt *lt);

/* Row-major C[M,N] = op(A) op(B) with op(X) = X or X^T (ta, tb); A, B of
 * dtype (0 f32, 1 bf16, 2 f16) with leading dimensions lda, ldb; C f32 with
 * ldc, overwritten (accum: added to, beta 1).  fp32 operands compute in true fp32 (no TF32); 16-bit
 * operands accumulate in fp32.  Falls back to the module's own GEMM where
 * cuBLASLt offers no algorithm. */
int mr__cuda_matmul(struct mr__cuda_ctx *c, int ta, int tb, int64_t M,
                    int64_t N, int64_t K, const void *A, int64_t lda,
                    const void *B, int64_t ldb, float *C, int64_t ldc,
                    int dtype, int accum);

/* ---- the op registry's kernels (cuda_ops.c) ---- */

void mr__cuda_kernels_register(void);

/* ---- construction (cuda_backend.c), measurements (probe.c), NCCL ---- */

/* A backend as mr_cuda_backend_new makes it, seen from inside the module. */
int mr__cuda_backend_make(int device, int amp, struct mr__cuda **out);

struct mr_gpu_probe;
struct mr_comm_ops;
int mr__cuda_probe(int ndev, struct mr_gpu_probe *out);
int mr__cuda_matmul_rate(int device, int m, int n, int k, int dtype, int iters,
                         double *flops);
/* worker/comm/nccl.c */
const struct mr_comm_ops *mr__comm_nccl_ops(void);

#endif
