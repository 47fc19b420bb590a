/* kernels_common.cuh - device helpers shared by the module's kernel files:
 * launch sizes, amp rounding, deterministic block reductions, the status
 * word. */
#ifndef MR_CUDA_KERNELS_COMMON_CUH
#define MR_CUDA_KERNELS_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "worker/backend/cuda/kernels.h"

#define MR_THREADS 256

/* Blocks for a grid-stride loop over n elements. */
static inline unsigned mr_blocks(int64_t n) {
  int64_t b = (n + MR_THREADS - 1) / MR_THREADS;
  if (b < 1)
    b = 1;
  if (b > 65536)
    b = 65536;
  return (unsigned)b;
}

/* A float rounded to bf16 (amp 1) or fp16 (amp 2), as the CPU backend's
 * amp emulation does (round to nearest even; fp16 overflows to inf). */
__device__ __forceinline__ float mr_round_amp(float x, int amp) {
  if (amp == 1)
    return __bfloat162float(__float2bfloat16_rn(x));
  if (amp == 2)
    return __half2float(__float2half_rn(x));
  return x;
}

/* Records the first kernel error. */
__device__ __forceinline__ void mr_report(struct mr__cuda_status *st, int code,
                                          long long a, long long b, long long c) {
  if (st != nullptr && atomicCAS(&st->code, 0, code) == 0) {
    st->a = a;
    st->b = b;
    st->c = c;
  }
}

/* Sum over the block in a fixed tree (the same for the same blockDim);
 * every thread gets the result.  smem: 32 elements. */
template <typename T>
__device__ __forceinline__ T mr_block_sum(T v, T *smem) {
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, o);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int nw = (blockDim.x + 31) >> 5;
  __syncthreads(); /* smem may still be read from a previous call */
  if (lane == 0)
    smem[warp] = v;
  __syncthreads();
  T t = lane < nw ? smem[lane] : T(0);
  for (int o = 16; o > 0; o >>= 1)
    t += __shfl_xor_sync(0xffffffffu, t, o);
  return t;
}

__device__ __forceinline__ float mr_block_max(float v, float *smem) {
  for (int o = 16; o > 0; o >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int nw = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0)
    smem[warp] = v;
  __syncthreads();
  float t = lane < nw ? smem[lane] : -INFINITY;
  for (int o = 16; o > 0; o >>= 1)
    t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
  return t;
}

/* The maximum of a row of V floats over the block, NaN when the row holds
 * a NaN (so an overflow upstream reaches the loss); every thread gets it.
 * smem: 32 floats. */
__device__ __forceinline__ float mr_block_row_max(const float *x, int64_t V, float *smem) {
  float m = -INFINITY, nan = 0.0f;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    float v = x[j];
    if (v != v)
      nan = 1.0f;
    m = fmaxf(m, v);
  }
  m = mr_block_max(m, smem);
  nan = mr_block_max(nan, smem);
  return nan != 0.0f ? NAN : m;
}

#define MR_GRID_STRIDE(i, n)                                                 \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);  \
       i += (int64_t)gridDim.x * blockDim.x)

#endif
