/* completion.c - seeding, fixed-point propagation, reshard edges. */
#include "compiler/spmd/completion.h"

#include <regex.h>
#include <stdlib.h>
#include <string.h>

#include "compiler/autodiff.h"
#include "common/dtype.h"
#include "common/error.h"
#include "compiler/ops.h"
#include "compiler/spmd/rules.h"

void mr_dist_graph_close(struct mr_dist_graph *dg) {
  free(dg->tensor);
  free(dg->need);
  free(dg->edge_of);
  free(dg->last_edge);
  free(dg->edges);
  memset(dg, 0, sizeof *dg);
}

static int seed_params(const struct mr_graph *g, const struct mr_mesh *m,
                       const struct mr_completion_opts *o,
                       struct mr_dist_attr *d) {
  for (int r = 0; r < o->n_rules; r++) {
    const struct mr_shard_rule *sr = &o->rules[r];
    regex_t re;
    if (regcomp(&re, sr->match, REG_EXTENDED | REG_NOSUB))
      return mr_error_set(MR_EINVAL, "shard_rules[%d].match \"%s\": expected "
                          "an extended regular expression", r, sr->match);
    struct mr_dist_attr want = mr_dist_replicated(m->ndim);
    for (int k = 0; k < sr->n_placements; k++) {
      int md = mr_mesh_dim(m, sr->placements[k].mesh_dim);
      if (md < 0)
        continue; /* a mesh without that dim: the rule does not apply there */
      if (mr_placement_parse(sr->placements[k].placement, &want.p[md]) < 0) {
        regfree(&re);
        return mr_error_set(MR_EINVAL, "shard_rules[%d].placements[%d]: %s", r,
                            k, mr_error_message());
      }
    }
    for (int t = 0; t < g->n_tensors; t++) {
      const struct mr_tensor *tt = &g->tensors[t];
      if (tt->role != MR_ROLE_PARAM || d[t].known)
        continue; /* the first matching rule wins */
      if (regexec(&re, tt->name, 0, NULL, 0))
        continue;
      if (mr_dist_check(&want, tt->ndim) < 0) {
        regfree(&re);
        return mr_error_set(MR_EINVAL, "shard_rules[%d] on %s: %s", r, tt->name,
                            mr_error_message());
      }
      for (int md = 0; md < m->ndim; md++)
        if (want.p[md].kind == MR_PARTIAL) {
          regfree(&re);
          return mr_error_set(MR_EINVAL, "shard_rules[%d] on %s: a parameter "
                              "cannot be Partial", r, tt->name);
        }
      d[t] = want;
    }
    regfree(&re);
  }
  return 0;
}

static int seed(const struct mr_graph *g, const struct mr_mesh *m,
                const struct mr_completion_opts *o, struct mr_dist_attr *d) {
  for (int t = 0; t < g->n_tensors; t++)
    if (o->seed && o->seed[t].known)
      d[t] = o->seed[t];
  MR_TRY(seed_params(g, m, o, d));
  for (int t = 0; t < g->n_tensors; t++) {
    const struct mr_tensor *tt = &g->tensors[t];
    if (d[t].known)
      continue;
    if (tt->role == MR_ROLE_PARAM) {
      d[t] = mr_dist_replicated(m->ndim);
    } else if (tt->role == MR_ROLE_INPUT && tt->producer < 0) {
      d[t] = mr_dist_replicated(m->ndim);
      if (tt->dtype == MR_I32 && tt->ndim == 1) { /* tokens, targets */
        if (o->data_dim >= 0)
          d[t].p[o->data_dim] = mr_shard(0);
        if (o->seq_dim >= 0)
          d[t].p[o->seq_dim] = mr_shard(0);
      }
    }
  }
  return 0;
}

static const struct mr_spmd_rule *rule_of(const struct mr_op *op) {
  return mr_spmd_rule_of(op->kind);
}

static unsigned hinted(const struct mr_graph *g, const struct mr_op *op) {
  unsigned h = 0;
  for (int i = 0; i < op->n_in; i++)
    if (op->in[i] >= 0 && g->tensors[op->in[i]].role == MR_ROLE_PARAM)
      h |= 1u << i;
  return h;
}

static void gather_in(const struct mr_op *op, const struct mr_dist_attr *d, int ndim,
                      struct mr_dist_attr *in) {
  for (int i = 0; i < op->n_in; i++)
    in[i] = op->in[i] >= 0 ? d[op->in[i]] : mr_dist_replicated(ndim);
}

/* One forward and one reverse sweep; returns how many tensors got a
 * placement, or an error. */
static int sweep(const struct mr_graph *g, const struct mr_mesh *m,
                 struct mr_dist_attr *d) {
  int changed = 0;
  struct mr_dist_attr in[MR_OP_MAX_IN], need[MR_OP_MAX_IN], out[MR_OP_MAX_OUT];
  for (int k = 0; k < g->n_ops; k++) {
    const struct mr_op *op = &g->ops[k];
    int all_in = 1, any_out_unknown = 0;
    for (int i = 0; i < op->n_in; i++)
      all_in &= op->in[i] < 0 || d[op->in[i]].known;
    for (int j = 0; j < op->n_out; j++)
      any_out_unknown |= !d[op->out[j]].known;
    if (!all_in || !any_out_unknown)
      continue;
    const struct mr_spmd_rule *r = rule_of(op);
    gather_in(op, d, m->ndim, in);
    MR_TRY(mr_spmd_infer(r, g, op, m, in, hinted(g, op), NULL, need, out));
    for (int j = 0; j < op->n_out; j++)
      if (!d[op->out[j]].known) {
        d[op->out[j]] = out[j];
        changed++;
      }
  }
  for (int k = g->n_ops - 1; k >= 0; k--) {
    const struct mr_op *op = &g->ops[k];
    int any_in_unknown = 0, any_out = 0;
    for (int i = 0; i < op->n_in; i++)
      any_in_unknown |= op->in[i] >= 0 && !d[op->in[i]].known;
    for (int j = 0; j < op->n_out; j++) {
      any_out |= d[op->out[j]].known;
      out[j] = d[op->out[j]];
    }
    if (!any_in_unknown || !any_out)
      continue;
    MR_TRY(mr_spmd_infer_reverse(rule_of(op), g, op, m, out, need, out));
    for (int i = 0; i < op->n_in; i++)
      if (op->in[i] >= 0 && !d[op->in[i]].known) {
        d[op->in[i]] = need[i];
        changed++;
      }
  }
  return changed;
}

static int add_edge(struct mr_dist_graph *dg, const struct mr_completion_opts *o,
                    enum mr_edge_kind kind, int t, int op, int slot,
                    const struct mr_dist_attr *src,
                    const struct mr_dist_attr *dst) {
  const struct mr_graph *g = dg->g;
  for (int e = dg->last_edge[t]; e >= 0; e = dg->edges[e].next_of_tensor)
    if (dg->edges[e].kind == kind && mr_dist_eq(&dg->edges[e].dst, dst) &&
        mr_dist_eq(&dg->edges[e].src, src))
      return e;
  if (dg->n_edges == dg->cap_edges) {
    int cap = dg->cap_edges ? 2 * dg->cap_edges : 64;
    void *p = realloc(dg->edges, (size_t)cap * sizeof *dg->edges);
    if (!p)
      return mr_error_set(MR_ENOMEM, "completion: out of memory");
    dg->edges = p;
    dg->cap_edges = cap;
  }
  struct mr_reshard_edge *e = &dg->edges[dg->n_edges];
  memset(e, 0, sizeof *e);
  e->kind = kind;
  e->tensor = t;
  e->op = op;
  e->slot = slot;
  e->backward = op < 0 ? kind == MR_EDGE_GRAD_SYNC : g->ops[op].backward;
  e->src = *src;
  e->dst = *dst;
  const struct mr_tensor *tt = &g->tensors[t];
  MR_TRY(mr_reshard_plan(&dg->mesh, tt->ndim, tt->shape,
                         (int)mr_dtype_size(tt->dtype), src, dst, o->cost,
                         o->cost_ctx, &e->plan));
  e->next_of_tensor = dg->last_edge[t];
  dg->last_edge[t] = dg->n_edges;
  return dg->n_edges++;
}

struct cost_ctx {
  const struct mr_dist_graph *dg;
  const struct mr_completion_opts *o;
};

/* A reshard an earlier consumer pays for already is free. */
static double edge_cost(void *ctx, const struct mr_op *op, int slot,
                        const struct mr_dist_attr *src,
                        const struct mr_dist_attr *dst) {
  const struct cost_ctx *c = ctx;
  const struct mr_dist_graph *dg = c->dg;
  int t = op->in[slot];
  for (int e = dg->last_edge[t]; e >= 0; e = dg->edges[e].next_of_tensor)
    if (mr_dist_eq(&dg->edges[e].src, src) && mr_dist_eq(&dg->edges[e].dst, dst))
      return 0;
  const struct mr_tensor *tt = &dg->g->tensors[t];
  struct mr_reshard_plan p;
  if (mr_reshard_plan(&dg->mesh, tt->ndim, tt->shape,
                      (int)mr_dtype_size(tt->dtype), src, dst, c->o->cost,
                      c->o->cost_ctx, &p) < 0)
    return 1e30;
  return p.cost;
}

int mr_spmd_complete(const struct mr_graph *g, const struct mr_mesh *m,
                     const struct mr_completion_opts *o,
                     struct mr_dist_graph *dg) {
  memset(dg, 0, sizeof *dg);
  dg->g = g;
  dg->mesh = *m;
  size_t slots = (size_t)(g->n_ops ? g->n_ops : 1) * MR_OP_MAX_IN;
  dg->tensor = calloc((size_t)(g->n_tensors ? g->n_tensors : 1), sizeof *dg->tensor);
  dg->need = calloc(slots, sizeof *dg->need);
  dg->edge_of = malloc(slots * sizeof *dg->edge_of);
  dg->last_edge = malloc((size_t)(g->n_tensors ? g->n_tensors : 1) *
                         sizeof *dg->last_edge);
  int rc = 0;
  if (!dg->tensor || !dg->need || !dg->edge_of || !dg->last_edge) {
    rc = mr_error_set(MR_ENOMEM, "completion: out of memory");
    goto err;
  }
  for (size_t i = 0; i < slots; i++)
    dg->edge_of[i] = -1;
  for (int t = 0; t < g->n_tensors; t++)
    dg->last_edge[t] = -1;
  for (int k = 0; k < g->n_ops; k++)
    if (!rule_of(&g->ops[k])) {
      const struct mr_op_def *def = mr_op_def(g->ops[k].kind);
      rc = mr_error_set(MR_EINVAL, "completion: op %s has no SPMD rule",
                        def ? def->name : "?");
      goto err;
    }
  struct mr_dist_attr *d = dg->tensor;
  MR_TRY_GOTO(rc, seed(g, m, o, d), err);
  for (;;) {
    dg->iterations++;
    MR_TRY_GOTO(rc, sweep(g, m, d), err);
    if (rc == 0) {
      /* stuck: replicate the first unknown graph input and go on */
      int t = 0;
      while (t < g->n_tensors && (d[t].known || g->tensors[t].producer >= 0))
        t++;
      if (t == g->n_tensors)
        break;
      d[t] = mr_dist_replicated(m->ndim);
    }
  }
  for (int t = 0; t < g->n_tensors; t++)
    if (!d[t].known)
      d[t] = mr_dist_replicated(m->ndim);
  /* final pass: what every op reads and produces */
  struct mr_dist_attr in[MR_OP_MAX_IN], need[MR_OP_MAX_IN], out[MR_OP_MAX_OUT];
  for (int k = 0; k < g->n_ops; k++) {
    const struct mr_op *op = &g->ops[k];
    gather_in(op, d, m->ndim, in);
    struct cost_ctx cc = {dg, o};
    struct mr_spmd_cost cost = {edge_cost, &cc};
    MR_TRY_GOTO(rc, mr_spmd_infer(rule_of(op), g, op, m, in, hinted(g, op),
                                  &cost, need, out), err);
    for (int j = 0; j < op->n_out; j++)
      d[op->out[j]] = out[j];
    for (int i = 0; i < op->n_in; i++) {
      dg->need[k * MR_OP_MAX_IN + i] = need[i];
      if (op->in[i] < 0 || mr_dist_eq(&in[i], &need[i]))
        continue;
      MR_TRY_GOTO(rc, add_edge(dg, o, MR_EDGE_OPERAND, op->in[i], k, i, &in[i],
                               &need[i]), err);
      dg->edge_of[k * MR_OP_MAX_IN + i] = rc;
    }
  }
  for (int t = 0; t < g->n_tensors; t++) {
    int p = g->tensors[t].grad_of;
    if (g->tensors[t].role != MR_ROLE_GRAD || p < 0 ||
        g->tensors[p].role != MR_ROLE_PARAM || mr_dist_eq(&d[t], &d[p]))
      continue;
    MR_TRY_GOTO(rc, add_edge(dg, o, MR_EDGE_GRAD_SYNC, t, -1, -1, &d[t], &d[p]),
                err);
  }
  if (g->loss >= 0) {
    struct mr_dist_attr r = mr_dist_replicated(m->ndim);
    if (!mr_dist_eq(&d[g->loss], &r))
      MR_TRY_GOTO(rc, add_edge(dg, o, MR_EDGE_LOSS, g->loss, -1, -1,
                               &d[g->loss], &r), err);
  }
  return 0;
err:
  mr_dist_graph_close(dg);
  return rc;
}

int mr_dist_graph_count(const struct mr_dist_graph *dg, int ek,
                        enum mr_reshard_kind kind, int md, int backward) {
  int n = 0;
  for (int e = 0; e < dg->n_edges; e++) {
    const struct mr_reshard_edge *x = &dg->edges[e];
    if ((ek >= 0 && (int)x->kind != ek) ||
        (backward >= 0 && x->backward != backward))
      continue;
    for (int s = 0; s < x->plan.n_steps; s++)
      if (x->plan.steps[s].kind == kind &&
          (md < 0 || x->plan.steps[s].mesh_dim == md))
        n++;
  }
  return n;
}

int64_t mr_dist_graph_bytes(const struct mr_dist_graph *dg) {
  int64_t b = 0;
  for (int e = 0; e < dg->n_edges; e++)
    b += dg->edges[e].plan.bytes;
  return b;
}

int mr_dist_graph_splits(const struct mr_dist_graph *dg, int t, int dim) {
  const struct mr_dist_attr *d = &dg->tensor[t];
  for (int md = 0; md < d->ndim; md++)
    if (d->p[md].kind == MR_SHARD && d->p[md].dim == dim &&
        dg->mesh.shape[md] > 1)
      return 1;
  return 0;
}

/* Builds, differentiates and completes one form; on failure closes both. */
static int complete_form(const struct mr_model_config *cfg, int64_t batch,
                         int64_t seq, enum mr_loss_form form,
                         const struct mr_mesh *m,
                         const struct mr_completion_opts *o,
                         struct mr_model *mo, struct mr_dist_graph *dg) {
  memset(dg, 0, sizeof *dg);
  int seed, rc = mr_model_build_loss(cfg, batch, seq, form, mo);
  if (rc == 0)
    rc = mr_autodiff(&mo->graph, mo->loss, &seed);
  if (rc == 0)
    rc = mr_spmd_complete(&mo->graph, m, o, dg);
  if (rc < 0)
    mr_model_close(mo);
  return rc;
}

int mr_spmd_complete_model(const struct mr_model_config *cfg, int64_t batch,
                           int64_t seq, const struct mr_mesh *m,
                           const struct mr_completion_opts *o,
                           struct mr_model *mo, struct mr_dist_graph *dg) {
  memset(mo, 0, sizeof *mo);
  memset(dg, 0, sizeof *dg);
  if (o->seed)
    return mr_error_set(MR_EINVAL, "completion of a model: explicit seeds "
                        "are not supported (the loss forms number tensors "
                        "differently)");
  MR_TRY(complete_form(cfg, batch, seq, MR_LOSS_FUSED, m, o, mo, dg));
  if (!mr_dist_graph_splits(dg, mo->logits, 1))
    return 0;
  struct mr_model vp;
  struct mr_dist_graph vdg;
  int rc = complete_form(cfg, batch, seq, MR_LOSS_VOCAB_PARALLEL, m, o, &vp,
                         &vdg);
  if (rc < 0) {
    mr_dist_graph_close(dg);
    mr_model_close(mo);
    return rc;
  }
  if (mr_dist_graph_bytes(&vdg) >= mr_dist_graph_bytes(dg)) {
    mr_dist_graph_close(&vdg);
    mr_model_close(&vp);
    return 0;
  }
  mr_dist_graph_close(dg);
  mr_model_close(mo);
  *mo = vp;
  *dg = vdg;
  dg->g = &mo->graph; /* the graph struct moved; its arrays did not */
  return 0;
}
