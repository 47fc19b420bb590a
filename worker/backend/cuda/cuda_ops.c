/* cuda_ops.c - binds the op registry's kinds to the CUDA kernels: shapes
 * and attributes to launcher arguments, exactly as worker/exec_extra.c
 * binds them to the CPU kernels (the same overwrite / accumulate rules, the
 * same vocabulary-shard attributes, the same amp rounding of matmul and
 * attention operands). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "compiler/ops.h"
#include "common/tunable.h"
#include "worker/backend/cuda/cuda_internal.h"

#define TT(g, id) (&(g)->tensors[(id)])
#define NEL(g, id) mr_tensor_numel(TT(g, id))
#define ROWS(g, id) (TT(g, id)->shape[0])
#define COLS(g, id) mr_tensor_cols(TT(g, id)) /* the rest of the dims as one */
#define CTX(v) ((struct mr__cuda_ctx *)(v))
#define STREAM(c) ((c)->cur->s)

/* a kernel's launch result, naming the op */
#define LAUNCH(op, call) MR_TRY(mr__cuda_check((call), op))

static int enter(struct mr__cuda_ctx *c) { return mr__cuda_set_device(c->device); }

static size_t align256(size_t n) { return (n + 255) / 256 * 256; }

static int k_matmul(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                    void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  int ai = op->in[0], bi = op->in[1];
  int ta = op->attr[0] != 0, tb = op->attr[1] != 0;
  int64_t m = ta ? COLS(g, ai) : ROWS(g, ai), k = ta ? ROWS(g, ai) : COLS(g, ai);
  int64_t n = tb ? ROWS(g, bi) : COLS(g, bi);
  const void *A = b[0], *B = b[1];
  float *out = b[op->n_in];
  int dtype = 0;
  if (c->amp) {
    /* operands rounded to 16 bits on the device, fp32 accumulation */
    size_t na = (size_t)NEL(g, ai), nb = (size_t)NEL(g, bi);
    char *s = NULL;
    MR_TRY(mr__cuda_scratch(c, align256(na * 2) + align256(nb * 2), (void **)&s));
    LAUNCH("matmul (to 16 bit)", mr__k_to_half(STREAM(c), s, b[0], (int64_t)na, c->amp));
    LAUNCH("matmul (to 16 bit)", mr__k_to_half(STREAM(c), s + align256(na * 2), b[1],
                                               (int64_t)nb, c->amp));
    A = s;
    B = s + align256(na * 2);
    dtype = c->amp;
  }
  MR_TRY(mr__cuda_matmul(c, ta, tb, m, n, k, A, COLS(g, ai), B, COLS(g, bi), out, n,
                         dtype, mr_op_accum(op, 0)));
  if (op->n_in > 2 && op->in[2] >= 0)
    LAUNCH("matmul (bias)", mr__k_bias_add(STREAM(c), out, b[2], m, n));
  return 0;
}

static int k_embedding(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                       void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  int64_t n = ROWS(g, op->in[0]), v = ROWS(g, op->in[1]), cols = COLS(g, op->in[1]);
  int64_t lo = 0, all = v;
  if (op->attr[1] > 0) { /* a vocabulary shard: rows [a0, a0 + V) of a1 */
    lo = (int64_t)op->attr[0];
    all = (int64_t)op->attr[1];
  }
  LAUNCH("embedding", mr__k_embedding_fwd(STREAM(c), b[2], b[1], b[0], n, v, cols, lo,
                                          all, c->status));
  return 0;
}

static int k_embedding_bwd(void *ctx, const struct mr_graph *g,
                           const struct mr_op *op, void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  int64_t n = ROWS(g, op->in[0]), cols = COLS(g, op->in[1]), v = ROWS(g, op->out[0]);
  int64_t lo = 0, all = v;
  if (op->attr[2] > 0) {
    lo = (int64_t)op->attr[1];
    all = (int64_t)op->attr[2];
  }
  LAUNCH("embedding_bwd", mr__k_embedding_bwd(STREAM(c), b[2], b[1], b[0], n, v, cols,
                                              lo, all, mr_op_accum(op, 0), c->status));
  return 0;
}

static int colred_scratch(struct mr__cuda_ctx *c, int64_t rows, int64_t cols, int outs,
                          float **part) {
  int64_t r = (rows + MR__COLRED_ROWS - 1) / MR__COLRED_ROWS;
  size_t bytes = (size_t)(r > 0 ? r : 1) * (size_t)cols * sizeof(float) * (size_t)outs;
  return mr__cuda_scratch(c, bytes, (void **)part);
}

static int k_bias_grad(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                       void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  int64_t m = ROWS(g, op->in[0]), n = COLS(g, op->in[0]);
  float *part = NULL;
  MR_TRY(colred_scratch(c, m, n, 1, &part));
  LAUNCH("bias_grad", mr__k_bias_grad(STREAM(c), b[1], b[0], m, n, mr_op_accum(op, 0), part));
  return 0;
}

static int k_add(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                 void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  LAUNCH("add", mr__k_add(STREAM(c), b[2], b[0], b[1], NEL(g, op->in[0])));
  return 0;
}

static int k_rmsnorm(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                     void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  LAUNCH("rmsnorm", mr__k_rmsnorm_fwd(STREAM(c), b[2], b[3], b[0], b[1],
                                      ROWS(g, op->in[0]), COLS(g, op->in[0]),
                                      (float)op->attr[0]));
  return 0;
}

static int k_rmsnorm_bwd(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                         void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  int64_t n = ROWS(g, op->in[1]), cols = COLS(g, op->in[1]);
  float *part = NULL;
  MR_TRY(colred_scratch(c, n, cols, 1, &part));
  LAUNCH("rmsnorm_bwd", mr__k_rmsnorm_bwd_dx(STREAM(c), b[4], b[0], b[1], b[2], b[3],
                                             n, cols));
  LAUNCH("rmsnorm_bwd (dw)", mr__k_norm_dwdb(STREAM(c), b[5], NULL, b[0], b[1], NULL,
                                             b[3], n, cols, mr_op_accum(op, 1), part));
  return 0;
}

static int k_layernorm(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                       void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  LAUNCH("layernorm", mr__k_layernorm_fwd(STREAM(c), b[3], b[4], b[5], b[0], b[1],
                                          b[2], ROWS(g, op->in[0]),
                                          COLS(g, op->in[0]), (float)op->attr[0]));
  return 0;
}

static int k_layernorm_bwd(void *ctx, const struct mr_graph *g,
                           const struct mr_op *op, void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  int64_t n = ROWS(g, op->in[1]), cols = COLS(g, op->in[1]);
  float *part = NULL;
  MR_TRY(colred_scratch(c, n, cols, 2, &part));
  LAUNCH("layernorm_bwd", mr__k_layernorm_bwd_dx(STREAM(c), b[5], b[0], b[1], b[2],
                                                 b[3], b[4], n, cols));
  LAUNCH("layernorm_bwd (dw, db)",
         mr__k_norm_dwdb(STREAM(c), b[6], b[7], b[0], b[1], b[3], b[4], n, cols,
                         mr_op_accum(op, 1) | mr_op_accum(op, 2) << 1, part));
  return 0;
}

/* The cos/sin tables [T, D/2], computed on the host by mr_rope_table (as
 * the CPU backend's), kept on the device per (T, D, frequencies). */
static int same_rope(const struct mr_rope *a, const struct mr_rope *b) {
  return a->theta == b->theta && a->kind == b->kind && a->factor == b->factor &&
         a->low_freq_factor == b->low_freq_factor && a->high_freq_factor == b->high_freq_factor &&
         a->original_max_positions == b->original_max_positions;
}

static int rope_table(struct mr__cuda_ctx *c, int T, int D, const struct mr_rope *rope,
                      const float **cs, const float **sn) {
  for (size_t i = 0; i < MR_ARRAY_LEN(c->rope); i++) {
    struct mr__rope_table *r = &c->rope[i];
    if (r->cs != NULL && r->T == T && r->D == D && same_rope(&r->rope, rope)) {
      *cs = r->cs;
      *sn = r->sn;
      return 0;
    }
  }
  int half = D / 2;
  size_t n = (size_t)T * (size_t)half;
  float *host = malloc(2 * (n ? n : 1) * sizeof(float));
  if (host == NULL)
    return mr_error_set(MR_ENOMEM, "rope: out of host memory");
  int trc = mr_rope_table(rope, T, D, host, host + n);
  if (trc < 0) {
    free(host);
    return trc;
  }
  struct mr__rope_table *r = &c->rope[c->rope_next];
  c->rope_next = (c->rope_next + 1) % (int)MR_ARRAY_LEN(c->rope);
  if (r->cs != NULL) {
    /* kernels queued earlier may still read the table being replaced */
    int rc = mr__cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (rc < 0) {
      free(host);
      return rc;
    }
    mr__cuda_pool_free(&c->be->pool, r->cs);
    memset(r, 0, sizeof *r);
  }
  float *dev = NULL;
  int rc = mr__cuda_pool_alloc(&c->be->pool, 2 * (n ? n : 1) * sizeof(float),
                               (void **)&dev);
  if (rc == 0)
    rc = mr__cuda_check(cudaMemcpyAsync(dev, host, 2 * n * sizeof(float),
                                        cudaMemcpyHostToDevice, STREAM(c)),
                        "cudaMemcpyAsync");
  if (rc == 0)
    rc = mr__cuda_check(cudaStreamSynchronize(STREAM(c)), "cudaStreamSynchronize");
  free(host);
  if (rc < 0) {
    mr__cuda_pool_free(&c->be->pool, dev);
    return rc;
  }
  r->T = T;
  r->D = D;
  r->rope = *rope;
  r->cs = dev;
  r->sn = dev + n;
  *cs = r->cs;
  *sn = r->sn;
  return 0;
}

static int k_rope(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                  void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  int64_t n = ROWS(g, op->in[0]), hd = COLS(g, op->in[0]);
  int t = (int)op->attr[0], h = (int)op->attr[1], d = (int)(hd / h);
  const float *cs = NULL, *sn = NULL;
  struct mr_rope rope = mr_rope_of_attr(op->attr);
  MR_TRY(rope_table(c, t, d, &rope, &cs, &sn));
  LAUNCH("rope", mr__k_rope(STREAM(c), b[1], b[0], cs, sn, n, t, h, d,
                            op->attr[3] < 0 ? -1.0f : 1.0f));
  return 0;
}

static int k_swiglu(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                    void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  LAUNCH("swiglu", mr__k_swiglu_fwd(STREAM(c), b[2], b[0], b[1], NEL(g, op->in[0])));
  return 0;
}

static int k_swiglu_bwd(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                        void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  LAUNCH("swiglu_bwd", mr__k_swiglu_bwd(STREAM(c), b[3], b[4], b[0], b[1], b[2],
                                        NEL(g, op->in[0])));
  return 0;
}

static int k_gelu(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                  void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  LAUNCH("gelu", mr__k_gelu_fwd(STREAM(c), b[1], b[0], NEL(g, op->in[0])));
  return 0;
}

static int k_gelu_bwd(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                      void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  LAUNCH("gelu_bwd", mr__k_gelu_bwd(STREAM(c), b[2], b[0], b[1], NEL(g, op->in[0])));
  return 0;
}

struct attn_shape {
  int B, T, H, KH, D;
};

static int attn_shape(const struct mr_graph *g, const struct mr_op *op, int q,
                      struct attn_shape *s) {
  s->T = (int)op->attr[0];
  s->H = (int)op->attr[1];
  s->KH = (int)op->attr[2];
  s->B = (int)(ROWS(g, q) / s->T);
  s->D = (int)(COLS(g, q) / s->H);
  if (op->attr[3] > 0)
    return mr_error_set(MR_ENOTSUP, "attention: a sliding window (%g keys) is not built "
                        "on CUDA", op->attr[3]);
  if (s->D > 256)
    return mr_error_set(MR_ENOTSUP, "attention: head dim %d: the CUDA kernels take "
                        "at most 256", s->D);
  return 0;
}

/* Whether this attention runs on the tensor cores (MESHRUN_CUDA_ATTENTION
 * auto) or on the CUDA cores (cores). */
static int attn_tensor(const struct mr__cuda_ctx *c, const struct attn_shape *s, int *tc) {
  const char *mode = mr_tunable_str(MR_TUNABLE_CUDA_ATTENTION);
  if (strcmp(mode, "auto") != 0 && strcmp(mode, "cores") != 0)
    return mr_error_set(MR_EINVAL, "MESHRUN_CUDA_ATTENTION=%s: expected auto or cores",
                        mode);
  *tc = strcmp(mode, "auto") == 0 && mr__k_attn_tensor_ok(c->amp, s->D);
  return 0;
}

static int k_attention(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                       void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  struct attn_shape s;
  MR_TRY(attn_shape(g, op, op->in[0], &s));
  int tc = 0;
  MR_TRY(attn_tensor(c, &s, &tc));
  LAUNCH("attention", mr__k_attn_fwd(STREAM(c), b[3], b[4], b[0], b[1], b[2], s.B,
                                     s.T, s.H, s.KH, s.D, c->amp, tc));
  return 0;
}

static int k_attention_bwd(void *ctx, const struct mr_graph *g,
                           const struct mr_op *op, void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  struct attn_shape s;
  MR_TRY(attn_shape(g, op, op->in[1], &s));
  int tc = 0;
  MR_TRY(attn_tensor(c, &s, &tc));
  float *scratch = NULL;
  size_t floats = (size_t)mr__k_attn_bwd_scratch(s.B, s.T, s.H, s.KH, s.D, tc);
  MR_TRY(mr__cuda_scratch(c, floats * sizeof(float), (void **)&scratch));
  LAUNCH("attention_bwd", mr__k_attn_bwd(STREAM(c), b[6], b[7], b[8], b[0], b[1], b[2],
                                         b[3], b[4], b[5], s.B, s.T, s.H, s.KH, s.D,
                                         c->amp, tc, scratch));
  return 0;
}

static int k_split3(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                    void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  int64_t n = ROWS(g, op->in[0]), cols = COLS(g, op->in[0]) / 3;
  if (n == 0 || cols == 0)
    return 0;
  size_t w = (size_t)cols * sizeof(float);
  for (int p = 0; p < 3; p++)
    MR_CUDA_TRY(cudaMemcpy2DAsync(b[1 + p], w, (const float *)b[0] + p * cols, 3 * w,
                                  w, (size_t)n, cudaMemcpyDeviceToDevice, STREAM(c)));
  return 0;
}

static int k_concat3(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                     void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  int64_t n = ROWS(g, op->in[0]), cols = COLS(g, op->in[0]);
  if (n == 0 || cols == 0)
    return 0;
  size_t w = (size_t)cols * sizeof(float);
  for (int p = 0; p < 3; p++)
    MR_CUDA_TRY(cudaMemcpy2DAsync((float *)b[3] + p * cols, 3 * w, b[p], w, w,
                                  (size_t)n, cudaMemcpyDeviceToDevice, STREAM(c)));
  return 0;
}

/* mean over the rows whose target is not ignored (< 0), or over a0 rows */
static int k_cross_entropy(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                  void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  int64_t n = ROWS(g, op->in[0]), v = COLS(g, op->in[0]);
  float *rows = NULL;
  MR_TRY(mr__cuda_scratch(c, (size_t)n * sizeof(float), (void **)&rows));
  LAUNCH("cross_entropy", mr__k_xent_fwd(STREAM(c), rows, b[3], b[0], b[1], n, v,
                                         c->status));
  LAUNCH("cross_entropy (mean)", mr__k_xent_mean(STREAM(c), b[2], rows, b[1], n,
                                                 op->attr[0]));
  return 0;
}

static int k_cross_entropy_bwd(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                      void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  int64_t n = ROWS(g, op->in[1]), v = COLS(g, op->in[1]);
  float *scale = NULL;
  MR_TRY(mr__cuda_scratch(c, sizeof(float), (void **)&scale));
  LAUNCH("cross_entropy_bwd (scale)", mr__k_xent_scale(STREAM(c), scale, b[0], b[2], n,
                                                       op->attr[0]));
  LAUNCH("cross_entropy_bwd", mr__k_xent_bwd(STREAM(c), b[4], b[1], b[3], b[2], scale,
                                             n, v, c->status));
  return 0;
}

/* a1 > 0: the logits are columns [a0, a0 + V) of a vocabulary of a1 */
static int vocab_shard(const struct mr_graph *g, const struct mr_op *op, const char *name,
                       int64_t *lo, int64_t *vocab) {
  int64_t v = COLS(g, op->in[0]);
  *lo = (int64_t)op->attr[0];
  *vocab = op->attr[1] > 0 ? (int64_t)op->attr[1] : v;
  if (*lo < 0 || *vocab < *lo + v)
    return mr_error_set(MR_EINVAL, "%s: bad shape N=%lld V=%lld for columns from %lld of "
                        "a vocabulary of %lld", name, (long long)ROWS(g, op->in[0]),
                        (long long)v, (long long)*lo, (long long)*vocab);
  return 0;
}

static int k_xent_max(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                      void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  LAUNCH("xent_max", mr__k_xv_max(STREAM(c), b[1], b[0], ROWS(g, op->in[0]),
                                  COLS(g, op->in[0])));
  return 0;
}

static int k_xent_sumexp(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                         void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  int64_t lo, vocab;
  MR_TRY(vocab_shard(g, op, "xent_sumexp", &lo, &vocab));
  LAUNCH("xent_sumexp", mr__k_xv_sumexp(STREAM(c), b[3], b[4], b[0], b[1], b[2],
                                        ROWS(g, op->in[0]), COLS(g, op->in[0]), lo, vocab,
                                        c->status));
  return 0;
}

static int k_xent_sumexp_bwd(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                             void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  int64_t lo, vocab;
  MR_TRY(vocab_shard(g, op, "xent_sumexp_bwd", &lo, &vocab));
  const float *ds = op->n_in > 3 ? b[3] : NULL, *dtl = op->n_in > 4 ? b[4] : NULL;
  LAUNCH("xent_sumexp_bwd",
         mr__k_xv_sumexp_bwd(STREAM(c), b[op->n_in], b[0], b[1], b[2], ds, dtl,
                             ROWS(g, op->in[0]), COLS(g, op->in[0]), lo, vocab, c->status));
  return 0;
}

/* a0 > 0: a row shard divides by the rows of the whole batch (as
 * cross_entropy) */
static int k_xent_finish(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                         void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  LAUNCH("xent_finish", mr__k_xv_finish(STREAM(c), b[4], b[5], b[0], b[1], b[2], b[3],
                                        ROWS(g, op->in[0]), op->attr[0]));
  return 0;
}

static int k_xent_finish_bwd(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                             void *const *b) {
  struct mr__cuda_ctx *c = CTX(ctx);
  MR_TRY(enter(c));
  int64_t n = ROWS(g, op->in[0]);
  const float *dloss = op->n_in > 2 ? b[2] : NULL, *dlse = op->n_in > 3 ? b[3] : NULL;
  float *scale = NULL;
  MR_TRY(mr__cuda_scratch(c, sizeof(float), (void **)&scale));
  if (dloss != NULL)
    LAUNCH("xent_finish_bwd (scale)", mr__k_xent_scale(STREAM(c), scale, dloss, b[1], n,
                                                       op->attr[0]));
  else
    MR_CUDA_TRY(cudaMemsetAsync(scale, 0, sizeof(float), STREAM(c)));
  LAUNCH("xent_finish_bwd", mr__k_xv_finish_bwd(STREAM(c), b[op->n_in], b[op->n_in + 1],
                                                scale, dlse, b[0], b[1], n));
  return 0;
}

void mr__cuda_kernels_register(void) {
  MR_OP_BIND_KERNELS(MR_BACKEND_CUDA);
}
