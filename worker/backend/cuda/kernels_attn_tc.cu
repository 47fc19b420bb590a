/* kernels_attn_tc.cu - causal self-attention with grouped-query heads on
 * the tensor cores, for bf16 amp and head dims D = 16, 32, ..., 128.
 *
 * The same algorithm as kernels_attn.cu (online softmax forward; the
 * FlashAttention-2 backward split into a dK/dV pass and a dQ pass, no
 * atomics, deterministic), with every product of two tiles a bf16 WMMA
 * (16 x 16 x 16, fp32 accumulation):
 *
 *  - q, k, v and dout are rounded to bf16 as they are read, as the CPU
 *    backend's amp emulation rounds them, so those operands are exact and
 *    their products are the CPU's up to the order of the fp32 sums;
 *  - P and dS are fp32 values the CPU keeps in fp32: each enters its
 *    products as two bf16 parts, hi = bf16(x) and lo = bf16(x - hi), which
 *    carry 16 of its 24 bits (a relative error near 2^-17, against 2^-9
 *    for P rounded once as FlashAttention does).
 *
 * Tiles are 64 queries by 64 keys; a block has 4 warps, warp w owning rows
 * [16w, 16w + 16) of its tile.  Score tiles go through shared memory in
 * fp32 for the softmax (the WMMA accumulator's layout is opaque), and the
 * forward keeps its output rows there, where each new key tile rescales
 * them.  Blocks are numbered heaviest first: the query tiles nearest the
 * end of the sequence (the forward and dQ) or the key tiles nearest its
 * start (dK/dV) see the most tiles under the causal mask.
 *
 * dK and dV are computed per query head; with grouped heads (rep > 1) each
 * head's part lands in scratch and a last kernel sums a group's parts in
 * head order. */
#include <mma.h>

#include "worker/backend/cuda/kernels_common.cuh"

using namespace nvcuda;

#define TB 64                // queries or keys per tile
#define TC_WARPS 4           // warp w owns rows [16w, 16w + 16) of a tile
#define TC_THREADS (TC_WARPS * 32)
#define LDS (TB + 4)         // fp32 score tiles' row stride
#define LDP (TB + 8)         // bf16 P and dS tiles' row stride

typedef __nv_bfloat16 bf16;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> frag_a;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> frag_b_row;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> frag_b_col;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> frag_c;

struct tc_dims {
  int B, T, H, KH, rep, ntiles;
  int64_t qs, ks; // row strides of q (o, dq, dout) and of k (v, dk, dv)
  float scale;
};

/* Rows [t0, t0 + 64) of columns [col, col + D) of x (row stride `stride`,
 * rows of batch b) into a bf16 tile with row stride D + 8; rows past T are
 * 0.  D is a multiple of 16, so rows are read as float4. */
template <int D>
__device__ __forceinline__ void tc_load(bf16 *tile, const float *x, int64_t stride,
                                        int64_t col, int t0, int T, int b) {
  constexpr int LDH = D + 8, PER_ROW = D / 4;
  for (int idx = threadIdx.x; idx < TB * PER_ROW; idx += TC_THREADS) {
    int i = idx / PER_ROW, d = (idx % PER_ROW) * 4, t = t0 + i;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (t < T)
      v = *reinterpret_cast<const float4 *>(x + ((int64_t)b * T + t) * stride + col + d);
    bf16 *dst = tile + i * LDH + d;
    dst[0] = __float2bfloat16_rn(v.x);
    dst[1] = __float2bfloat16_rn(v.y);
    dst[2] = __float2bfloat16_rn(v.z);
    dst[3] = __float2bfloat16_rn(v.w);
  }
}

/* Rows [k0, k0 + 64) of kv head kvh of k and v into their tiles. */
template <int D>
__device__ __forceinline__ void tc_load_keys(bf16 *Ks, bf16 *Vs, const float *k,
                                             const float *v, int k0, const tc_dims &a, int b,
                                             int kvh) {
  tc_load<D>(Ks, k, a.ks, (int64_t)kvh * D, k0, a.T, b);
  tc_load<D>(Vs, v, a.ks, (int64_t)kvh * D, k0, a.T, b);
}

/* x as hi + lo, both bf16 */
__device__ __forceinline__ void split_bf16(float x, bf16 *hi, bf16 *lo) {
  bf16 h = __float2bfloat16_rn(x);
  *hi = h;
  *lo = __float2bfloat16_rn(x - __bfloat162float(h));
}

/* out (16 x 64, fp32, row stride LDS) = A (16 x D rows of a, row stride
 * D + 8) times the transpose of B (64 x D, rows of b): scores of 16 rows
 * against a tile's 64. */
template <int NF>
__device__ __forceinline__ void rows_times_tile_t(float *out, const bf16 *a, const bf16 *b) {
  constexpr int LDH = 16 * NF + 8;
#pragma unroll
  for (int n = 0; n < TB / 16; n++) {
    frag_c acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int kk = 0; kk < NF; kk++) {
      frag_a fa;
      frag_b_col fb;
      wmma::load_matrix_sync(fa, a + kk * 16, LDH);
      wmma::load_matrix_sync(fb, b + (n * 16) * LDH + kk * 16, LDH);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + n * 16, acc, LDS, wmma::mem_row_major);
  }
}

/* acc[n] += (hi + lo) (16 x 64, row stride LDP) times columns [16n, 16n +
 * 16) of tile (64 x D, row stride D + 8), for every n < NF. */
template <int NF>
__device__ __forceinline__ void split_times_tile(frag_c *acc, const bf16 *hi, const bf16 *lo,
                                                 const bf16 *tile) {
  constexpr int LDH = 16 * NF + 8;
#pragma unroll
  for (int kk = 0; kk < TB / 16; kk++) {
    frag_a fh, fl;
    wmma::load_matrix_sync(fh, hi + kk * 16, LDP);
    wmma::load_matrix_sync(fl, lo + kk * 16, LDP);
#pragma unroll
    for (int n = 0; n < NF; n++) {
      frag_b_row fb;
      wmma::load_matrix_sync(fb, tile + (kk * 16) * LDH + n * 16, LDH);
      wmma::mma_sync(acc[n], fh, fb, acc[n]);
      wmma::mma_sync(acc[n], fl, fb, acc[n]);
    }
  }
}

/* Writes a warp's 16 x D accumulators to rows [r0, r0 + 16) (those below
 * T) of columns [col, col + D) of y (row stride `stride`), through stage
 * (16 x (D + 4) floats of this warp's). */
template <int NF>
__device__ __forceinline__ void store_rows(float *y, int64_t stride, int64_t col, int r0,
                                           int T, int b, const frag_c *acc, float *stage) {
  constexpr int D = 16 * NF, LDO = D + 4;
#pragma unroll
  for (int n = 0; n < NF; n++)
    wmma::store_matrix_sync(stage + n * 16, acc[n], LDO, wmma::mem_row_major);
  __syncwarp();
  int lane = threadIdx.x & 31;
  for (int idx = lane; idx < 16 * D; idx += 32) {
    int r = idx / D, d = idx % D, t = r0 + r;
    if (t < T)
      y[((int64_t)b * T + t) * stride + col + d] = stage[r * LDO + d];
  }
}

template <int NF>
__global__ void __launch_bounds__(TC_THREADS)
    attn_fwd_tc_k(float *o, float *lse, const float *q, const float *k, const float *v,
                  tc_dims a) {
  constexpr int D = 16 * NF, LDH = D + 8, LDO = D + 4;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16 *Qs = (bf16 *)smem, *Ks = Qs + TB * LDH, *Vs = Ks + TB * LDH;
  float *Ss = (float *)(Vs + TB * LDH);
  bf16 *Ph = (bf16 *)(Ss + TB * LDS), *Pl = Ph + TB * LDP;
  float *Os = (float *)(Pl + TB * LDP), *Ms = Os + TB * LDO, *Ls = Ms + TB;
  int nbh = a.B * a.H;
  int bh = blockIdx.x % nbh, qt = a.ntiles - 1 - (int)(blockIdx.x / nbh);
  int b = bh / a.H, h = bh % a.H, kvh = h / a.rep;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int q0 = qt * TB;
  tc_load<D>(Qs, q, a.qs, (int64_t)h * D, q0, a.T, b);
  for (int i = threadIdx.x; i < TB * LDO; i += TC_THREADS)
    Os[i] = 0.0f;
  if (threadIdx.x < TB) {
    Ms[threadIdx.x] = -INFINITY;
    Ls[threadIdx.x] = 0.0f;
  }
  float *Sw = Ss + warp * 16 * LDS, *Ow = Os + warp * 16 * LDO;
  bf16 *Phw = Ph + warp * 16 * LDP, *Plw = Pl + warp * 16 * LDP;
  /* lane pair (2r, 2r + 1) owns row r of the warp's 16, half the columns each */
  int r = lane >> 1, half = lane & 1, row = warp * 16 + r, t = q0 + row;
  for (int kt = 0; kt <= qt; kt++) {
    int k0 = kt * TB;
    __syncthreads();
    tc_load_keys<D>(Ks, Vs, k, v, k0, a, b, kvh);
    __syncthreads();
    rows_times_tile_t<NF>(Sw, Qs + warp * 16 * LDH, Ks);
    __syncwarp();
    float *srow = Sw + r * LDS + half * 32;
    float mx = -INFINITY;
    for (int c = 0; c < 32; c++) {
      int key = k0 + half * 32 + c;
      float s = (key <= t && t < a.T) ? srow[c] * a.scale : -INFINITY;
      srow[c] = s;
      mx = fmaxf(mx, s);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    float m_old = Ms[row], m_new = fmaxf(m_old, mx);
    float alpha = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
    float ps = 0.0f;
    for (int c = 0; c < 32; c++) {
      float p = srow[c] == -INFINITY ? 0.0f : expf(srow[c] - m_new);
      split_bf16(p, &Phw[r * LDP + half * 32 + c], &Plw[r * LDP + half * 32 + c]);
      ps += p;
    }
    ps += __shfl_xor_sync(0xffffffffu, ps, 1);
    for (int d = half; d < D; d += 2)
      Ow[r * LDO + d] *= alpha;
    __syncwarp();
    if (half == 0) {
      Ms[row] = m_new;
      Ls[row] = Ls[row] * alpha + ps;
    }
    frag_c acc[NF];
#pragma unroll
    for (int n = 0; n < NF; n++)
      wmma::load_matrix_sync(acc[n], Ow + n * 16, LDO, wmma::mem_row_major);
    split_times_tile<NF>(acc, Phw, Plw, Vs);
#pragma unroll
    for (int n = 0; n < NF; n++)
      wmma::store_matrix_sync(Ow + n * 16, acc[n], LDO, wmma::mem_row_major);
    __syncwarp();
  }
  if (t < a.T) {
    float inv = 1.0f / Ls[row];
    float *orow = o + ((int64_t)b * a.T + t) * a.qs + (int64_t)h * D;
    for (int d = half; d < D; d += 2)
      orow[d] = Ow[r * LDO + d] * inv;
    if (half == 0)
      lse[((int64_t)b * a.H + h) * a.T + t] = Ms[row] + logf(Ls[row]);
  }
}

/* Loads a backward tile pair's query side: rows [q0, q0 + 64) of head h of
 * q and dout, and their lse and Di (0 past T). */
template <int D>
__device__ __forceinline__ void tc_load_query_side(bf16 *Qs, bf16 *dOs, float *lse_s,
                                                   float *di_s, const float *q,
                                                   const float *dout, const float *lse,
                                                   const float *di, int q0, const tc_dims &a,
                                                   int b, int h) {
  tc_load<D>(Qs, q, a.qs, (int64_t)h * D, q0, a.T, b);
  tc_load<D>(dOs, dout, a.qs, (int64_t)h * D, q0, a.T, b);
  if (threadIdx.x < TB) {
    int t = q0 + threadIdx.x;
    int64_t at = ((int64_t)b * a.H + h) * a.T + t;
    lse_s[threadIdx.x] = t < a.T ? lse[at] : 0.0f;
    di_s[threadIdx.x] = t < a.T ? di[at] : 0.0f;
  }
}

/* dK and dV of key tile kt for query head h: into dk / dv (rep 1) or into
 * head h's columns of the parts pdk / pdv (laid out like q). */
template <int NF>
__global__ void __launch_bounds__(TC_THREADS)
    attn_dkdv_tc_k(float *dk, float *dv, const float *dout, const float *q, const float *k,
                   const float *v, const float *lse, const float *di, tc_dims a) {
  constexpr int D = 16 * NF, LDH = D + 8, LDO = D + 4;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16 *Ks = (bf16 *)smem, *Vs = Ks + TB * LDH, *Qs = Vs + TB * LDH, *dOs = Qs + TB * LDH;
  float *St = (float *)(dOs + TB * LDH), *dPt = St + TB * LDS;
  bf16 *Ph = (bf16 *)(dPt + TB * LDS), *Pl = Ph + TB * LDP, *Dh = Pl + TB * LDP,
       *Dl = Dh + TB * LDP;
  float *lse_s = (float *)(Dl + TB * LDP), *di_s = lse_s + TB;
  int nbh = a.B * a.H;
  int bh = blockIdx.x % nbh, kt = (int)(blockIdx.x / nbh);
  int b = bh / a.H, h = bh % a.H, kvh = h / a.rep;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int k0 = kt * TB;
  tc_load_keys<D>(Ks, Vs, k, v, k0, a, b, kvh);
  frag_c dK[NF], dV[NF];
#pragma unroll
  for (int n = 0; n < NF; n++) {
    wmma::fill_fragment(dK[n], 0.0f);
    wmma::fill_fragment(dV[n], 0.0f);
  }
  float *Stw = St + warp * 16 * LDS, *dPtw = dPt + warp * 16 * LDS;
  bf16 *Phw = Ph + warp * 16 * LDP, *Plw = Pl + warp * 16 * LDP;
  bf16 *Dhw = Dh + warp * 16 * LDP, *Dlw = Dl + warp * 16 * LDP;
  /* lane pair (2r, 2r + 1) owns key r of the warp's 16, half the queries each */
  int r = lane >> 1, half = lane & 1, key = k0 + warp * 16 + r;
  for (int qt = kt; qt < a.ntiles; qt++) {
    int q0 = qt * TB;
    __syncthreads();
    tc_load_query_side<D>(Qs, dOs, lse_s, di_s, q, dout, lse, di, q0, a, b, h);
    __syncthreads();
    /* S^T and dP^T for the warp's 16 keys against the tile's 64 queries */
    rows_times_tile_t<NF>(Stw, Ks + warp * 16 * LDH, Qs);
    rows_times_tile_t<NF>(dPtw, Vs + warp * 16 * LDH, dOs);
    __syncwarp();
    for (int c = 0; c < 32; c++) {
      int qi = half * 32 + c, t = q0 + qi, at = r * LDS + qi;
      float p = 0.0f, ds = 0.0f;
      if (key <= t && t < a.T) {
        p = expf(Stw[at] * a.scale - lse_s[qi]);
        ds = p * (dPtw[at] - di_s[qi]) * a.scale;
      }
      split_bf16(p, &Phw[r * LDP + qi], &Plw[r * LDP + qi]);
      split_bf16(ds, &Dhw[r * LDP + qi], &Dlw[r * LDP + qi]);
    }
    __syncwarp();
    split_times_tile<NF>(dV, Phw, Plw, dOs);
    split_times_tile<NF>(dK, Dhw, Dlw, Qs);
  }
  __syncthreads(); /* the query tiles are free: they stage the results */
  float *stage = (float *)Qs + warp * 16 * LDO;
  int64_t stride = a.rep == 1 ? a.ks : a.qs, col = (int64_t)(a.rep == 1 ? kvh : h) * D;
  store_rows<NF>(dk, stride, col, k0 + warp * 16, a.T, b, dK, stage);
  __syncwarp();
  store_rows<NF>(dv, stride, col, k0 + warp * 16, a.T, b, dV, stage);
}

template <int NF>
__global__ void __launch_bounds__(TC_THREADS)
    attn_dq_tc_k(float *dq, const float *dout, const float *q, const float *k, const float *v,
                 const float *lse, const float *di, tc_dims a) {
  constexpr int D = 16 * NF, LDH = D + 8, LDO = D + 4;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16 *Qs = (bf16 *)smem, *dOs = Qs + TB * LDH, *Ks = dOs + TB * LDH, *Vs = Ks + TB * LDH;
  float *Ss = (float *)(Vs + TB * LDH), *dPs = Ss + TB * LDS;
  bf16 *Dh = (bf16 *)(dPs + TB * LDS), *Dl = Dh + TB * LDP;
  float *lse_s = (float *)(Dl + TB * LDP), *di_s = lse_s + TB;
  int nbh = a.B * a.H;
  int bh = blockIdx.x % nbh, qt = a.ntiles - 1 - (int)(blockIdx.x / nbh);
  int b = bh / a.H, h = bh % a.H, kvh = h / a.rep;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int q0 = qt * TB;
  tc_load_query_side<D>(Qs, dOs, lse_s, di_s, q, dout, lse, di, q0, a, b, h);
  frag_c dQ[NF];
#pragma unroll
  for (int n = 0; n < NF; n++)
    wmma::fill_fragment(dQ[n], 0.0f);
  float *Sw = Ss + warp * 16 * LDS, *dPw = dPs + warp * 16 * LDS;
  bf16 *Dhw = Dh + warp * 16 * LDP, *Dlw = Dl + warp * 16 * LDP;
  int r = lane >> 1, half = lane & 1, row = warp * 16 + r, t = q0 + row;
  for (int kt = 0; kt <= qt; kt++) {
    int k0 = kt * TB;
    __syncthreads();
    tc_load_keys<D>(Ks, Vs, k, v, k0, a, b, kvh);
    __syncthreads();
    rows_times_tile_t<NF>(Sw, Qs + warp * 16 * LDH, Ks);
    rows_times_tile_t<NF>(dPw, dOs + warp * 16 * LDH, Vs);
    __syncwarp();
    for (int c = 0; c < 32; c++) {
      int kc = half * 32 + c, key = k0 + kc, at = r * LDS + kc;
      float ds = 0.0f;
      if (key <= t && t < a.T) {
        float p = expf(Sw[at] * a.scale - lse_s[row]);
        ds = p * (dPw[at] - di_s[row]) * a.scale;
      }
      split_bf16(ds, &Dhw[r * LDP + kc], &Dlw[r * LDP + kc]);
    }
    __syncwarp();
    split_times_tile<NF>(dQ, Dhw, Dlw, Ks);
  }
  __syncthreads();
  float *stage = (float *)Ks + warp * 16 * LDO;
  store_rows<NF>(dq, a.qs, (int64_t)h * D, q0 + warp * 16, a.T, b, dQ, stage);
}

/* dk[b, t, g, :] = sum over the group's heads j of part[b, t, g * rep + j, :],
 * in head order; the same for dv. */
__global__ void attn_group_sum_k(float *dk, float *dv, const float *pdk, const float *pdv,
                                 int64_t rows, int KH, int rep, int D) {
  int64_t n = rows * KH * D;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    int64_t bt = i / ((int64_t)KH * D);
    int rest = (int)(i % ((int64_t)KH * D)), g = rest / D, d = rest % D;
    const int64_t base = bt * KH * rep * D + (int64_t)g * rep * D + d;
    float sk = 0.0f, sv = 0.0f;
    for (int j = 0; j < rep; j++) {
      sk += pdk[base + (int64_t)j * D];
      sv += pdv[base + (int64_t)j * D];
    }
    dk[i] = sk;
    dv[i] = sv;
  }
}

static tc_dims make_tc_dims(int B, int T, int H, int KH, int D) {
  tc_dims a;
  a.B = B;
  a.T = T;
  a.H = H;
  a.KH = KH;
  a.rep = H / KH;
  a.ntiles = (T + TB - 1) / TB;
  a.qs = (int64_t)H * D;
  a.ks = (int64_t)KH * D;
  a.scale = 1.0f / sqrtf((float)D);
  return a;
}

template <typename K, typename... Args>
static cudaError_t tc_launch(K kernel, unsigned blocks, size_t smem, cudaStream_t s,
                             Args... args) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)smem);
  if (e != cudaSuccess)
    return e;
  kernel<<<blocks, TC_THREADS, smem, s>>>(args...);
  return cudaGetLastError();
}

static size_t tile_bytes(int D) { return (size_t)TB * (D + 8) * sizeof(bf16); }
static size_t score_bytes(void) { return (size_t)TB * LDS * sizeof(float); }
static size_t split_bytes(void) { return (size_t)TB * LDP * sizeof(bf16); }

/* The kernel for head dim D = 16 * NF, NF = 1..8, as kern<NF>. */
#define TC_DISPATCH(D, kern, ...)                                                  \
  switch ((D) / 16) {                                                              \
  case 1: return tc_launch(kern<1>, __VA_ARGS__);                                 \
  case 2: return tc_launch(kern<2>, __VA_ARGS__);                                 \
  case 3: return tc_launch(kern<3>, __VA_ARGS__);                                 \
  case 4: return tc_launch(kern<4>, __VA_ARGS__);                                 \
  case 5: return tc_launch(kern<5>, __VA_ARGS__);                                 \
  case 6: return tc_launch(kern<6>, __VA_ARGS__);                                 \
  case 7: return tc_launch(kern<7>, __VA_ARGS__);                                 \
  case 8: return tc_launch(kern<8>, __VA_ARGS__);                                 \
  default: return cudaErrorInvalidValue;                                           \
  }

extern "C" int mr__k_attn_tensor_ok(int amp, int D) {
  return amp == 1 && D > 0 && D % 16 == 0 && D <= 128;
}

extern "C" int64_t mr__k_attn_tc_parts(int B, int T, int H, int KH, int D) {
  return H == KH ? 0 : (int64_t)2 * B * T * H * D;
}

static cudaError_t fwd_launch(cudaStream_t s, float *o, float *lse, const float *q,
                              const float *k, const float *v, const tc_dims &a, int D) {
  unsigned blocks = (unsigned)((int64_t)a.B * a.H * a.ntiles);
  size_t smem = 3 * tile_bytes(D) + score_bytes() + 2 * split_bytes() +
                sizeof(float) * ((size_t)TB * (D + 4) + 2 * TB);
  TC_DISPATCH(D, attn_fwd_tc_k, blocks, smem, s, o, lse, q, k, v, a)
}

extern "C" cudaError_t mr__k_attn_fwd_tc(cudaStream_t s, float *o, float *lse,
                                         const float *q, const float *k, const float *v,
                                         int B, int T, int H, int KH, int D) {
  return fwd_launch(s, o, lse, q, k, v, make_tc_dims(B, T, H, KH, D), D);
}

static cudaError_t dkdv_launch(cudaStream_t s, float *dk, float *dv, const float *dout,
                               const float *q, const float *k, const float *v,
                               const float *lse, const float *di, const tc_dims &a, int D) {
  unsigned blocks = (unsigned)((int64_t)a.B * a.H * a.ntiles);
  size_t smem = 4 * tile_bytes(D) + 2 * score_bytes() + 4 * split_bytes() +
                2 * TB * sizeof(float);
  TC_DISPATCH(D, attn_dkdv_tc_k, blocks, smem, s, dk, dv, dout, q, k, v, lse, di, a)
}

static cudaError_t dq_launch(cudaStream_t s, float *dq, const float *dout, const float *q,
                             const float *k, const float *v, const float *lse,
                             const float *di, const tc_dims &a, int D) {
  unsigned blocks = (unsigned)((int64_t)a.B * a.H * a.ntiles);
  size_t smem = 4 * tile_bytes(D) + 2 * score_bytes() + 2 * split_bytes() +
                2 * TB * sizeof(float);
  TC_DISPATCH(D, attn_dq_tc_k, blocks, smem, s, dq, dout, q, k, v, lse, di, a)
}

/* di: Di, computed; parts: mr__k_attn_tc_parts floats of scratch. */
extern "C" cudaError_t mr__k_attn_bwd_tc(cudaStream_t s, float *dq, float *dk, float *dv,
                                         const float *dout, const float *q, const float *k,
                                         const float *v, const float *lse, const float *di,
                                         int B, int T, int H, int KH, int D, float *parts) {
  tc_dims a = make_tc_dims(B, T, H, KH, D);
  float *pdk = dk, *pdv = dv;
  if (a.rep > 1) {
    pdk = parts;
    pdv = parts + (int64_t)B * T * H * D;
  }
  cudaError_t e = dkdv_launch(s, pdk, pdv, dout, q, k, v, lse, di, a, D);
  if (e == cudaSuccess && a.rep > 1) {
    attn_group_sum_k<<<mr_blocks((int64_t)B * T * KH * D), MR_THREADS, 0, s>>>(
        dk, dv, pdk, pdv, (int64_t)B * T, KH, a.rep, D);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess)
    e = dq_launch(s, dq, dout, q, k, v, lse, di, a, D);
  return e;
}
