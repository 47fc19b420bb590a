/* spmd_sim_graph.c - a completed graph run rank by rank. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compiler/ops.h"
#include "compiler/spmd/completion.h"
#include "compiler/spmd/rules.h"
#include "tests/spmd_sim.h"
#include "worker/exec.h"

static void copy_tensor(struct sim_tensor *dst, const struct sim_tensor *src) {
  *dst = *src;
  for (int r = 0; r < src->nranks; r++) {
    int64_t n = sim_numel(src->r[r].ndim, src->r[r].shape);
    dst->r[r].d = malloc(sizeof(float) * (size_t)(n ? n : 1));
    memcpy(dst->r[r].d, src->r[r].d, sizeof(float) * (size_t)n);
  }
}

static int run_op(const struct mr_dist_graph *dg, int k,
                  struct sim_tensor *vals, struct mr_cpu_ctx *ctx) {
  const struct mr_graph *g = dg->g;
  const struct mr_mesh *m = &dg->mesh;
  const struct mr_op *op = &g->ops[k];
  struct sim_tensor view[MR_OP_MAX_IN];
  int owned[MR_OP_MAX_IN] = {0};
  for (int i = 0; i < op->n_in; i++) {
    if (op->in[i] < 0)
      continue;
    int e = dg->edge_of[k * MR_OP_MAX_IN + i];
    if (e < 0) {
      view[i] = vals[op->in[i]];
      continue;
    }
    copy_tensor(&view[i], &vals[op->in[i]]);
    owned[i] = 1;
    if (sim_plan(&view[i], &dg->edges[e].plan, m) < 0)
      return -1;
  }
  const struct mr_spmd_rule *rule = mr_spmd_rule_of(op->kind);
  int n = mr_mesh_size(m);
  for (int j = 0; j < op->n_out; j++) {
    struct sim_tensor *o = &vals[op->out[j]];
    memset(o, 0, sizeof *o);
    o->mesh = m;
    o->nranks = n;
    o->da = dg->tensor[op->out[j]];
  }
  mr_kernel_fn fn = mr_op_kernel(op->kind, MR_BACKEND_CPU);
  int rc = 0;
  for (int r = 0; r < n && rc == 0; r++) {
    struct mr_tensor lt[MR_OP_MAX_IN + MR_OP_MAX_OUT];
    struct mr_op lop = *op;
    void *bufs[MR_OP_MAX_IN + MR_OP_MAX_OUT];
    int32_t *ints[MR_OP_MAX_IN] = {0};
    int nt = 0, coord[MR_MESH_MAX_DIMS];
    mr_mesh_coord(m, r, coord);
    if (rule->localize)
      rule->localize(g, op, m, &dg->need[k * MR_OP_MAX_IN], coord, lop.attr);
    for (int i = 0; i < op->n_in; i++) {
      bufs[i] = NULL;
      if (op->in[i] < 0) {
        lop.in[i] = -1;
        continue;
      }
      const struct sim_buf *b = &view[i].r[r];
      lt[nt] = g->tensors[op->in[i]];
      memcpy(lt[nt].shape, b->shape, sizeof(int64_t) * (size_t)b->ndim);
      lop.in[i] = nt++;
      bufs[i] = b->d;
      if (lt[lop.in[i]].dtype == MR_I32) {
        int64_t ne = sim_numel(b->ndim, b->shape);
        ints[i] = malloc(sizeof(int32_t) * (size_t)(ne ? ne : 1));
        for (int64_t e = 0; e < ne; e++)
          ints[i][e] = (int32_t)b->d[e];
        bufs[i] = ints[i];
      }
    }
    for (int j = 0; j < op->n_out; j++) {
      int t = op->out[j];
      int64_t off[MR_TENSOR_MAX_DIMS], len[MR_TENSOR_MAX_DIMS];
      mr_dist_local(m, &dg->tensor[t], g->tensors[t].ndim, g->tensors[t].shape,
                    coord, off, len);
      lt[nt] = g->tensors[t];
      memcpy(lt[nt].shape, len, sizeof(int64_t) * (size_t)lt[nt].ndim);
      lop.out[j] = nt++;
      struct sim_buf *ob = &vals[t].r[r];
      ob->ndim = lt[lop.out[j]].ndim;
      memcpy(ob->shape, len, sizeof ob->shape);
      int64_t ne = sim_numel(ob->ndim, len);
      ob->d = calloc((size_t)(ne ? ne : 1), sizeof(float));
      bufs[op->n_in + j] = ob->d;
    }
    /* an empty output shard (more ranks than rows) computes nothing */
    int empty = 0;
    for (int j = 0; j < op->n_out; j++)
      empty |= mr_tensor_numel(&lt[lop.out[j]]) == 0;
    if (empty) {
      for (int i = 0; i < op->n_in; i++)
        free(ints[i]);
      continue;
    }
    struct mr_graph lg;
    memset(&lg, 0, sizeof lg);
    lg.tensors = lt;
    lg.n_tensors = nt;
    lg.ops = &lop;
    lg.n_ops = 1;
    lg.loss = -1;
    rc = fn(ctx, &lg, &lop, bufs);
    for (int i = 0; i < op->n_in; i++)
      free(ints[i]);
  }
  for (int i = 0; i < op->n_in; i++)
    if (owned[i])
      sim_tensor_free(&view[i]);
  return rc;
}

/* Random Partial operands that reduce to x: the operand of Partial
 * coordinate p (replicas on other mesh dims agree) is random for p > 0
 * and makes up the rest at p = 0. */
static void partial_scatter(struct sim_tensor *st, const struct mr_mesh *m,
                            const struct mr_dist_attr *da,
                            const struct mr_tensor *t, const float *x,
                            uint32_t seed) {
  int n = mr_mesh_size(m), np = 1, avg = 1, mx = 0;
  for (int i = 0; i < da->ndim; i++)
    if (da->p[i].kind == MR_PARTIAL) {
      np *= m->shape[i];
      avg *= da->p[i].reduce == MR_REDUCE_AVG ? m->shape[i] : 1;
      mx |= da->p[i].reduce == MR_REDUCE_MAX;
    }
  int64_t ne = mr_tensor_numel(t);
  float *ops = malloc(sizeof(float) * (size_t)(ne * np));
  for (int64_t e = 0; e < ne; e++) {
    double rest = (double)x[e] * avg;
    for (int p = 1; p < np; p++) {
      seed = seed * 1664525u + 1013904223u;
      float u = (float)((seed >> 8) % 2001) / 1000.0f - 1.0f;
      ops[p * ne + e] = mx ? x[e] - fabsf(u) : u;
      rest -= ops[p * ne + e];
    }
    ops[e] = mx ? x[e] : (float)rest;
  }
  const float *opp[SIM_MAX_RANKS];
  for (int r = 0; r < n; r++) {
    int c[MR_MESH_MAX_DIMS], p = 0;
    mr_mesh_coord(m, r, c);
    for (int i = 0; i < da->ndim; i++)
      if (da->p[i].kind == MR_PARTIAL)
        p = p * m->shape[i] + c[i];
    opp[r] = ops + p * ne;
  }
  sim_scatter(st, m, da, t->ndim, t->shape, NULL, opp);
  free(ops);
}

int sim_run_graph(const struct mr_dist_graph *dg, float *const *global_in,
                  float **global_out) {
  const struct mr_graph *g = dg->g;
  mr_cpu_kernels_register();
  struct sim_tensor *vals = calloc((size_t)g->n_tensors, sizeof *vals);
  struct mr_cpu_ctx ctx;
  memset(&ctx, 0, sizeof ctx);
  int rc = mr_cpu_ctx_init(&ctx, 1, MR_AMP_NONE);
  for (int t = 0; t < g->n_tensors && rc == 0; t++) {
    if (g->tensors[t].producer >= 0)
      continue;
    int64_t n = mr_tensor_numel(&g->tensors[t]);
    float *zero = NULL;
    const float *src = global_in[t];
    if (!src)
      src = zero = calloc((size_t)n, sizeof(float));
    int partial = 0;
    for (int i = 0; i < dg->tensor[t].ndim; i++)
      partial |= dg->tensor[t].p[i].kind == MR_PARTIAL;
    if (partial)
      partial_scatter(&vals[t], &dg->mesh, &dg->tensor[t], &g->tensors[t], src,
                      0x9e3779b9u * (uint32_t)(t + 1));
    else
      sim_scatter(&vals[t], &dg->mesh, &dg->tensor[t], g->tensors[t].ndim,
                  g->tensors[t].shape, src, NULL);
    free(zero);
  }
  for (int k = 0; k < g->n_ops && rc == 0; k++)
    rc = run_op(dg, k, vals, &ctx);
  for (int e = 0; e < dg->n_edges && rc == 0; e++)
    if (dg->edges[e].kind != MR_EDGE_OPERAND &&
        sim_plan(&vals[dg->edges[e].tensor], &dg->edges[e].plan, &dg->mesh) < 0)
      rc = -1;
  for (int t = 0; t < g->n_tensors; t++) {
    global_out[t] = NULL;
    if (rc == 0 && vals[t].nranks) {
      global_out[t] = malloc(sizeof(float) * (size_t)mr_tensor_numel(&g->tensors[t]));
      if (sim_gather(&vals[t], g->tensors[t].ndim, g->tensors[t].shape,
                     global_out[t]) < 0)
        rc = -1;
    }
    sim_tensor_free(&vals[t]);
  }
  mr_cpu_ctx_close(&ctx);
  free(vals);
  return rc;
}

int sim_run_reference(const struct mr_graph *g, float *const *global_in,
                      float **global_out) {
  struct mr_exec x;
  int rc = mr_exec_init(&x, g, 1, MR_AMP_NONE);
  if (rc < 0)
    return rc;
  for (int t = 0; t < g->n_tensors; t++) {
    if (g->tensors[t].producer >= 0 || !global_in[t])
      continue;
    int64_t n = mr_tensor_numel(&g->tensors[t]);
    if (g->tensors[t].dtype == MR_I32)
      for (int64_t e = 0; e < n; e++)
        ((int32_t *)x.buf[t])[e] = (int32_t)global_in[t][e];
    else
      memcpy(x.buf[t], global_in[t], sizeof(float) * (size_t)n);
  }
  /* keep every tensor: run op by op and copy outputs out right away, as
   * arena buffers are reused */
  for (int t = 0; t < g->n_tensors; t++)
    global_out[t] = NULL;
  for (int k = 0; k < g->n_ops && rc == 0; k++) {
    rc = mr_exec_run(&x, k, k + 1);
    for (int j = 0; j < g->ops[k].n_out && rc == 0; j++) {
      int t = g->ops[k].out[j];
      int64_t n = mr_tensor_numel(&g->tensors[t]);
      free(global_out[t]);
      global_out[t] = malloc(sizeof(float) * (size_t)n);
      memcpy(global_out[t], x.buf[t], sizeof(float) * (size_t)n);
    }
  }
  mr_exec_close(&x);
  return rc;
}
