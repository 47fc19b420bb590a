/* exec_extra.c - registry ops on the CPU backend's kernels. */
#include "worker/exec_extra.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "common/error.h"
#include "compiler/ops.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/backend/cpu/pool.h"
#include "worker/backend/cpu/xent_vocab.h"

#define TT(g, id) (&(g)->tensors[(id)])
#define NEL(g, id) mr_tensor_numel(TT(g, id))
#define ROWS(g, id) ((int)TT(g, id)->shape[0])
#define COLS(g, id) ((int)mr_tensor_cols(TT(g, id))) /* the rest of the dims as one */
#define POOL(ctx) (((struct mr_cpu_ctx *)(ctx))->pool)

int mr_cpu_ctx_init(struct mr_cpu_ctx *ctx, int threads, enum mr_amp_mode amp) {
  memset(ctx, 0, sizeof *ctx);
  ctx->amp = amp;
  return mr_pool_new(threads > 0 ? threads : 1, &ctx->pool);
}

void mr_cpu_ctx_close(struct mr_cpu_ctx *ctx) {
  mr_pool_free(ctx->pool);
  free(ctx->scratch);
  memset(ctx, 0, sizeof *ctx);
}

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

void mr__round_f16_n(float *dst, const float *src, size_t n) {
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, &src[i], 4);
    uint32_t a = u & 0x7fffffffu;
    float x = src[i], y;
    if (a >= 0x38800000u) { /* |x| >= 2^-14: keep 10 mantissa bits, RNE */
      uint32_t r = u + 0xfffu + ((u >> 13) & 1u);
      r &= ~0x1fffu;
      memcpy(&y, &r, 4);
      if (fabsf(y) > 65504.0f) /* past the largest half: infinity */
        y = copysignf(INFINITY, x);
    } else { /* subnormal halves: multiples of 2^-24 */
      y = rintf(x * 0x1p24f) * 0x1p-24f;
    }
    dst[i] = a > 0x7f800000u ? x : y; /* NaN stays NaN */
  }
}

/* Under amp, copies the inputs listed into scratch rounded through the
 * 16-bit type and points src[i] at the copies; else leaves src alone. */
static int round_inputs(struct mr_cpu_ctx *c, const struct mr_graph *g,
                        const int *ids, const float **src, int n) {
  if (!c->amp)
    return 0;
  size_t total = 0;
  for (int i = 0; i < n; i++)
    total += (size_t)NEL(g, ids[i]);
  float *s = scratch(c, total ? total : 1);
  if (!s)
    return MR_ENOMEM;
  for (int i = 0; i < n; i++) {
    size_t k = (size_t)NEL(g, ids[i]);
    if (c->amp == MR_AMP_ROUND_BF16)
      MR_TRY(mr_cpu_round_bf16(c->pool, s, src[i], k));
    else
      mr__round_f16_n(s, src[i], k);
    src[i] = s;
    s += k;
  }
  return 0;
}

static int k_matmul(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                    void *const *b) {
  int ai = op->in[0], bi = op->in[1];
  int ta = op->attr[0] != 0, tb = op->attr[1] != 0;
  int m = ta ? COLS(g, ai) : ROWS(g, ai), k = ta ? ROWS(g, ai) : COLS(g, ai);
  int n = tb ? ROWS(g, bi) : COLS(g, bi);
  const float *src[2] = {b[0], b[1]};
  float *out = b[op->n_in];
  const struct mr_cpu_ctx *c = ctx;
  float beta = mr_op_accum(op, 0) ? 1.0f : 0.0f;
  /* bf16 on the hardware's kernel rounds the operands as it packs them:
   * no pass of their own */
  int hw = c->amp == MR_AMP_ROUND_BF16 && k > 0 && mr_cpu_has_bf16_gemm();
  if (!hw)
    MR_TRY(round_inputs(ctx, g, op->in, src, 2));
  MR_TRY((hw ? mr_cpu_gemm_bf16 : mr_cpu_gemm)(POOL(ctx), ta, tb, m, n, k, 1.0f, src[0],
                                               COLS(g, ai), src[1], COLS(g, bi), beta, out, n));
  if (op->n_in > 2 && op->in[2] >= 0)
    MR_TRY(mr_cpu_bias_add(POOL(ctx), out, b[2], m, n));
  return 0;
}

/* a1 > 0: the table is rows [a0, a0 + V) of a vocabulary of a1 (sharded
 * by vocabulary); ids outside the shard give zero rows */
static int embedding_shard_fwd(const struct mr_graph *g, const struct mr_op *op,
                               void *const *b) {
  const int32_t *ids = b[0];
  const float *w = b[1];
  float *out = b[2];
  int64_t n = ROWS(g, op->in[0]), v = ROWS(g, op->in[1]), c = COLS(g, op->in[1]);
  int64_t lo = (int64_t)op->attr[0], all = (int64_t)op->attr[1];
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
static int embedding_shard_bwd(const struct mr_graph *g, const struct mr_op *op,
                               void *const *b) {
  const int32_t *ids = b[0];
  const float *d = b[1];
  float *dw = b[2];
  int64_t n = ROWS(g, op->in[0]), c = COLS(g, op->in[1]), v = ROWS(g, op->out[0]);
  int64_t lo = (int64_t)op->attr[1], all = (int64_t)op->attr[2];
  if (!mr_op_accum(op, 0))
    memset(dw, 0, (size_t)(v * c) * sizeof *dw);
  for (int64_t i = 0; i < n; i++) {
    if (ids[i] < 0 || ids[i] >= all)
      return mr_error_set(MR_ERANGE, "embedding_bwd: id %d out of range", ids[i]);
    int64_t r = (int64_t)ids[i] - lo;
    if (r < 0 || r >= v)
      continue;
    for (int64_t k = 0; k < c; k++)
      dw[r * c + k] += d[i * c + k];
  }
  return 0;
}

static int k_embedding(void *ctx, const struct mr_graph *g,
                       const struct mr_op *op, void *const *b) {
  if (op->attr[1] > 0)
    return embedding_shard_fwd(g, op, b);
  return mr_cpu_embedding_fwd(POOL(ctx), b[2], b[1], b[0], ROWS(g, op->in[0]),
                              ROWS(g, op->in[1]), COLS(g, op->in[1]));
}

static int k_embedding_bwd(void *ctx, const struct mr_graph *g,
                           const struct mr_op *op, void *const *b) {
  if (op->attr[2] > 0)
    return embedding_shard_bwd(g, op, b);
  if (!mr_op_accum(op, 0))
    memset(b[2], 0, (size_t)NEL(g, op->out[0]) * sizeof(float));
  return mr_cpu_embedding_bwd(POOL(ctx), b[2], b[1], b[0], ROWS(g, op->in[0]),
                              ROWS(g, op->out[0]), COLS(g, op->in[1]));
}

static int k_bias_grad(void *ctx, const struct mr_graph *g,
                       const struct mr_op *op, void *const *b) {
  if (!mr_op_accum(op, 0))
    memset(b[1], 0, (size_t)NEL(g, op->out[0]) * sizeof(float));
  return mr_cpu_bias_grad(POOL(ctx), b[1], b[0], ROWS(g, op->in[0]),
                          COLS(g, op->in[0]));
}

static int k_add(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                 void *const *b) {
  return mr_cpu_add(POOL(ctx), b[2], b[0], b[1], (size_t)NEL(g, op->in[0]));
}

static int k_rmsnorm(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                     void *const *b) {
  return mr_cpu_rmsnorm_fwd(POOL(ctx), b[2], b[3], b[0], b[1], ROWS(g, op->in[0]),
                            COLS(g, op->in[0]), (float)op->attr[0]);
}

static int k_rmsnorm_bwd(void *ctx, const struct mr_graph *g,
                         const struct mr_op *op, void *const *b) {
  if (!mr_op_accum(op, 1))
    memset(b[5], 0, (size_t)NEL(g, op->out[1]) * sizeof(float));
  return mr_cpu_rmsnorm_bwd(POOL(ctx), b[4], b[5], b[0], b[1], b[2], b[3],
                            ROWS(g, op->in[1]), COLS(g, op->in[1]), false);
}

static int k_layernorm(void *ctx, const struct mr_graph *g,
                       const struct mr_op *op, void *const *b) {
  return mr_cpu_layernorm_fwd(POOL(ctx), b[3], b[4], b[5], b[0], b[1], b[2],
                              ROWS(g, op->in[0]), COLS(g, op->in[0]),
                              (float)op->attr[0]);
}

static int k_layernorm_bwd(void *ctx, const struct mr_graph *g,
                           const struct mr_op *op, void *const *b) {
  size_t c = (size_t)COLS(g, op->in[1]);
  if (!mr_op_accum(op, 1))
    memset(b[6], 0, c * sizeof(float));
  if (!mr_op_accum(op, 2))
    memset(b[7], 0, c * sizeof(float));
  return mr_cpu_layernorm_bwd(POOL(ctx), b[5], b[6], b[7], b[0], b[1], b[2],
                              b[3], b[4], ROWS(g, op->in[1]), (int)c, false);
}

static int k_rope(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                  void *const *b) {
  int n = ROWS(g, op->in[0]), hd = COLS(g, op->in[0]);
  int t = (int)op->attr[0], h = (int)op->attr[1], d = hd / h;
  /* the table depends on (t, d) and the frequencies only: every layer,
   * forward and backward, reuses it */
  struct mr_rope rope = mr_rope_of_attr(op->attr);
  struct {
    int64_t t, d;
    struct mr_rope rope;
  } key;
  memset(&key, 0, sizeof key); /* the key's padding compares too */
  key.t = t, key.d = d, key.rope = rope;
  int fresh;
  float *tab = mr__pool_keyed_scratch(POOL(ctx), &key, sizeof key,
                                      sizeof(float) * (size_t)t * (size_t)d, &fresh);
  if (!tab)
    return MR_ENOMEM;
  float *cs = tab, *sn = tab + (size_t)t * (size_t)(d / 2);
  if (fresh) {
    int rc = mr_rope_table(&rope, t, d, cs, sn);
    if (rc < 0) {
      mr__pool_keyed_scratch(POOL(ctx), NULL, 0, 0, NULL);
      return rc;
    }
  }
  memcpy(b[1], b[0], (size_t)n * (size_t)hd * sizeof(float));
  if (op->attr[3] < 0)
    return mr_cpu_rope_bwd(POOL(ctx), b[1], cs, sn, NULL, n / t, t, h, d, t, 0);
  return mr_cpu_rope_fwd(POOL(ctx), b[1], cs, sn, NULL, n / t, t, h, d, t, 0);
}

static int k_swiglu(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                    void *const *b) {
  return mr_cpu_swiglu_fwd(POOL(ctx), b[2], b[0], b[1], (size_t)NEL(g, op->in[0]));
}

static int k_swiglu_bwd(void *ctx, const struct mr_graph *g,
                        const struct mr_op *op, void *const *b) {
  return mr_cpu_swiglu_bwd(POOL(ctx), b[3], b[4], b[0], b[1], b[2],
                           (size_t)NEL(g, op->in[0]), false);
}

static int k_gelu(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                  void *const *b) {
  return mr_cpu_gelu_fwd(POOL(ctx), b[1], b[0], (size_t)NEL(g, op->in[0]));
}

static int k_gelu_bwd(void *ctx, const struct mr_graph *g,
                      const struct mr_op *op, void *const *b) {
  return mr_cpu_gelu_bwd(POOL(ctx), b[2], b[0], b[1], (size_t)NEL(g, op->in[0]),
                         false);
}

static struct mr_attn_shape attn_shape(const struct mr_graph *g,
                                       const struct mr_op *op, int q) {
  struct mr_attn_shape s;
  memset(&s, 0, sizeof s);
  s.T = (int)op->attr[0];
  s.H = (int)op->attr[1];
  s.Hkv = (int)op->attr[2];
  s.window = (int)op->attr[3];
  s.B = ROWS(g, q) / s.T;
  s.D = COLS(g, q) / s.H;
  return s;
}

/* Under bf16 on the hardware's kernel the attention products round their
 * operands as they pack them (P and dS too); elsewhere amp rounds the
 * inputs in a pass of their own and the products run in fp32. */
static int attn_round(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                      struct mr_attn_shape *s, const float **src, int n) {
  const struct mr_cpu_ctx *c = ctx;
  s->bf16 = c->amp == MR_AMP_ROUND_BF16 && mr_cpu_has_bf16_gemm();
  return s->bf16 ? 0 : round_inputs(ctx, g, op->in, src, n);
}

static int k_attention(void *ctx, const struct mr_graph *g,
                       const struct mr_op *op, void *const *b) {
  struct mr_attn_shape s = attn_shape(g, op, op->in[0]);
  const float *src[3] = {b[0], b[1], b[2]};
  MR_TRY(attn_round(ctx, g, op, &s, src, 3));
  return mr_cpu_attention_fwd(POOL(ctx), b[3], b[4], src[0], src[1], src[2], &s);
}

/* The backward takes the rounded operands; lse is the forward's. */
static int k_attention_bwd(void *ctx, const struct mr_graph *g,
                           const struct mr_op *op, void *const *b) {
  struct mr_attn_shape s = attn_shape(g, op, op->in[1]);
  const float *src[4] = {b[0], b[1], b[2], b[3]};
  MR_TRY(attn_round(ctx, g, op, &s, src, 4));
  return mr_cpu_attention_bwd(POOL(ctx), b[6], b[7], b[8], src[0], src[1],
                              src[2], src[3], b[4], b[5], &s);
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

/* mean over the rows whose target is not ignored (< 0) */
static int k_cross_entropy(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                  void *const *b) {
  int n = ROWS(g, op->in[0]), v = COLS(g, op->in[0]), valid = 0;
  float *rows = scratch(ctx, (size_t)n);
  if (!rows)
    return MR_ENOMEM;
  MR_TRY(mr_cpu_xent_fwd(POOL(ctx), rows, b[3], b[0], b[1], n, v, &valid));
  double s = 0;
  for (int i = 0; i < n; i++)
    s += rows[i];
  /* a0 > 0: a row shard divides by the rows of the whole batch, so each
   * rank's loss is its Partial(sum) operand */
  double denom = op->attr[0] > 0 ? op->attr[0] : (double)valid;
  ((float *)b[2])[0] = denom > 0 ? (float)(s / denom) : 0.0f;
  return 0;
}

static int k_cross_entropy_bwd(void *ctx, const struct mr_graph *g,
                      const struct mr_op *op, void *const *b) {
  int n = ROWS(g, op->in[1]), v = COLS(g, op->in[1]), valid = 0;
  const int32_t *y = b[2];
  for (int i = 0; i < n; i++)
    valid += y[i] >= 0;
  double denom = op->attr[0] > 0 ? op->attr[0] : (double)valid;
  float scale = denom > 0 ? (float)(((const float *)b[0])[0] / denom) : 0.0f;
  return mr_cpu_xent_bwd(POOL(ctx), b[4], b[1], b[3], y, NULL, scale, n, v);
}

/* a1 > 0: the logits are columns [a0, a0 + V) of a vocabulary of a1 */
static int64_t vocab_of(const struct mr_op *op, int v) {
  return op->attr[1] > 0 ? (int64_t)op->attr[1] : v;
}

static int k_xent_max(void *ctx, const struct mr_graph *g,
                      const struct mr_op *op, void *const *b) {
  return mr_cpu_xent_rowmax(POOL(ctx), b[1], b[0], ROWS(g, op->in[0]),
                            COLS(g, op->in[0]));
}

static int k_xent_sumexp(void *ctx, const struct mr_graph *g,
                         const struct mr_op *op, void *const *b) {
  int n = ROWS(g, op->in[0]), v = COLS(g, op->in[0]);
  return mr_cpu_xent_sumexp(POOL(ctx), b[3], b[4], b[0], b[1], b[2], n, v,
                            (int64_t)op->attr[0], vocab_of(op, v));
}

static int k_xent_sumexp_bwd(void *ctx, const struct mr_graph *g,
                             const struct mr_op *op, void *const *b) {
  int n = ROWS(g, op->in[0]), v = COLS(g, op->in[0]);
  const float *ds = op->n_in > 3 ? b[3] : NULL, *dtl = op->n_in > 4 ? b[4] : NULL;
  return mr_cpu_xent_sumexp_bwd(POOL(ctx), b[op->n_in], b[0], b[1], b[2], ds,
                                dtl, n, v, (int64_t)op->attr[0],
                                vocab_of(op, v));
}

/* a0 > 0: a row shard divides by the rows of the whole batch, so each
 * rank's loss is its Partial(sum) operand (as cross_entropy) */
static int k_xent_finish(void *ctx, const struct mr_graph *g,
                         const struct mr_op *op, void *const *b) {
  (void)ctx;
  return mr_cpu_xent_finish(b[4], b[5], b[0], b[1], b[2], b[3],
                            ROWS(g, op->in[0]), op->attr[0]);
}

static int k_xent_finish_bwd(void *ctx, const struct mr_graph *g,
                             const struct mr_op *op, void *const *b) {
  (void)ctx;
  const float *dloss = op->n_in > 2 ? b[2] : NULL;
  const float *dlse = op->n_in > 3 ? b[3] : NULL;
  return mr_cpu_xent_finish_bwd(b[op->n_in], b[op->n_in + 1],
                                dloss ? dloss[0] : 0.0f, dlse, b[0], b[1],
                                ROWS(g, op->in[0]), op->attr[0]);
}

void mr_cpu_kernels_register(void) {
  MR_OP_BIND_KERNELS(MR_BACKEND_CPU);
}
