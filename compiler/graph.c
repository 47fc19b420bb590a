/* graph.c - growing the tensor and op arrays; inference through ops.c. */
#include "compiler/graph.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "compiler/ops.h"

void mr_graph_init(struct mr_graph *g) {
  memset(g, 0, sizeof *g);
  g->loss = -1;
}

void mr_graph_close(struct mr_graph *g) {
  free(g->tensors);
  free(g->ops);
  memset(g, 0, sizeof *g);
  g->loss = -1;
}

int64_t mr_tensor_numel(const struct mr_tensor *t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++)
    n *= t->shape[i];
  return n;
}

int64_t mr_tensor_cols(const struct mr_tensor *t) {
  int64_t n = 1;
  for (int i = 1; i < t->ndim; i++)
    n *= t->shape[i];
  return n;
}

int mr_tensor_file_shape(const struct mr_tensor *t, int64_t *shape) {
  int n = t->merged && t->ndim >= 2 ? t->ndim - 1 : t->ndim;
  for (int i = 0; i < n; i++)
    shape[i] = t->shape[i];
  if (n < t->ndim)
    shape[n - 1] *= t->shape[n];
  return n;
}

int64_t mr_tensor_bytes(const struct mr_tensor *t) {
  return mr_tensor_numel(t) * (int64_t)mr_dtype_size(t->dtype);
}

int mr_graph_tensor(struct mr_graph *g, const char *name, enum mr_dtype dtype,
                    enum mr_tensor_role role, int ndim, const int64_t *shape) {
  if (ndim < 1 || ndim > MR_MAX_DIMS)
    return mr_error_set(MR_EINVAL, "tensor %s: %d dims, expected 1..%d", name,
                        ndim, MR_MAX_DIMS);
  if (strlen(name) >= MR_TENSOR_NAME_MAX)
    return mr_error_set(MR_EINVAL, "tensor name too long: %s", name);
  for (int i = 0; i < ndim; i++)
    if (shape[i] <= 0)
      return mr_error_set(MR_EINVAL, "tensor %s: dim %d is %lld, expected > 0",
                          name, i, (long long)shape[i]);
  if (g->n_tensors == g->cap_tensors) {
    int cap = g->cap_tensors ? 2 * g->cap_tensors : 64;
    struct mr_tensor *t = realloc(g->tensors, (size_t)cap * sizeof *t);
    if (!t)
      return MR_ENOMEM;
    g->tensors = t;
    g->cap_tensors = cap;
  }
  struct mr_tensor *t = &g->tensors[g->n_tensors];
  memset(t, 0, sizeof *t);
  snprintf(t->name, sizeof t->name, "%s", name);
  t->dtype = dtype;
  t->role = role;
  t->ndim = ndim;
  memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
  t->producer = -1;
  t->grad = -1;
  t->grad_of = -1;
  return g->n_tensors++;
}

int mr_graph_param(struct mr_graph *g, const char *name, enum mr_init_kind init,
                   int ndim, const int64_t *shape) {
  int id = mr_graph_tensor(g, name, MR_F32, MR_ROLE_PARAM, ndim, shape);
  if (id >= 0)
    g->tensors[id].init = init;
  return id;
}

int mr_graph_find(const struct mr_graph *g, const char *name) {
  for (int i = 0; i < g->n_tensors; i++)
    if (strcmp(g->tensors[i].name, name) == 0)
      return i;
  return -1;
}

static int push_op(struct mr_graph *g, const struct mr_op *op) {
  if (g->n_ops == g->cap_ops) {
    int cap = g->cap_ops ? 2 * g->cap_ops : 64;
    struct mr_op *o = realloc(g->ops, (size_t)cap * sizeof *o);
    if (!o)
      return MR_ENOMEM;
    g->ops = o;
    g->cap_ops = cap;
  }
  g->ops[g->n_ops] = *op;
  return g->n_ops++;
}

/* Fills op's header and runs inference; shapes[] gets the outputs. */
static int prepare(const struct mr_graph *g, int kind, const int *in, int n_in,
                   const double *attr, struct mr_op *op,
                   struct mr_shape *shapes) {
  const struct mr_op_def *def = mr_op_def(kind);
  if (!def)
    return mr_error_set(MR_EINVAL, "op kind %d: no such op", kind);
  if (n_in < def->n_in_min || n_in > def->n_in_max)
    return mr_error_set(MR_EINVAL, "op %s: %d inputs, expected %d..%d",
                        def->name, n_in, def->n_in_min, def->n_in_max);
  memset(op, 0, sizeof *op);
  op->kind = kind;
  op->n_in = n_in;
  op->n_out = def->n_out;
  op->fwd_op = -1;
  for (int i = 0; i < MR_OP_MAX_IN; i++)
    op->in[i] = -1;
  for (int i = 0; i < MR_OP_MAX_OUT; i++)
    op->out[i] = -1;
  for (int i = 0; i < n_in; i++) {
    if (in[i] < -1 || in[i] >= g->n_tensors ||
        (in[i] == -1 && i < def->n_in_min))
      return mr_error_set(MR_EINVAL, "op %s: input %d is tensor %d, not in "
                          "the graph", def->name, i, in[i]);
    op->in[i] = in[i];
  }
  if (attr)
    memcpy(op->attr, attr, sizeof op->attr);
  memset(shapes, 0, sizeof *shapes * MR_OP_MAX_OUT);
  return def->infer(g, op, shapes);
}

int mr_graph_op(struct mr_graph *g, int kind, const char *name,
                const int *in, int n_in, const double *attr, int *out_ids) {
  struct mr_op op;
  struct mr_shape shapes[MR_OP_MAX_OUT];
  MR_TRY(prepare(g, kind, in, n_in, attr, &op, shapes));
  for (int i = 0; i < op.n_out; i++) {
    char nm[MR_TENSOR_NAME_MAX];
    if (i == 0)
      snprintf(nm, sizeof nm, "%s", name);
    else
      snprintf(nm, sizeof nm, "%.80s.%d", name, i);
    int id = mr_graph_tensor(g, nm, shapes[i].dtype, MR_ROLE_ACTIVATION,
                             shapes[i].ndim, shapes[i].d);
    if (id < 0)
      return id;
    op.out[i] = id;
    g->tensors[id].producer = g->n_ops;
    if (out_ids)
      out_ids[i] = id;
  }
  return push_op(g, &op);
}

/* Whether the existing tensors out[] are what op's inference gave. */
static int outputs_fit(const struct mr_graph *g, const struct mr_op *op,
                       const struct mr_shape *shapes, const int *out, int n_out) {
  const char *name = mr_op_def(op->kind)->name;
  if (n_out != op->n_out)
    return mr_error_set(MR_EINVAL, "op %s: %d outputs given, it has %d", name, n_out,
                        op->n_out);
  for (int i = 0; i < n_out; i++) {
    if (out[i] < 0 || out[i] >= g->n_tensors)
      return mr_error_set(MR_EINVAL, "op %s: output %d is tensor %d, not in the graph", name,
                          i, out[i]);
    const struct mr_tensor *t = &g->tensors[out[i]];
    int same = t->ndim == shapes[i].ndim && t->dtype == shapes[i].dtype;
    for (int d = 0; same && d < t->ndim; d++)
      same = t->shape[d] == shapes[i].d[d];
    if (!same)
      return mr_error_set(MR_ESHAPE, "op %s: output %d (%s) has the wrong "
                          "shape or dtype", name, i, t->name);
  }
  return 0;
}

int mr_graph_op_into(struct mr_graph *g, int kind, const int *in, int n_in,
                     const double *attr, const int *out, int n_out) {
  struct mr_op op;
  struct mr_shape shapes[MR_OP_MAX_OUT];
  MR_TRY(prepare(g, kind, in, n_in, attr, &op, shapes));
  MR_TRY(outputs_fit(g, &op, shapes, out, n_out));
  for (int i = 0; i < n_out; i++) {
    op.out[i] = out[i];
    g->tensors[out[i]].producer = g->n_ops;
  }
  return push_op(g, &op);
}

/* Whether op k is one of the n in ops[]. */
static int listed(const int *ops, int n, int k) {
  for (int i = 0; i < n; i++)
    if (ops[i] == k)
      return 1;
  return 0;
}

int mr_graph_fuse(struct mr_graph *g, const int *ops, int n_ops, int kind, const int *in,
                  int n_in, const double *attr, const int *out, int n_out) {
  if (g->n_forward_ops > 0)
    return mr_error_set(MR_EINVAL, "graph fuse: the graph is differentiated already; fuse "
                        "forward ops before autodiff");
  if (n_ops < 1)
    return mr_error_set(MR_EINVAL, "graph fuse: no ops to fuse");
  int at = g->n_ops;
  for (int i = 0; i < n_ops; i++) {
    if (ops[i] < 0 || ops[i] >= g->n_ops)
      return mr_error_set(MR_EINVAL, "graph fuse: op %d is not in the graph", ops[i]);
    at = ops[i] < at ? ops[i] : at;
  }
  struct mr_op op;
  struct mr_shape shapes[MR_OP_MAX_OUT];
  MR_TRY(prepare(g, kind, in, n_in, attr, &op, shapes));
  MR_TRY(outputs_fit(g, &op, shapes, out, n_out));
  const char *name = mr_op_def(kind)->name;
  for (int i = 0; i < n_in; i++)
    if (in[i] >= 0 && g->tensors[in[i]].producer >= at)
      return mr_error_set(MR_EINVAL, "op %s: input %s is produced after op %d, where the "
                          "fused op goes", name, g->tensors[in[i]].name, at);
  for (int i = 0; i < n_ops; i++) {
    const struct mr_op *o = &g->ops[ops[i]];
    for (int j = 0; j < o->n_out; j++)
      if (!listed(out, n_out, o->out[j]))
        return mr_error_set(MR_EINVAL, "op %s: %s, an output of a fused op, is not one of "
                            "its outputs", name, g->tensors[o->out[j]].name);
  }
  int *moved = malloc(sizeof *moved * (size_t)g->n_ops);
  if (moved == NULL)
    return mr_error_set(MR_ENOMEM, "graph fuse: out of memory");
  for (int i = 0; i < n_out; i++)
    op.out[i] = out[i];
  /* the fused op takes the place of the first; the others go, the ops
   * after them move up, and every producer follows */
  g->ops[at] = op;
  int n = 0;
  for (int k = 0; k < g->n_ops; k++) {
    moved[k] = -1;
    if (k != at && listed(ops, n_ops, k))
      continue;
    moved[k] = n;
    g->ops[n++] = g->ops[k];
  }
  g->n_ops = n;
  for (int t = 0; t < g->n_tensors; t++)
    if (g->tensors[t].producer >= 0)
      g->tensors[t].producer = moved[g->tensors[t].producer];
  for (int i = 0; i < n_out; i++)
    g->tensors[out[i]].producer = at; /* no fused op came before it */
  free(moved);
  return at;
}

char *mr_graph_dump(const struct mr_graph *g) {
  size_t cap = 4096, len = 0;
  char *s = malloc(cap);
  if (!s)
    return NULL;
  s[0] = 0;
  for (int i = 0; i < g->n_ops; i++) {
    const struct mr_op *op = &g->ops[i];
    char line[1024];
    int n = snprintf(line, sizeof line, "%4d %-18s", i, mr_op_def(op->kind)->name);
    for (int j = 0; j < op->n_in && n < 900; j++)
      n += snprintf(line + n, sizeof line - (size_t)n, " %s",
                    op->in[j] >= 0 ? g->tensors[op->in[j]].name : "-");
    n += snprintf(line + n, sizeof line - (size_t)n, " ->");
    for (int j = 0; j < op->n_out && n < 1000; j++)
      n += snprintf(line + n, sizeof line - (size_t)n, " %s",
                    g->tensors[op->out[j]].name);
    if (n > (int)sizeof line - 2)
      n = (int)sizeof line - 2;
    line[n++] = '\n';
    line[n] = 0;
    if (len + (size_t)n + 1 > cap) {
      cap = 2 * cap + (size_t)n;
      char *t = realloc(s, cap);
      if (!t) {
        free(s);
        return NULL;
      }
      s = t;
    }
    memcpy(s + len, line, (size_t)n + 1);
    len += (size_t)n;
  }
  return s;
}
