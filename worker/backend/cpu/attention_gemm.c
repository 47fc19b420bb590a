/* attention_gemm.c - causal attention on the AVX-512 matmul (sgemm.h), for
 * the CPUs that have it; attention.c's blockwise loops serve the others.
 *
 * Per (batch, head), query rows are taken QB at a time; block [r0, r1)
 * sees keys [0, r1) only, so the masked upper triangle is mostly skipped.
 * Forward: S = scale Q K^T as one matmul into a QB x r1 buffer, a row
 * softmax in place (lse saved), O = P V / l.  Backward, per (batch, kv
 * head) over the query heads reading it: P = exp(S - lse) rebuilt,
 * dP = dO V^T, dS = P (dP - rowsum(dO o O)), dQ = scale dS K,
 * dK += scale dS^T Q, dV += P^T dO.  K, V, Q and dO are packed once per
 * task.  A task owns everything it writes, and every sum has a fixed
 * order, so the result is the same for any number of threads. */
#include "worker/backend/cpu/attention_gemm.h"

#include <math.h>
#include <string.h>

#include <immintrin.h>

#include "common/error.h"
#include "worker/backend/cpu/sgemm.h"
#include "worker/backend/cpu/simd.h"

#define QB 64 // query rows per block
#define AVX512 __attribute__((target("avx512f")))

struct gjob {
  struct mr_attn_shape s;
  float *o, *lse, *dq, *dk, *dv;
  const float *q, *k, *v, *dout, *co;
  struct mr_pool *pool;
  int lds;   // row stride of the score buffers (T rounded up to 16)
  size_t kt; // floats of K^T packed (D x T), also V^T
  size_t kd; // floats of a T x D operand packed
};

static const float *at(const float *x, const struct mr_attn_shape *s, int b,
                       int t, int ld, int head) {
  return x + ((size_t)b * (size_t)s->T + (size_t)t) * (size_t)ld +
         (size_t)head * (size_t)s->D;
}

/* Horizontal max and sum of x[0, n) in a fixed order (16 lanes, then the
 * lanes pairwise), so every target and thread count gives the same bits. */
AVX512 static float row_max(const float *x, int n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int c = 0;
  for (; c + 16 <= n; c += 16)
    m = _mm512_max_ps(m, _mm512_loadu_ps(x + c));
  if (c < n)
    m = _mm512_mask_max_ps(m, (__mmask16)((1u << (n - c)) - 1), m,
                           _mm512_maskz_loadu_ps((__mmask16)((1u << (n - c)) - 1), x + c));
  return _mm512_reduce_max_ps(m);
}

/* p[c] = exp(s[c] - sub) for c < n, 0 for n <= c < w; returns the sum of
 * the p[c] in lane order. */
AVX512 static float exp_row(float *p, int n, int w, float sub) {
  for (int c = 0; c < n; c++)
    p[c] = mr__expf(p[c] - sub);
  for (int c = n; c < w; c++)
    p[c] = 0;
  __m512 acc = _mm512_setzero_ps();
  int c = 0;
  for (; c + 16 <= n; c += 16)
    acc = _mm512_add_ps(acc, _mm512_loadu_ps(p + c));
  if (c < n)
    acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps((__mmask16)((1u << (n - c)) - 1), p + c));
  float l[16];
  _mm512_storeu_ps(l, acc);
  float s = 0;
  for (int i = 0; i < 16; i++)
    s += l[i];
  return s;
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
  mr__sgemm_pack_b(true, D, T, at(j->k, s, b, 0, s->ldk, kvh), s->ldk, kt, 0,
                   (T + MR__SGEMM_NR - 1) / MR__SGEMM_NR);
  mr__sgemm_pack_b(false, T, D, at(j->v, s, b, 0, s->ldv, kvh), s->ldv, vp, 0,
                   (D + MR__SGEMM_NR - 1) / MR__SGEMM_NR);
  float *lse = j->lse ? j->lse + ((size_t)b * (size_t)s->H + (size_t)h) * (size_t)T : NULL;
  for (int r0 = 0; r0 < T; r0 += QB) {
    int r1 = T - r0 < QB ? T : r0 + QB, nr = r1 - r0;
    mr__sgemm_block(false, D, s->scale, at(j->q, s, b, r0, s->ldq, h), s->ldq, kt,
                    D, 0.0f, S, j->lds, NULL, 0, nr, 0, r1);
    float inv[QB];
    for (int i = 0; i < nr; i++) {
      float *p = S + (size_t)i * (size_t)j->lds;
      int n = r0 + i + 1;
      float m = row_max(p, n);
      float l = exp_row(p, n, r1, m);
      inv[i] = 1.0f / l;
      if (lse)
        lse[r0 + i] = m + logf(l);
    }
    float *o = (float *)at(j->o, s, b, r0, s->ldo, h);
    mr__sgemm_block(false, r1, 1.0f, S, j->lds, vp, T, 0.0f, o, s->ldo, NULL, 0,
                    nr, 0, D);
    for (int i = 0; i < nr; i++) {
      float *orow = o + (size_t)i * (size_t)s->ldo;
      for (int d = 0; d < D; d++)
        orow[d] *= inv[i];
    }
  }
  return 0;
}

static void sizes(struct gjob *j) {
  j->lds = (j->s.T + 15) / 16 * 16;
  j->kt = mr__sgemm_packed_floats(j->s.D, j->s.T);
  j->kd = mr__sgemm_packed_floats(j->s.T, j->s.D);
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

/* dS = P (dP - Di) in place of dP, P = exp(S - lse) in place of S, for
 * columns < n; both 0 up to w. */
AVX512 static void ds_row(float *p, float *dp, int n, int w, float lse, float di) {
  for (int c = 0; c < n; c++) {
    float e = mr__expf(p[c] - lse);
    p[c] = e;
    dp[c] = e * (dp[c] - di);
  }
  for (int c = n; c < w; c++) {
    p[c] = 0;
    dp[c] = 0;
  }
}

static int bwd_task(void *arg, int task, int thread) {
  const struct gjob *j = arg;
  const struct mr_attn_shape *s = &j->s;
  int b = task / s->Hkv, kvh = task % s->Hkv, g = s->H / s->Hkv;
  int T = s->T, D = s->D, np = (T + MR__SGEMM_NR - 1) / MR__SGEMM_NR;
  int nd = (D + MR__SGEMM_NR - 1) / MR__SGEMM_NR;
  size_t sb = (size_t)QB * (size_t)j->lds;
  size_t need = 2 * j->kt + 3 * j->kd + 2 * sb;
  float *kt = mr_pool_scratch(j->pool, thread, need * sizeof(float));
  if (!kt)
    return mr_error_set(MR_ENOMEM, "attention: no memory for %zu floats of tiles", need);
  float *vt = kt + j->kt, *kp = vt + j->kt, *qp = kp + j->kd, *dop = qp + j->kd,
        *S = dop + j->kd, *dP = S + sb;
  const float *k = at(j->k, s, b, 0, s->ldk, kvh), *v = at(j->v, s, b, 0, s->ldv, kvh);
  float *dk = (float *)at(j->dk, s, b, 0, s->ldk, kvh);
  float *dv = (float *)at(j->dv, s, b, 0, s->ldv, kvh);
  mr__sgemm_pack_b(true, D, T, k, s->ldk, kt, 0, np);
  mr__sgemm_pack_b(true, D, T, v, s->ldv, vt, 0, np);
  mr__sgemm_pack_b(false, T, D, k, s->ldk, kp, 0, nd);
  for (int t = 0; t < T; t++) {
    memset(dk + (size_t)t * (size_t)s->ldk, 0, sizeof(float) * (size_t)D);
    memset(dv + (size_t)t * (size_t)s->ldv, 0, sizeof(float) * (size_t)D);
  }
  for (int h = kvh * g; h < (kvh + 1) * g; h++) {
    const float *q = at(j->q, s, b, 0, s->ldq, h), *dout = at(j->dout, s, b, 0, s->ldo, h);
    const float *o = at(j->co, s, b, 0, s->ldo, h);
    const float *lse = j->lse + ((size_t)b * (size_t)s->H + (size_t)h) * (size_t)T;
    mr__sgemm_pack_b(false, T, D, q, s->ldq, qp, 0, nd);
    mr__sgemm_pack_b(false, T, D, dout, s->ldo, dop, 0, nd);
    for (int r0 = 0; r0 < T; r0 += QB) {
      int r1 = T - r0 < QB ? T : r0 + QB, nr = r1 - r0;
      mr__sgemm_block(false, D, s->scale, q + (size_t)r0 * (size_t)s->ldq, s->ldq,
                      kt, D, 0.0f, S, j->lds, NULL, 0, nr, 0, r1);
      mr__sgemm_block(false, D, 1.0f, dout + (size_t)r0 * (size_t)s->ldo, s->ldo,
                      vt, D, 0.0f, dP, j->lds, NULL, 0, nr, 0, r1);
      for (int i = 0; i < nr; i++) {
        int t = r0 + i;
        const float *dor = dout + (size_t)t * (size_t)s->ldo;
        const float *orow = o + (size_t)t * (size_t)s->ldo;
        float di = 0;
        for (int d = 0; d < D; d++)
          di += dor[d] * orow[d];
        ds_row(S + (size_t)i * (size_t)j->lds, dP + (size_t)i * (size_t)j->lds,
               t + 1, r1, lse[t], di);
      }
      mr__sgemm_block(false, r1, s->scale, dP, j->lds, kp, T, 0.0f,
                      (float *)at(j->dq, s, b, r0, s->ldq, h), s->ldq, NULL, 0,
                      nr, 0, D);
      mr__sgemm_block(true, nr, s->scale, dP, j->lds, qp + (size_t)r0 * MR__SGEMM_NR,
                      T, 1.0f, dk, s->ldk, NULL, 0, r1, 0, D);
      mr__sgemm_block(true, nr, 1.0f, S, j->lds, dop + (size_t)r0 * MR__SGEMM_NR,
                      T, 1.0f, dv, s->ldv, NULL, 0, r1, 0, D);
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
