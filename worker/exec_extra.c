/* exec_extra.c - CPU kernels for the ops in common/ops.h. */
#include "worker/exec_extra.h"

#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "common/error.h"
#include "common/ops.h"

#define TT(g, id) (&(g)->tensors[(id)])
#define NEL(g, id) mr_tensor_numel(TT(g, id))
#define ROWS(g, id) (TT(g, id)->shape[0])
#define COLS(g, id) (TT(g, id)->ndim > 1 ? TT(g, id)->shape[1] : 1)

static float *scratch(struct mr_cpu_ctx *c, size_t n) {
  if (n > c->scratch_floats) {
    float *p = realloc(c->scratch, n * sizeof *p);
    if (!p)
      return NULL;
    c->scratch = p;
    c->scratch_floats = n;
  }
  return c->scratch;
}

void mr_cpu_ctx_close(struct mr_cpu_ctx *ctx) {
  free(ctx->scratch);
  ctx->scratch = NULL;
  ctx->scratch_floats = 0;
}

/* Rounds n floats from src into dst through the 16-bit type. */
static void round16(enum mr_amp_mode amp, float *dst, const float *src,
                    size_t n) {
  if (amp == MR_AMP_ROUND_BF16)
    for (size_t i = 0; i < n; i++)
      dst[i] = mr_bf16_to_f32(mr_f32_to_bf16(src[i]));
  else
    for (size_t i = 0; i < n; i++)
      dst[i] = mr_f16_to_f32(mr_f32_to_f16(src[i]));
}

/* ---- matmul, split over threads by rows of C ---- */

struct gemm_job {
  int ta, tb;
  int64_t m, n, k;
  const float *a, *b;
  int64_t lda, ldb;
  float *c;
};

static void gemm_rows(const struct gemm_job *j, int64_t r0, int64_t r1) {
  if (r1 <= r0)
    return;
  const float *a = j->ta ? j->a + r0 : j->a + r0 * j->lda;
  cblas_sgemm(CblasRowMajor, j->ta ? CblasTrans : CblasNoTrans,
              j->tb ? CblasTrans : CblasNoTrans, (int)(r1 - r0), (int)j->n,
              (int)j->k, 1.0f, a, (int)j->lda, j->b, (int)j->ldb, 0.0f,
              j->c + r0 * j->n, (int)j->n);
}

struct gemm_part {
  const struct gemm_job *j;
  int64_t r0, r1;
};

static void *gemm_thread(void *p) {
  struct gemm_part *q = p;
  gemm_rows(q->j, q->r0, q->r1);
  return NULL;
}

static void gemm(const struct mr_cpu_ctx *c, const struct gemm_job *j) {
  int nt = c->threads > 1 ? c->threads : 1;
  if (nt > 8)
    nt = 8;
  if (nt == 1 || j->m < 64 * nt || (double)j->m * j->n * j->k < 4e6) {
    gemm_rows(j, 0, j->m);
    return;
  }
  pthread_t th[8];
  struct gemm_part parts[8];
  int64_t per = (j->m + nt - 1) / nt;
  int started = 0;
  for (int i = 0; i < nt; i++) {
    parts[i].j = j;
    parts[i].r0 = i * per < j->m ? i * per : j->m;
    parts[i].r1 = (i + 1) * per < j->m ? (i + 1) * per : j->m;
  }
  for (int i = 1; i < nt; i++) {
    if (pthread_create(&th[i], NULL, gemm_thread, &parts[i]) != 0)
      break;
    started = i;
  }
  gemm_rows(j, parts[0].r0, parts[0].r1);
  for (int i = 1; i <= started; i++)
    pthread_join(th[i], NULL);
  for (int i = started + 1; i < nt; i++)
    gemm_rows(j, parts[i].r0, parts[i].r1);
}

static int k_matmul(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                    void *const *b) {
  struct mr_cpu_ctx *c = ctx;
  int ai = op->in[0], bi = op->in[1];
  int has_bias = op->n_in > 2 && op->in[2] >= 0;
  float *out = b[op->n_in];
  struct gemm_job j;
  j.ta = op->attr[0] != 0;
  j.tb = op->attr[1] != 0;
  j.lda = COLS(g, ai);
  j.ldb = COLS(g, bi);
  j.m = j.ta ? COLS(g, ai) : ROWS(g, ai);
  j.k = j.ta ? ROWS(g, ai) : COLS(g, ai);
  j.n = j.tb ? ROWS(g, bi) : COLS(g, bi);
  j.a = b[0];
  j.b = b[1];
  j.c = out;
  if (c->amp) {
    size_t na = (size_t)NEL(g, ai), nb = (size_t)NEL(g, bi);
    float *s = scratch(c, na + nb);
    if (!s)
      return MR_ENOMEM;
    round16(c->amp, s, b[0], na);
    round16(c->amp, s + na, b[1], nb);
    j.a = s;
    j.b = s + na;
  }
  gemm(c, &j);
  if (has_bias) {
    const float *bias = b[2];
    for (int64_t r = 0; r < j.m; r++)
      for (int64_t i = 0; i < j.n; i++)
        out[r * j.n + i] += bias[i];
  }
  return 0;
}

/* ---- elementwise and row ops ---- */

/* a1 > 0: the table is rows [a0, a0 + V) of a vocabulary of a1 (sharded
 * by vocabulary); ids outside the shard give zero rows */
static int k_embedding(void *ctx, const struct mr_graph *g,
                       const struct mr_op *op, void *const *b) {
  const int32_t *ids = b[0];
  const float *w = b[1];
  float *out = b[2];
  int64_t n = ROWS(g, op->in[0]), v = ROWS(g, op->in[1]), c = COLS(g, op->in[1]);
  int64_t lo = (int64_t)op->attr[0], all = op->attr[1] > 0 ? (int64_t)op->attr[1] : v;
  for (int64_t i = 0; i < n; i++) {
    if (ids[i] < 0 || ids[i] >= all)
      return mr_error_set(MR_ERANGE, "embedding %s: id %d at row %lld, "
                          "expected 0..%lld", TT(g, op->in[1])->name, ids[i],
                          (long long)i, (long long)all - 1);
    int64_t r = (int64_t)ids[i] - lo;
    if (r < 0 || r >= v)
      memset(out + i * c, 0, (size_t)c * sizeof *out);
    else
      memcpy(out + i * c, w + r * c, (size_t)c * sizeof *out);
  }
  return 0;
}

/* a1: first vocabulary row of dtable, a2 > 0: the whole vocabulary (a
 * vocabulary shard skips ids outside it) */
static int k_embedding_bwd(void *ctx, const struct mr_graph *g,
                           const struct mr_op *op, void *const *b) {
  const int32_t *ids = b[0];
  const float *d = b[1];
  float *dw = b[2];
  int64_t n = ROWS(g, op->in[0]), c = COLS(g, op->in[1]), v = ROWS(g, op->out[0]);
  int64_t lo = (int64_t)op->attr[1], all = op->attr[2] > 0 ? (int64_t)op->attr[2] : v;
  memset(dw, 0, (size_t)(v * c) * sizeof *dw);
  for (int64_t i = 0; i < n; i++) {
    if (ids[i] < 0 || ids[i] >= all)
      return mr_error_set(MR_ERANGE, "embedding_bwd: id %d out of range", ids[i]);
    int64_t r = (int64_t)ids[i] - lo;
    if (r < 0 || r >= v)
      continue;
    float *row = dw + r * c;
    for (int64_t k = 0; k < c; k++)
      row[k] += d[i * c + k];
  }
  return 0;
}

static int k_bias_grad(void *ctx, const struct mr_graph *g,
                       const struct mr_op *op, void *const *b) {
  const float *d = b[0];
  float *db = b[1];
  int64_t m = ROWS(g, op->in[0]), n = COLS(g, op->in[0]);
  memset(db, 0, (size_t)n * sizeof *db);
  for (int64_t r = 0; r < m; r++)
    for (int64_t i = 0; i < n; i++)
      db[i] += d[r * n + i];
  return 0;
}

static int k_add(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                 void *const *b) {
  const float *x = b[0], *y = b[1];
  float *o = b[2];
  int64_t n = NEL(g, op->in[0]);
  for (int64_t i = 0; i < n; i++)
    o[i] = x[i] + y[i];
  return 0;
}

static int k_rmsnorm(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                     void *const *b) {
  const float *x = b[0], *w = b[1];
  float *y = b[2], *rstd = b[3];
  int64_t n = ROWS(g, op->in[0]), c = COLS(g, op->in[0]);
  for (int64_t r = 0; r < n; r++) {
    const float *xr = x + r * c;
    double ss = 0;
    for (int64_t i = 0; i < c; i++)
      ss += (double)xr[i] * xr[i];
    float s = (float)(1.0 / sqrt(ss / (double)c + op->attr[0]));
    rstd[r] = s;
    for (int64_t i = 0; i < c; i++)
      y[r * c + i] = xr[i] * s * w[i];
  }
  return 0;
}

static int k_rmsnorm_bwd(void *ctx, const struct mr_graph *g,
                         const struct mr_op *op, void *const *b) {
  const float *dy = b[0], *x = b[1], *w = b[2], *rstd = b[3];
  float *dx = b[4], *dw = b[5];
  int64_t n = ROWS(g, op->in[1]), c = COLS(g, op->in[1]);
  memset(dw, 0, (size_t)c * sizeof *dw);
  for (int64_t r = 0; r < n; r++) {
    const float *xr = x + r * c, *dr = dy + r * c;
    float s = rstd[r];
    double dot = 0;
    for (int64_t i = 0; i < c; i++) {
      dot += (double)dr[i] * w[i] * xr[i] * s;
      dw[i] += dr[i] * xr[i] * s;
    }
    float m = (float)(dot / (double)c);
    for (int64_t i = 0; i < c; i++)
      dx[r * c + i] = s * (dr[i] * w[i] - xr[i] * s * m);
  }
  return 0;
}

static int k_layernorm(void *ctx, const struct mr_graph *g,
                       const struct mr_op *op, void *const *b) {
  const float *x = b[0], *w = b[1], *bias = b[2];
  float *y = b[3], *mean = b[4], *rstd = b[5];
  int64_t n = ROWS(g, op->in[0]), c = COLS(g, op->in[0]);
  for (int64_t r = 0; r < n; r++) {
    const float *xr = x + r * c;
    double s = 0, ss = 0;
    for (int64_t i = 0; i < c; i++)
      s += xr[i];
    double mu = s / (double)c;
    for (int64_t i = 0; i < c; i++)
      ss += (xr[i] - mu) * (xr[i] - mu);
    float rs = (float)(1.0 / sqrt(ss / (double)c + op->attr[0]));
    mean[r] = (float)mu;
    rstd[r] = rs;
    for (int64_t i = 0; i < c; i++)
      y[r * c + i] = (xr[i] - (float)mu) * rs * w[i] + bias[i];
  }
  return 0;
}

static int k_layernorm_bwd(void *ctx, const struct mr_graph *g,
                           const struct mr_op *op, void *const *b) {
  const float *dy = b[0], *x = b[1], *w = b[2], *mean = b[3], *rstd = b[4];
  float *dx = b[5], *dw = b[6], *db = b[7];
  int64_t n = ROWS(g, op->in[1]), c = COLS(g, op->in[1]);
  memset(dw, 0, (size_t)c * sizeof *dw);
  memset(db, 0, (size_t)c * sizeof *db);
  for (int64_t r = 0; r < n; r++) {
    const float *xr = x + r * c, *dr = dy + r * c;
    float mu = mean[r], rs = rstd[r];
    double sd = 0, sdx = 0;
    for (int64_t i = 0; i < c; i++) {
      float xh = (xr[i] - mu) * rs, dxh = dr[i] * w[i];
      sd += dxh;
      sdx += (double)dxh * xh;
      dw[i] += dr[i] * xh;
      db[i] += dr[i];
    }
    float md = (float)(sd / (double)c), mdx = (float)(sdx / (double)c);
    for (int64_t i = 0; i < c; i++) {
      float xh = (xr[i] - mu) * rs;
      dx[r * c + i] = rs * (dr[i] * w[i] - md - xh * mdx);
    }
  }
  return 0;
}

/* rotate-half RoPE as in transformers' LLaMA: pairs (i, i + D/2) */
static int k_rope(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                  void *const *b) {
  const float *x = b[0];
  float *y = b[1];
  int64_t n = ROWS(g, op->in[0]), hd = COLS(g, op->in[0]);
  int64_t t = (int64_t)op->attr[0], h = (int64_t)op->attr[1], d = hd / h;
  double theta = op->attr[2], sign = op->attr[3] < 0 ? -1.0 : 1.0;
  int64_t half = d / 2;
  for (int64_t r = 0; r < n; r++) {
    double pos = (double)(r % t);
    for (int64_t i = 0; i < half; i++) {
      float inv = (float)(1.0 / pow(theta, (double)(2 * i) / (double)d));
      double ang = pos * inv;
      float cs = (float)cos(ang), sn = (float)(sign * sin(ang));
      for (int64_t k = 0; k < h; k++) {
        const float *xr = x + r * hd + k * d;
        float *yr = y + r * hd + k * d;
        float a = xr[i], bb = xr[i + half];
        yr[i] = a * cs - bb * sn;
        yr[i + half] = bb * cs + a * sn;
      }
    }
  }
  return 0;
}

static int k_swiglu(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                    void *const *b) {
  const float *gt = b[0], *up = b[1];
  float *y = b[2];
  int64_t n = NEL(g, op->in[0]);
  for (int64_t i = 0; i < n; i++)
    y[i] = gt[i] / (1.0f + expf(-gt[i])) * up[i];
  return 0;
}

static int k_swiglu_bwd(void *ctx, const struct mr_graph *g,
                        const struct mr_op *op, void *const *b) {
  const float *dy = b[0], *gt = b[1], *up = b[2];
  float *dg = b[3], *du = b[4];
  int64_t n = NEL(g, op->in[0]);
  for (int64_t i = 0; i < n; i++) {
    float s = 1.0f / (1.0f + expf(-gt[i])), silu = gt[i] * s;
    dg[i] = dy[i] * up[i] * s * (1.0f + gt[i] * (1.0f - s));
    du[i] = dy[i] * silu;
  }
  return 0;
}

#define GELU_K 0.7978845608028654f /* sqrt(2/pi) */

static int k_gelu(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                  void *const *b) {
  const float *x = b[0];
  float *y = b[1];
  int64_t n = NEL(g, op->in[0]);
  for (int64_t i = 0; i < n; i++) {
    float v = x[i];
    y[i] = 0.5f * v * (1.0f + tanhf(GELU_K * (v + 0.044715f * v * v * v)));
  }
  return 0;
}

static int k_gelu_bwd(void *ctx, const struct mr_graph *g,
                      const struct mr_op *op, void *const *b) {
  const float *dy = b[0], *x = b[1];
  float *dx = b[2];
  int64_t n = NEL(g, op->in[0]);
  for (int64_t i = 0; i < n; i++) {
    float v = x[i], t = tanhf(GELU_K * (v + 0.044715f * v * v * v));
    float d = 0.5f * (1.0f + t) +
              0.5f * v * (1.0f - t * t) * GELU_K * (1.0f + 3 * 0.044715f * v * v);
    dx[i] = dy[i] * d;
  }
  return 0;
}

static int k_split3(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                    void *const *b) {
  const float *x = b[0];
  int64_t n = ROWS(g, op->in[0]), c = COLS(g, op->in[0]) / 3;
  for (int p = 0; p < 3; p++) {
    float *o = b[1 + p];
    for (int64_t r = 0; r < n; r++)
      memcpy(o + r * c, x + r * 3 * c + p * c, (size_t)c * sizeof *o);
  }
  return 0;
}

static int k_concat3(void *ctx, const struct mr_graph *g,
                     const struct mr_op *op, void *const *b) {
  float *x = b[3];
  int64_t n = ROWS(g, op->in[0]), c = COLS(g, op->in[0]);
  for (int p = 0; p < 3; p++) {
    const float *o = b[p];
    for (int64_t r = 0; r < n; r++)
      memcpy(x + r * 3 * c + p * c, o + r * c, (size_t)c * sizeof *o);
  }
  return 0;
}

static int k_xent(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                  void *const *b) {
  const float *l = b[0];
  const int32_t *y = b[1];
  float *loss = b[2], *lse = b[3];
  int64_t n = ROWS(g, op->in[0]), v = COLS(g, op->in[0]);
  double total = 0;
  for (int64_t r = 0; r < n; r++) {
    const float *lr = l + r * v;
    if (y[r] < 0 || y[r] >= v)
      return mr_error_set(MR_ERANGE, "cross_entropy: target %d at row %lld, "
                          "expected 0..%lld", y[r], (long long)r,
                          (long long)v - 1);
    float mx = lr[0];
    for (int64_t i = 1; i < v; i++)
      mx = lr[i] > mx ? lr[i] : mx;
    double s = 0;
    for (int64_t i = 0; i < v; i++)
      s += exp((double)(lr[i] - mx));
    double e = mx + log(s);
    lse[r] = (float)e;
    total += e - lr[y[r]];
  }
  /* a0 > 0: the rows of the whole batch when this rank holds a shard, so
   * each rank's loss is its Partial(sum) operand */
  double rows = op->attr[0] > 0 ? op->attr[0] : (double)n;
  loss[0] = (float)(total / rows);
  return 0;
}

static int k_xent_bwd(void *ctx, const struct mr_graph *g,
                      const struct mr_op *op, void *const *b) {
  const float *dl = b[0], *l = b[1], *lse = b[3];
  const int32_t *y = b[2];
  float *d = b[4];
  int64_t n = ROWS(g, op->in[1]), v = COLS(g, op->in[1]);
  double rows = op->attr[0] > 0 ? op->attr[0] : (double)n;
  float scale = (float)(dl[0] / rows);
  for (int64_t r = 0; r < n; r++) {
    for (int64_t i = 0; i < v; i++)
      d[r * v + i] = expf(l[r * v + i] - lse[r]) * scale;
    d[r * v + y[r]] -= scale;
  }
  return 0;
}

int mr__cpu_attention(struct mr_cpu_ctx *c, const struct mr_graph *g,
                      const struct mr_op *op, void *const *b);
int mr__cpu_attention_bwd(struct mr_cpu_ctx *c, const struct mr_graph *g,
                          const struct mr_op *op, void *const *b);

static int k_attention(void *ctx, const struct mr_graph *g,
                       const struct mr_op *op, void *const *b) {
  return mr__cpu_attention(ctx, g, op, b);
}

static int k_attention_bwd(void *ctx, const struct mr_graph *g,
                           const struct mr_op *op, void *const *b) {
  return mr__cpu_attention_bwd(ctx, g, op, b);
}

void mr_cpu_kernels_register(void) {
  static const struct {
    int kind;
    mr_kernel_fn fn;
  } table[] = {
      {MR_OP_EMBEDDING, k_embedding},     {MR_OP_EMBEDDING_BWD, k_embedding_bwd},
      {MR_OP_MATMUL, k_matmul},           {MR_OP_BIAS_GRAD, k_bias_grad},
      {MR_OP_ADD, k_add},                 {MR_OP_RMSNORM, k_rmsnorm},
      {MR_OP_RMSNORM_BWD, k_rmsnorm_bwd}, {MR_OP_LAYERNORM, k_layernorm},
      {MR_OP_LAYERNORM_BWD, k_layernorm_bwd}, {MR_OP_ROPE, k_rope},
      {MR_OP_SWIGLU, k_swiglu},           {MR_OP_SWIGLU_BWD, k_swiglu_bwd},
      {MR_OP_GELU, k_gelu},               {MR_OP_GELU_BWD, k_gelu_bwd},
      {MR_OP_ATTENTION, k_attention},     {MR_OP_ATTENTION_BWD, k_attention_bwd},
      {MR_OP_SPLIT3, k_split3},           {MR_OP_CONCAT3, k_concat3},
      {MR_OP_CROSS_ENTROPY, k_xent},      {MR_OP_CROSS_ENTROPY_BWD, k_xent_bwd},
  };
  for (size_t i = 0; i < MR_ARRAY_LEN(table); i++)
    mr_op_set_kernel(table[i].kind, MR_BACKEND_CPU, table[i].fn);
}
