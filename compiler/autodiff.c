/* autodiff.c - reverse walk over the forward ops. */
#include "compiler/autodiff.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "compiler/ops.h"

/* Adds contribution d to tensor x's running gradient in acc[]. */
static int accumulate(struct mr_graph *g, int *acc, int x, int d) {
  if (acc[x] < 0) {
    acc[x] = d;
    return 0;
  }
  char nm[MR_TENSOR_NAME_MAX];
  snprintf(nm, sizeof nm, "gradsum/%.80s", g->tensors[x].name);
  int in[2] = {acc[x], d}, out;
  int rc = mr_graph_op(g, MR_OP_ADD, nm, in, 2, NULL, &out);
  if (rc < 0)
    return rc;
  g->ops[rc].backward = 1;
  acc[x] = out;
  return 0;
}

int mr_autodiff(struct mr_graph *g, int out, int *seed) {
  int n_fwd = g->n_ops, rc = 0;
  g->n_forward_ops = n_fwd;
  /* tensors only grow; size acc for the final count lazily */
  int cap = g->n_tensors * 8 + 64;
  int *acc = malloc((size_t)cap * sizeof *acc);
  if (!acc)
    return MR_ENOMEM;
  for (int i = 0; i < cap; i++)
    acc[i] = -1;
  char nm[MR_TENSOR_NAME_MAX];
  const struct mr_tensor *o = &g->tensors[out];
  snprintf(nm, sizeof nm, "grad/%.80s", o->name);
  int64_t shape[MR_MAX_DIMS];
  memcpy(shape, o->shape, sizeof shape);
  int s = mr_graph_tensor(g, nm, MR_F32, MR_ROLE_INPUT, o->ndim, shape);
  if (s < 0) {
    free(acc);
    return s;
  }
  acc[out] = s;
  *seed = s;
  for (int i = n_fwd - 1; i >= 0; i--) {
    struct mr_op op = g->ops[i];
    int dout[MR_OP_MAX_OUT], din[MR_OP_MAX_IN], any = 0;
    for (int j = 0; j < op.n_out; j++) {
      dout[j] = acc[op.out[j]];
      any |= dout[j] >= 0;
    }
    if (!any)
      continue;
    const struct mr_op_def *def = mr_op_def(op.kind);
    if (!def->grad) {
      rc = mr_error_set(MR_ENOTSUP, "op %s has no gradient", def->name);
      goto out;
    }
    for (int j = 0; j < MR_OP_MAX_IN; j++)
      din[j] = -1;
    int first_new = g->n_ops;
    MR_TRY_GOTO(rc, def->grad(g, i, dout, din), out);
    if (g->n_tensors + 16 > cap) {
      int ncap = 2 * g->n_tensors + 64;
      int *a = realloc(acc, (size_t)ncap * sizeof *a);
      if (!a) {
        rc = MR_ENOMEM;
        goto out;
      }
      for (int k = cap; k < ncap; k++)
        a[k] = -1;
      acc = a;
      cap = ncap;
    }
    for (int j = 0; j < op.n_in; j++)
      if (op.in[j] >= 0 && din[j] >= 0)
        MR_TRY_GOTO(rc, accumulate(g, acc, op.in[j], din[j]), out);
    for (int k = first_new; k < g->n_ops; k++) { /* pipeline stages follow it */
      g->ops[k].backward = 1;
      g->ops[k].fwd_op = i;
    }
  }
  for (int i = 0; i < g->n_tensors && i < cap; i++) {
    struct mr_tensor *t = &g->tensors[i];
    if (t->role != MR_ROLE_PARAM || acc[i] < 0)
      continue;
    struct mr_tensor *d = &g->tensors[acc[i]];
    d->role = MR_ROLE_GRAD;
    d->grad_of = i;
    char nm2[MR_TENSOR_NAME_MAX];
    snprintf(nm2, sizeof nm2, "grad/%.80s", t->name);
    memcpy(d->name, nm2, sizeof nm2);
    t->grad = acc[i];
  }
out:
  free(acc);
  return rc;
}
