/* kernels_misc.cu - fused cross-entropy, the runtime's vector entries
 * (axpby, sum of squares, AdamW) and the fallback GEMM. */
#include "worker/backend/cuda/kernels_common.cuh"

/* ---- cross-entropy fused with softmax: one block per row ---- */

#define XENT_THREADS 512

__global__ void xent_fwd_k(float *loss_rows, float *lse_out, const float *logits,
                           const int32_t *targets, int64_t V,
                           struct mr__cuda_status *st) {
  __shared__ float red[32];
  int64_t r = blockIdx.x;
  const float *x = logits + r * V;
  float m = mr_block_row_max(x, V, red);
  float l;
  if (m != m) {
    l = NAN;
  } else if (m == -INFINITY) {
    l = m;
  } else {
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
      s += expf(x[j] - m);
    s = mr_block_sum(s, red);
    l = m + logf(s);
  }
  if (threadIdx.x == 0) {
    int64_t t = targets[r];
    lse_out[r] = l;
    if (t >= V) {
      mr_report(st, MR__KERR_XENT_TARGET, t, r, V);
      loss_rows[r] = 0.0f;
    } else {
      loss_rows[r] = t < 0 ? 0.0f : l - x[t];
    }
  }
}

/* loss[0] = sum of rows (double, fixed tree) / denominator */
__global__ void xent_mean_k(float *loss, const float *rows, const int32_t *t,
                            int64_t N, double denom_attr) {
  __shared__ double red[32];
  double s = 0.0, valid = 0.0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    s += (double)rows[i];
    valid += t[i] >= 0 ? 1.0 : 0.0;
  }
  s = mr_block_sum(s, red);
  valid = mr_block_sum(valid, red);
  if (threadIdx.x == 0) {
    double denom = denom_attr > 0 ? denom_attr : valid;
    loss[0] = denom > 0 ? (float)(s / denom) : 0.0f;
  }
}

__global__ void xent_scale_k(float *scale, const float *dloss, const int32_t *t,
                             int64_t N, double denom_attr) {
  __shared__ double red[32];
  double valid = 0.0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x)
    valid += t[i] >= 0 ? 1.0 : 0.0;
  valid = mr_block_sum(valid, red);
  if (threadIdx.x == 0) {
    double denom = denom_attr > 0 ? denom_attr : valid;
    scale[0] = denom > 0 ? (float)((double)dloss[0] / denom) : 0.0f;
  }
}

__global__ void xent_bwd_k(float *d, const float *logits, const float *lse,
                           const int32_t *targets, const float *scale, int64_t V,
                           struct mr__cuda_status *st) {
  int64_t r = blockIdx.x;
  int64_t t = targets[r];
  if (t >= V) {
    if (threadIdx.x == 0)
      mr_report(st, MR__KERR_XENT_TARGET, t, r, V);
    t = -1;
  }
  float g = t < 0 ? 0.0f : scale[0];
  float l = lse[r];
  const float *x = logits + r * V;
  float *dr = d + r * V;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    float v = g * expf(x[j] - l);
    dr[j] = j == t ? v - g : v;
  }
}

extern "C" cudaError_t mr__k_xent_fwd(cudaStream_t s, float *loss_rows, float *lse,
                                      const float *logits, const int32_t *t,
                                      int64_t N, int64_t V,
                                      struct mr__cuda_status *st) {
  if (N > 0)
    xent_fwd_k<<<(unsigned)N, XENT_THREADS, 0, s>>>(loss_rows, lse, logits, t, V, st);
  return cudaGetLastError();
}

extern "C" cudaError_t mr__k_xent_mean(cudaStream_t s, float *loss,
                                       const float *loss_rows, const int32_t *t,
                                       int64_t N, double denom_attr) {
  xent_mean_k<<<1, 1024, 0, s>>>(loss, loss_rows, t, N, denom_attr);
  return cudaGetLastError();
}

extern "C" cudaError_t mr__k_xent_scale(cudaStream_t s, float *scale,
                                        const float *dloss, const int32_t *t,
                                        int64_t N, double denom_attr) {
  xent_scale_k<<<1, 1024, 0, s>>>(scale, dloss, t, N, denom_attr);
  return cudaGetLastError();
}

extern "C" cudaError_t mr__k_xent_bwd(cudaStream_t s, float *dlogits,
                                      const float *logits, const float *lse,
                                      const int32_t *t, const float *scale,
                                      int64_t N, int64_t V,
                                      struct mr__cuda_status *st) {
  if (N > 0)
    xent_bwd_k<<<(unsigned)N, XENT_THREADS, 0, s>>>(dlogits, logits, lse, t, scale,
                                                    V, st);
  return cudaGetLastError();
}

/* ---- axpby, sum of squares, AdamW ---- */

__global__ void axpby_k(float *y, const float *x, float a, float b, int64_t n) {
  MR_GRID_STRIDE(i, n) {
    if (a == 1.0f)
      y[i] += b * x[i];
    else if (a == 0.0f)
      y[i] = b * x[i];
    else
      y[i] = a * y[i] + b * x[i];
  }
}

extern "C" cudaError_t mr__k_axpby(cudaStream_t s, float *y, const float *x,
                                   float a, float b, int64_t n) {
  if (n > 0)
    axpby_k<<<mr_blocks(n), MR_THREADS, 0, s>>>(y, x, a, b, n);
  return cudaGetLastError();
}

#define SUMSQ_CHUNK 4096

/* One block (128 threads) per 4096-element chunk.  Thread (group g, lane l)
 * sums lane l of the 256-element group g in float, the CPU's 8 lanes; the
 * lanes are combined in the CPU's pairwise order, the group's tail added
 * after, and the groups summed in double in order. */
__global__ void sumsq_k(double *part, const float *x, int64_t n) {
  __shared__ float lanes[16][8];
  __shared__ float tails[16];
  int g = threadIdx.x >> 3, l = threadIdx.x & 7;
  int64_t base = (int64_t)blockIdx.x * SUMSQ_CHUNK + (int64_t)g * 256;
  int64_t end = base + 256 < n ? base + 256 : n;
  int64_t len = end > base ? end - base : 0;
  int64_t full = len / 8 * 8;
  float acc = 0.0f;
  for (int64_t i = l; i < full; i += 8)
    acc = fmaf(x[base + i], x[base + i], acc);
  lanes[g][l] = acc;
  __syncthreads();
  if (l == 0) {
    const float *a = lanes[g];
    float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    for (int64_t i = full; i < len; i++)
      s += x[base + i] * x[base + i];
    tails[g] = len > 0 ? s : 0.0f;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int i = 0; i < 16; i++) {
      int64_t gb = (int64_t)blockIdx.x * SUMSQ_CHUNK + (int64_t)i * 256;
      if (gb < n)
        total += (double)tails[i];
    }
    part[blockIdx.x] = total;
  }
}

extern "C" cudaError_t mr__k_sumsq_chunks(cudaStream_t s, double *part,
                                          const float *x, int64_t n) {
  int64_t chunks = (n + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK;
  if (chunks > 0)
    sumsq_k<<<(unsigned)chunks, 128, 0, s>>>(part, x, n);
  return cudaGetLastError();
}

/* torch.optim.AdamW's order, as mr_cpu_adamw_step */
__global__ void adamw_k(float *p, const float *grad, float *m, float *v, int64_t n,
                        float decay, float b1, float b2, float step_size,
                        float bc2_sqrt, float eps, float gs) {
  MR_GRID_STRIDE(i, n) {
    float g = grad[i] * gs;
    float pi = p[i] * decay;
    float mi = m[i] * b1 + g * (1.0f - b1);
    float vi = v[i] * b2 + (1.0f - b2) * g * g;
    float denom = sqrtf(vi) / bc2_sqrt + eps;
    p[i] = pi - step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
  }
}

extern "C" cudaError_t mr__k_adamw(cudaStream_t s, float *p, const float *g,
                                   float *m, float *v, int64_t n, float decay,
                                   float b1, float b2, float step_size,
                                   float bc2_sqrt, float eps, float gs) {
  if (n > 0)
    adamw_k<<<mr_blocks(n), MR_THREADS, 0, s>>>(p, g, m, v, n, decay, b1, b2,
                                                step_size, bc2_sqrt, eps, gs);
  return cudaGetLastError();
}

/* ---- fallback GEMM: 32x32 tiles, 256 threads, 4 outputs each ---- */

template <typename T>
__device__ __forceinline__ float mr_load_f(const T *p, int64_t i);
template <>
__device__ __forceinline__ float mr_load_f<float>(const float *p, int64_t i) {
  return p[i];
}
template <>
__device__ __forceinline__ float mr_load_f<__nv_bfloat16>(const __nv_bfloat16 *p,
                                                          int64_t i) {
  return __bfloat162float(p[i]);
}
template <>
__device__ __forceinline__ float mr_load_f<__half>(const __half *p, int64_t i) {
  return __half2float(p[i]);
}

template <typename T>
__global__ void gemm_k(int ta, int tb, int64_t M, int64_t N, int64_t K, const T *A,
                       int64_t lda, const T *B, int64_t ldb, float *C, int64_t ldc,
                       int accum) {
  __shared__ float As[32][33], Bs[32][33];
  int tx = threadIdx.x & 31, ty = threadIdx.x >> 5; /* ty 0..7 */
  int64_t m0 = (int64_t)blockIdx.y * 32, n0 = (int64_t)blockIdx.x * 32;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    for (int i = ty; i < 32; i += 8) {
      /* As[i][tx] = op(A)[m0 + i, k0 + tx]; Bs[i][tx] = op(B)[k0 + i, n0 + tx] */
      int64_t m = m0 + i, k = k0 + tx;
      float a = 0.0f;
      if (m < M && k < K)
        a = mr_load_f(A, ta ? k * lda + m : m * lda + k);
      As[i][tx] = a;
      int64_t kb = k0 + i, n = n0 + tx;
      float b = 0.0f;
      if (kb < K && n < N)
        b = mr_load_f(B, tb ? n * ldb + kb : kb * ldb + n);
      Bs[i][tx] = b;
    }
    __syncthreads();
    for (int kk = 0; kk < 32; kk++) {
      float bv = Bs[kk][tx];
#pragma unroll
      for (int j = 0; j < 4; j++)
        acc[j] = fmaf(As[ty + 8 * j][kk], bv, acc[j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int j = 0; j < 4; j++) {
    int64_t m = m0 + ty + 8 * j, n = n0 + tx;
    if (m < M && n < N)
      C[m * ldc + n] = accum ? C[m * ldc + n] + acc[j] : acc[j];
  }
}

extern "C" cudaError_t mr__k_gemm_fallback(cudaStream_t s, int ta, int tb,
                                           int64_t M, int64_t N, int64_t K,
                                           const void *A, int64_t lda,
                                           const void *B, int64_t ldb, float *C,
                                           int64_t ldc, int dtype, int accum) {
  if (M <= 0 || N <= 0)
    return cudaGetLastError();
  if ((M + 31) / 32 > 65535)
    return cudaErrorInvalidConfiguration;
  dim3 grid((unsigned)((N + 31) / 32), (unsigned)((M + 31) / 32));
  if (dtype == 1)
    gemm_k<__nv_bfloat16><<<grid, 256, 0, s>>>(ta, tb, M, N, K,
                                              (const __nv_bfloat16 *)A, lda,
                                              (const __nv_bfloat16 *)B, ldb, C, ldc,
                                              accum);
  else if (dtype == 2)
    gemm_k<__half><<<grid, 256, 0, s>>>(ta, tb, M, N, K, (const __half *)A, lda,
                                       (const __half *)B, ldb, C, ldc, accum);
  else
    gemm_k<float><<<grid, 256, 0, s>>>(ta, tb, M, N, K, (const float *)A, lda,
                                      (const float *)B, ldb, C, ldc, accum);
  return cudaGetLastError();
}
