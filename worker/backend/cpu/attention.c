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

#include "common/error.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/backend/cpu/simd.h"

#define BK 64 // keys per block
#define BQ 64 // queries per forward task

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

/* Kt[d * BK + c] = x[k0 + c][d], zero beyond kn. */
MR_CPU_BODY void transpose_tile(float *Kt, const float *x, size_t ld, int kn, int D) {
  for (int c = 0; c < kn; c++) {
    const float *xr = x + (size_t)c * ld;
    for (int d = 0; d < D; d++)
      Kt[d * BK + c] = xr[d];
  }
  for (int d = 0; d < D; d++)
    for (int c = kn; c < BK; c++)
      Kt[d * BK + c] = 0;
}

/* s[c] = a * sum_d x[d] Kt[d][c] over all BK columns */
MR_CPU_BODY void row_scores(float *restrict s, const float *x, const float *Kt,
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

MR_CPU_BODY void attn_fwd_k_body(const struct attn_job *j, int b, int h, int qb,
                               float *scr) {
  const struct mr_attn_shape *sh = &j->s;
  int D = sh->D, T = sh->T, kvh = h / (sh->H / sh->Hkv);
  float scale = sh->scale;
  float *Kt = scr, *O = Kt + (size_t)D * BK, *m = O + (size_t)BQ * D,
        *l = m + BQ, *s = l + BQ;
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
      row_scores(s, j->q + row(j, b, t, sh->ldq, h), Kt, D, scale);
      float bm = -INFINITY;
      for (int c = 0; c < nvis; c++)
        bm = s[c] > bm ? s[c] : bm;
      float mn = m[r] > bm ? m[r] : bm;
      float alpha = mr__expf(m[r] - mn);
      float sum = 0;
      for (int c = 0; c < nvis; c++) {
        s[c] = mr__expf(s[c] - mn);
        sum += s[c];
      }
      l[r] = l[r] * alpha + sum;
      m[r] = mn;
      float *orow = O + (size_t)r * D;
      for (int d = 0; d < D; d++)
        orow[d] *= alpha;
      for (int c = 0; c < nvis; c++) {
        const float *vr = vb + (size_t)c * (size_t)sh->ldv;
        float p = s[c];
        for (int d = 0; d < D; d++)
          orow[d] += p * vr[d];
      }
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
MR_CPU_DISPATCH(attn_fwd_k,
                (const struct attn_job *j, int b, int h, int qb, float *scr),
                (j, b, h, qb, scr))

static int attn_fwd_task(void *arg, int task, int thread) {
  const struct attn_job *j = arg;
  int BH = j->s.B * j->s.H;
  int qb = j->nqb - 1 - task / BH; /* the longest (last) query blocks first */
  int bh = task % BH;
  size_t need = sizeof(float) * ((size_t)j->s.D * BK + (size_t)BQ * j->s.D + 2 * BQ + BK);
  float *scr = mr_pool_scratch(j->pool, thread, need);
  if (!scr)
    return mr_error_set(MR_ENOMEM, "attention: no memory for a %zu-byte tile", need);
  attn_fwd_k(j, bh / j->s.H, bh % j->s.H, qb, scr);
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
  j.nqb = (j.s.T + BQ - 1) / BQ;
  long ntasks = (long)j.s.B * j.s.H * j.nqb;
  if (ntasks > 1 << 30)
    return mr_error_set(MR_EINVAL, "attention_fwd: too many tasks (%ld)", ntasks);
  return mr_pool_run(pool, (int)ntasks, attn_fwd_task, &j);
}

/* ---- backward ---- */

MR_CPU_BODY void attn_bwd_k_body(const struct attn_job *j, int b, int kvh,
                               float *scr) {
  const struct mr_attn_shape *sh = &j->s;
  int D = sh->D, T = sh->T, g = sh->H / sh->Hkv;
  float scale = sh->scale;
  float *Kt = scr, *Vt = Kt + (size_t)D * BK, *dKb = Vt + (size_t)D * BK,
        *dVb = dKb + (size_t)BK * D, *s = dVb + (size_t)BK * D, *dp = s + BK,
        *Di = dp + BK;
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
      float *dqr = j->dq + row(j, b, t, sh->ldq, h);
      for (int d = 0; d < D; d++)
        dqr[d] = 0;
    }
  }
  for (int k0 = 0; k0 < T; k0 += BK) {
    int kn = T - k0 < BK ? T - k0 : BK;
    const float *kb = j->k + row(j, b, k0, sh->ldk, kvh);
    transpose_tile(Kt, kb, (size_t)sh->ldk, kn, D);
    transpose_tile(Vt, j->v + row(j, b, k0, sh->ldv, kvh), (size_t)sh->ldv, kn, D);
    memset(dKb, 0, sizeof(float) * (size_t)kn * D);
    memset(dVb, 0, sizeof(float) * (size_t)kn * D);
    for (int hh = 0; hh < g; hh++) {
      int h = kvh * g + hh;
      const float *lse = j->lse + ((size_t)b * sh->H + h) * (size_t)T;
      for (int t = k0; t < T; t++) {
        int nvis = t - k0 + 1 < kn ? t - k0 + 1 : kn;
        const float *qr = j->q + row(j, b, t, sh->ldq, h);
        const float *dor = j->dout + row(j, b, t, sh->ldo, h);
        float *dqr = j->dq + row(j, b, t, sh->ldq, h);
        row_scores(s, qr, Kt, D, scale);
        row_scores(dp, dor, Vt, D, 1.0f);
        float lt = lse[t], dt = Di[(size_t)hh * T + t];
        for (int c = 0; c < nvis; c++) {
          float p = mr__expf(s[c] - lt);
          s[c] = p;                      /* p */
          dp[c] = p * (dp[c] - dt) * scale; /* scale * dS */
        }
        for (int c = 0; c < nvis; c++) {
          float p = s[c], ds = dp[c];
          float *dvr = dVb + (size_t)c * D, *dkr = dKb + (size_t)c * D;
          const float *kr = kb + (size_t)c * (size_t)sh->ldk;
          for (int d = 0; d < D; d++) {
            dvr[d] += p * dor[d];
            dkr[d] += ds * qr[d];
            dqr[d] += ds * kr[d];
          }
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
MR_CPU_DISPATCH(attn_bwd_k, (const struct attn_job *j, int b, int kvh, float *scr),
                (j, b, kvh, scr))

static int attn_bwd_task(void *arg, int task, int thread) {
  const struct attn_job *j = arg;
  size_t need = sizeof(float) * (4 * (size_t)j->s.D * BK + 2 * BK +
                                 (size_t)(j->s.H / j->s.Hkv) * (size_t)j->s.T);
  float *scr = mr_pool_scratch(j->pool, thread, need);
  if (!scr)
    return mr_error_set(MR_ENOMEM, "attention: no memory for a %zu-byte tile", need);
  attn_bwd_k(j, task / j->s.Hkv, task % j->s.Hkv, scr);
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
  long ntasks = (long)j.s.B * j.s.Hkv;
  if (ntasks > 1 << 30)
    return mr_error_set(MR_EINVAL, "attention_bwd: too many tasks (%ld)", ntasks);
  return mr_pool_run(pool, (int)ntasks, attn_bwd_task, &j);
}
