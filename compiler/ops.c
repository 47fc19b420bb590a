/* ops.c - the op registry table: inference, gradient builders, costs. */
#include "compiler/ops.h"
#include "compiler/spmd/rules.h"

#include <stdio.h>
#include <string.h>

#include "common/error.h"

#define T(g, id) (&(g)->tensors[(id)])
/* every tensor seen as a matrix: its first dim by the rest */
#define ROWS(g, id) (T(g, id)->shape[0])
#define COLS(g, id) mr_tensor_cols(T(g, id))
#define NUMEL(g, id) ((double)mr_tensor_numel(T(g, id)))

static void set2(struct mr_shape *s, int64_t a, int64_t b, enum mr_dtype dt) {
  s->ndim = 2;
  s->d[0] = a;
  s->d[1] = b;
  s->dtype = dt;
}

static void set1(struct mr_shape *s, int64_t a, enum mr_dtype dt) {
  s->ndim = 1;
  s->d[0] = a;
  s->dtype = dt;
}

static void like(struct mr_shape *s, const struct mr_tensor *t) {
  s->ndim = t->ndim;
  memcpy(s->d, t->shape, sizeof s->d);
  s->dtype = t->dtype;
}

static int need(int ok, const struct mr_graph *g, const struct mr_op *op,
                const char *what) {
  if (ok)
    return 0;
  char ins[400];
  int n = 0;
  ins[0] = 0;
  for (int i = 0; i < op->n_in && n < 300; i++) {
    if (op->in[i] < 0)
      continue;
    const struct mr_tensor *t = T(g, op->in[i]);
    n += snprintf(ins + n, sizeof ins - (size_t)n, " %s[", t->name);
    for (int d = 0; d < t->ndim && n < 380; d++)
      n += snprintf(ins + n, sizeof ins - (size_t)n, d ? ",%lld" : "%lld",
                    (long long)t->shape[d]);
    if (n < 390)
      n += snprintf(ins + n, sizeof ins - (size_t)n, "]");
  }
  return mr_error_set(MR_ESHAPE, "op %s: %s (inputs:%s)",
                      mr_op_def(op->kind)->name, what, ins);
}

static int is2d(const struct mr_graph *g, int id) { return T(g, id)->ndim == 2; }

static int same_shape(const struct mr_graph *g, int a, int b) {
  const struct mr_tensor *x = T(g, a), *y = T(g, b);
  if (x->ndim != y->ndim)
    return 0;
  for (int i = 0; i < x->ndim; i++)
    if (x->shape[i] != y->shape[i])
      return 0;
  return 1;
}

/* ---- inference ---- */

static int infer_embedding(const struct mr_graph *g, const struct mr_op *op,
                           struct mr_shape *o) {
  int ids = op->in[0], w = op->in[1];
  MR_TRY(need(T(g, ids)->ndim == 1 && T(g, ids)->dtype == MR_I32 && is2d(g, w),
              g, op, "expected ids[N] int32 and table[V,C]"));
  set2(o, ROWS(g, ids), COLS(g, w), MR_F32);
  return 0;
}

static int infer_embedding_bwd(const struct mr_graph *g, const struct mr_op *op,
                               struct mr_shape *o) {
  int ids = op->in[0], d = op->in[1];
  MR_TRY(need(T(g, ids)->dtype == MR_I32 && is2d(g, d) &&
                  ROWS(g, d) == ROWS(g, ids) && op->attr[0] >= 1,
              g, op, "expected ids[N], dout[N,C] and a0 = vocab"));
  set2(o, (int64_t)op->attr[0], COLS(g, d), MR_F32);
  return 0;
}

static void mm_dims(const struct mr_graph *g, const struct mr_op *op,
                    int64_t *m, int64_t *k, int64_t *k2, int64_t *n) {
  int a = op->in[0], b = op->in[1];
  *m = op->attr[0] ? COLS(g, a) : ROWS(g, a);
  *k = op->attr[0] ? ROWS(g, a) : COLS(g, a);
  *k2 = op->attr[1] ? COLS(g, b) : ROWS(g, b);
  *n = op->attr[1] ? ROWS(g, b) : COLS(g, b);
}

/* The dims of operand x of a matmul in its three parts: x is a matrix of
 * its first dim by the rest, the rest taken as one dim of several (GPT-2's
 * fused q|k|v weight [C, 3, C]).  Of a (`lead`: the left operand), the
 * first dim is M and the rest K, or transposed K then M; of b, K then N,
 * or transposed N then K.  *outer: the M or N dims, *inner: the K dims. */
static void mm_parts(const struct mr_tensor *x, int lead, int transposed, int *outer0,
                     int *outer_n, int *inner0, int *inner_n) {
  int first_is_outer = lead ? !transposed : transposed;
  *outer0 = first_is_outer ? 0 : 1;
  *outer_n = first_is_outer ? 1 : x->ndim - 1;
  *inner0 = first_is_outer ? 1 : 0;
  *inner_n = first_is_outer ? x->ndim - 1 : 1;
}

static int infer_matmul(const struct mr_graph *g, const struct mr_op *op,
                        struct mr_shape *o) {
  const struct mr_tensor *a = T(g, op->in[0]), *b = T(g, op->in[1]);
  MR_TRY(need(a->ndim >= 2 && b->ndim >= 2 && a->ndim + b->ndim <= 2 + MR_MAX_DIMS, g, op,
              "expected operands of 2 or more dims"));
  int ao, an, ai, ak, bo, bn, bi, bk;
  mm_parts(a, 1, op->attr[0] != 0, &ao, &an, &ai, &ak);
  mm_parts(b, 0, op->attr[1] != 0, &bo, &bn, &bi, &bk);
  int same = ak == bk;
  for (int d = 0; same && d < ak; d++)
    same = a->shape[ai + d] == b->shape[bi + d];
  MR_TRY(need(same, g, op, "inner dimensions differ"));
  o->ndim = an + bn;
  o->dtype = MR_F32;
  for (int d = 0; d < an; d++)
    o->d[d] = a->shape[ao + d];
  for (int d = 0; d < bn; d++)
    o->d[an + d] = b->shape[bo + d];
  if (op->n_in > 2 && op->in[2] >= 0) {
    const struct mr_tensor *c = T(g, op->in[2]);
    int ok = c->ndim == bn;
    for (int d = 0; ok && d < bn; d++)
      ok = c->shape[d] == b->shape[bo + d];
    MR_TRY(need(ok, g, op, "bias must have the shape of N"));
  }
  return 0;
}

/* dy [M, N...] -> [N...] */
static int infer_bias_grad(const struct mr_graph *g, const struct mr_op *op,
                           struct mr_shape *o) {
  const struct mr_tensor *dy = T(g, op->in[0]);
  MR_TRY(need(dy->ndim >= 2, g, op, "expected dy[M,N]"));
  o->ndim = dy->ndim - 1;
  o->dtype = MR_F32;
  for (int d = 1; d < dy->ndim; d++)
    o->d[d - 1] = dy->shape[d];
  return 0;
}

static int infer_same(const struct mr_graph *g, const struct mr_op *op,
                      struct mr_shape *o) {
  for (int i = 1; i < op->n_in; i++)
    MR_TRY(need(same_shape(g, op->in[0], op->in[i]), g, op,
                "operands must have the same shape"));
  like(o, T(g, op->in[0]));
  return 0;
}

/* dy-first backward of an elementwise pair: outputs like inputs 1.. */
static int infer_elem_bwd(const struct mr_graph *g, const struct mr_op *op,
                          struct mr_shape *o) {
  for (int i = 1; i < op->n_in; i++)
    MR_TRY(need(same_shape(g, op->in[0], op->in[i]), g, op,
                "operands must have the same shape"));
  for (int i = 0; i < mr_op_def(op->kind)->n_out; i++)
    like(&o[i], T(g, op->in[0]));
  return 0;
}

static int infer_norm(const struct mr_graph *g, const struct mr_op *op,
                      struct mr_shape *o) {
  int x = op->in[0];
  MR_TRY(need(is2d(g, x), g, op, "expected x[N,C]"));
  for (int i = 1; i < op->n_in; i++)
    MR_TRY(need(T(g, op->in[i])->ndim == 1 && ROWS(g, op->in[i]) == COLS(g, x),
                g, op, "weight and bias must be [C]"));
  like(&o[0], T(g, x));
  for (int i = 1; i < mr_op_def(op->kind)->n_out; i++)
    set1(&o[i], ROWS(g, x), MR_F32);
  return 0;
}

static int infer_norm_bwd(const struct mr_graph *g, const struct mr_op *op,
                          struct mr_shape *o) {
  int dy = op->in[0], x = op->in[1], w = op->in[2];
  MR_TRY(need(is2d(g, x) && same_shape(g, dy, x) &&
                  ROWS(g, w) == COLS(g, x),
              g, op, "expected dy, x [N,C] and w [C]"));
  like(&o[0], T(g, x));
  for (int i = 1; i < mr_op_def(op->kind)->n_out; i++)
    set1(&o[i], COLS(g, x), MR_F32);
  return 0;
}

static int infer_rope(const struct mr_graph *g, const struct mr_op *op,
                      struct mr_shape *o) {
  int x = op->in[0];
  int64_t t = (int64_t)op->attr[0], h = (int64_t)op->attr[1];
  MR_TRY(need(is2d(g, x) && t > 0 && h > 0 && ROWS(g, x) % t == 0 &&
                  COLS(g, x) % h == 0 && (COLS(g, x) / h) % 2 == 0,
              g, op, "expected x[B*T, H*D] with T | rows, H | cols, even D"));
  like(o, T(g, x));
  return 0;
}

static int infer_attention(const struct mr_graph *g, const struct mr_op *op,
                           struct mr_shape *o) {
  int q = op->in[0], k = op->in[1], v = op->in[2];
  int64_t t = (int64_t)op->attr[0], h = (int64_t)op->attr[1],
          kh = (int64_t)op->attr[2];
  MR_TRY(need(t > 0 && h > 0 && kh > 0 && h % kh == 0 && is2d(g, q) &&
                  ROWS(g, q) % t == 0 && COLS(g, q) % h == 0 &&
                  same_shape(g, k, v) && ROWS(g, k) == ROWS(g, q) &&
                  COLS(g, k) == COLS(g, q) / h * kh,
              g, op, "expected q[B*T,H*D], k and v [B*T,KH*D], KH | H"));
  like(&o[0], T(g, q));
  /* lse [B, H, T]: three dims so that a batch or a head shard of it is a
   * shard of one dim */
  o[1].ndim = 3;
  o[1].d[0] = ROWS(g, q) / t;
  o[1].d[1] = h;
  o[1].d[2] = t;
  o[1].dtype = MR_F32;
  return 0;
}

static int infer_attention_bwd(const struct mr_graph *g, const struct mr_op *op,
                               struct mr_shape *o) {
  MR_TRY(need(same_shape(g, op->in[0], op->in[1]) &&
                  same_shape(g, op->in[1], op->in[4]),
              g, op, "do, q and o must match"));
  like(&o[0], T(g, op->in[1]));
  like(&o[1], T(g, op->in[2]));
  like(&o[2], T(g, op->in[3]));
  return 0;
}

/* x [N, 3C] or [N, 3, C] -> three [N, C]: each row's thirds */
static int infer_split3(const struct mr_graph *g, const struct mr_op *op,
                        struct mr_shape *o) {
  const struct mr_tensor *x = T(g, op->in[0]);
  MR_TRY(need((x->ndim == 2 && x->shape[1] % 3 == 0) || (x->ndim == 3 && x->shape[1] == 3),
              g, op, "expected x[N,3C] or x[N,3,C]"));
  for (int i = 0; i < 3; i++)
    set2(&o[i], x->shape[0], COLS(g, op->in[0]) / 3, MR_F32);
  return 0;
}

/* three [N, C] -> [N, 3C], or [N, 3, C] when a0 is 1 (the gradient of a
 * split3 of that shape) */
static int infer_concat3(const struct mr_graph *g, const struct mr_op *op,
                         struct mr_shape *o) {
  MR_TRY(infer_same(g, op, o));
  MR_TRY(need(is2d(g, op->in[0]), g, op, "expected 2-D parts"));
  if (op->attr[0] != 0) {
    o->ndim = 3;
    o->d[2] = o->d[1];
    o->d[1] = 3;
  } else {
    o->d[1] *= 3;
  }
  return 0;
}

static int infer_xent(const struct mr_graph *g, const struct mr_op *op,
                      struct mr_shape *o) {
  int l = op->in[0], y = op->in[1];
  MR_TRY(need(is2d(g, l) && T(g, y)->ndim == 1 && T(g, y)->dtype == MR_I32 &&
                  ROWS(g, y) == ROWS(g, l),
              g, op, "expected logits[N,V] and targets[N] int32"));
  set1(&o[0], 1, MR_F32);
  set1(&o[1], ROWS(g, l), MR_F32);
  return 0;
}

static int infer_xent_bwd(const struct mr_graph *g, const struct mr_op *op,
                          struct mr_shape *o) {
  MR_TRY(need(NUMEL(g, op->in[0]) == 1 && is2d(g, op->in[1]), g, op,
              "expected dloss[1] and logits[N,V]"));
  like(o, T(g, op->in[1]));
  return 0;
}

/* a 1-D tensor of n elements of type dt */
static int vec(const struct mr_graph *g, int id, int64_t n, enum mr_dtype dt) {
  return id >= 0 && T(g, id)->ndim == 1 && ROWS(g, id) == n && T(g, id)->dtype == dt;
}

static int present_vec(const struct mr_graph *g, const struct mr_op *op, int i,
                       int64_t n) {
  return i >= op->n_in || op->in[i] < 0 || vec(g, op->in[i], n, MR_F32);
}

static int infer_xent_max(const struct mr_graph *g, const struct mr_op *op,
                          struct mr_shape *o) {
  MR_TRY(need(is2d(g, op->in[0]), g, op, "expected logits[N,V]"));
  set1(o, ROWS(g, op->in[0]), MR_F32);
  return 0;
}

static int infer_xent_sumexp(const struct mr_graph *g, const struct mr_op *op,
                             struct mr_shape *o) {
  int l = op->in[0];
  int64_t n = is2d(g, l) ? ROWS(g, l) : -1;
  MR_TRY(need(n >= 0 && vec(g, op->in[1], n, MR_I32) &&
                  vec(g, op->in[2], n, MR_F32) && op->attr[0] >= 0,
              g, op, "expected logits[N,V], targets[N] int32 and m[N]"));
  set1(&o[0], n, MR_F32);
  set1(&o[1], n, MR_F32);
  return 0;
}

static int infer_xent_sumexp_bwd(const struct mr_graph *g, const struct mr_op *op,
                                 struct mr_shape *o) {
  int l = op->in[0];
  int64_t n = is2d(g, l) ? ROWS(g, l) : -1;
  MR_TRY(need(n >= 0 && vec(g, op->in[1], n, MR_I32) &&
                  vec(g, op->in[2], n, MR_F32) && present_vec(g, op, 3, n) &&
                  present_vec(g, op, 4, n),
              g, op, "expected logits[N,V], targets[N] int32, m, ds, dtl [N]"));
  like(o, T(g, l));
  return 0;
}

static int infer_xent_finish(const struct mr_graph *g, const struct mr_op *op,
                             struct mr_shape *o) {
  int64_t n = T(g, op->in[0])->ndim == 1 ? ROWS(g, op->in[0]) : -1;
  MR_TRY(need(vec(g, op->in[0], n, MR_F32) && vec(g, op->in[1], n, MR_F32) &&
                  vec(g, op->in[2], n, MR_F32) && vec(g, op->in[3], n, MR_I32),
              g, op, "expected s, tl, m [N] and targets[N] int32"));
  set1(&o[0], 1, MR_F32);
  set1(&o[1], n, MR_F32);
  return 0;
}

static int infer_xent_finish_bwd(const struct mr_graph *g, const struct mr_op *op,
                                 struct mr_shape *o) {
  int64_t n = T(g, op->in[0])->ndim == 1 ? ROWS(g, op->in[0]) : -1;
  MR_TRY(need(vec(g, op->in[0], n, MR_F32) && vec(g, op->in[1], n, MR_I32) &&
                  (op->n_in < 3 || op->in[2] < 0 || NUMEL(g, op->in[2]) == 1) &&
                  present_vec(g, op, 3, n),
              g, op, "expected s[N], targets[N] int32, dloss[1], dlse[N]"));
  set1(&o[0], n, MR_F32);
  set1(&o[1], n, MR_F32);
  return 0;
}

/* ---- gradient builders ---- */

/* Name for the gradient of tensor id. */
static const char *gname(struct mr_graph *g, int id, char *buf, size_t n) {
  snprintf(buf, n, "grad/%.80s", T(g, id)->name);
  return buf;
}

static int emit(struct mr_graph *g, int kind, const char *name, const int *in,
                int n_in, const double *attr, int *out) {
  int rc = mr_graph_op(g, kind, name, in, n_in, attr, out);
  if (rc < 0)
    return rc;
  g->ops[rc].backward = 1;
  return 0;
}

static int grad_embedding(struct mr_graph *g, int op_id, const int *dout,
                          int *din) {
  struct mr_op op = g->ops[op_id];
  char nm[MR_TENSOR_NAME_MAX];
  din[0] = -1;
  double a[MR_OP_MAX_ATTR] = {(double)ROWS(g, op.in[1])};
  int in[2] = {op.in[0], dout[0]};
  return emit(g, MR_OP_EMBEDDING_BWD, gname(g, op.in[1], nm, sizeof nm), in, 2,
              a, &din[1]);
}

static int grad_matmul(struct mr_graph *g, int op_id, const int *dout,
                       int *din) {
  struct mr_op op = g->ops[op_id];
  char nm[MR_TENSOR_NAME_MAX];
  int ta = op.attr[0] != 0, tb = op.attr[1] != 0, a = op.in[0], b = op.in[1];
  int dc = dout[0];
  /* C = op(A) op(B).  dA: if !ta, dC op(B)^T; else op(B) dC^T. */
  {
    int in[2];
    double at[MR_OP_MAX_ATTR] = {0};
    if (!ta) {
      in[0] = dc, in[1] = b, at[0] = 0, at[1] = !tb;
    } else {
      in[0] = b, in[1] = dc, at[0] = tb, at[1] = 1;
    }
    MR_TRY(emit(g, MR_OP_MATMUL, gname(g, a, nm, sizeof nm), in, 2, at, &din[0]));
  }
  {
    int in[2];
    double at[MR_OP_MAX_ATTR] = {0};
    /* dB: if !tb, op(A)^T dC; else dC^T op(A). */
    if (!tb) {
      in[0] = a, in[1] = dc, at[0] = !ta, at[1] = 0;
    } else {
      in[0] = dc, in[1] = a, at[0] = 1, at[1] = ta;
    }
    MR_TRY(emit(g, MR_OP_MATMUL, gname(g, b, nm, sizeof nm), in, 2, at, &din[1]));
  }
  if (op.n_in > 2 && op.in[2] >= 0) {
    int in[1] = {dc};
    MR_TRY(emit(g, MR_OP_BIAS_GRAD, gname(g, op.in[2], nm, sizeof nm), in, 1,
                NULL, &din[2]));
  }
  return 0;
}

static int grad_add(struct mr_graph *g, int op_id, const int *dout, int *din) {
  din[0] = dout[0];
  din[1] = dout[0];
  return 0;
}

static int grad_rmsnorm(struct mr_graph *g, int op_id, const int *dout,
                        int *din) {
  struct mr_op op = g->ops[op_id];
  char nm[MR_TENSOR_NAME_MAX];
  int in[4] = {dout[0], op.in[0], op.in[1], op.out[1]};
  return emit(g, MR_OP_RMSNORM_BWD, gname(g, op.in[0], nm, sizeof nm), in, 4,
              op.attr, din);
}

static int grad_layernorm(struct mr_graph *g, int op_id, const int *dout,
                          int *din) {
  struct mr_op op = g->ops[op_id];
  char nm[MR_TENSOR_NAME_MAX];
  int in[5] = {dout[0], op.in[0], op.in[1], op.out[1], op.out[2]};
  return emit(g, MR_OP_LAYERNORM_BWD, gname(g, op.in[0], nm, sizeof nm), in, 5,
              op.attr, din);
}

static int grad_rope(struct mr_graph *g, int op_id, const int *dout, int *din) {
  struct mr_op op = g->ops[op_id];
  char nm[MR_TENSOR_NAME_MAX];
  double a[MR_OP_MAX_ATTR];
  memcpy(a, op.attr, sizeof a);
  a[3] = -(a[3] == 0 ? 1 : a[3]);
  int in[1] = {dout[0]};
  return emit(g, MR_OP_ROPE, gname(g, op.in[0], nm, sizeof nm), in, 1, a, din);
}

static int grad_swiglu(struct mr_graph *g, int op_id, const int *dout,
                       int *din) {
  struct mr_op op = g->ops[op_id];
  char nm[MR_TENSOR_NAME_MAX];
  int in[3] = {dout[0], op.in[0], op.in[1]};
  return emit(g, MR_OP_SWIGLU_BWD, gname(g, op.in[0], nm, sizeof nm), in, 3,
              NULL, din);
}

static int grad_gelu(struct mr_graph *g, int op_id, const int *dout, int *din) {
  struct mr_op op = g->ops[op_id];
  char nm[MR_TENSOR_NAME_MAX];
  int in[2] = {dout[0], op.in[0]};
  return emit(g, MR_OP_GELU_BWD, gname(g, op.in[0], nm, sizeof nm), in, 2,
              NULL, din);
}

static int grad_attention(struct mr_graph *g, int op_id, const int *dout,
                          int *din) {
  struct mr_op op = g->ops[op_id];
  char nm[MR_TENSOR_NAME_MAX];
  int in[6] = {dout[0], op.in[0], op.in[1], op.in[2], op.out[0], op.out[1]};
  return emit(g, MR_OP_ATTENTION_BWD, gname(g, op.in[0], nm, sizeof nm), in, 6,
              op.attr, din);
}

static int grad_split3(struct mr_graph *g, int op_id, const int *dout,
                       int *din) {
  struct mr_op op = g->ops[op_id];
  char nm[MR_TENSOR_NAME_MAX];
  /* a part nobody used has no gradient: concat needs all three */
  for (int i = 0; i < 3; i++)
    if (dout[i] < 0)
      return mr_error_set(MR_ENOTSUP, "split3 %s: output %d unused",
                          T(g, op.in[0])->name, i);
  double at[MR_OP_MAX_ATTR] = {T(g, op.in[0])->ndim == 3};
  return emit(g, MR_OP_CONCAT3, gname(g, op.in[0], nm, sizeof nm), dout, 3,
              at, din);
}

static int grad_concat3(struct mr_graph *g, int op_id, const int *dout,
                        int *din) {
  struct mr_op op = g->ops[op_id];
  char nm[MR_TENSOR_NAME_MAX];
  int in[1] = {dout[0]};
  return emit(g, MR_OP_SPLIT3, gname(g, op.out[0], nm, sizeof nm), in, 1, NULL,
              din);
}

static int grad_xent(struct mr_graph *g, int op_id, const int *dout, int *din) {
  struct mr_op op = g->ops[op_id];
  char nm[MR_TENSOR_NAME_MAX];
  din[1] = -1;
  int in[4] = {dout[0], op.in[0], op.in[1], op.out[1]};
  return emit(g, MR_OP_CROSS_ENTROPY_BWD, gname(g, op.in[0], nm, sizeof nm), in,
              4, NULL, &din[0]);
}

/* The row maxima m only shift the exponentials: the loss and lse do not
 * depend on them (their partials through xent_sumexp and xent_finish
 * cancel), so neither builder passes a gradient to m, and xent_max has
 * none to pass on. */
static int grad_xent_sumexp(struct mr_graph *g, int op_id, const int *dout,
                            int *din) {
  struct mr_op op = g->ops[op_id];
  char nm[MR_TENSOR_NAME_MAX];
  din[1] = din[2] = -1;
  int in[5] = {op.in[0], op.in[1], op.in[2], dout[0], dout[1]};
  return emit(g, MR_OP_XENT_SUMEXP_BWD, gname(g, op.in[0], nm, sizeof nm), in,
              5, op.attr, &din[0]);
}

static int grad_xent_finish(struct mr_graph *g, int op_id, const int *dout,
                            int *din) {
  struct mr_op op = g->ops[op_id];
  char nm[MR_TENSOR_NAME_MAX];
  din[2] = din[3] = -1;
  int in[4] = {op.in[0], op.in[3], dout[0], dout[1]};
  /* writes ds and dtl, the gradients of inputs 0 and 1 */
  return emit(g, MR_OP_XENT_FINISH_BWD, gname(g, op.in[0], nm, sizeof nm), in,
              4, op.attr, din);
}

/* ---- costs ---- */

static double flops_matmul(const struct mr_graph *g, const struct mr_op *op) {
  int64_t m, k, k2, n;
  mm_dims(g, op, &m, &k, &k2, &n);
  return 2.0 * (double)m * (double)n * (double)k;
}

/* causal attention: QK^T and PV over the lower triangle */
static double flops_attention(const struct mr_graph *g, const struct mr_op *op) {
  double t = op->attr[0], rows = (double)ROWS(g, op->in[0]);
  double hd = (double)COLS(g, op->in[0]);
  double f = 2.0 * 2.0 * rows * hd * (t + 1) / 2;
  return op->kind == MR_OP_ATTENTION ? f : 2.5 * f; /* bwd: 5 matmuls vs 2 */
}

static double flops_elem(const struct mr_graph *g, const struct mr_op *op) {
  return 5.0 * NUMEL(g, op->out[0]);
}

/* per logit a compare (xent_max), or a subtract, an exponential (counted
 * as 2) and an add (xent_sumexp and its backward); about as much per row
 * for the finishing steps, whose first input is [N] */
static double flops_xent_steps(const struct mr_graph *g, const struct mr_op *op) {
  return (op->kind == MR_OP_XENT_MAX ? 1.0 : 4.0) * NUMEL(g, op->in[0]);
}

static double bytes_io(const struct mr_graph *g, const struct mr_op *op) {
  double b = 0;
  for (int i = 0; i < op->n_in; i++)
    if (op->in[i] >= 0)
      b += (double)mr_tensor_bytes(T(g, op->in[i]));
  for (int i = 0; i < op->n_out; i++)
    b += (double)mr_tensor_bytes(T(g, op->out[i]));
  return b;
}

/* kind and name as MR_OP_LIST spells them (a test holds the two together) */
#define ROW(kind, name, lo, hi, nout, inf, gr, fl)                           \
  [MR_OP_##kind] = {#name, lo, hi, nout, inf, gr, fl, bytes_io, &mr_spmd_rule_##name, 0}
/* an op whose kernels can add into the outputs in mask (accum_outs) */
#define ROW_ACC(kind, name, lo, hi, nout, inf, gr, fl, mask)                 \
  [MR_OP_##kind] = {#name, lo, hi, nout, inf, gr, fl, bytes_io, &mr_spmd_rule_##name, mask}

static const struct mr_op_def defs[MR_OP_COUNT] = {
    ROW(EMBEDDING, embedding, 2, 2, 1, infer_embedding, grad_embedding,
        flops_elem),
    ROW_ACC(EMBEDDING_BWD, embedding_bwd, 2, 2, 1, infer_embedding_bwd,
            NULL, flops_elem, 1u),
    ROW_ACC(MATMUL, matmul, 2, 3, 1, infer_matmul, grad_matmul,
            flops_matmul, 1u),
    ROW_ACC(BIAS_GRAD, bias_grad, 1, 1, 1, infer_bias_grad, NULL,
            flops_elem, 1u),
    ROW(ADD, add, 2, 2, 1, infer_same, grad_add, flops_elem),
    ROW(RMSNORM, rmsnorm, 2, 2, 2, infer_norm, grad_rmsnorm,
        flops_elem),
    ROW_ACC(RMSNORM_BWD, rmsnorm_bwd, 4, 4, 2, infer_norm_bwd, NULL,
            flops_elem, 2u), /* dw */
    ROW(LAYERNORM, layernorm, 3, 3, 3, infer_norm, grad_layernorm,
        flops_elem),
    ROW_ACC(LAYERNORM_BWD, layernorm_bwd, 5, 5, 3, infer_norm_bwd, NULL,
            flops_elem, 6u), /* dw, db */
    ROW(ROPE, rope, 1, 1, 1, infer_rope, grad_rope, flops_elem),
    ROW(SWIGLU, swiglu, 2, 2, 1, infer_same, grad_swiglu, flops_elem),
    ROW(SWIGLU_BWD, swiglu_bwd, 3, 3, 2, infer_elem_bwd, NULL,
        flops_elem),
    ROW(GELU, gelu, 1, 1, 1, infer_same, grad_gelu, flops_elem),
    ROW(GELU_BWD, gelu_bwd, 2, 2, 1, infer_elem_bwd, NULL, flops_elem),
    ROW(ATTENTION, attention, 3, 3, 2, infer_attention, grad_attention,
        flops_attention),
    ROW(ATTENTION_BWD, attention_bwd, 6, 6, 3, infer_attention_bwd,
        NULL, flops_attention),
    ROW(SPLIT3, split3, 1, 1, 3, infer_split3, grad_split3, flops_elem),
    ROW(CONCAT3, concat3, 3, 3, 1, infer_concat3, grad_concat3,
        flops_elem),
    ROW(CROSS_ENTROPY, cross_entropy, 2, 2, 2, infer_xent, grad_xent,
        flops_elem),
    ROW(CROSS_ENTROPY_BWD, cross_entropy_bwd, 4, 4, 1, infer_xent_bwd,
        NULL, flops_elem),
    ROW(XENT_MAX, xent_max, 1, 1, 1, infer_xent_max, NULL,
        flops_xent_steps),
    ROW(XENT_SUMEXP, xent_sumexp, 3, 3, 2, infer_xent_sumexp,
        grad_xent_sumexp, flops_xent_steps),
    ROW(XENT_SUMEXP_BWD, xent_sumexp_bwd, 3, 5, 1, infer_xent_sumexp_bwd,
        NULL, flops_xent_steps),
    ROW(XENT_FINISH, xent_finish, 4, 4, 2, infer_xent_finish,
        grad_xent_finish, flops_xent_steps),
    ROW(XENT_FINISH_BWD, xent_finish_bwd, 2, 4, 2, infer_xent_finish_bwd,
        NULL, flops_xent_steps),
};

/* ops registered at run time (plugins) follow the built-in ones */
static struct mr_op_def extra[MR_OP_MAX_KINDS - MR_OP_COUNT];
static int n_extra;
static mr_kernel_fn kernels[MR_OP_MAX_KINDS][MR_BACKEND_COUNT];

const struct mr_op_def *mr_op_def(int kind) {
  if (kind < 0 || kind >= MR_OP_COUNT + n_extra)
    return NULL;
  return kind < MR_OP_COUNT ? &defs[kind] : &extra[kind - MR_OP_COUNT];
}

int mr_op_kind_by_name(const char *name) {
  for (int i = 0; i < MR_OP_COUNT + n_extra; i++)
    if (strcmp(mr_op_def(i)->name, name) == 0)
      return i;
  return mr_error_set(MR_EINVAL, "no op named %s", name);
}

int mr_op_count(void) { return MR_OP_COUNT + n_extra; }

int mr_op_register(const struct mr_op_def *def) {
  if (!def || !def->name || !def->infer || !def->flops || !def->bytes ||
      def->n_in_min < 0 || def->n_in_max > MR_OP_MAX_IN ||
      def->n_in_min > def->n_in_max || def->n_out < 1 ||
      def->n_out > MR_OP_MAX_OUT)
    return mr_error_set(MR_EINVAL, "op %s: a definition needs a name, shape "
                        "inference, costs and arities within %d inputs and %d "
                        "outputs", def && def->name ? def->name : "?",
                        MR_OP_MAX_IN, MR_OP_MAX_OUT);
  for (int i = 0; i < MR_OP_COUNT + n_extra; i++)
    if (strcmp(mr_op_def(i)->name, def->name) == 0)
      return mr_error_set(MR_EINVAL, "op %s is registered already", def->name);
  if (n_extra == MR_OP_MAX_KINDS - MR_OP_COUNT)
    return mr_error_set(MR_ENOMEM, "op %s: more than %d op kinds", def->name,
                        MR_OP_MAX_KINDS);
  extra[n_extra] = *def;
  return MR_OP_COUNT + n_extra++;
}

void mr_op_set_kernel(int kind, enum mr_backend_kind backend, mr_kernel_fn fn) {
  if (kind >= 0 && kind < MR_OP_COUNT + n_extra && backend < MR_BACKEND_COUNT)
    kernels[kind][backend] = fn;
}

mr_kernel_fn mr_op_kernel(int kind, enum mr_backend_kind backend) {
  if (kind < 0 || kind >= MR_OP_COUNT + n_extra || backend >= MR_BACKEND_COUNT)
    return NULL;
  return kernels[kind][backend];
}

double mr_graph_flops(const struct mr_graph *g) {
  double f = 0;
  for (int i = 0; i < g->n_ops; i++)
    f += mr_op_def(g->ops[i].kind)->flops(g, &g->ops[i]);
  return f;
}
