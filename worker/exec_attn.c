/* exec_attn.c - causal attention with grouped KV heads on the CPU.
 *
 * Per (batch, query head): S = scale * Q K^T through OpenBLAS, a row-wise
 * softmax over the causal prefix (its log-sum-exp saved), O = P V.  The
 * backward recomputes P from the saved log-sum-exp rather than storing the
 * T x T matrix.  Work is split over threads by (batch, KV head) so the KV
 * gradients, shared by a group of query heads, have one writer. */
#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "common/error.h"
#include "common/ops.h"
#include "worker/exec_extra.h"

int mr__cpu_attention(struct mr_cpu_ctx *c, const struct mr_graph *g,
                      const struct mr_op *op, void *const *b);
int mr__cpu_attention_bwd(struct mr_cpu_ctx *c, const struct mr_graph *g,
                          const struct mr_op *op, void *const *b);

struct attn {
  int64_t t, h, kh, d, nb;         // seq, heads, kv heads, head dim, batch
  float scale;
  const float *q, *k, *v, *o, *lse, *dout;
  float *out, *lse_out, *dq, *dk, *dv;
  float *work;                     // 2 * t * t floats per thread
  int bwd;
};

struct attn_part {
  const struct attn *a;
  int64_t p0, p1;                  // range over batch * kv heads
  float *s, *dp;
};

/* P (in s, t x t) from S = scale * Q K^T and each row's log-sum-exp. */
static void probs(const struct attn *a, float *s, const float *lse, int64_t h,
                  int save) {
  int64_t t = a->t;
  for (int64_t i = 0; i < t; i++) {
    float *row = s + i * t;
    float e;
    if (save) {
      float mx = row[0];
      for (int64_t j = 1; j <= i; j++)
        mx = row[j] > mx ? row[j] : mx;
      double sum = 0;
      for (int64_t j = 0; j <= i; j++)
        sum += exp((double)(row[j] - mx));
      e = (float)(mx + log(sum));
      a->lse_out[i * a->h + h] = e;
    } else {
      e = lse[i * a->h + h];
    }
    for (int64_t j = 0; j <= i; j++)
      row[j] = expf(row[j] - e);
    for (int64_t j = i + 1; j < t; j++)
      row[j] = 0;
  }
}

static void run_part(const struct attn_part *p) {
  const struct attn *a = p->a;
  int64_t t = a->t, d = a->d, hd = a->h * d, khd = a->kh * d;
  int64_t rep = a->h / a->kh;
  for (int64_t idx = p->p0; idx < p->p1; idx++) {
    int64_t bi = idx / a->kh, kv = idx % a->kh;
    const float *k = a->k + bi * t * khd + kv * d;
    const float *v = a->v + bi * t * khd + kv * d;
    if (a->bwd) {
      float *dk = a->dk + bi * t * khd + kv * d;
      float *dv = a->dv + bi * t * khd + kv * d;
      for (int64_t i = 0; i < t; i++) {
        memset(dk + i * khd, 0, (size_t)d * sizeof *dk);
        memset(dv + i * khd, 0, (size_t)d * sizeof *dv);
      }
    }
    for (int64_t h = kv * rep; h < (kv + 1) * rep; h++) {
      const float *q = a->q + bi * t * hd + h * d;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)t, (int)t,
                  (int)d, a->scale, q, (int)hd, k, (int)khd, 0.0f, p->s,
                  (int)t);
      if (!a->bwd) {
        /* lse_out is indexed from this batch's first row */
        struct attn sub = *a;
        sub.lse_out = a->lse_out + bi * t * a->h;
        probs(&sub, p->s, NULL, h, 1);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)t, (int)d,
                    (int)t, 1.0f, p->s, (int)t, v, (int)khd, 0.0f,
                    a->out + bi * t * hd + h * d, (int)hd);
        continue;
      }
      probs(a, p->s, a->lse + bi * t * a->h, h, 0);
      const float *dout = a->dout + bi * t * hd + h * d;
      const float *o = a->o + bi * t * hd + h * d;
      float *dk = a->dk + bi * t * khd + kv * d;
      float *dv = a->dv + bi * t * khd + kv * d;
      /* dV += P^T dO;  dP = dO V^T */
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)t, (int)d,
                  (int)t, 1.0f, p->s, (int)t, dout, (int)hd, 1.0f, dv,
                  (int)khd);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)t, (int)t,
                  (int)d, 1.0f, dout, (int)hd, v, (int)khd, 0.0f, p->dp,
                  (int)t);
      for (int64_t i = 0; i < t; i++) {
        double di = 0;
        for (int64_t x = 0; x < d; x++)
          di += (double)dout[i * hd + x] * o[i * hd + x];
        float *pr = p->s + i * t, *dpr = p->dp + i * t;
        for (int64_t j = 0; j <= i; j++)
          dpr[j] = pr[j] * (dpr[j] - (float)di);
        for (int64_t j = i + 1; j < t; j++)
          dpr[j] = 0;
      }
      /* dQ = scale dS K;  dK += scale dS^T Q */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)t, (int)d,
                  (int)t, a->scale, p->dp, (int)t, k, (int)khd, 0.0f,
                  a->dq + bi * t * hd + h * d, (int)hd);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)t, (int)d,
                  (int)t, a->scale, p->dp, (int)t, q, (int)hd, 1.0f, dk,
                  (int)khd);
    }
  }
}

static void *part_thread(void *p) {
  run_part(p);
  return NULL;
}

static int run(struct mr_cpu_ctx *c, struct attn *a) {
  int nt = c->threads > 1 ? c->threads : 1;
  int64_t total = a->nb * a->kh;
  if (nt > total)
    nt = (int)total;
  if (nt > 8)
    nt = 8;
  struct attn_part parts[8];
  pthread_t th[8];
  int64_t per = (total + nt - 1) / nt;
  for (int i = 0; i < nt; i++) {
    parts[i].a = a;
    parts[i].p0 = i * per < total ? i * per : total;
    parts[i].p1 = (i + 1) * per < total ? (i + 1) * per : total;
    parts[i].s = a->work + (size_t)i * 2 * (size_t)(a->t * a->t);
    parts[i].dp = parts[i].s + a->t * a->t;
  }
  int started = 0;
  for (int i = 1; i < nt; i++) {
    if (pthread_create(&th[i], NULL, part_thread, &parts[i]) != 0)
      break;
    started = i;
  }
  run_part(&parts[0]);
  for (int i = 1; i <= started; i++)
    pthread_join(th[i], NULL);
  for (int i = started + 1; i < nt; i++)
    run_part(&parts[i]);
  return 0;
}

/* Sets up dims and scratch: the T x T work areas, then (under amp) rounded
 * copies of the n_round inputs listed. */
static int setup(struct mr_cpu_ctx *c, const struct mr_graph *g,
                 const struct mr_op *op, int qi, struct attn *a,
                 const float **round_src, const float ***round_dst,
                 const int *round_ids, int n_round) {
  const struct mr_tensor *q = &g->tensors[qi];
  memset(a, 0, sizeof *a);
  a->t = (int64_t)op->attr[0];
  a->h = (int64_t)op->attr[1];
  a->kh = (int64_t)op->attr[2];
  a->d = q->shape[1] / a->h;
  a->nb = q->shape[0] / a->t;
  a->scale = (float)(1.0 / sqrt((double)a->d));
  int nt = c->threads > 1 ? (c->threads > 8 ? 8 : c->threads) : 1;
  size_t work = (size_t)nt * 2 * (size_t)(a->t * a->t), extra = 0;
  if (c->amp)
    for (int i = 0; i < n_round; i++)
      extra += (size_t)mr_tensor_numel(&g->tensors[round_ids[i]]);
  /* scratch is shared with matmul; take it once for everything */
  if (work + extra > c->scratch_floats) {
    float *p = realloc(c->scratch, (work + extra) * sizeof *p);
    if (!p)
      return MR_ENOMEM;
    c->scratch = p;
    c->scratch_floats = work + extra;
  }
  a->work = c->scratch;
  if (c->amp) {
    float *dst = c->scratch + work;
    for (int i = 0; i < n_round; i++) {
      size_t n = (size_t)mr_tensor_numel(&g->tensors[round_ids[i]]);
      const float *src = round_src[i];
      if (c->amp == MR_AMP_ROUND_BF16)
        for (size_t j = 0; j < n; j++)
          dst[j] = mr_bf16_to_f32(mr_f32_to_bf16(src[j]));
      else
        for (size_t j = 0; j < n; j++)
          dst[j] = mr_f16_to_f32(mr_f32_to_f16(src[j]));
      *round_dst[i] = dst;
      dst += n;
    }
  }
  return 0;
}

int mr__cpu_attention(struct mr_cpu_ctx *c, const struct mr_graph *g,
                      const struct mr_op *op, void *const *b) {
  struct attn a;
  const float *q = b[0], *k = b[1], *v = b[2];
  const float *src[3] = {q, k, v};
  const float **dst[3] = {&q, &k, &v};
  MR_TRY(setup(c, g, op, op->in[0], &a, src, dst, op->in, 3));
  a.q = q, a.k = k, a.v = v;
  a.out = b[3];
  a.lse_out = b[4];
  return run(c, &a);
}

int mr__cpu_attention_bwd(struct mr_cpu_ctx *c, const struct mr_graph *g,
                          const struct mr_op *op, void *const *b) {
  struct attn a;
  const float *dout = b[0], *q = b[1], *k = b[2], *v = b[3];
  const float *src[4] = {dout, q, k, v};
  const float **dst[4] = {&dout, &q, &k, &v};
  MR_TRY(setup(c, g, op, op->in[1], &a, src, dst, op->in, 4));
  a.bwd = 1;
  a.dout = dout, a.q = q, a.k = k, a.v = v;
  a.o = b[4];
  a.lse = b[5];
  a.dq = b[6];
  a.dk = b[7];
  a.dv = b[8];
  return run(c, &a);
}
