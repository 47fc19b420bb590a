/* rules_ops.c - the SPMD rule of every op in the registry (compiler/ops.h),
 * written as einsum specs (see rules.h). */
#include <string.h>

#include "common/error.h"
#include "compiler/ops.h"
#include "compiler/spmd/rules.h"

#define T(g, id) (&(g)->tensors[(id)])

static void set(char *dst, const char *letters) {
  strncpy(dst, letters, MR_TENSOR_MAX_DIMS);
  dst[MR_TENSOR_MAX_DIMS] = 0;
}

/* letters "abcd" for a tensor of ndim dims (elementwise ops) */
static const char *plain(const struct mr_graph *g, int id) {
  static const char *const l[] = {"", "a", "ab", "abc", "abcd"};
  return l[T(g, id)->ndim];
}

static int elementwise(const struct mr_graph *g, const struct mr_op *op,
                       struct mr_spmd_spec *s, enum mr_spmd_linear lin) {
  const struct mr_op_def *d = mr_op_def(op->kind);
  s->n_in = op->n_in;
  s->n_out = d->n_out;
  for (int i = 0; i < op->n_in; i++)
    set(s->in[i], plain(g, op->in[i]));
  for (int o = 0; o < s->n_out; o++)
    set(s->out[o], plain(g, op->out[o]));
  s->linear = lin;
  return 0;
}

static int spec_add(const struct mr_graph *g, const struct mr_op *op,
                    struct mr_spmd_spec *s) {
  return elementwise(g, op, s, MR_SPMD_LINEAR_JOINT);
}

static int spec_pointwise(const struct mr_graph *g, const struct mr_op *op,
                          struct mr_spmd_spec *s) {
  return elementwise(g, op, s, MR_SPMD_NONLINEAR);
}

/* Letters of a matmul operand x (a matrix of its first dim by the rest,
 * compiler/ops.c): its first dim is the outer one (M of a, N of b) unless
 * transposed the other way, and the rest are K — or the reverse.  outer[]
 * and inner[] give the letters of each part in order. */
static void mm_letters(const struct mr_tensor *x, int first_is_outer, const char *outer,
                       const char *inner, char *dst) {
  memset(dst, 0, MR_TENSOR_MAX_DIMS + 1);
  for (int d = 0; d < x->ndim && d < MR_TENSOR_MAX_DIMS; d++) {
    int first = d == 0;
    dst[d] = first == first_is_outer ? outer[first ? 0 : d - 1] : inner[first ? 0 : d - 1];
  }
}

/* C[M.., N..] = op(A) op(B) contracting K..: GPT-2's fused weight [C, 3, C]
 * makes N two dims (and K two in the gradient of A). */
static int spec_matmul(const struct mr_graph *g, const struct mr_op *op,
                       struct mr_spmd_spec *s) {
  const struct mr_tensor *a = T(g, op->in[0]), *b = T(g, op->in[1]);
  int ta = op->attr[0] != 0, tb = op->attr[1] != 0;
  s->n_in = op->n_in;
  s->n_out = 1;
  mm_letters(a, !ta, "mxy", "kuv", s->in[0]);
  mm_letters(b, tb, "nqr", "kuv", s->in[1]);
  int an = ta ? a->ndim - 1 : 1, bn = tb ? 1 : b->ndim - 1, ak = ta ? 1 : a->ndim - 1;
  char *out = s->out[0]; /* M letters then N letters */
  memset(out, 0, MR_TENSOR_MAX_DIMS + 1);
  for (int d = 0; d < an + bn && d < MR_TENSOR_MAX_DIMS; d++)
    out[d] = d < an ? "mxy"[d] : "nqr"[d - an];
  if (op->n_in > 2 && op->in[2] >= 0) {
    memcpy(s->in[2], out + an, MR_TENSOR_MAX_DIMS + 1 - (size_t)an);
    s->additive = 1u << 2;
  }
  memcpy(s->contract, "kuv", (size_t)(ak < 3 ? ak : 3));
  s->linear = MR_SPMD_MULTILINEAR;
  return 0;
}

/* db[N..] = the sum of dy[M, N..] over M */
static int spec_bias_grad(const struct mr_graph *g, const struct mr_op *op,
                          struct mr_spmd_spec *s) {
  int nd = T(g, op->in[0])->ndim;
  s->n_in = s->n_out = 1;
  set(s->in[0], nd == 3 ? "mnq" : "mn");
  set(s->out[0], nd == 3 ? "nq" : "n");
  set(s->contract, "m");
  s->linear = MR_SPMD_LINEAR_JOINT;
  return 0;
}

static int spec_embedding(const struct mr_graph *g, const struct mr_op *op,
                          struct mr_spmd_spec *s) {
  (void)g, (void)op;
  s->n_in = 2;
  s->n_out = 1;
  set(s->in[0], "n");
  set(s->in[1], "vc");
  set(s->out[0], "nc");
  s->nonfloat = 1;
  /* a vocabulary-sharded table: each rank looks up the ids it holds and
   * gives zero rows for the rest, a Partial(sum) operand */
  set(s->contract, "v");
  s->linear = MR_SPMD_MULTILINEAR;
  return 0;
}

static void embedding_localize(const struct mr_graph *g, const struct mr_op *op,
                               const struct mr_mesh *m,
                               const struct mr_dist_attr *need,
                               const int *coord, double *attr) {
  const struct mr_tensor *w = T(g, op->in[1]);
  int64_t off[MR_TENSOR_MAX_DIMS], len[MR_TENSOR_MAX_DIMS];
  mr_dist_local(m, &need[1], w->ndim, w->shape, coord, off, len);
  memcpy(attr, op->attr, sizeof op->attr);
  attr[0] = (double)off[0];
  attr[1] = (double)w->shape[0];
}

static int spec_embedding_bwd(const struct mr_graph *g, const struct mr_op *op,
                              struct mr_spmd_spec *s) {
  (void)g, (void)op;
  s->n_in = 2;
  s->n_out = 1;
  set(s->in[0], "n");
  set(s->in[1], "nc");
  set(s->out[0], "vc");
  s->nonfloat = 1;
  set(s->contract, "n");
  set(s->forbid, "v");
  s->linear = MR_SPMD_MULTILINEAR;
  return 0;
}

static int spec_norm(const struct mr_graph *g, const struct mr_op *op,
                     struct mr_spmd_spec *s) {
  (void)g;
  s->n_in = op->n_in;
  s->n_out = mr_op_def(op->kind)->n_out;
  set(s->in[0], "nc");
  for (int i = 1; i < s->n_in; i++)
    set(s->in[i], "c");
  set(s->out[0], "nc");
  for (int o = 1; o < s->n_out; o++)
    set(s->out[o], "n");
  set(s->forbid, "c"); /* a row statistic over c */
  return 0;
}

static int spec_norm_bwd(const struct mr_graph *g, const struct mr_op *op,
                         struct mr_spmd_spec *s) {
  (void)g;
  /* dy, x, w, [mean,] rstd -> dx, dw[, db] */
  s->n_in = op->n_in;
  s->n_out = mr_op_def(op->kind)->n_out;
  set(s->in[0], "nc");
  set(s->in[1], "nc");
  set(s->in[2], "c");
  for (int i = 3; i < s->n_in; i++)
    set(s->in[i], "n");
  set(s->out[0], "nc");
  for (int o = 1; o < s->n_out; o++)
    set(s->out[o], "c");
  set(s->contract, "n");
  set(s->forbid, "c");
  return 0;
}

static int64_t seqs(const struct mr_graph *g, const struct mr_op *op) {
  int64_t t = (int64_t)op->attr[0];
  return t > 0 ? T(g, op->in[0])->shape[0] / t : 1;
}

static int spec_rope(const struct mr_graph *g, const struct mr_op *op,
                     struct mr_spmd_spec *s) {
  s->n_in = s->n_out = 1;
  set(s->in[0], "nc");
  set(s->out[0], "nc");
  /* positions are row % T: shards must hold whole sequences; columns
   * split at head boundaries */
  s->in_atoms[0][0] = s->out_atoms[0][0] = seqs(g, op);
  s->in_atoms[0][1] = s->out_atoms[0][1] = (int64_t)op->attr[1];
  set(s->strict, "c");
  s->linear = MR_SPMD_LINEAR_JOINT;
  return 0;
}

static void rope_localize(const struct mr_graph *g, const struct mr_op *op,
                          const struct mr_mesh *m,
                          const struct mr_dist_attr *need, const int *coord,
                          double *attr) {
  (void)coord;
  (void)g;
  memcpy(attr, op->attr, sizeof op->attr);
  attr[1] /= mr_dist_split_degree(m, &need[0], 1);
}

/* q, k, v, o: [B*T, heads*D] as "nc"; lse: [B, H, T] as "nct" (its rows
 * are sequences, not tokens: n shards both only at sequence boundaries,
 * which the atoms guarantee, and then as the same ranges) */
static void heads(struct mr_spmd_spec *s, int is_out, int i, int64_t b,
                  int64_t h) {
  int64_t *at = is_out ? s->out_atoms[i] : s->in_atoms[i];
  set(is_out ? s->out[i] : s->in[i], "nc");
  at[0] = b;
  at[1] = h;
}

static void lse(struct mr_spmd_spec *s, int is_out, int i, int64_t b, int64_t h) {
  int64_t *at = is_out ? s->out_atoms[i] : s->in_atoms[i];
  set(is_out ? s->out[i] : s->in[i], "nct");
  at[0] = b;
  at[1] = h; /* and t is forbidden: a shard of T is no shard of the rows */
}

static int spec_attention(const struct mr_graph *g, const struct mr_op *op,
                          struct mr_spmd_spec *s) {
  int64_t b = seqs(g, op), h = (int64_t)op->attr[1], kh = (int64_t)op->attr[2];
  s->n_in = 3;
  s->n_out = 2;
  heads(s, 0, 0, b, h);
  heads(s, 0, 1, b, kh);
  heads(s, 0, 2, b, kh);
  heads(s, 1, 0, b, h);
  lse(s, 1, 1, b, h);
  set(s->forbid, "t");
  set(s->strict, "c");
  return 0;
}

static int spec_attention_bwd(const struct mr_graph *g, const struct mr_op *op,
                              struct mr_spmd_spec *s) {
  /* do, q, k, v, o, lse -> dq, dk, dv */
  int64_t t = (int64_t)op->attr[0];
  int64_t b = t > 0 ? T(g, op->in[1])->shape[0] / t : 1;
  int64_t h = (int64_t)op->attr[1], kh = (int64_t)op->attr[2];
  s->n_in = 6;
  s->n_out = 3;
  int64_t hin[6] = {h, h, kh, kh, h, h}, hout[3] = {h, kh, kh};
  for (int i = 0; i < 5; i++)
    heads(s, 0, i, b, hin[i]);
  lse(s, 0, 5, b, hin[5]);
  set(s->forbid, "t");
  for (int o = 0; o < 3; o++)
    heads(s, 1, o, b, hout[o]);
  set(s->strict, "c");
  return 0;
}

static void attention_localize(const struct mr_graph *g, const struct mr_op *op,
                               const struct mr_mesh *m,
                               const struct mr_dist_attr *need, const int *coord,
                          double *attr) {
  (void)coord;
  (void)g;
  int q = op->kind == MR_OP_ATTENTION ? 0 : 1;
  memcpy(attr, op->attr, sizeof op->attr);
  attr[1] /= mr_dist_split_degree(m, &need[q], 1);
  attr[2] /= mr_dist_split_degree(m, &need[q + 1], 1);
}

static int spec_split_concat(const struct mr_graph *g, const struct mr_op *op,
                             struct mr_spmd_spec *s) {
  s->n_in = op->n_in;
  s->n_out = mr_op_def(op->kind)->n_out;
  int split = op->kind == MR_OP_SPLIT3;
  int whole = T(g, split ? op->in[0] : op->out[0])->ndim; /* [N,3C] or [N,3,C] */
  for (int i = 0; i < s->n_in; i++)
    set(s->in[i], split && whole == 3 ? "npc" : "nc");
  for (int o = 0; o < s->n_out; o++)
    set(s->out[o], !split && whole == 3 ? "npc" : "nc");
  /* a shard of [N,3C] is not three shards of [N,C]; of [N,3,C] along C
   * it is (the thirds of each head group: tensor parallel attention) */
  set(s->forbid, whole == 3 ? "p" : "c");
  s->linear = MR_SPMD_LINEAR_JOINT;
  return 0;
}

static int spec_xent(const struct mr_graph *g, const struct mr_op *op,
                     struct mr_spmd_spec *s) {
  (void)g, (void)op;
  s->n_in = 2;
  s->n_out = 2;
  set(s->in[0], "nv");
  set(s->in[1], "n");
  s->nonfloat = 1u << 1;
  set(s->out[0], "z");
  set(s->out[1], "n");
  /* rows sharded: each rank's loss is its rows' sum over the global row
   * count, a Partial(sum) operand */
  set(s->contract, "n");
  set(s->forbid, "vz");
  return 0;
}

static int spec_xent_bwd(const struct mr_graph *g, const struct mr_op *op,
                         struct mr_spmd_spec *s) {
  (void)g, (void)op;
  s->n_in = 4;
  s->n_out = 1;
  set(s->in[0], "z");
  set(s->in[1], "nv");
  set(s->in[2], "n");
  set(s->in[3], "n");
  s->nonfloat = 1u << 2;
  set(s->out[0], "nv");
  set(s->forbid, "vz");
  return 0;
}

static void xent_localize(const struct mr_graph *g, const struct mr_op *op,
                          const struct mr_mesh *m,
                          const struct mr_dist_attr *need, const int *coord,
                          double *attr) {
  (void)coord;
  (void)m, (void)need;
  int logits = op->kind == MR_OP_CROSS_ENTROPY ? op->in[0] : op->in[1];
  memcpy(attr, op->attr, sizeof op->attr);
  attr[0] = (double)T(g, logits)->shape[0]; /* the mean is over all rows */
}

/* Vocabulary-parallel cross-entropy: with the vocabulary (v) sharded, the
 * row maxima are Partial(max) and the sums of exponentials and the
 * targets' logits Partial(sum), all [N]: completion all-reduces them before
 * the finishing step, and the logits never move.  Each shard learns its
 * first column from `localize`, as a vocabulary-sharded embedding does. */
static int spec_xent_max(const struct mr_graph *g, const struct mr_op *op,
                         struct mr_spmd_spec *s) {
  (void)g, (void)op;
  s->n_in = s->n_out = 1;
  set(s->in[0], "nv");
  set(s->out[0], "n");
  set(s->contract, "v");
  s->contract_op = MR_REDUCE_MAX;
  return 0;
}

static int spec_xent_sumexp(const struct mr_graph *g, const struct mr_op *op,
                            struct mr_spmd_spec *s) {
  (void)g, (void)op;
  s->n_in = 3;
  s->n_out = 2;
  set(s->in[0], "nv");
  set(s->in[1], "n");
  set(s->in[2], "n"); /* m: whole rows' maxima, so replicated over v */
  s->nonfloat = 1u << 1;
  set(s->out[0], "n");
  set(s->out[1], "n");
  set(s->contract, "v");
  return 0;
}

static int spec_xent_sumexp_bwd(const struct mr_graph *g,
                                const struct mr_op *op,
                                struct mr_spmd_spec *s) {
  (void)g;
  /* logits, targets, m[, ds[, dtl]] -> dlogits: local per shard */
  s->n_in = op->n_in;
  s->n_out = 1;
  set(s->in[0], "nv");
  for (int i = 1; i < op->n_in; i++)
    if (op->in[i] >= 0)
      set(s->in[i], "n");
  s->nonfloat = 1u << 1;
  set(s->out[0], "nv");
  return 0;
}

static void xent_vocab_localize(const struct mr_graph *g,
                                const struct mr_op *op, const struct mr_mesh *m,
                                const struct mr_dist_attr *need,
                                const int *coord, double *attr) {
  const struct mr_tensor *l = T(g, op->in[0]);
  int64_t off[MR_TENSOR_MAX_DIMS], len[MR_TENSOR_MAX_DIMS];
  mr_dist_local(m, &need[0], l->ndim, l->shape, coord, off, len);
  memcpy(attr, op->attr, sizeof op->attr);
  attr[0] = (double)off[1];
  attr[1] = (double)l->shape[1];
}

static int spec_xent_finish(const struct mr_graph *g, const struct mr_op *op,
                            struct mr_spmd_spec *s) {
  (void)g, (void)op;
  s->n_in = 4;
  s->n_out = 2;
  for (int i = 0; i < 4; i++)
    set(s->in[i], "n");
  s->nonfloat = 1u << 3;
  set(s->out[0], "z");
  set(s->out[1], "n");
  /* rows sharded: each rank's loss is its rows' sum over the global row
   * count, a Partial(sum) operand (as cross_entropy) */
  set(s->contract, "n");
  set(s->forbid, "z");
  return 0;
}

static int spec_xent_finish_bwd(const struct mr_graph *g,
                                const struct mr_op *op,
                                struct mr_spmd_spec *s) {
  (void)g;
  /* s, targets[, dloss[, dlse]] -> ds, dtl */
  s->n_in = op->n_in;
  s->n_out = 2;
  set(s->in[0], "n");
  set(s->in[1], "n");
  if (op->n_in > 2 && op->in[2] >= 0)
    set(s->in[2], "z");
  if (op->n_in > 3 && op->in[3] >= 0)
    set(s->in[3], "n");
  s->nonfloat = 1u << 1;
  set(s->out[0], "n");
  set(s->out[1], "n");
  set(s->forbid, "z");
  return 0;
}

static void xent_rows_localize(const struct mr_graph *g, const struct mr_op *op,
                               const struct mr_mesh *m,
                               const struct mr_dist_attr *need,
                               const int *coord, double *attr) {
  (void)coord, (void)m, (void)need;
  memcpy(attr, op->attr, sizeof op->attr);
  attr[0] = (double)T(g, op->in[0])->shape[0]; /* the mean is over all rows */
}

/* every built-in op's rule, named for its row in compiler/ops.c */
#define RULE(name, spec, localize) \
  const struct mr_spmd_rule mr_spmd_rule_##name = {#name, spec, localize};
RULE(embedding, spec_embedding, embedding_localize)
RULE(embedding_bwd, spec_embedding_bwd, NULL)
RULE(matmul, spec_matmul, NULL)
RULE(bias_grad, spec_bias_grad, NULL)
RULE(add, spec_add, NULL)
RULE(rmsnorm, spec_norm, NULL)
RULE(rmsnorm_bwd, spec_norm_bwd, NULL)
RULE(layernorm, spec_norm, NULL)
RULE(layernorm_bwd, spec_norm_bwd, NULL)
RULE(rope, spec_rope, rope_localize)
RULE(swiglu, spec_pointwise, NULL)
RULE(swiglu_bwd, spec_pointwise, NULL)
RULE(gelu, spec_pointwise, NULL)
RULE(gelu_bwd, spec_pointwise, NULL)
RULE(attention, spec_attention, attention_localize)
RULE(attention_bwd, spec_attention_bwd, attention_localize)
RULE(split3, spec_split_concat, NULL)
RULE(concat3, spec_split_concat, NULL)
RULE(cross_entropy, spec_xent, xent_localize)
RULE(cross_entropy_bwd, spec_xent_bwd, xent_localize)
RULE(xent_max, spec_xent_max, NULL)
RULE(xent_sumexp, spec_xent_sumexp, xent_vocab_localize)
RULE(xent_sumexp_bwd, spec_xent_sumexp_bwd, xent_vocab_localize)
RULE(xent_finish, spec_xent_finish, xent_rows_localize)
RULE(xent_finish_bwd, spec_xent_finish_bwd, xent_rows_localize)
#undef RULE
