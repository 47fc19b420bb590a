/* lower_events.c - the communication each instruction of a rank program
 * issues, in order: what the static check simulates and the dump shows. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "compiler/fit.h"
#include "compiler/ops.h"
#include "compiler/spmd/lower_internal.h"

/* ---- events ---- */

int mr__lower_add_event(struct build *b, struct mr_ins *in, enum mr_comm_event_kind kind,
                     const struct mr_group_desc *gd, int peer, int64_t count,
                     enum mr_dtype dt, int root, int batch, const char *what) {
  struct mr_rank_program *p = b->p;
  if (b->rc < 0)
    return -1;
  if (p->n_ev == b->cap_ev) {
    int c = b->cap_ev ? 2 * b->cap_ev : 256;
    struct mr_comm_event *e = realloc(p->ev, (size_t)c * sizeof *e);
    if (e)
      p->ev = e;
    char **w = e ? realloc(p->ev_what, (size_t)c * sizeof *w) : NULL;
    if (!w) {
      b->rc = MR_ENOMEM;
      return -1;
    }
    p->ev_what = w;
    b->cap_ev = c;
  }
  int i = p->n_ev;
  p->ev_what[i] = strdup(what);
  if (!p->ev_what[i]) {
    b->rc = MR_ENOMEM;
    return -1;
  }
  p->n_ev++;
  p->ev[i] = (struct mr_comm_event){.kind = kind, .group = gd->name, .ranks = gd->ranks,
                                    .n_ranks = gd->n, .peer = peer, .count = count,
                                    .dtype = dt, .root = root, .batch = batch,
                                    .id = -1, .what = p->ev_what[i]};
  if (in) {
    if (in->ev < 0)
      in->ev = i;
    in->n_ev++;
  }
  return i;
}

static enum mr_comm_event_kind step_event(enum mr_reshard_kind k) {
  switch (k) {
  case MR_RS_ALL_GATHER:
    return MR_CEV_ALL_GATHER;
  case MR_RS_REDUCE_SCATTER:
    return MR_CEV_REDUCE_SCATTER;
  case MR_RS_ALL_TO_ALL:
    return MR_CEV_ALL_TO_ALL;
  default:
    return MR_CEV_ALL_REDUCE;
  }
}

static int is_collective(enum mr_reshard_kind k) {
  return k == MR_RS_ALL_GATHER || k == MR_RS_REDUCE_SCATTER || k == MR_RS_ALL_TO_ALL ||
         k == MR_RS_ALL_REDUCE;
}

/* Events of edge e's steps: every step (only == -1), the steps on mesh dim
 * `only` (only >= 0), or the steps off mesh dim d (only == -2 - d). */
static void edge_events(struct build *b, struct mr_ins *in, int e, int only,
                        int64_t *staging) {
  const struct mr_lowered *L = b->L;
  const struct mr_reshard_edge *ed = &L->dg.edges[e];
  const struct mr_graph *g = b->g;
  struct mr_dist_attr before = ed->src;
  for (int s = 0; s < ed->plan.n_steps; s++) {
    const struct mr_reshard_step *st = &ed->plan.steps[s];
    int take = only == -1 || (only >= 0 && st->mesh_dim == only) ||
               (only <= -2 && st->mesh_dim != -2 - only);
    if (take && is_collective(st->kind) && st->group_size > 1) {
      int64_t count = mr__lower_step_count(L, b->p->coord, ed->tensor, &before, st, staging);
      char what[160];
      snprintf(what, sizeof what, "%s of %.80s", mr_reshard_kind_name(st->kind),
               g->tensors[ed->tensor].name);
      mr__lower_add_event(b, in, step_event(st->kind), mr__lower_dim_group(b->p, st->mesh_dim), -1, count,
                g->tensors[ed->tensor].dtype, 0, -1, what);
    }
    before = st->after;
  }
}

void mr__lower_loss_events(struct build *b, struct mr_ins *in) {
  const struct mr_lowered *L = b->L;
  int le = mr_lowered_loss_deferred(L) && b->p->pipe == L->lay.pp - 1 ? mr_lowered_loss_edge(L)
                                                                       : -1;
  if (le >= 0)
    edge_events(b, in, le, -1, NULL);
}

/* The grad-sync edge of parameter t, or -1. */
int mr__lower_sync_edge(const struct mr_lowered *L, int t) {
  int gt = L->model.graph.tensors[t].grad;
  for (int e = 0; e < L->dg.n_edges; e++)
    if (L->dg.edges[e].kind == MR_EDGE_GRAD_SYNC && L->dg.edges[e].tensor == gt)
      return e;
  return -1;
}

static void small_allreduces(struct build *b, struct mr_ins *in, const char *what) {
  const struct mr_rank_program *p = b->p;
  const struct mr_group_desc *gs[3] = {&p->model_group, &p->data_group, &p->pipe_group};
  for (int i = 0; i < 3; i++)
    if (gs[i]->n > 1)
      mr__lower_add_event(b, in, MR_CEV_ALL_REDUCE, gs[i], -1, 1, MR_F32, 0, -1, what);
}

/* Fills the events of instruction in (expanded, with micro). */
void mr__lower_events_of(struct build *b, struct mr_ins *in, int64_t *staging) {
  struct mr_rank_program *p = b->p;
  const struct mr_lowered *L = b->L;
  const struct mr_graph *g = b->g;
  const struct mr_layout *lay = &L->lay;
  char what[160];
  switch (in->kind) {
  case MR_INS_RECV:
  case MR_INS_SEND: {
    const struct mr_tensor *lt = &p->local.tensors[in->tensor];
    snprintf(what, sizeof what, "%.80s of micro-batch %d", lt->name, in->micro);
    mr__lower_add_event(b, in, in->kind == MR_INS_SEND ? MR_CEV_SEND : MR_CEV_RECV, &p->pipe_group,
              in->peer, p->buf[in->tensor].numel, lt->dtype, 0,
              in->kind == MR_INS_SEND ? MR_CEV_DETACHED : -1, what);
    break;
  }
  case MR_INS_GATHER: {
    const struct mr_param_plan *pp = &p->params[p->param_of[in->tensor]];
    snprintf(what, sizeof what, "ZeRO-3 gather of %.80s", g->tensors[in->tensor].name);
    mr__lower_add_event(b, in, MR_CEV_ALL_GATHER, &p->data_group, -1, pp->block * lay->dp, MR_F32, 0,
              -1, what);
    break;
  }
  case MR_INS_RESHARD:
    edge_events(b, in, in->edge, -1, staging);
    break;
  case MR_INS_GRAD: {
    struct mr_param_plan *pp = &p->params[p->param_of[in->tensor]];
    int e = in->edge;
    snprintf(what, sizeof what, "gradient of %.80s", g->tensors[in->tensor].name);
    /* off the data dim (a slice to the parameter's shard, a sum over
     * sequence-parallel ranks): every micro-batch, before accumulating;
     * a phantom slot reduce-scatters zeros as they are */
    if (e >= 0 && in->micro < p->n_micro)
      edge_events(b, in, e, -2 - L->data_dim, staging);
    if (lay->zero >= 2) {
      mr__lower_add_event(b, in, MR_CEV_REDUCE_SCATTER, &p->data_group, -1, pp->block, MR_F32, 0, -1,
                what);
    } else if (in->micro == p->n_micro - 1 && e >= 0 && L->data_dim >= 0) {
      int first = p->n_ev;
      edge_events(b, in, e, L->data_dim, NULL); /* in place on the accumulator */
      if (p->n_ev > first)
        pp->sync_ev = first;
    }
    break;
  }
  case MR_INS_OPTIMIZER:
    small_allreduces(b, in, "gradient norm");
    if (lay->zero == 1 || lay->zero == 2)
      for (int i = 0; i < p->n_params; i++) {
        if (p->params[i].replica_of >= 0)
          continue;
        snprintf(what, sizeof what, "updated %.80s", g->tensors[p->params[i].tensor].name);
        mr__lower_add_event(b, in, MR_CEV_ALL_GATHER, &p->data_group, -1, p->params[i].block * lay->dp,
                  MR_F32, 0, -1, what);
      }
    break;
  case MR_INS_PARAM_SYNC:
    for (int i = 0; i < p->n_params; i++) {
      const struct mr_param_plan *pp = &p->params[i];
      snprintf(what, sizeof what, "updated %.80s", g->tensors[pp->tensor].name);
      int64_t n = mr_param_sync_count(lay, pp);
      if (pp->replica_of >= 0)
        mr__lower_add_event(b, in, MR_CEV_RECV, &p->pipe_group, pp->replica_of, n, MR_F32, 0, -1,
                  what);
      for (int k = 0; k < pp->n_replicas; k++)
        mr__lower_add_event(b, in, MR_CEV_SEND, &p->pipe_group, pp->replicas[k], n, MR_F32, 0,
                  MR_CEV_DETACHED, what);
    }
    break;
  case MR_INS_STEP_END:
    mr__lower_loss_events(b, in);
    if (lay->pp > 1)
      mr__lower_add_event(b, in, MR_CEV_BROADCAST, &p->pipe_group, -1, 1, MR_F32, lay->pp - 1, -1,
                "the loss");
    break;
  default:
    break;
  }
}

