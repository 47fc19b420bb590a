/* attention.c - causal self-attention, flash style, with grouped-query heads.
 *
 * Forward: a task is (batch, head, block of BQ queries).  Keys are visited
 * in blocks of BK, transposed into a D x BK tile so one query row's scores
 * are a broadcast-multiply-add over a contiguous vector; an online softmax
 * (running max m and sum l per row) folds each block into the output, so at
 * most one BK-long score row exists at a time.  The natural log-sum-exp of
 * each row is saved.
 *
 * Backward: a task is (batch, kv head).  For each key block it accumulates
 * dK and dV of the block over every query row of every query head that reads
 * that kv head, rebuilding p = exp(s - lse) from the saved lse, and adds
 * into dQ of those rows, which the task owns; nothing is shared between
 * tasks, so no atomics and the result is deterministic. */
#include <math.h>
#include <string.h>

#include <immintrin.h>

#include "common/error.h"
#include "worker/backend/cpu/attention_gemm.h"
#include "worker/backend/cpu/bgemm.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/backend/cpu/simd.h"

#define BK 64 // keys per block
#define BQ 64 // queries per forward task, query rows per backward chunk

struct attn_job {
  struct mr_attn_shape s;
  float *o, *lse, *dq, *dk, *dv;
  const float *q, *k, *v, *dout, *co;
  struct mr_pool *pool;
  int nqb; // query blocks per (b, h)
};

static size_t row(const struct attn_job *j, int b, int t, int ld, int head) {
  return ((size_t)b * (size_t)j->s.T + (size_t)t) * (size_t)ld +
         (size_t)head * (size_t)j->s.D;
}

/* ---- micro-kernels: AVX2+FMA with intrinsics, and portable C ---- */

/* Kt[d * BK + c] = x[c * ld + d], zero beyond kn. */
static void transpose_tile(float *Kt, const float *x, size_t ld, int kn, int D) {
  for (int c = 0; c < kn; c++) {
    const float *xr = x + (size_t)c * ld;
    for (int d = 0; d < D; d++)
      Kt[d * BK + c] = xr[d];
  }
  for (int d = 0; d < D; d++)
    for (int c = kn; c < BK; c++)
      Kt[d * BK + c] = 0;
}

/* s[c] = a * sum_d x[d] Kt[d][c] for all BK columns. */
static void scores_base(float *restrict s, const float *x, const float *Kt,
                        int D, float a) {
  for (int c = 0; c < BK; c++)
    s[c] = 0;
  for (int d = 0; d < D; d++) {
    float xd = x[d] * a;
    const float *kt = Kt + d * BK;
    for (int c = 0; c < BK; c++)
      s[c] += xd * kt[c];
  }
}

__attribute__((target("avx2,fma"))) static void
scores_avx2(float *restrict s, const float *x, const float *Kt, int D, float a) {
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0,
         c6 = c0, c7 = c0;
  for (int d = 0; d < D; d++) {
    __m256 xd = _mm256_set1_ps(x[d] * a);
    const float *kt = Kt + d * BK;
    c0 = _mm256_fmadd_ps(xd, _mm256_load_ps(kt + 0), c0);
    c1 = _mm256_fmadd_ps(xd, _mm256_load_ps(kt + 8), c1);
    c2 = _mm256_fmadd_ps(xd, _mm256_load_ps(kt + 16), c2);
    c3 = _mm256_fmadd_ps(xd, _mm256_load_ps(kt + 24), c3);
    c4 = _mm256_fmadd_ps(xd, _mm256_load_ps(kt + 32), c4);
    c5 = _mm256_fmadd_ps(xd, _mm256_load_ps(kt + 40), c5);
    c6 = _mm256_fmadd_ps(xd, _mm256_load_ps(kt + 48), c6);
    c7 = _mm256_fmadd_ps(xd, _mm256_load_ps(kt + 56), c7);
  }
  _mm256_store_ps(s + 0, c0);
  _mm256_store_ps(s + 8, c1);
  _mm256_store_ps(s + 16, c2);
  _mm256_store_ps(s + 24, c3);
  _mm256_store_ps(s + 32, c4);
  _mm256_store_ps(s + 40, c5);
  _mm256_store_ps(s + 48, c6);
  _mm256_store_ps(s + 56, c7);
}

/* out[d] += sum_{i < n} w[i * ws] X[i * ldx + d], d < D: a weighted sum of
 * n rows, the accumulator kept in registers across the rows. */
static void wsum_base(float *restrict out, const float *w, int ws,
                      const float *X, size_t ldx, int n, int D) {
  for (int i = 0; i < n; i++) {
    float wi = w[(size_t)i * ws];
    const float *xr = X + (size_t)i * ldx;
    for (int d = 0; d < D; d++)
      out[d] += wi * xr[d];
  }
}

__attribute__((target("avx2,fma"))) static void
wsum_avx2(float *restrict out, const float *w, int ws, const float *X,
          size_t ldx, int n, int D) {
  int d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) {
    /* two sets of four accumulators, even and odd rows, to cover the FMA
     * latency */
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0,
           b1 = a0, b2 = a0, b3 = a0;
    int i = 0;
    for (; i + 2 <= n; i += 2) {
      const float *x0 = X + (size_t)i * ldx + d0, *x1 = x0 + ldx;
      __m256 w0 = _mm256_set1_ps(w[(size_t)i * ws]);
      __m256 w1 = _mm256_set1_ps(w[(size_t)(i + 1) * ws]);
      a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0), a0);
      a1 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + 8), a1);
      a2 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + 16), a2);
      a3 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + 24), a3);
      b0 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1), b0);
      b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + 8), b1);
      b2 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + 16), b2);
      b3 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + 24), b3);
    }
    if (i < n) {
      const float *x0 = X + (size_t)i * ldx + d0;
      __m256 w0 = _mm256_set1_ps(w[(size_t)i * ws]);
      a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0), a0);
      a1 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + 8), a1);
      a2 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + 16), a2);
      a3 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + 24), a3);
    }
    float *o = out + d0;
    _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_add_ps(a0, b0)));
    _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_loadu_ps(o + 8), _mm256_add_ps(a1, b1)));
    _mm256_storeu_ps(o + 16, _mm256_add_ps(_mm256_loadu_ps(o + 16), _mm256_add_ps(a2, b2)));
    _mm256_storeu_ps(o + 24, _mm256_add_ps(_mm256_loadu_ps(o + 24), _mm256_add_ps(a3, b3)));
  }
  for (; d0 + 8 <= D; d0 += 8) {
    __m256 a0 = _mm256_setzero_ps();
    for (int i = 0; i < n; i++)
      a0 = _mm256_fmadd_ps(_mm256_set1_ps(w[(size_t)i * ws]),
                           _mm256_loadu_ps(X + (size_t)i * ldx + d0), a0);
    _mm256_storeu_ps(out + d0, _mm256_add_ps(_mm256_loadu_ps(out + d0), a0));
  }
  if (d0 < D)
    wsum_base(out + d0, w, ws, X + d0, ldx, n, D - d0);
}

/* Forward softmax step of one row over a key block: p[c] = exp(s[c] - mn)
 * for c < nvis, 0 beyond; returns sum p. */
MR_CPU_BODY float fwd_p_k_body(float *p, int nvis, float mn) {
  float acc[8] = {0};
  for (int c0 = 0; c0 < BK; c0 += 8)
    for (int l = 0; l < 8; l++) {
      int c = c0 + l;
      float e = mr__expf(p[c] - mn);
      e = c < nvis ? e : 0.0f;
      p[c] = e;
      acc[l] += e;
    }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}
__attribute__((target("avx2,fma"))) static float fwd_p_avx2(float *p, int nvis, float mn) {
  return fwd_p_k_body(p, nvis, mn);
}
static float fwd_p_base(float *p, int nvis, float mn) { return fwd_p_k_body(p, nvis, mn); }

/* Backward step of one row: p = exp(s - lse) (0 where masked), and in dp
 * the scaled score gradient scale * p * (dp - D_i). */
MR_CPU_BODY void bwd_p_k_body(float *s, float *dp, int nvis, float lse, float Di,
                              float scale) {
  for (int c = 0; c < BK; c++) {
    float e = mr__expf(s[c] - lse);
    e = c < nvis ? e : 0.0f;
    s[c] = e;
    dp[c] = e * (dp[c] - Di) * scale;
  }
}
MR_CPU_DISPATCH(bwd_p_k, (float *s, float *dp, int nvis, float lse, float Di, float scale),
                (s, dp, nvis, lse, Di, scale))

static float row_max(const float *s, int n) {
  float m = -INFINITY;
  for (int c = 0; c < n; c++)
    m = s[c] > m ? s[c] : m;
  return m;
}

/* ---- forward ---- */

static void attn_fwd_block(const struct attn_job *j, int b, int h, int qb,
                           float *scr, int avx2) {
  const struct mr_attn_shape *sh = &j->s;
  int D = sh->D, T = sh->T, kvh = h / (sh->H / sh->Hkv);
  float scale = sh->scale;
  float *Kt = scr, *s = Kt + (size_t)D * BK, *O = s + BK, *m = O + (size_t)BQ * D,
        *l = m + BQ;
  int q0 = qb * BQ, nq = T - q0 < BQ ? T - q0 : BQ;
  for (int r = 0; r < nq; r++) {
    m[r] = -INFINITY;
    l[r] = 0;
  }
  memset(O, 0, sizeof(float) * (size_t)nq * (size_t)D);
  int q_end = q0 + nq;
  for (int k0 = 0; k0 < q_end; k0 += BK) {
    int kn = T - k0 < BK ? T - k0 : BK;
    transpose_tile(Kt, j->k + row(j, b, k0, sh->ldk, kvh), (size_t)sh->ldk, kn, D);
    const float *vb = j->v + row(j, b, k0, sh->ldv, kvh);
    for (int r = 0; r < nq; r++) {
      int t = q0 + r;
      if (t < k0)
        continue;
      int nvis = t - k0 + 1 < kn ? t - k0 + 1 : kn;
      const float *qr = j->q + row(j, b, t, sh->ldq, h);
      if (avx2)
        scores_avx2(s, qr, Kt, D, scale);
      else
        scores_base(s, qr, Kt, D, scale);
      float bm = row_max(s, nvis);
      float mn = m[r] > bm ? m[r] : bm;
      float alpha = expf(m[r] - mn);
      float sum = avx2 ? fwd_p_avx2(s, nvis, mn) : fwd_p_base(s, nvis, mn);
      l[r] = l[r] * alpha + sum;
      m[r] = mn;
      float *orow = O + (size_t)r * D;
      if (alpha != 1.0f)
        for (int d = 0; d < D; d++)
          orow[d] *= alpha;
      if (avx2)
        wsum_avx2(orow, s, 1, vb, (size_t)sh->ldv, nvis, D);
      else
        wsum_base(orow, s, 1, vb, (size_t)sh->ldv, nvis, D);
    }
  }
  for (int r = 0; r < nq; r++) {
    float *dst = j->o + row(j, b, q0 + r, sh->ldo, h);
    float inv = 1.0f / l[r];
    for (int d = 0; d < D; d++)
      dst[d] = O[(size_t)r * D + d] * inv;
    if (j->lse)
      j->lse[((size_t)b * sh->H + h) * (size_t)T + (size_t)(q0 + r)] = m[r] + logf(l[r]);
  }
}

static int attn_fwd_task(void *arg, int task, int thread) {
  const struct attn_job *j = arg;
  int BH = j->s.B * j->s.H;
  int qb = j->nqb - 1 - task / BH; /* the longest (last) query blocks first */
  int bh = task % BH;
  size_t need = sizeof(float) * ((size_t)j->s.D * BK + BK + (size_t)BQ * j->s.D + 2 * BQ);
  float *scr = mr_pool_scratch(j->pool, thread, need);
  if (!scr)
    return mr_error_set(MR_ENOMEM, "attention: no memory for a %zu-byte tile", need);
  attn_fwd_block(j, bh / j->s.H, bh % j->s.H, qb, scr, mr__cpu_has_avx2());
  return 0;
}

static int check_shape(const char *what, struct mr_attn_shape *s) {
  if (s->B < 0 || s->T < 0 || s->H <= 0 || s->Hkv <= 0 || s->D <= 0 ||
      s->H % s->Hkv)
    return mr_error_set(MR_EINVAL,
                        "%s: bad shape B=%d T=%d H=%d Hkv=%d D=%d (Hkv must divide H)",
                        what, s->B, s->T, s->H, s->Hkv, s->D);
  if (!s->ldq) s->ldq = s->H * s->D;
  if (!s->ldo) s->ldo = s->H * s->D;
  if (!s->ldk) s->ldk = s->Hkv * s->D;
  if (!s->ldv) s->ldv = s->Hkv * s->D;
  if (s->bf16 && !mr__cpu_has_avx512_bf16())
    return mr_error_set(MR_ENOTSUP, "%s: bf16 products need AVX512_BF16", what);
  if (s->window < 0 || (s->window > 0 && !mr__cpu_has_avx2()))
    return mr_error_set(MR_ENOTSUP, "%s: window %d: sliding-window attention needs AVX2",
                        what, s->window);
  if (s->ldq < s->H * s->D || s->ldo < s->H * s->D || s->ldk < s->Hkv * s->D ||
      s->ldv < s->Hkv * s->D)
    return mr_error_set(MR_EINVAL, "%s: a row stride is shorter than its row "
                        "(ldq=%d ldk=%d ldv=%d ldo=%d)", what, s->ldq, s->ldk,
                        s->ldv, s->ldo);
  if (s->scale == 0)
    s->scale = 1.0f / sqrtf((float)s->D);
  return 0;
}

int mr_cpu_attention_fwd(struct mr_pool *pool, float *o, float *lse,
                         const float *q, const float *k, const float *v,
                         const struct mr_attn_shape *s) {
  struct attn_job j = {.s = *s, .o = o, .lse = lse, .q = q, .k = k, .v = v,
                       .pool = pool};
  MR_TRY(check_shape("attention_fwd", &j.s));
  if (mr__cpu_has_avx2())
    return mr__attention_fwd_gemm(pool, o, lse, q, k, v, &j.s);
  j.nqb = (j.s.T + BQ - 1) / BQ;
  long ntasks = (long)j.s.B * j.s.H * j.nqb;
  if (ntasks > 1 << 30)
    return mr_error_set(MR_EINVAL, "attention_fwd: too many tasks (%ld)", ntasks);
  return mr_pool_run(pool, (int)ntasks, attn_fwd_task, &j);
}

/* ---- backward ---- */

static void attn_bwd_head(const struct attn_job *j, int b, int kvh, float *scr,
                          int avx2) {
  const struct mr_attn_shape *sh = &j->s;
  int D = sh->D, T = sh->T, g = sh->H / sh->Hkv;
  float scale = sh->scale;
  /* tiles: Kt, Vt [D][BK]; dKb, dVb [BK][D]; P, dS [BQ][BK]; Di [g][T] */
  float *Kt = scr, *Vt = Kt + (size_t)D * BK, *dKb = Vt + (size_t)D * BK,
        *dVb = dKb + (size_t)BK * D, *P = dVb + (size_t)BK * D,
        *dS = P + (size_t)BQ * BK, *Di = dS + (size_t)BQ * BK;
  /* D_i = do_i . o_i, and dq starts at zero */
  for (int hh = 0; hh < g; hh++) {
    int h = kvh * g + hh;
    for (int t = 0; t < T; t++) {
      const float *dor = j->dout + row(j, b, t, sh->ldo, h);
      const float *orow = j->co + row(j, b, t, sh->ldo, h);
      float acc = 0;
      for (int d = 0; d < D; d++)
        acc += dor[d] * orow[d];
      Di[(size_t)hh * T + t] = acc;
      memset(j->dq + row(j, b, t, sh->ldq, h), 0, sizeof(float) * (size_t)D);
    }
  }
  size_t ldq = (size_t)sh->ldq, ldk = (size_t)sh->ldk, ldo = (size_t)sh->ldo;
  for (int k0 = 0; k0 < T; k0 += BK) {
    int kn = T - k0 < BK ? T - k0 : BK;
    const float *kb = j->k + row(j, b, k0, sh->ldk, kvh);
    transpose_tile(Kt, kb, ldk, kn, D);
    transpose_tile(Vt, j->v + row(j, b, k0, sh->ldv, kvh), (size_t)sh->ldv, kn, D);
    memset(dKb, 0, sizeof(float) * (size_t)kn * D);
    memset(dVb, 0, sizeof(float) * (size_t)kn * D);
    for (int hh = 0; hh < g; hh++) {
      int h = kvh * g + hh;
      const float *lse = j->lse + ((size_t)b * sh->H + h) * (size_t)T;
      /* query rows t >= k0 see this block; take them BQ at a time */
      for (int r0 = k0; r0 < T; r0 += BQ) {
        int R = T - r0 < BQ ? T - r0 : BQ;
        const float *q0 = j->q + row(j, b, r0, sh->ldq, h);
        const float *do0 = j->dout + row(j, b, r0, sh->ldo, h);
        for (int r = 0; r < R; r++) {
          int t = r0 + r, nvis = t - k0 + 1 < kn ? t - k0 + 1 : kn;
          float *pr = P + (size_t)r * BK, *dsr = dS + (size_t)r * BK;
          if (avx2) {
            scores_avx2(pr, q0 + (size_t)r * ldq, Kt, D, scale);
            scores_avx2(dsr, do0 + (size_t)r * ldo, Vt, D, 1.0f);
          } else {
            scores_base(pr, q0 + (size_t)r * ldq, Kt, D, scale);
            scores_base(dsr, do0 + (size_t)r * ldo, Vt, D, 1.0f);
          }
          bwd_p_k(pr, dsr, nvis, lse[t], Di[(size_t)hh * T + t], scale);
        }
        /* dV[c] += sum_r P[r][c] dO_r;  dK[c] += sum_r dS[r][c] Q_r */
        for (int c = 0; c < kn; c++) {
          if (avx2) {
            wsum_avx2(dVb + (size_t)c * D, P + c, BK, do0, ldo, R, D);
            wsum_avx2(dKb + (size_t)c * D, dS + c, BK, q0, ldq, R, D);
          } else {
            wsum_base(dVb + (size_t)c * D, P + c, BK, do0, ldo, R, D);
            wsum_base(dKb + (size_t)c * D, dS + c, BK, q0, ldq, R, D);
          }
        }
        /* dQ_r += sum_c dS[r][c] K_c */
        for (int r = 0; r < R; r++) {
          float *dqr = j->dq + row(j, b, r0 + r, sh->ldq, h);
          if (avx2)
            wsum_avx2(dqr, dS + (size_t)r * BK, 1, kb, ldk, kn, D);
          else
            wsum_base(dqr, dS + (size_t)r * BK, 1, kb, ldk, kn, D);
        }
      }
    }
    for (int c = 0; c < kn; c++) {
      memcpy(j->dk + row(j, b, k0 + c, sh->ldk, kvh), dKb + (size_t)c * D,
             sizeof(float) * (size_t)D);
      memcpy(j->dv + row(j, b, k0 + c, sh->ldv, kvh), dVb + (size_t)c * D,
             sizeof(float) * (size_t)D);
    }
  }
}

static int attn_bwd_task(void *arg, int task, int thread) {
  const struct attn_job *j = arg;
  size_t need = sizeof(float) * (4 * (size_t)j->s.D * BK + 2 * (size_t)BQ * BK +
                                 (size_t)(j->s.H / j->s.Hkv) * (size_t)j->s.T);
  float *scr = mr_pool_scratch(j->pool, thread, need);
  if (!scr)
    return mr_error_set(MR_ENOMEM, "attention: no memory for a %zu-byte tile", need);
  attn_bwd_head(j, task / j->s.Hkv, task % j->s.Hkv, scr, mr__cpu_has_avx2());
  return 0;
}

int mr_cpu_attention_bwd(struct mr_pool *pool, float *dq, float *dk, float *dv,
                         const float *dout, const float *q, const float *k,
                         const float *v, const float *o, const float *lse,
                         const struct mr_attn_shape *s) {
  struct attn_job j = {.s = *s, .dq = dq, .dk = dk, .dv = dv, .dout = dout,
                       .q = q, .k = k, .v = v, .co = o, .lse = (float *)lse,
                       .pool = pool};
  MR_TRY(check_shape("attention_bwd", &j.s));
  if (mr__cpu_has_avx2())
    return mr__attention_bwd_gemm(pool, dq, dk, dv, dout, q, k, v, o, lse, &j.s);
  long ntasks = (long)j.s.B * j.s.Hkv;
  if (ntasks > 1 << 30)
    return mr_error_set(MR_EINVAL, "attention_bwd: too many tasks (%ld)", ntasks);
  return mr_pool_run(pool, (int)ntasks, attn_bwd_task, &j);
}
