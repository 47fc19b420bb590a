/* kernels_elem.cu - embedding, elementwise ops, normalization, RoPE, the
 * column reductions behind bias and norm weight gradients, and the 16-bit
 * conversions.  Formulas and operation order follow the CPU kernels. */
#include "worker/backend/cuda/kernels_common.cuh"

/* ---- embedding ---- */

__global__ void embedding_fwd_k(float *out, const float *table, const int32_t *ids,
                                int64_t N, int64_t V, int64_t C, int64_t lo,
                                int64_t all, struct mr__cuda_status *st) {
  MR_GRID_STRIDE(i, N * C) {
    int64_t r = i / C, c = i % C;
    int64_t id = ids[r];
    if (id < 0 || id >= all) {
      if (c == 0)
        mr_report(st, MR__KERR_EMBED_ID, id, r, all);
      out[i] = 0.0f;
      continue;
    }
    int64_t row = id - lo;
    out[i] = row >= 0 && row < V ? table[row * C + c] : 0.0f;
  }
}

#define EMB_GROUP 8

/* One thread per column walks the tokens in order, EMB_GROUP at a time:
 * the group's loads are independent, repeated ids within a group are
 * folded into their first occurrence in token order, so every row of
 * dtable receives its tokens' gradients in token order, as on the CPU. */
__global__ void embedding_bwd_k(float *dt, const float *dout, const int32_t *ids,
                                int64_t N, int64_t V, int64_t C, int64_t lo,
                                int64_t all, struct mr__cuda_status *st) {
  int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C)
    return;
  for (int64_t r0 = 0; r0 < N; r0 += EMB_GROUP) {
    int64_t row[EMB_GROUP];
    float g[EMB_GROUP], acc[EMB_GROUP];
    int lead[EMB_GROUP];
#pragma unroll
    for (int j = 0; j < EMB_GROUP; j++) {
      row[j] = -1;
      g[j] = 0.0f;
      if (r0 + j < N) {
        int64_t id = ids[r0 + j];
        if (id < 0 || id >= all) {
          if (c == 0)
            mr_report(st, MR__KERR_EMBED_ID, id, r0 + j, all);
        } else if (id - lo >= 0 && id - lo < V) {
          row[j] = id - lo;
          g[j] = dout[(r0 + j) * C + c];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < EMB_GROUP; j++) {
      lead[j] = j;
#pragma unroll
      for (int i = 0; i < EMB_GROUP; i++)
        if (i < j && lead[j] == j && row[i] == row[j])
          lead[j] = i;
    }
#pragma unroll
    for (int j = 0; j < EMB_GROUP; j++)
      acc[j] = (row[j] >= 0 && lead[j] == j) ? dt[row[j] * C + c] : 0.0f;
#pragma unroll
    for (int j = 0; j < EMB_GROUP; j++)
      if (row[j] >= 0) {
#pragma unroll
        for (int i = 0; i < EMB_GROUP; i++)
          if (i == lead[j])
            acc[i] += g[j];
      }
#pragma unroll
    for (int j = 0; j < EMB_GROUP; j++)
      if (row[j] >= 0 && lead[j] == j)
        dt[row[j] * C + c] = acc[j];
  }
}

extern "C" cudaError_t mr__k_embedding_fwd(cudaStream_t s, float *out,
                                           const float *table, const int32_t *ids,
                                           int64_t N, int64_t V, int64_t C,
                                           int64_t lo, int64_t all,
                                           struct mr__cuda_status *st) {
  if (N * C > 0)
    embedding_fwd_k<<<mr_blocks(N * C), MR_THREADS, 0, s>>>(out, table, ids, N, V,
                                                            C, lo, all, st);
  return cudaGetLastError();
}

extern "C" cudaError_t mr__k_embedding_bwd(cudaStream_t s, float *dtable,
                                           const float *dout, const int32_t *ids,
                                           int64_t N, int64_t V, int64_t C,
                                           int64_t lo, int64_t all, int accum,
                                           struct mr__cuda_status *st) {
  cudaError_t e =
      accum ? cudaSuccess : cudaMemsetAsync(dtable, 0, (size_t)(V * C) * sizeof(float), s);
  if (e != cudaSuccess || N == 0 || C == 0)
    return e;
  unsigned blocks = (unsigned)((C + 127) / 128);
  embedding_bwd_k<<<blocks, 128, 0, s>>>(dtable, dout, ids, N, V, C, lo, all, st);
  return cudaGetLastError();
}

/* ---- elementwise ---- */

__global__ void add_k(float *out, const float *a, const float *b, int64_t n) {
  MR_GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}

__global__ void bias_add_k(float *y, const float *b, int64_t M, int64_t N) {
  MR_GRID_STRIDE(i, M * N) y[i] = y[i] + b[i % N];
}

extern "C" cudaError_t mr__k_add(cudaStream_t s, float *out, const float *a,
                                 const float *b, int64_t n) {
  if (n > 0)
    add_k<<<mr_blocks(n), MR_THREADS, 0, s>>>(out, a, b, n);
  return cudaGetLastError();
}

extern "C" cudaError_t mr__k_bias_add(cudaStream_t s, float *y, const float *b,
                                      int64_t M, int64_t N) {
  if (M * N > 0)
    bias_add_k<<<mr_blocks(M * N), MR_THREADS, 0, s>>>(y, b, M, N);
  return cudaGetLastError();
}

/* silu(g) * u with the CPU's expression order */
__global__ void swiglu_fwd_k(float *out, const float *g, const float *u, int64_t n) {
  MR_GRID_STRIDE(i, n) {
    float x = g[i];
    out[i] = x / (1.0f + expf(-x)) * u[i];
  }
}

__global__ void swiglu_bwd_k(float *dg, float *du, const float *d, const float *g,
                             const float *u, int64_t n) {
  MR_GRID_STRIDE(i, n) {
    float x = g[i];
    float sg = 1.0f / (1.0f + expf(-x));
    float silu = x * sg;
    float vg = d[i] * u[i] * sg * (1.0f + x * (1.0f - sg));
    float vu = d[i] * silu;
    dg[i] = vg;
    du[i] = vu;
  }
}

#define GELU_K 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_A 0.044715f

__device__ __forceinline__ float tanh_as_cpu(float u) {
  return 1.0f - 2.0f / (expf(2.0f * u) + 1.0f);
}

__global__ void gelu_fwd_k(float *out, const float *x, int64_t n) {
  MR_GRID_STRIDE(i, n) {
    float v = x[i];
    out[i] = 0.5f * v * (1.0f + tanh_as_cpu(GELU_K * (v + GELU_A * v * v * v)));
  }
}

__global__ void gelu_bwd_k(float *dx, const float *d, const float *x, int64_t n) {
  MR_GRID_STRIDE(i, n) {
    float v = x[i];
    float t = tanh_as_cpu(GELU_K * (v + GELU_A * v * v * v));
    float dt = GELU_K * (1.0f + 3.0f * GELU_A * v * v) * (1.0f - t * t);
    dx[i] = d[i] * (0.5f * (1.0f + t) + 0.5f * v * dt);
  }
}

extern "C" cudaError_t mr__k_swiglu_fwd(cudaStream_t s, float *out, const float *g,
                                        const float *u, int64_t n) {
  if (n > 0)
    swiglu_fwd_k<<<mr_blocks(n), MR_THREADS, 0, s>>>(out, g, u, n);
  return cudaGetLastError();
}

extern "C" cudaError_t mr__k_swiglu_bwd(cudaStream_t s, float *dg, float *du,
                                        const float *d, const float *g,
                                        const float *u, int64_t n) {
  if (n > 0)
    swiglu_bwd_k<<<mr_blocks(n), MR_THREADS, 0, s>>>(dg, du, d, g, u, n);
  return cudaGetLastError();
}

extern "C" cudaError_t mr__k_gelu_fwd(cudaStream_t s, float *out, const float *x,
                                      int64_t n) {
  if (n > 0)
    gelu_fwd_k<<<mr_blocks(n), MR_THREADS, 0, s>>>(out, x, n);
  return cudaGetLastError();
}

extern "C" cudaError_t mr__k_gelu_bwd(cudaStream_t s, float *dx, const float *d,
                                      const float *x, int64_t n) {
  if (n > 0)
    gelu_bwd_k<<<mr_blocks(n), MR_THREADS, 0, s>>>(dx, d, x, n);
  return cudaGetLastError();
}

/* ---- 16-bit conversions ---- */

__global__ void to_bf16_k(__nv_bfloat16 *dst, const float *src, int64_t n) {
  MR_GRID_STRIDE(i, n) dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void to_f16_k(__half *dst, const float *src, int64_t n) {
  MR_GRID_STRIDE(i, n) dst[i] = __float2half_rn(src[i]);
}

extern "C" cudaError_t mr__k_to_half(cudaStream_t s, void *dst, const float *src,
                                     int64_t n, int dtype) {
  if (n <= 0)
    return cudaGetLastError();
  if (dtype == 1)
    to_bf16_k<<<mr_blocks(n), MR_THREADS, 0, s>>>((__nv_bfloat16 *)dst, src, n);
  else
    to_f16_k<<<mr_blocks(n), MR_THREADS, 0, s>>>((__half *)dst, src, n);
  return cudaGetLastError();
}

/* ---- column reductions: bias gradient, norm weight and bias gradients ---- */

/* Block (32 columns x 8 row lanes) over MR__COLRED_ROWS rows: partial sums
 * per column, combined in a fixed order.  mode 0: dy; mode 1: dy * xhat
 * (and dy into part_b when given). */
template <int MODE>
__global__ void colred_part_k(float *part_w, float *part_b, const float *dy,
                              const float *x, const float *mean, const float *rstd,
                              int64_t N, int64_t C) {
  __shared__ float sw[8][33], sb[8][33];
  int cx = threadIdx.x, ry = threadIdx.y;
  int64_t c = (int64_t)blockIdx.x * 32 + cx;
  int64_t r0 = (int64_t)blockIdx.y * MR__COLRED_ROWS;
  int64_t r1 = r0 + MR__COLRED_ROWS < N ? r0 + MR__COLRED_ROWS : N;
  float aw = 0.0f, ab = 0.0f;
  if (c < C)
    for (int64_t r = r0 + ry; r < r1; r += 8) {
      float g = dy[r * C + c];
      if (MODE == 0) {
        aw += g;
      } else {
        float m = mean != nullptr ? mean[r] : 0.0f;
        aw += g * ((x[r * C + c] - m) * rstd[r]);
        ab += g;
      }
    }
  sw[ry][cx] = aw;
  sb[ry][cx] = ab;
  __syncthreads();
  if (ry == 0 && c < C) {
    float w = 0.0f, b = 0.0f;
    for (int i = 0; i < 8; i++) {
      w += sw[i][cx];
      b += sb[i][cx];
    }
    part_w[(int64_t)blockIdx.y * C + c] = w;
    if (part_b != nullptr)
      part_b[(int64_t)blockIdx.y * C + c] = b;
  }
}

__global__ void colred_final_k(float *out, const float *part, int64_t R, int64_t C,
                               int accum) {
  MR_GRID_STRIDE(c, C) {
    float s = 0.0f;
    for (int64_t r = 0; r < R; r++)
      s += part[r * C + c];
    out[c] = accum ? out[c] + s : s;
  }
}

static cudaError_t colred(cudaStream_t s, int mode, float *dw, float *db,
                          const float *dy, const float *x, const float *mean,
                          const float *rstd, int64_t N, int64_t C, int accum,
                          float *part) {
  if (C <= 0)
    return cudaGetLastError();
  int64_t R = (N + MR__COLRED_ROWS - 1) / MR__COLRED_ROWS;
  float *pw = part, *pb = db != nullptr ? part + R * C : nullptr;
  if (R > 0) {
    if (R > 65535)
      return cudaErrorInvalidConfiguration;
    dim3 grid((unsigned)((C + 31) / 32), (unsigned)R), block(32, 8);
    if (mode == 0)
      colred_part_k<0><<<grid, block, 0, s>>>(pw, nullptr, dy, x, mean, rstd, N, C);
    else
      colred_part_k<1><<<grid, block, 0, s>>>(pw, pb, dy, x, mean, rstd, N, C);
  }
  colred_final_k<<<mr_blocks(C), MR_THREADS, 0, s>>>(dw, pw, R, C, accum & 1);
  if (db != nullptr)
    colred_final_k<<<mr_blocks(C), MR_THREADS, 0, s>>>(db, pb, R, C, (accum >> 1) & 1);
  return cudaGetLastError();
}

extern "C" cudaError_t mr__k_bias_grad(cudaStream_t s, float *db, const float *dy,
                                       int64_t M, int64_t N, int accum, float *part) {
  return colred(s, 0, db, nullptr, dy, nullptr, nullptr, nullptr, M, N, accum, part);
}

extern "C" cudaError_t mr__k_norm_dwdb(cudaStream_t s, float *dw, float *db,
                                       const float *dy, const float *x,
                                       const float *mean, const float *rstd,
                                       int64_t N, int64_t C, int accum, float *part) {
  return colred(s, 1, dw, db, dy, x, mean, rstd, N, C, accum, part);
}

/* ---- RMSNorm and LayerNorm: one block per row ---- */

__global__ void rmsnorm_fwd_k(float *y, float *rstd, const float *x, const float *w,
                              int64_t C, float eps) {
  __shared__ float red[32];
  const float *xr = x + (int64_t)blockIdx.x * C;
  float *yr = y + (int64_t)blockIdx.x * C;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    ss += xr[c] * xr[c];
  ss = mr_block_sum(ss, red);
  float r = 1.0f / sqrtf(ss / (float)C + eps);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    yr[c] = xr[c] * r * w[c];
  if (rstd != nullptr && threadIdx.x == 0)
    rstd[blockIdx.x] = r;
}

/* dx = r w dy - r^3 / C * x * sum(dy w x) */
__global__ void rmsnorm_bwd_k(float *dx, const float *dy, const float *x,
                              const float *w, const float *rstd, int64_t C) {
  __shared__ float red[32];
  int64_t base = (int64_t)blockIdx.x * C;
  float r = rstd[blockIdx.x];
  float dot = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    dot += dy[base + c] * w[c] * x[base + c];
  dot = mr_block_sum(dot, red);
  float k = r * r * r * dot / (float)C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    dx[base + c] = r * w[c] * dy[base + c] - k * x[base + c];
}

__global__ void layernorm_fwd_k(float *y, float *mean, float *rstd, const float *x,
                                const float *w, const float *b, int64_t C,
                                float eps) {
  __shared__ float red[32];
  int64_t base = (int64_t)blockIdx.x * C;
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    s += x[base + c];
  float m = mr_block_sum(s, red) / (float)C;
  float v = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float d = x[base + c] - m;
    v += d * d;
  }
  v = mr_block_sum(v, red);
  float r = 1.0f / sqrtf(v / (float)C + eps);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    y[base + c] = (x[base + c] - m) * r * w[c] + b[c];
  if (mean != nullptr && threadIdx.x == 0) {
    mean[blockIdx.x] = m;
    rstd[blockIdx.x] = r;
  }
}

/* dx = r (g - mean(g) - xhat mean(g xhat)), g = dy w, xhat = (x - m) r */
__global__ void layernorm_bwd_k(float *dx, const float *dy, const float *x,
                                const float *w, const float *mean,
                                const float *rstd, int64_t C) {
  __shared__ float red[32];
  int64_t base = (int64_t)blockIdx.x * C;
  float m = mean[blockIdx.x], r = rstd[blockIdx.x];
  float sg = 0.0f, sgx = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float g = dy[base + c] * w[c];
    sg += g;
    sgx += g * ((x[base + c] - m) * r);
  }
  sg = mr_block_sum(sg, red) / (float)C;
  sgx = mr_block_sum(sgx, red) / (float)C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float xh = (x[base + c] - m) * r;
    dx[base + c] = r * (dy[base + c] * w[c] - sg - xh * sgx);
  }
}

static unsigned row_threads(int64_t C) {
  return C >= 1024 ? 512 : C >= 256 ? 256 : 128;
}

extern "C" cudaError_t mr__k_rmsnorm_fwd(cudaStream_t s, float *y, float *rstd,
                                         const float *x, const float *w, int64_t N,
                                         int64_t C, float eps) {
  if (N > 0)
    rmsnorm_fwd_k<<<(unsigned)N, row_threads(C), 0, s>>>(y, rstd, x, w, C, eps);
  return cudaGetLastError();
}

extern "C" cudaError_t mr__k_rmsnorm_bwd_dx(cudaStream_t s, float *dx,
                                            const float *dy, const float *x,
                                            const float *w, const float *rstd,
                                            int64_t N, int64_t C) {
  if (N > 0)
    rmsnorm_bwd_k<<<(unsigned)N, row_threads(C), 0, s>>>(dx, dy, x, w, rstd, C);
  return cudaGetLastError();
}

extern "C" cudaError_t mr__k_layernorm_fwd(cudaStream_t s, float *y, float *mean,
                                           float *rstd, const float *x,
                                           const float *w, const float *b,
                                           int64_t N, int64_t C, float eps) {
  if (N > 0)
    layernorm_fwd_k<<<(unsigned)N, row_threads(C), 0, s>>>(y, mean, rstd, x, w, b,
                                                           C, eps);
  return cudaGetLastError();
}

extern "C" cudaError_t mr__k_layernorm_bwd_dx(cudaStream_t s, float *dx,
                                              const float *dy, const float *x,
                                              const float *w, const float *mean,
                                              const float *rstd, int64_t N,
                                              int64_t C) {
  if (N > 0)
    layernorm_bwd_k<<<(unsigned)N, row_threads(C), 0, s>>>(dx, dy, x, w, mean,
                                                           rstd, C);
  return cudaGetLastError();
}

/* ---- RoPE (rotate_half) ---- */

__global__ void rope_k(float *y, const float *x, const float *cs, const float *sn,
                       int64_t rows, int T, int H, int D, float dir) {
  int half = D / 2;
  int64_t per_row = (int64_t)H * half;
  MR_GRID_STRIDE(i, rows * per_row) {
    int64_t r = i / per_row;
    int rem = (int)(i % per_row);
    int h = rem / half, j = rem % half;
    int64_t p = r % T;
    int64_t a = r * (int64_t)H * D + (int64_t)h * D + j, b = a + half;
    float c = cs[p * half + j], sgn = dir * sn[p * half + j];
    float u = x[a], v = x[b];
    y[a] = u * c - v * sgn;
    y[b] = v * c + u * sgn;
  }
}

extern "C" cudaError_t mr__k_rope(cudaStream_t s, float *y, const float *x,
                                  const float *cs, const float *sn, int64_t rows,
                                  int T, int H, int D, float dir) {
  int64_t n = rows * (int64_t)H * (D / 2);
  if (n > 0)
    rope_k<<<mr_blocks(n), MR_THREADS, 0, s>>>(y, x, cs, sn, rows, T, H, D, dir);
  return cudaGetLastError();
}

/* ---- integer average for the NCCL backend ---- */

template <typename I>
__global__ void div_int_k(I *x, int64_t n, int d) {
  MR_GRID_STRIDE(i, n) x[i] = x[i] / (I)d;
}

extern "C" cudaError_t mr__k_div_int(cudaStream_t s, void *x, int64_t n, int dtype,
                                     int divisor) {
  if (n <= 0 || divisor <= 1)
    return cudaGetLastError();
  if (dtype == 3)
    div_int_k<int32_t><<<mr_blocks(n), MR_THREADS, 0, s>>>((int32_t *)x, n, divisor);
  else
    div_int_k<long long><<<mr_blocks(n), MR_THREADS, 0, s>>>((long long *)x, n, divisor);
  return cudaGetLastError();
}
