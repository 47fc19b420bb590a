/* kernels_attn.cu - causal self-attention with grouped-query heads, flash
 * style, in float32 on the CUDA cores.
 *
 * Tiles are 32 queries by 32 keys; a block of 256 threads works on one
 * tile pair, thread t owning row t/8 and every 8th column or dimension from
 * t%8, so each row's 8 threads sit in one warp and reduce with shuffles.
 * Rows of the shared tiles are padded to D+1 floats (no bank conflicts for
 * even D).
 *
 * Forward: a block per (batch, head, query tile) walks the key tiles up to
 * the diagonal with an online softmax (running max m and sum l per row);
 * no T x T matrix exists.  It writes o and lse = m + log l.
 *
 * Backward (FlashAttention-2's split, no atomics, deterministic): Di =
 * rowsum(dO o O); a block per (batch, kv head, key tile) accumulates dK and
 * dV over every query head of its group and every query tile at or below
 * the diagonal, rebuilding P = exp(s - lse); a block per (batch, head,
 * query tile) accumulates dQ over the key tiles.  All three gradients are
 * overwritten. */
#include "worker/backend/cuda/kernels_common.cuh"

#define TQ 32
#define TK 32
#define ATT_THREADS 256

struct attn_dims {
  int B, T, H, KH, D, rep, ntiles;
  int64_t qs, ks; // row strides of q (and o, dq, do) and of k (and v, dk, dv)
  float scale;
  int amp;
};

/* Loads rows [t0, t0 + 32) of one head (columns [col, col + D)) of x into
 * a padded tile, rounded for amp and multiplied by mul; rows past T are 0. */
__device__ __forceinline__ void load_tile(float *tile, int ld, const float *x,
                                          int64_t stride, int64_t col, int t0,
                                          const attn_dims &a, int b, float mul) {
  for (int idx = threadIdx.x; idx < 32 * a.D; idx += ATT_THREADS) {
    int i = idx / a.D, d = idx % a.D, t = t0 + i;
    float v = 0.0f;
    if (t < a.T)
      v = mr_round_amp(x[((int64_t)b * a.T + t) * stride + col + d], a.amp) * mul;
    tile[i * ld + d] = v;
  }
}

template <int DMAX>
__global__ void __launch_bounds__(ATT_THREADS)
    attn_fwd_k(float *o, float *lse, const float *q, const float *k, const float *v,
               attn_dims a) {
  extern __shared__ float sm[];
  const int ld = a.D + 1;
  float *Qs = sm, *Ks = Qs + TQ * ld, *Vs = Ks + TK * ld, *Ps = Vs + TK * ld;
  int qt = blockIdx.x % a.ntiles, bh = blockIdx.x / a.ntiles;
  int b = bh / a.H, h = bh % a.H, kvh = h / a.rep;
  int r = threadIdx.x >> 3, sub = threadIdx.x & 7;
  int q0 = qt * TQ, t = q0 + r;
  /* q is pre-scaled, as the CPU kernel scales each query row */
  load_tile(Qs, ld, q, a.qs, (int64_t)h * a.D, q0, a, b, a.scale);
  constexpr int NPT = DMAX / 8;
  float acc[NPT];
#pragma unroll
  for (int i = 0; i < NPT; i++)
    acc[i] = 0.0f;
  float m_i = -INFINITY, l_i = 0.0f;
  for (int kt = 0; kt <= qt; kt++) {
    int k0 = kt * TK;
    __syncthreads();
    load_tile(Ks, ld, k, a.ks, (int64_t)kvh * a.D, k0, a, b, 1.0f);
    load_tile(Vs, ld, v, a.ks, (int64_t)kvh * a.D, k0, a, b, 1.0f);
    __syncthreads();
    float s[4];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; j++) {
      int c = sub + 8 * j, key = k0 + c;
      float acc_s = 0.0f;
      for (int d = 0; d < a.D; d++)
        acc_s = fmaf(Qs[r * ld + d], Ks[c * ld + d], acc_s);
      s[j] = (key <= t && t < a.T) ? acc_s : -INFINITY;
      mx = fmaxf(mx, s[j]);
    }
    for (int off = 1; off < 8; off <<= 1)
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float m_new = fmaxf(m_i, mx);
    float alpha = m_i == -INFINITY ? 0.0f : expf(m_i - m_new);
    float ps = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
      float p = s[j] == -INFINITY ? 0.0f : expf(s[j] - m_new);
      Ps[r * (TK + 1) + sub + 8 * j] = p;
      ps += p;
    }
    for (int off = 1; off < 8; off <<= 1)
      ps += __shfl_xor_sync(0xffffffffu, ps, off);
    l_i = l_i * alpha + ps;
    m_i = m_new;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < NPT; i++) {
      int d = sub + 8 * i;
      if (d < a.D) {
        float x = acc[i] * alpha;
        for (int c = 0; c < TK; c++)
          x = fmaf(Ps[r * (TK + 1) + c], Vs[c * ld + d], x);
        acc[i] = x;
      }
    }
  }
  if (t < a.T) {
    float inv = 1.0f / l_i;
    float *orow = o + ((int64_t)b * a.T + t) * a.qs + (int64_t)h * a.D;
#pragma unroll
    for (int i = 0; i < NPT; i++) {
      int d = sub + 8 * i;
      if (d < a.D)
        orow[d] = acc[i] * inv;
    }
    if (sub == 0)
      lse[((int64_t)b * a.H + h) * a.T + t] = m_i + logf(l_i);
  }
}

/* Di[b, h, t] = sum_d dO * O (dO rounded for amp, as the CPU rounds it) */
__global__ void attn_di_k(float *di, const float *dout, const float *o, attn_dims a) {
  int64_t rows = (int64_t)a.B * a.T * a.H;
  int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  if (warp >= rows)
    return;
  int h = (int)(warp % a.H);
  int64_t bt = warp / a.H;
  int b = (int)(bt / a.T), t = (int)(bt % a.T);
  const float *dr = dout + bt * a.qs + (int64_t)h * a.D;
  const float *orow = o + bt * a.qs + (int64_t)h * a.D;
  float s = 0.0f;
  for (int d = lane; d < a.D; d += 32)
    s += mr_round_amp(dr[d], a.amp) * orow[d];
  for (int off = 16; off > 0; off >>= 1)
    s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0)
    di[((int64_t)b * a.H + h) * a.T + t] = s;
}

/* The query side of a backward tile pair: rows [q0, q0 + 32) of head h of
 * q and dout as load_tile loads them, and those rows' lse and Di (0 past T). */
__device__ __forceinline__ void load_query_side(float *Qs, float *dOs, float *lse_s,
                                                float *di_s, const float *q,
                                                const float *dout, const float *lse,
                                                const float *di, int ld, int q0,
                                                const attn_dims &a, int b, int h) {
  load_tile(Qs, ld, q, a.qs, (int64_t)h * a.D, q0, a, b, 1.0f);
  load_tile(dOs, ld, dout, a.qs, (int64_t)h * a.D, q0, a, b, 1.0f);
  if (threadIdx.x < TQ) {
    int t = q0 + threadIdx.x;
    int64_t at = ((int64_t)b * a.H + h) * a.T + t;
    lse_s[threadIdx.x] = t < a.T ? lse[at] : 0.0f;
    di_s[threadIdx.x] = t < a.T ? di[at] : 0.0f;
  }
}

/* P and the scaled score gradient dS for rows [q0, q0+32) x keys [k0,
 * k0+32): thread (r, sub) fills columns sub + 8j of row r. */
__device__ __forceinline__ void attn_p_ds(float *Ps, float *dSs, const float *Qs,
                                          const float *dOs, const float *Ks,
                                          const float *Vs, const float *lse_s,
                                          const float *di_s, int ld, int q0, int k0,
                                          const attn_dims &a, int want_p) {
  int r = threadIdx.x >> 3, sub = threadIdx.x & 7, t = q0 + r;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    int c = sub + 8 * j, key = k0 + c;
    float p = 0.0f, ds = 0.0f;
    if (key <= t && t < a.T) {
      float sc = 0.0f, dp = 0.0f;
      for (int d = 0; d < a.D; d++) {
        sc = fmaf(Qs[r * ld + d], Ks[c * ld + d], sc);
        dp = fmaf(dOs[r * ld + d], Vs[c * ld + d], dp);
      }
      p = expf(sc * a.scale - lse_s[r]);
      ds = p * (dp - di_s[r]) * a.scale;
    }
    if (want_p)
      Ps[r * (TK + 1) + c] = p;
    dSs[r * (TK + 1) + c] = ds;
  }
}

template <int DMAX>
__global__ void __launch_bounds__(ATT_THREADS)
    attn_dkdv_k(float *dk, float *dv, const float *dout, const float *q,
                const float *k, const float *v, const float *lse, const float *di,
                attn_dims a) {
  extern __shared__ float sm[];
  const int ld = a.D + 1;
  float *Ks = sm, *Vs = Ks + TK * ld, *Qs = Vs + TK * ld, *dOs = Qs + TQ * ld;
  float *Ps = dOs + TQ * ld, *dSs = Ps + TQ * (TK + 1);
  float *lse_s = dSs + TQ * (TK + 1), *di_s = lse_s + TQ;
  int kt = blockIdx.x % a.ntiles, bk = blockIdx.x / a.ntiles;
  int b = bk / a.KH, kvh = bk % a.KH;
  int c = threadIdx.x >> 3, sub = threadIdx.x & 7;
  int k0 = kt * TK;
  load_tile(Ks, ld, k, a.ks, (int64_t)kvh * a.D, k0, a, b, 1.0f);
  load_tile(Vs, ld, v, a.ks, (int64_t)kvh * a.D, k0, a, b, 1.0f);
  constexpr int NPT = DMAX / 8;
  float dK[NPT], dV[NPT];
#pragma unroll
  for (int i = 0; i < NPT; i++)
    dK[i] = dV[i] = 0.0f;
  for (int h = kvh * a.rep; h < (kvh + 1) * a.rep; h++) {
    for (int qt = kt; qt < a.ntiles; qt++) {
      int q0 = qt * TQ;
      __syncthreads();
      load_query_side(Qs, dOs, lse_s, di_s, q, dout, lse, di, ld, q0, a, b, h);
      __syncthreads();
      attn_p_ds(Ps, dSs, Qs, dOs, Ks, Vs, lse_s, di_s, ld, q0, k0, a, 1);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < NPT; i++) {
        int d = sub + 8 * i;
        if (d < a.D) {
          float xv = dV[i], xk = dK[i];
          for (int r = 0; r < TQ; r++) {
            xv = fmaf(Ps[r * (TK + 1) + c], dOs[r * ld + d], xv);
            xk = fmaf(dSs[r * (TK + 1) + c], Qs[r * ld + d], xk);
          }
          dV[i] = xv;
          dK[i] = xk;
        }
      }
    }
  }
  int key = k0 + c;
  if (key < a.T) {
    int64_t off = ((int64_t)b * a.T + key) * a.ks + (int64_t)kvh * a.D;
#pragma unroll
    for (int i = 0; i < NPT; i++) {
      int d = sub + 8 * i;
      if (d < a.D) {
        dk[off + d] = dK[i];
        dv[off + d] = dV[i];
      }
    }
  }
}

template <int DMAX>
__global__ void __launch_bounds__(ATT_THREADS)
    attn_dq_k(float *dq, const float *dout, const float *q, const float *k,
              const float *v, const float *lse, const float *di, attn_dims a) {
  extern __shared__ float sm[];
  const int ld = a.D + 1;
  float *Qs = sm, *dOs = Qs + TQ * ld, *Ks = dOs + TQ * ld, *Vs = Ks + TK * ld;
  float *dSs = Vs + TK * ld, *lse_s = dSs + TQ * (TK + 1), *di_s = lse_s + TQ;
  int qt = blockIdx.x % a.ntiles, bh = blockIdx.x / a.ntiles;
  int b = bh / a.H, h = bh % a.H, kvh = h / a.rep;
  int r = threadIdx.x >> 3, sub = threadIdx.x & 7;
  int q0 = qt * TQ, t = q0 + r;
  load_query_side(Qs, dOs, lse_s, di_s, q, dout, lse, di, ld, q0, a, b, h);
  constexpr int NPT = DMAX / 8;
  float dQ[NPT];
#pragma unroll
  for (int i = 0; i < NPT; i++)
    dQ[i] = 0.0f;
  for (int kt = 0; kt <= qt; kt++) {
    int k0 = kt * TK;
    __syncthreads();
    load_tile(Ks, ld, k, a.ks, (int64_t)kvh * a.D, k0, a, b, 1.0f);
    load_tile(Vs, ld, v, a.ks, (int64_t)kvh * a.D, k0, a, b, 1.0f);
    __syncthreads();
    attn_p_ds(nullptr, dSs, Qs, dOs, Ks, Vs, lse_s, di_s, ld, q0, k0, a, 0);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < NPT; i++) {
      int d = sub + 8 * i;
      if (d < a.D) {
        float x = dQ[i];
        for (int c = 0; c < TK; c++)
          x = fmaf(dSs[r * (TK + 1) + c], Ks[c * ld + d], x);
        dQ[i] = x;
      }
    }
  }
  if (t < a.T) {
    float *row = dq + ((int64_t)b * a.T + t) * a.qs + (int64_t)h * a.D;
#pragma unroll
    for (int i = 0; i < NPT; i++) {
      int d = sub + 8 * i;
      if (d < a.D)
        row[d] = dQ[i];
    }
  }
}

static attn_dims make_dims(int B, int T, int H, int KH, int D, int amp) {
  attn_dims a;
  a.B = B;
  a.T = T;
  a.H = H;
  a.KH = KH;
  a.D = D;
  a.rep = H / KH;
  a.ntiles = (T + TQ - 1) / TQ;
  a.qs = (int64_t)H * D;
  a.ks = (int64_t)KH * D;
  a.scale = 1.0f / sqrtf((float)D);
  a.amp = amp;
  return a;
}

/* Launches kernel with dynamic shared memory smem, raising the per-kernel
 * limit first where smem passes the default 48 KiB. */
template <typename K, typename... Args>
static cudaError_t launch_big(K kernel, unsigned blocks, size_t smem, cudaStream_t s,
                              Args... args) {
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem);
    if (e != cudaSuccess)
      return e;
  }
  kernel<<<blocks, ATT_THREADS, smem, s>>>(args...);
  return cudaGetLastError();
}

/* The tensor-core kernels read rows as float4 */
static bool rows_align(const float *a, const float *b, const float *c, const float *d) {
  return (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d) & 15) == 0;
}

static cudaError_t check_dims(int B, int T, int H, int KH, int D) {
  if (B < 0 || T < 0 || H <= 0 || KH <= 0 || H % KH != 0 || D <= 0 || D > 256)
    return cudaErrorInvalidValue;
  int64_t blocks = (int64_t)B * H * ((T + TQ - 1) / TQ);
  if (blocks > 0x7fffffffLL)
    return cudaErrorInvalidConfiguration;
  return cudaSuccess;
}

extern "C" cudaError_t mr__k_attn_fwd(cudaStream_t s, float *o, float *lse,
                                      const float *q, const float *k, const float *v,
                                      int B, int T, int H, int KH, int D, int amp,
                                      int tc) {
  cudaError_t e = check_dims(B, T, H, KH, D);
  if (e != cudaSuccess || B == 0 || T == 0)
    return e;
  if (tc && mr__k_attn_tensor_ok(amp, D) && rows_align(q, k, v, v))
    return mr__k_attn_fwd_tc(s, o, lse, q, k, v, B, T, H, KH, D);
  attn_dims a = make_dims(B, T, H, KH, D, amp);
  unsigned blocks = (unsigned)((int64_t)B * H * a.ntiles);
  size_t smem = sizeof(float) * ((size_t)(TQ + 2 * TK) * (D + 1) + TQ * (TK + 1));
  if (D <= 64)
    return launch_big(attn_fwd_k<64>, blocks, smem, s, o, lse, q, k, v, a);
  if (D <= 128)
    return launch_big(attn_fwd_k<128>, blocks, smem, s, o, lse, q, k, v, a);
  return launch_big(attn_fwd_k<256>, blocks, smem, s, o, lse, q, k, v, a);
}

extern "C" cudaError_t mr__k_attn_bwd(cudaStream_t s, float *dq, float *dk, float *dv,
                                      const float *dout, const float *q,
                                      const float *k, const float *v, const float *o,
                                      const float *lse, int B, int T, int H, int KH,
                                      int D, int amp, int tc, float *scratch) {
  cudaError_t e = check_dims(B, T, H, KH, D);
  if (e != cudaSuccess || B == 0 || T == 0)
    return e;
  attn_dims a = make_dims(B, T, H, KH, D, amp);
  int64_t rows = (int64_t)B * T * H;
  float *di = scratch;
  attn_di_k<<<(unsigned)((rows * 32 + 255) / 256), 256, 0, s>>>(di, dout, o, a);
  if ((e = cudaGetLastError()) != cudaSuccess)
    return e;
  if (tc && mr__k_attn_tensor_ok(amp, D) && rows_align(q, k, v, dout))
    return mr__k_attn_bwd_tc(s, dq, dk, dv, dout, q, k, v, lse, di, B, T, H, KH, D,
                             scratch + rows);
  unsigned kv_blocks = (unsigned)((int64_t)B * KH * a.ntiles);
  unsigned q_blocks = (unsigned)((int64_t)B * H * a.ntiles);
  size_t tiles = sizeof(float) * ((size_t)(2 * TQ + 2 * TK) * (D + 1));
  size_t smem_kv = tiles + sizeof(float) * (2 * TQ * (TK + 1) + 2 * TQ);
  size_t smem_q = tiles + sizeof(float) * (TQ * (TK + 1) + 2 * TQ);
  if (D <= 64) {
    e = launch_big(attn_dkdv_k<64>, kv_blocks, smem_kv, s, dk, dv, dout, q, k, v, lse, di, a);
    if (e == cudaSuccess)
      e = launch_big(attn_dq_k<64>, q_blocks, smem_q, s, dq, dout, q, k, v, lse, di, a);
  } else if (D <= 128) {
    e = launch_big(attn_dkdv_k<128>, kv_blocks, smem_kv, s, dk, dv, dout, q, k, v, lse, di, a);
    if (e == cudaSuccess)
      e = launch_big(attn_dq_k<128>, q_blocks, smem_q, s, dq, dout, q, k, v, lse, di, a);
  } else {
    e = launch_big(attn_dkdv_k<256>, kv_blocks, smem_kv, s, dk, dv, dout, q, k, v, lse, di, a);
    if (e == cudaSuccess)
      e = launch_big(attn_dq_k<256>, q_blocks, smem_q, s, dq, dout, q, k, v, lse, di, a);
  }
  return e;
}

extern "C" int64_t mr__k_attn_bwd_scratch(int B, int T, int H, int KH, int D, int tc) {
  int64_t di = (int64_t)B * H * T;
  return tc ? di + mr__k_attn_tc_parts(B, T, H, KH, D) : di;
}
