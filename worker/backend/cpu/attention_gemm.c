/* attention_gemm.c - causal attention as matmuls: our sgemm (sgemm.h)
 * where the CPU has AVX2, else single-threaded OpenBLAS calls;
 * attention.c's blockwise loops remain for the portable path.
 *
 * Per (batch, head), query rows are taken QB at a time; block [r0, r1)
 * sees keys [0, r1) only, so the masked upper triangle is mostly skipped.
 * Forward: S = scale Q K^T as one matmul into a QB x r1 buffer, a row
 * softmax in place (lse saved), O = P V / l.  Backward, per (batch, kv
 * head) over the query heads reading it: P = exp(S - lse) rebuilt,
 * dP = dO V^T, dS = P (dP - rowsum(dO o O)), dQ = scale dS K,
 * dK += scale dS^T Q, dV += P^T dO.  With our sgemm, K, V, Q and dO are
 * packed once per task.  Under bf16 (mr_attn_shape.bf16) the products are
 * bgemm.h's: the operands, P and dS among them, rounded to bf16 as they
 * are packed, the sums in fp32.  A task owns everything it writes, and
 * every sum has a fixed order, so the result is the same for any number of
 * threads. */
#include "worker/backend/cpu/attention_gemm.h"

#include <cblas.h>
#include <math.h>
#include <string.h>

#include <immintrin.h>

#include "common/error.h"
#include "worker/backend/cpu/bgemm.h"
#include "worker/backend/cpu/sgemm.h"
#include "worker/backend/cpu/simd.h"

#define QB 64 // query rows per block
#define NR MR__SGEMM_NR
#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2,fma")))

struct gjob {
  struct mr_attn_shape s;
  float *o, *lse, *dq, *dk, *dv;
  const float *q, *k, *v, *dout, *co;
  struct mr_pool *pool;
  int lds;   // row stride of the score buffers (T rounded up to 16)
  size_t kt; // floats (or bf16 pair words) of K^T packed (D x T), also V^T
  size_t kd; // the same of a T x D operand packed; both 0 on OpenBLAS
  int own;    // our sgemm (packed operands), else OpenBLAS
  int avx512; // the AVX-512 copies of the row passes
  bool bf16; // bgemm.h products
};

/* The right-hand operand of a product: op(B) = raw (ld) or its transpose
 * (t), and, with our sgemm, the same packed (kp rows, or under bf16 kp
 * pairs of rows, per panel). */
struct opnd {
  const float *raw;
  int ld;
  bool t;
  float *packed;
  int kp;
};

/* Packs op(B), K x N, when the packed form is used. */
static void opnd_init(struct opnd *o, const struct gjob *j, const float *raw,
                      int ld, bool t, float *packed, int K, int N) {
  o->raw = raw, o->ld = ld, o->t = t, o->packed = packed, o->kp = K;
  if (j->bf16) {
    o->kp = (K + 1) / 2;
    mr__bgemm_pack_b(t, K, N, raw, ld, (uint32_t *)packed, 0,
                     (N + MR__BGEMM_NR - 1) / MR__BGEMM_NR);
  } else if (j->own) {
    mr__sgemm_pack_b(t, K, N, raw, ld, packed, 0, (N + NR - 1) / NR);
  }
}

/* C[M, N] = alpha op(A) op(B)[k0 : k0 + K, :] + beta C, on this thread
 * (k0 even under bf16: a row pair is packed as one). */
static void mm(const struct gjob *j, bool ta, int M, int N, int K, float alpha,
               const float *A, int lda, const struct opnd *b, int k0,
               float beta, float *C, int ldc) {
  if (j->bf16) {
    const uint32_t *bp = (const uint32_t *)b->packed + (size_t)(k0 / 2) * MR__BGEMM_NR;
    mr__bgemm_block(ta, K, alpha, A, lda, bp, b->kp, beta, C, ldc, NULL, 0, M, 0, N);
    return;
  }
  if (j->own) {
    mr__sgemm_block(ta, K, alpha, A, lda, b->packed + (size_t)k0 * mr__sgemm_row_floats(), b->kp,
                    beta, C, ldc, NULL, 0, M, 0, N);
    return;
  }
  const float *B = b->raw + (b->t ? (size_t)k0 : (size_t)k0 * (size_t)b->ld);
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans,
              b->t ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B,
              b->ld, beta, C, ldc);
}

static const float *at(const float *x, const struct mr_attn_shape *s, int b,
                       int t, int ld, int head) {
  return x + ((size_t)b * (size_t)s->T + (size_t)t) * (size_t)ld +
         (size_t)head * (size_t)s->D;
}

/* Max and sum of x[0, n) over 16 lanes, then the lanes in a fixed order,
 * so the bits do not depend on the thread count. */
MR_CPU_BODY float lanes_max(const float *x, int n) {
  float m[16];
  for (int l = 0; l < 16; l++)
    m[l] = -INFINITY;
  int c = 0;
  for (; c + 16 <= n; c += 16)
    for (int l = 0; l < 16; l++)
      m[l] = x[c + l] > m[l] ? x[c + l] : m[l];
  for (int l = 0; c + l < n; l++)
    m[l] = x[c + l] > m[l] ? x[c + l] : m[l];
  for (int w = 8; w > 0; w /= 2)
    for (int l = 0; l < w; l++)
      m[l] = m[l + w] > m[l] ? m[l + w] : m[l];
  return m[0];
}

MR_CPU_BODY float lanes_sum(const float *x, int n) {
  float a[16] = {0};
  int c = 0;
  for (; c + 16 <= n; c += 16)
    for (int l = 0; l < 16; l++)
      a[l] += x[c + l];
  for (int l = 0; c + l < n; l++)
    a[l] += x[c + l];
  for (int w = 8; w > 0; w /= 2)
    for (int l = 0; l < w; l++)
      a[l] += a[l + w];
  return a[0];
}

/* The first key row t sees: window W > 0 shows keys (t - W, t]. */
static inline int first_key(int t, int window) {
  return window > 0 && t - window + 1 > 0 ? t - window + 1 : 0;
}

/* Forward softmax of rows r0 + i (i < nr) of S in place: row t keeps
 * p[c] = exp(s[c] - max) for lo <= c <= t (lo = first_key), 0 elsewhere up
 * to r1; inv[i] = 1 / sum p. */
MR_CPU_BODY void fwd_rows_body(float *S, int lds, int nr, int r0, int r1, int window,
                               float *lse, float *inv) {
  for (int i = 0; i < nr; i++) {
    float *p = S + (size_t)i * (size_t)lds;
    int n = r0 + i + 1, lo = first_key(r0 + i, window);
    float m = lanes_max(p + lo, n - lo);
    for (int c = 0; c < lo; c++)
      p[c] = 0;
    for (int c = lo; c < n; c++)
      p[c] = mr__expf(p[c] - m);
    for (int c = n; c < r1; c++)
      p[c] = 0;
    float l = lanes_sum(p + lo, n - lo);
    inv[i] = 1.0f / l;
    if (lse)
      lse[r0 + i] = m + logf(l);
  }
}

/* Backward, rows r0 + i: P = exp(S - lse) in place of S and
 * dS = P (dP - D_t), D_t = dO_t . O_t, in place of dP; 0 past the
 * diagonal up to r1. */
MR_CPU_BODY void bwd_rows_body(float *S, float *dP, int lds, int nr, int r0,
                               int r1, int window, const float *lse, const float *dout,
                               const float *o, int ldo, int D) {
  for (int i = 0; i < nr; i++) {
    int t = r0 + i, lo = first_key(t, window);
    const float *dor = dout + (size_t)t * (size_t)ldo, *orow = o + (size_t)t * (size_t)ldo;
    float di = 0;
    for (int d = 0; d < D; d++)
      di += dor[d] * orow[d];
    float *p = S + (size_t)i * (size_t)lds, *dp = dP + (size_t)i * (size_t)lds;
    float sub = lse[t];
    for (int c = 0; c < lo; c++) {
      p[c] = 0;
      dp[c] = 0;
    }
    for (int c = lo; c <= t; c++) {
      float e = mr__expf(p[c] - sub);
      p[c] = e;
      dp[c] = e * (dp[c] - di);
    }
    for (int c = t + 1; c < r1; c++) {
      p[c] = 0;
      dp[c] = 0;
    }
  }
}

/* The AVX-512 row passes, written out: 16 lanes of mr__expf's polynomial
 * (simd.h's constants) per instruction (the compiler left most of the body's scalar), the
 * sums in 16 lanes reduced in a fixed order.  Within a rounding or two of
 * the bodies; the same for any number of threads. */
AVX512 static inline __m512 exp512(__m512 x) {
#define V(c) _mm512_set1_ps(MR__EXP_##c)
  __m512 xc = _mm512_min_ps(_mm512_max_ps(x, V(LO)), V(HI)); /* NaN goes to LO */
  __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(xc, V(LOG2E), V(ROUND)), V(ROUND));
  __m512 r = _mm512_fnmadd_ps(n, V(LN2_LO), _mm512_fnmadd_ps(n, V(LN2_HI), xc));
  __m512 p = _mm512_fmadd_ps(V(P0), r, V(P1));
  p = _mm512_fmadd_ps(p, r, V(P2));
  p = _mm512_fmadd_ps(p, r, V(P3));
  p = _mm512_fmadd_ps(p, r, V(P4));
  p = _mm512_fmadd_ps(p, r, V(P5));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  y = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, V(LO), _CMP_NLT_UQ), y);
#undef V
  return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x); /* NaN stays */
}

/* Mask of the lanes [0, n) of a 16-lane run, n <= 16. */
static inline __mmask16 lanes(int n) { return n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1); }

/* x[c] = 0 for c in [from, to). */
AVX512 static void zero_run(float *x, int from, int to) {
  for (int c = from; c < to; c += 16)
    _mm512_mask_storeu_ps(x + c, lanes(to - c), _mm512_setzero_ps());
}

AVX512 static void fwd_rows_512(float *S, int lds, int nr, int r0, int r1, int window,
                                float *lse, float *inv) {
  for (int i = 0; i < nr; i++) {
    float *p = S + (size_t)i * (size_t)lds;
    int n = r0 + i + 1, lo = first_key(r0 + i, window);
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (int c = lo; c < n; c += 16)
      vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes(n - c), p + c));
    float m = _mm512_reduce_max_ps(vm);
    __m512 vmax = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
    for (int c = lo; c < n; c += 16) {
      __mmask16 k = lanes(n - c);
      __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + c), vmax)));
      _mm512_mask_storeu_ps(p + c, k, e);
      sum = _mm512_add_ps(sum, e);
    }
    zero_run(p, 0, lo);
    zero_run(p, n, r1);
    float l = _mm512_reduce_add_ps(sum);
    inv[i] = 1.0f / l;
    if (lse)
      lse[r0 + i] = m + logf(l);
  }
}

AVX512 static void bwd_rows_512(float *S, float *dP, int lds, int nr, int r0,
                                int r1, int window, const float *lse, const float *dout,
                                const float *o, int ldo, int D) {
  for (int i = 0; i < nr; i++) {
    int t = r0 + i, lo = first_key(t, window);
    const float *dor = dout + (size_t)t * (size_t)ldo, *orow = o + (size_t)t * (size_t)ldo;
    __m512 acc = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
      __mmask16 k = lanes(D - d);
      acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, dor + d), _mm512_maskz_loadu_ps(k, orow + d),
                            acc);
    }
    __m512 di = _mm512_set1_ps(_mm512_reduce_add_ps(acc)), sub = _mm512_set1_ps(lse[t]);
    float *p = S + (size_t)i * (size_t)lds, *dp = dP + (size_t)i * (size_t)lds;
    for (int c = lo; c <= t; c += 16) {
      __mmask16 k = lanes(t + 1 - c);
      __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + c), sub));
      _mm512_mask_storeu_ps(p + c, k, e);
      _mm512_mask_storeu_ps(dp + c, k,
                            _mm512_mul_ps(e, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, dp + c), di)));
    }
    zero_run(p, 0, lo);
    zero_run(dp, 0, lo);
    zero_run(p, t + 1, r1);
    zero_run(dp, t + 1, r1);
  }
}

AVX2 static void fwd_rows_256(float *S, int lds, int nr, int r0, int r1, int window,
                              float *lse, float *inv) {
  fwd_rows_body(S, lds, nr, r0, r1, window, lse, inv);
}
AVX2 static void bwd_rows_256(float *S, float *dP, int lds, int nr, int r0,
                              int r1, int window, const float *lse, const float *dout,
                              const float *o, int ldo, int D) {
  bwd_rows_body(S, dP, lds, nr, r0, r1, window, lse, dout, o, ldo, D);
}

/* ---- forward ---- */

static int fwd_task(void *arg, int task, int thread) {
  const struct gjob *j = arg;
  const struct mr_attn_shape *s = &j->s;
  int b = task / s->H, h = task % s->H, kvh = h / (s->H / s->Hkv);
  int T = s->T, D = s->D;
  size_t need = j->kt + j->kd + (size_t)QB * (size_t)j->lds;
  float *kt = mr_pool_scratch(j->pool, thread, need * sizeof(float));
  if (!kt)
    return mr_error_set(MR_ENOMEM, "attention: no memory for %zu floats of tiles", need);
  float *vp = kt + j->kt, *S = vp + j->kd;
  struct opnd K, V;
  opnd_init(&K, j, at(j->k, s, b, 0, s->ldk, kvh), s->ldk, true, kt, D, T);
  opnd_init(&V, j, at(j->v, s, b, 0, s->ldv, kvh), s->ldv, false, vp, T, D);
  float *lse = j->lse ? j->lse + ((size_t)b * (size_t)s->H + (size_t)h) * (size_t)T : NULL;
  for (int r0 = 0; r0 < T; r0 += QB) {
    int r1 = T - r0 < QB ? T : r0 + QB, nr = r1 - r0;
    mm(j, false, nr, r1, D, s->scale, at(j->q, s, b, r0, s->ldq, h), s->ldq, &K,
       0, 0.0f, S, j->lds);
    float inv[QB];
    if (j->avx512)
      fwd_rows_512(S, j->lds, nr, r0, r1, s->window, lse, inv);
    else
      fwd_rows_256(S, j->lds, nr, r0, r1, s->window, lse, inv);
    float *o = (float *)at(j->o, s, b, r0, s->ldo, h);
    mm(j, false, nr, D, r1, 1.0f, S, j->lds, &V, 0, 0.0f, o, s->ldo);
    for (int i = 0; i < nr; i++) {
      float *orow = o + (size_t)i * (size_t)s->ldo;
      for (int d = 0; d < D; d++)
        orow[d] *= inv[i];
    }
  }
  return 0;
}

static void sizes(struct gjob *j) {
  j->own = mr__sgemm_own();
  j->avx512 = mr__cpu_has_avx512();
  j->bf16 = j->s.bf16; /* attention.c checked the CPU */
  j->lds = (j->s.T + 15) / 16 * 16;
  if (j->bf16) {
    j->kt = mr__bgemm_packed_words(j->s.D, j->s.T);
    j->kd = mr__bgemm_packed_words(j->s.T, j->s.D);
  } else {
    j->kt = j->own ? mr__sgemm_packed_floats(j->s.D, j->s.T) : 0;
    j->kd = j->own ? mr__sgemm_packed_floats(j->s.T, j->s.D) : 0;
  }
}

int mr__attention_fwd_gemm(struct mr_pool *pool, float *o, float *lse,
                           const float *q, const float *k, const float *v,
                           const struct mr_attn_shape *s) {
  struct gjob j = {.s = *s, .o = o, .lse = lse, .q = q, .k = k, .v = v,
                   .pool = pool};
  sizes(&j);
  long ntasks = (long)s->B * s->H;
  if (ntasks > 1 << 30)
    return mr_error_set(MR_EINVAL, "attention_fwd: too many tasks (%ld)", ntasks);
  return mr_pool_run(pool, (int)ntasks, fwd_task, &j);
}

/* ---- backward ---- */

static int bwd_task(void *arg, int task, int thread) {
  const struct gjob *j = arg;
  const struct mr_attn_shape *s = &j->s;
  int b = task / s->Hkv, kvh = task % s->Hkv, g = s->H / s->Hkv;
  int T = s->T, D = s->D;
  size_t sb = (size_t)QB * (size_t)j->lds;
  size_t need = 2 * j->kt + 3 * j->kd + 2 * sb;
  float *S = mr_pool_scratch(j->pool, thread, need * sizeof(float));
  if (!S)
    return mr_error_set(MR_ENOMEM, "attention: no memory for %zu floats of tiles", need);
  float *dP = S + sb, *kt = dP + sb, *vt = kt + j->kt, *kp = vt + j->kt,
        *qp = kp + j->kd, *dop = qp + j->kd;
  const float *k = at(j->k, s, b, 0, s->ldk, kvh), *v = at(j->v, s, b, 0, s->ldv, kvh);
  float *dk = (float *)at(j->dk, s, b, 0, s->ldk, kvh);
  float *dv = (float *)at(j->dv, s, b, 0, s->ldv, kvh);
  struct opnd Kt, Vt, Kn, Q, dO;
  opnd_init(&Kt, j, k, s->ldk, true, kt, D, T);
  opnd_init(&Vt, j, v, s->ldv, true, vt, D, T);
  opnd_init(&Kn, j, k, s->ldk, false, kp, T, D);
  for (int t = 0; t < T; t++) {
    memset(dk + (size_t)t * (size_t)s->ldk, 0, sizeof(float) * (size_t)D);
    memset(dv + (size_t)t * (size_t)s->ldv, 0, sizeof(float) * (size_t)D);
  }
  for (int h = kvh * g; h < (kvh + 1) * g; h++) {
    const float *q = at(j->q, s, b, 0, s->ldq, h), *dout = at(j->dout, s, b, 0, s->ldo, h);
    const float *o = at(j->co, s, b, 0, s->ldo, h);
    const float *lse = j->lse + ((size_t)b * (size_t)s->H + (size_t)h) * (size_t)T;
    opnd_init(&Q, j, q, s->ldq, false, qp, T, D);
    opnd_init(&dO, j, dout, s->ldo, false, dop, T, D);
    for (int r0 = 0; r0 < T; r0 += QB) {
      int r1 = T - r0 < QB ? T : r0 + QB, nr = r1 - r0;
      mm(j, false, nr, r1, D, s->scale, q + (size_t)r0 * (size_t)s->ldq, s->ldq,
         &Kt, 0, 0.0f, S, j->lds);
      mm(j, false, nr, r1, D, 1.0f, dout + (size_t)r0 * (size_t)s->ldo, s->ldo,
         &Vt, 0, 0.0f, dP, j->lds);
      if (j->avx512)
        bwd_rows_512(S, dP, j->lds, nr, r0, r1, s->window, lse, dout, o, s->ldo, D);
      else
        bwd_rows_256(S, dP, j->lds, nr, r0, r1, s->window, lse, dout, o, s->ldo, D);
      mm(j, false, nr, D, r1, s->scale, dP, j->lds, &Kn, 0, 0.0f,
         (float *)at(j->dq, s, b, r0, s->ldq, h), s->ldq);
      mm(j, true, r1, D, nr, s->scale, dP, j->lds, &Q, r0, 1.0f, dk, s->ldk);
      mm(j, true, r1, D, nr, 1.0f, S, j->lds, &dO, r0, 1.0f, dv, s->ldv);
    }
  }
  return 0;
}

int mr__attention_bwd_gemm(struct mr_pool *pool, float *dq, float *dk,
                           float *dv, const float *dout, const float *q,
                           const float *k, const float *v, const float *o,
                           const float *lse, const struct mr_attn_shape *s) {
  struct gjob j = {.s = *s, .dq = dq, .dk = dk, .dv = dv, .dout = dout,
                   .q = q, .k = k, .v = v, .co = o, .lse = (float *)lse,
                   .pool = pool};
  sizes(&j);
  long ntasks = (long)s->B * s->Hkv;
  if (ntasks > 1 << 30)
    return mr_error_set(MR_EINVAL, "attention_bwd: too many tasks (%ld)", ntasks);
  return mr_pool_run(pool, (int)ntasks, bwd_task, &j);
}
