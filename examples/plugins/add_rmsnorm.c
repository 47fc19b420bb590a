/* add_rmsnorm.c - an example meshrun plugin: a fused residual add and
 * RMSNorm, the pair every transformer block runs twice.
 *
 *   add_rmsnorm   x[N,C], r[N,C], w[C] -> s = x + r, y = rmsnorm(s) * w,
 *                 rstd[N]            a0 = eps
 *
 * It registers the op's row (shape inference, costs, a gradient built
 * from the registry's rmsnorm_bwd and add, and its SPMD rule: rows may be
 * sharded, data or sequence parallel, the normalized dim may not, so a
 * Partial residual after a row-parallel matmul is all-reduced, or
 * reduce-scattered under sequence parallelism, before the fused op), its
 * CPU kernel, and a model pass that fuses each residual add feeding an
 * rmsnorm in the models meshrun builds (a job with "plugins":
 * ["add_rmsnorm.so"] trains with it on every rank).
 *
 * Build: cc -shared -fPIC -I<meshrun> add_rmsnorm.c -o add_rmsnorm.so; it
 * uses only the table meshrun passes to meshrun_plugin_init. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/error.h"
#include "compiler/model.h"
#include "compiler/plugin.h"
#include "compiler/spmd/rules.h"

int meshrun_plugin_init(const struct mr_plugin_api *api);

static const struct mr_plugin_api *host;
static int kind = -1;

#define T(g, id) (&(g)->tensors[(id)])

static int infer(const struct mr_graph *g, const struct mr_op *op,
                 struct mr_shape *o) {
  const struct mr_tensor *x = T(g, op->in[0]), *r = T(g, op->in[1]),
                         *w = T(g, op->in[2]);
  if (x->ndim != 2 || r->ndim != 2 || x->shape[0] != r->shape[0] ||
      x->shape[1] != r->shape[1] || w->ndim != 1 || w->shape[0] != x->shape[1])
    return host->error_set(MR_ESHAPE, "op add_rmsnorm: expected x, r [N,C] "
                           "and w [C], got %s, %s, %s", x->name, r->name,
                           w->name);
  for (int i = 0; i < 2; i++) {
    o[i].ndim = 2;
    o[i].d[0] = x->shape[0];
    o[i].d[1] = x->shape[1];
    o[i].dtype = MR_F32;
  }
  o[2].ndim = 1;
  o[2].d[0] = x->shape[0];
  o[2].dtype = MR_F32;
  return 0;
}

static double flops(const struct mr_graph *g, const struct mr_op *op) {
  const struct mr_tensor *x = T(g, op->in[0]);
  return 5.0 * (double)(x->shape[0] * x->shape[1]);
}

static double bytes(const struct mr_graph *g, const struct mr_op *op) {
  const struct mr_tensor *x = T(g, op->in[0]);
  return 4.0 * 4.0 * (double)(x->shape[0] * x->shape[1]);
}

/* s feeds y; ds (the gradient reaching s from elsewhere) plus what flows
 * back through the norm is the gradient of both x and r. */
static int grad(struct mr_graph *g, int op_id, const int *dout, int *din) {
  struct mr_op op = g->ops[op_id];
  din[0] = din[1] = din[2] = -1;
  if (dout[1] < 0 && dout[0] < 0)
    return 0;
  int rms_bwd = host->op_kind_by_name("rmsnorm_bwd");
  int add = host->op_kind_by_name("add");
  char nm[MR_TENSOR_NAME_MAX];
  int dsum = dout[0];
  if (dout[1] >= 0) {
    int in[4] = {dout[1], op.out[0], op.in[2], op.out[2]}, out[MR_OP_MAX_OUT];
    snprintf(nm, sizeof nm, "grad/%.80s", g->tensors[op.out[0]].name);
    int k = host->graph_op(g, rms_bwd, nm, in, 4, NULL, out);
    if (k < 0)
      return k;
    g->ops[k].backward = 1;
    din[2] = out[1];
    if (dsum >= 0) {
      int a[2] = {dsum, out[0]};
      snprintf(nm, sizeof nm, "gradsum/%.80s", g->tensors[op.out[0]].name);
      k = host->graph_op(g, add, nm, a, 2, NULL, out + 2);
      if (k < 0)
        return k;
      g->ops[k].backward = 1;
      dsum = out[2];
    } else {
      dsum = out[0];
    }
  }
  din[0] = din[1] = dsum;
  return 0;
}

static int kernel(void *ctx, const struct mr_graph *g, const struct mr_op *op,
                  void *const *b) {
  (void)ctx;
  const float *x = b[0], *r = b[1], *w = b[2];
  float *s = b[3], *y = b[4], *rstd = b[5];
  int64_t n = T(g, op->in[0])->shape[0], c = T(g, op->in[0])->shape[1];
  for (int64_t i = 0; i < n; i++) {
    double ss = 0;
    for (int64_t j = 0; j < c; j++) {
      float v = x[i * c + j] + r[i * c + j];
      s[i * c + j] = v;
      ss += (double)v * v;
    }
    float rs = (float)(1.0 / sqrt(ss / (double)c + op->attr[0]));
    rstd[i] = rs;
    for (int64_t j = 0; j < c; j++)
      y[i * c + j] = s[i * c + j] * rs * w[j];
  }
  return 0;
}

static int spec(const struct mr_graph *g, const struct mr_op *op,
                struct mr_spmd_spec *s) {
  (void)g, (void)op;
  s->n_in = 3;
  s->n_out = 3;
  strcpy(s->in[0], "nc");
  strcpy(s->in[1], "nc");
  strcpy(s->in[2], "c");
  strcpy(s->out[0], "nc");
  strcpy(s->out[1], "nc");
  strcpy(s->out[2], "n");
  strcpy(s->forbid, "c"); /* the norm reduces over c */
  s->linear = MR_SPMD_NONLINEAR;
  return 0;
}

static int same_2d(const struct mr_tensor *a, const struct mr_tensor *b) {
  return a->ndim == 2 && b->ndim == 2 && a->shape[0] == b->shape[0] &&
         a->shape[1] == b->shape[1] && a->dtype == b->dtype;
}

/* Every rmsnorm whose input is an add of two tensors of its shape becomes
 * one add_rmsnorm writing the add's sum and the norm's outputs, so every
 * later reader of either finds what it read before. */
static int fuse(struct mr_graph *g) {
  int add = host->op_kind_by_name("add"), norm = host->op_kind_by_name("rmsnorm");
  for (int j = 0; j < g->n_ops; j++) {
    const struct mr_op *n = &g->ops[j];
    if (n->kind != norm || g->tensors[n->in[0]].producer < 0)
      continue;
    int i = g->tensors[n->in[0]].producer;
    const struct mr_op *a = &g->ops[i];
    const struct mr_tensor *s = T(g, a->out[0]);
    if (a->kind != add || !same_2d(T(g, a->in[0]), s) || !same_2d(T(g, a->in[1]), s))
      continue;
    int ops[2] = {i, j}, in[3] = {a->in[0], a->in[1], n->in[1]};
    int out[3] = {a->out[0], n->out[0], n->out[1]};
    double attr[MR_OP_MAX_ATTR] = {n->attr[0]};
    int rc = host->graph_fuse(g, ops, 2, kind, in, 3, attr, out, 3);
    if (rc < 0)
      return rc;
    j--; /* the norm's place now holds the op after it */
  }
  return 0;
}

static const struct mr_model_pass pass = {"add_rmsnorm", fuse};

static const struct mr_spmd_rule rule = {"add_rmsnorm", spec, NULL};

/* the op's one row: shape inference, gradient, costs and rule */
static const struct mr_op_def def = {
    .name = "add_rmsnorm", .n_in_min = 3, .n_in_max = 3, .n_out = 3,
    .infer = infer, .grad = grad, .flops = flops, .bytes = bytes, .spmd = &rule};

int meshrun_plugin_init(const struct mr_plugin_api *api) {
  if (api->version < MR_PLUGIN_API_VERSION)
    return api->error_set(MR_EVERSION, "add_rmsnorm: built for plugin API %d, "
                          "host has %d", MR_PLUGIN_API_VERSION, api->version);
  host = api;
  if (kind >= 0) /* loaded twice into one process: registered already */
    return 0;
  kind = api->op_register(&def);
  if (kind < 0)
    return kind;
  api->op_set_kernel(kind, MR_BACKEND_CPU, kernel);
  return api->pass_register(&pass);
}
