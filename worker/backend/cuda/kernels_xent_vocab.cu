/* kernels_xent_vocab.cu - cross-entropy in steps for logits split by
 * vocabulary, as worker/backend/cpu/xent_vocab.h defines them: row maxima,
 * sums of exponentials with the targets' logits, the finishing step, and
 * their gradients.  One block per row for the [N, V] steps (a fixed
 * reduction tree per row); the [N] finishing steps in one block or a grid
 * stride. */
#include "worker/backend/cuda/kernels_common.cuh"

#define XV_THREADS 256
#define XV_FINISH_THREADS 1024

/* The target's column in the shard [lo, lo + V), or -1. */
__device__ __forceinline__ int64_t xv_column(int32_t t, int64_t lo, int64_t V) {
  int64_t c = (int64_t)t - lo;
  return t >= 0 && c >= 0 && c < V ? c : -1;
}

__global__ void xv_max_k(float *m, const float *logits, int64_t V) {
  __shared__ float red[32];
  float mx = mr_block_row_max(logits + (int64_t)blockIdx.x * V, V, red);
  if (threadIdx.x == 0)
    m[blockIdx.x] = mx;
}

__global__ void xv_sumexp_k(float *s, float *tl, const float *logits,
                            const int32_t *targets, const float *m, int64_t V,
                            int64_t lo, int64_t vocab, struct mr__cuda_status *st) {
  __shared__ float red[32];
  int64_t r = blockIdx.x;
  const float *x = logits + r * V;
  float mx = m[r], acc = 0.0f;
  if (mx != -INFINITY) /* a row of -inf (or no columns) has no mass */
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
      acc += expf(x[j] - mx);
  acc = mr_block_sum(acc, red);
  if (threadIdx.x == 0) {
    int32_t t = targets[r];
    if (t >= vocab)
      mr_report(st, MR__KERR_XENT_TARGET, t, r, vocab);
    int64_t c = xv_column(t, lo, V);
    s[r] = acc;
    tl[r] = c >= 0 ? x[c] : 0.0f;
  }
}

/* d may be logits itself: each element is read and written by one thread. */
__global__ void xv_sumexp_bwd_k(float *d, const float *logits, const int32_t *targets,
                                const float *m, const float *ds, const float *dtl,
                                int64_t V, int64_t lo, int64_t vocab,
                                struct mr__cuda_status *st) {
  int64_t r = blockIdx.x;
  int32_t t = targets[r];
  if (t >= vocab && threadIdx.x == 0)
    mr_report(st, MR__KERR_XENT_TARGET, t, r, vocab);
  int64_t c = xv_column(t, lo, V);
  float g = ds != nullptr ? ds[r] : 0.0f, mx = m[r];
  float add = dtl != nullptr ? dtl[r] : 0.0f;
  int zero = g == 0.0f || mx == -INFINITY;
  const float *x = logits + r * V;
  float *dr = d + r * V;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    float v = zero ? 0.0f : g * expf(x[j] - mx);
    dr[j] = j == c ? v + add : v;
  }
}

/* lse and the loss over the rows whose target is >= 0, summed in double in
 * a fixed tree, over `rows` (0: their count). */
__global__ void xv_finish_k(float *loss, float *lse, const float *s, const float *tl,
                            const float *m, const int32_t *targets, int64_t N,
                            double rows) {
  __shared__ double red[32];
  double sum = 0.0, valid = 0.0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    float l = m[i] + logf(s[i]);
    lse[i] = l;
    if (targets[i] >= 0) {
      sum += (double)(l - tl[i]);
      valid += 1.0;
    }
  }
  sum = mr_block_sum(sum, red);
  valid = mr_block_sum(valid, red);
  if (threadIdx.x == 0) {
    double denom = rows > 0 ? rows : valid;
    loss[0] = denom > 0 ? (float)(sum / denom) : 0.0f;
  }
}

__global__ void xv_finish_bwd_k(float *ds, float *dtl, const float *scale,
                                const float *dlse, const float *s,
                                const int32_t *targets, int64_t N) {
  MR_GRID_STRIDE(i, N) {
    float w = targets[i] >= 0 ? scale[0] : 0.0f;
    float num = w + (dlse != nullptr ? dlse[i] : 0.0f);
    ds[i] = num == 0.0f ? 0.0f : num / s[i]; /* an ignored row may have s 0 */
    dtl[i] = -w;
  }
}

extern "C" cudaError_t mr__k_xv_max(cudaStream_t s, float *m, const float *logits,
                                    int64_t N, int64_t V) {
  if (N > 0)
    xv_max_k<<<(unsigned)N, XV_THREADS, 0, s>>>(m, logits, V);
  return cudaGetLastError();
}

extern "C" cudaError_t mr__k_xv_sumexp(cudaStream_t s, float *sum, float *tl,
                                       const float *logits, const int32_t *t,
                                       const float *m, int64_t N, int64_t V,
                                       int64_t lo, int64_t vocab,
                                       struct mr__cuda_status *st) {
  if (N > 0)
    xv_sumexp_k<<<(unsigned)N, XV_THREADS, 0, s>>>(sum, tl, logits, t, m, V, lo, vocab,
                                                   st);
  return cudaGetLastError();
}

extern "C" cudaError_t mr__k_xv_sumexp_bwd(cudaStream_t s, float *dlogits,
                                           const float *logits, const int32_t *t,
                                           const float *m, const float *ds,
                                           const float *dtl, int64_t N, int64_t V,
                                           int64_t lo, int64_t vocab,
                                           struct mr__cuda_status *st) {
  if (N > 0)
    xv_sumexp_bwd_k<<<(unsigned)N, XV_THREADS, 0, s>>>(dlogits, logits, t, m, ds, dtl, V,
                                                       lo, vocab, st);
  return cudaGetLastError();
}

extern "C" cudaError_t mr__k_xv_finish(cudaStream_t s, float *loss, float *lse,
                                       const float *sum, const float *tl,
                                       const float *m, const int32_t *t, int64_t N,
                                       double rows) {
  xv_finish_k<<<1, XV_FINISH_THREADS, 0, s>>>(loss, lse, sum, tl, m, t, N, rows);
  return cudaGetLastError();
}

extern "C" cudaError_t mr__k_xv_finish_bwd(cudaStream_t s, float *ds, float *dtl,
                                           const float *scale, const float *dlse,
                                           const float *sum, const int32_t *t,
                                           int64_t N) {
  if (N > 0)
    xv_finish_bwd_k<<<mr_blocks(N), MR_THREADS, 0, s>>>(ds, dtl, scale, dlse, sum, t, N);
  return cudaGetLastError();
}
