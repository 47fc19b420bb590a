/* lower_program.c - one rank's program: passes, schedule, buffers and the
 * communication each instruction issues. */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "compiler/fit.h"
#include "compiler/ops.h"
#include "compiler/spmd/lower_internal.h"
#include "compiler/planner/schedule.h"
#include "compiler/spmd/rules.h"

#define ALIGN 64
#define ALIGNED(b) (((b) + ALIGN - 1) / ALIGN * ALIGN)

static int64_t esize(const struct mr_graph *lg, int t) {
  return (int64_t)mr_dtype_size(lg->tensors[t].dtype);
}

/* ---- small growable arrays ---- */

static struct mr_ins *push_ins(struct build *b, struct mr_ins **arr, int *n, int *cap,
                               struct mr_ins in) {
  if (b->rc < 0)
    return NULL;
  if (*n == *cap) {
    int c = *cap ? 2 * *cap : 256;
    struct mr_ins *a = realloc(*arr, (size_t)c * sizeof *a);
    if (!a) {
      b->rc = MR_ENOMEM;
      return NULL;
    }
    *arr = a;
    *cap = c;
  }
  (*arr)[*n] = in;
  return &(*arr)[(*n)++];
}

/* An instruction of pass `pass` (-1: of the step), every operand unset. */
static struct mr_ins ins(enum mr_ins_kind k, int pass) {
  return (struct mr_ins){.kind = k, .pass = pass, .op = -1, .edge = -1, .tensor = -1,
                         .peer = -1, .ev = -1};
}

/* ---- coordinates, groups, local graph ---- */

static int group_desc(struct mr_group_desc *gd, const char *kind, const int *ranks, int n) {
  if ((gd->ranks = malloc((size_t)n * sizeof *gd->ranks)) == NULL)
    return MR_ENOMEM;
  gd->n = n;
  int k = snprintf(gd->name, sizeof gd->name, "%s{", kind);
  for (int i = 0; i < n; i++) {
    gd->ranks[i] = ranks[i];
    if (k < (int)sizeof gd->name - 8)
      k += snprintf(gd->name + k, sizeof gd->name - (size_t)k, i ? ",%d" : "%d", ranks[i]);
    else if (k < (int)sizeof gd->name - 2)
      k += snprintf(gd->name + k, sizeof gd->name - (size_t)k, ".");
  }
  if (k < (int)sizeof gd->name - 1)
    snprintf(gd->name + k, sizeof gd->name - (size_t)k, "}");
  return 0;
}

static int make_groups(struct mr_rank_program *p) {
  const struct mr_layout *lay = &p->L->lay;
  int most = lay->pp > lay->dp ? lay->pp : lay->dp;
  most = lay->tp > most ? lay->tp : most;
  int *r = malloc((size_t)most * sizeof *r);
  if (r == NULL)
    return MR_ENOMEM;
  for (int q = 0; q < lay->pp; q++)
    r[q] = mr_lower_rank(lay, q, p->data, p->model);
  int rc = group_desc(&p->pipe_group, "pipe", r, lay->pp);
  for (int d = 0; d < lay->dp; d++)
    r[d] = mr_lower_rank(lay, p->pipe, d, p->model);
  if (rc == 0)
    rc = group_desc(&p->data_group, "data", r, lay->dp);
  for (int t = 0; t < lay->tp; t++)
    r[t] = mr_lower_rank(lay, p->pipe, p->data, t);
  if (rc == 0)
    rc = group_desc(&p->model_group, "model", r, lay->tp);
  free(r);
  return rc;
}

/* The group of a mesh dim of L->mesh. */
const struct mr_group_desc *mr__lower_dim_group(const struct mr_rank_program *p, int md) {
  return md == p->L->data_dim ? &p->data_group : &p->model_group;
}

static int local_graph(struct build *b) {
  struct mr_rank_program *p = b->p;
  const struct mr_lowered *L = b->L;
  const struct mr_graph *g = b->g;
  const struct mr_dist_graph *dg = &L->dg;
  struct mr_graph *lg = &p->local;
  lg->tensors = calloc((size_t)L->n_local, sizeof *lg->tensors);
  lg->ops = calloc((size_t)(g->n_ops ? g->n_ops : 1), sizeof *lg->ops);
  p->buf = calloc((size_t)L->n_local, sizeof *p->buf);
  if (!lg->tensors || !lg->ops || !p->buf)
    return MR_ENOMEM;
  lg->n_tensors = lg->cap_tensors = L->n_local;
  lg->n_ops = lg->cap_ops = g->n_ops;
  lg->loss = g->loss;
  lg->n_forward_ops = g->n_forward_ops;
  for (int t = 0; t < L->n_local; t++) {
    int gt = t < g->n_tensors ? t : dg->edges[t - g->n_tensors].tensor;
    const struct mr_dist_attr *da =
        t < g->n_tensors ? &dg->tensor[t] : &dg->edges[t - g->n_tensors].dst;
    struct mr_tensor *lt = &lg->tensors[t];
    *lt = g->tensors[gt];
    if (t >= g->n_tensors) {
      snprintf(lt->name, sizeof lt->name, "rs/%.80s", g->tensors[gt].name);
      lt->role = MR_ROLE_ACTIVATION;
      lt->producer = -1;
      lt->grad = lt->grad_of = -1;
    }
    int64_t off[MR_MAX_DIMS], len[MR_MAX_DIMS];
    mr_dist_local(&L->mesh, da, lt->ndim, g->tensors[gt].shape, p->coord, off, len);
    memcpy(lt->shape, len, sizeof len);
    struct mr_lbuf *bf = &p->buf[t];
    bf->ndim = lt->ndim;
    memcpy(bf->shape, len, sizeof len);
    bf->numel = mr_tensor_numel(lt);
    bf->bytes = ALIGNED(bf->numel * esize(lg, t));
  }
  for (int k = 0; k < g->n_ops; k++) {
    struct mr_op *lo = &lg->ops[k];
    *lo = g->ops[k];
    const struct mr_spmd_rule *rule = mr_spmd_rule_of(lo->kind);
    if (rule && rule->localize)
      rule->localize(g, &g->ops[k], &L->mesh, &dg->need[k * MR_OP_MAX_IN], p->coord, lo->attr);
    for (int i = 0; i < lo->n_in; i++) {
      int e = dg->edge_of[k * MR_OP_MAX_IN + i];
      if (e >= 0)
        lo->in[i] = g->n_tensors + e;
    }
  }
  return 0;
}

/* ---- parameters ---- */

static int plan_params(struct build *b) {
  struct mr_rank_program *p = b->p;
  const struct mr_lowered *L = b->L;
  const struct mr_graph *g = b->g;
  const struct mr_layout *lay = &L->lay;
  p->param_of = malloc((size_t)g->n_tensors * sizeof *p->param_of);
  p->params = calloc((size_t)(g->n_tensors ? g->n_tensors : 1), sizeof *p->params);
  int *chunk = malloc((size_t)g->n_tensors * sizeof *chunk);
  if (!p->param_of || !p->params || !chunk) {
    free(chunk);
    return MR_ENOMEM;
  }
  for (int t = 0; t < g->n_tensors; t++) {
    p->param_of[t] = -1;
    chunk[t] = -1;
  }
  /* a parameter lives on the chunks that read it; the one its gradient is
   * produced on owns it */
  int *mine = calloc((size_t)g->n_tensors, sizeof *mine);
  if (!mine) {
    free(chunk);
    return MR_ENOMEM;
  }
  for (int k = 0; k < g->n_ops; k++)
    for (int i = 0; i < g->ops[k].n_in; i++) {
      int t = g->ops[k].in[i];
      if (t >= 0 && g->tensors[t].role == MR_ROLE_PARAM && b->my_chunk[L->op_chunk[k]]) {
        mine[t] = 1;
        chunk[t] = L->op_chunk[k];
      }
    }
  int64_t acc = 0, opt = 0;
  for (int t = 0; t < g->n_tensors; t++) {
    if (!mine[t] || g->tensors[t].grad < 0)
      continue;
    struct mr_param_plan *pp = &p->params[p->n_params];
    p->param_of[t] = p->n_params++;
    pp->tensor = t;
    pp->chunk = chunk[t];
    pp->replica_of = -1;
    int owner = L->op_chunk[g->tensors[g->tensors[t].grad].producer];
    if (!b->my_chunk[owner])
      pp->replica_of = mr_lower_rank(lay, owner % lay->pp, p->data, p->model);
    else { /* the other stages reading it hold copies */
      char held[64] = {0};
      for (int k = 0; k < g->n_ops; k++)
        for (int i = 0; i < g->ops[k].n_in; i++)
          if (g->ops[k].in[i] == t && L->op_chunk[k] % lay->pp != p->pipe &&
              L->op_chunk[k] % lay->pp < 64)
            held[L->op_chunk[k] % lay->pp] = 1;
      for (int q = 0; q < lay->pp && q < 64; q++)
        if (held[q]) {
          int *r = realloc(pp->replicas, (size_t)(pp->n_replicas + 1) * sizeof *r);
          if (!r) {
            free(chunk);
            free(mine);
            return MR_ENOMEM;
          }
          pp->replicas = r;
          pp->replicas[pp->n_replicas++] = mr_lower_rank(lay, q, p->data, p->model);
        }
    }
    pp->numel = p->buf[t].numel;
    pp->block = lay->zero > 0 ? (pp->numel + lay->dp - 1) / lay->dp : pp->numel;
    if (lay->zero > 0) {
      int64_t bg = pp->block * p->data;
      pp->begin = bg < pp->numel ? bg : pp->numel;
      pp->len = bg >= pp->numel ? 0 : (pp->numel - bg < pp->block ? pp->numel - bg : pp->block);
    } else {
      pp->begin = 0;
      pp->len = pp->numel;
    }
    mr_dist_local(&L->mesh, &L->dg.tensor[t], g->tensors[t].ndim, g->tensors[t].shape,
                  p->coord, pp->goff, pp->glen);
    /* count each element of the global gradient once: on data coordinate
     * 0 unless ZeRO splits it into blocks, on model coordinate 0 unless the
     * parameter is sharded over model */
    int norm = lay->zero > 0 || p->data == 0;
    if (L->model_dim >= 0 && L->dg.tensor[t].p[L->model_dim].kind != MR_SHARD && p->model != 0)
      norm = 0;
    pp->norm = norm;
    if (pp->replica_of >= 0) { /* a copy: no gradient, no state, not counted;
                                * under ZeRO-3 it stores its block, which the
                                * owner's update replaces and a gather reads */
      pp->norm = 0;
      if (lay->zero < 3)
        pp->len = 0;
      pp->acc_floats = 0;
      pp->acc_offset = acc;
      pp->state_offset = opt;
      pp->sync_ev = -1;
      continue;
    }
    pp->acc_floats = lay->zero >= 2 ? pp->block : pp->numel;
    pp->acc_offset = acc;
    acc += ALIGNED(pp->acc_floats * 4);
    pp->state_offset = opt;
    opt += 2 * mr_param_moment_stride(pp);
    pp->sync_ev = -1;
  }
  free(chunk);
  free(mine);
  p->acc_bytes = acc;
  p->optim_bytes = opt;
  return 0;
}

/* ---- pass templates ---- */

/* Inputs of op k as the local graph has them (edges substituted). */
int mr__lower_nth_in(const struct build *b, int k, int i) { return b->p->local.ops[k].in[i]; }

static int is_loss_edge(const struct mr_lowered *L, int e) {
  return L->dg.edges[e].kind == MR_EDGE_LOSS;
}

int mr_lowered_loss_edge(const struct mr_lowered *L) {
  for (int e = 0; e < L->dg.n_edges; e++)
    if (is_loss_edge(L, e))
      return e;
  return -1;
}

int mr_lowered_loss_deferred(const struct mr_lowered *L) {
  int le = mr_lowered_loss_edge(L);
  if (le < 0)
    return 0;
  for (int s = 0; s < L->dg.edges[le].plan.n_steps; s++) {
    enum mr_reshard_kind k = L->dg.edges[le].plan.steps[s].kind;
    if (k != MR_RS_ALL_REDUCE && k != MR_RS_SCALE)
      return 0;
  }
  return 1;
}

/* This rank's micro-batches and the first slice of the step's batch it
 * reads.  With micro-batches set per data rank the loss cannot be made
 * whole each micro-batch (that is a collective across the data ranks,
 * which now run different counts), so the loss edge's steps must be linear
 * (all-reduces, scalings): they run once on the step's sum
 * (mr_lowered_loss_deferred). */
static int micro_share(struct mr_rank_program *p, const struct mr_lowered *L) {
  p->n_slots = p->n_micro = L->lay.n_micro;
  p->first_slice = 0;
  if (L->dp_micro == NULL)
    return 0;
  p->n_slots = p->n_micro = L->dp_micro[p->data];
  for (int d = 0; d < p->data; d++)
    p->first_slice += L->dp_micro[d];
  for (int d = 0; L->lay.zero >= 2 && d < L->lay.dp; d++)
    p->n_slots = L->dp_micro[d] > p->n_slots ? L->dp_micro[d] : p->n_slots;
  int le = mr_lowered_loss_edge(L);
  for (int s = 0; le >= 0 && s < L->dg.edges[le].plan.n_steps; s++) {
    enum mr_reshard_kind k = L->dg.edges[le].plan.steps[s].kind;
    if (k != MR_RS_ALL_REDUCE && k != MR_RS_SCALE)
      return mr_error_set(MR_ENOTSUP, "lowering: micro-batches set per data-parallel rank sum "
                          "the loss over the step, but making it whole takes a %s",
                          mr_reshard_kind_name(k));
  }
  return 0;
}

/* Where every local tensor is written: (chunk, forward 0 | backward 1). */
static int producers(struct build *b) {
  const struct mr_lowered *L = b->L;
  const struct mr_graph *g = b->g;
  b->prod_chunk = malloc((size_t)L->n_local * sizeof *b->prod_chunk);
  b->prod_dir = malloc((size_t)L->n_local * sizeof *b->prod_dir);
  if (!b->prod_chunk || !b->prod_dir)
    return MR_ENOMEM;
  for (int t = 0; t < L->n_local; t++) {
    b->prod_chunk[t] = b->prod_dir[t] = -1;
    if (t < g->n_tensors && g->tensors[t].producer >= 0) {
      int k = g->tensors[t].producer;
      b->prod_chunk[t] = L->op_chunk[k];
      b->prod_dir[t] = g->ops[k].backward;
    } else if (t >= g->n_tensors) {
      int e = t - g->n_tensors, k = L->edge_at[e];
      if (k < 0 && is_loss_edge(L, e))
        k = g->tensors[g->loss].producer;
      if (k >= 0) {
        b->prod_chunk[t] = L->op_chunk[k];
        b->prod_dir[t] = g->ops[k].backward;
      }
    }
  }
  return 0;
}

/* Calls fn for every tensor chunk c reads, with the direction reading it. */
static void for_reads(const struct build *b, int c, void (*fn)(void *, int t, int dir),
                      void *ctx) {
  const struct mr_lowered *L = b->L;
  const struct mr_graph *g = b->g;
  for (int k = 0; k < g->n_ops; k++) {
    if (L->op_chunk[k] != c)
      continue;
    for (int i = 0; i < g->ops[k].n_in; i++)
      if (mr__lower_nth_in(b, k, i) >= 0)
        fn(ctx, mr__lower_nth_in(b, k, i), g->ops[k].backward);
  }
  for (int e = 0; e < L->dg.n_edges; e++) {
    int k = L->edge_at[e];
    if (k >= 0 && L->op_chunk[k] == c)
      fn(ctx, L->dg.edges[e].tensor, g->ops[k].backward);
  }
}

struct need_ctx {
  const struct build *b;
  int c;
  char *need;  // [n_local] bit 1: read in F, bit 2: read in B
};

static void mark_need(void *ctx, int t, int dir) {
  struct need_ctx *n = ctx;
  n->need[t] |= (char)(dir ? 2 : 1);
}

/* Tensors a pass must receive: produced on another chunk in direction dir
 * (forward tensors arrive with the forward pass even if only the backward
 * reads them), sorted by (source chunk, id). */
static int receives(const struct build *b, int c, int dir, int *out) {
  const struct mr_lowered *L = b->L;
  char *need = calloc((size_t)L->n_local, 1);
  if (!need)
    return MR_ENOMEM;
  struct need_ctx nc = {b, c, need};
  for_reads(b, c, mark_need, &nc);
  int n = 0;
  for (int src = 0; src < L->n_chunks; src++)
    for (int t = 0; t < L->n_local; t++)
      if (need[t] && b->prod_chunk[t] == src && src != c && b->prod_dir[t] == dir)
        out[n++] = t;
  free(need);
  return n;
}

/* Tensors pass (c, dir) sends, as (tensor, destination chunk) pairs sorted
 * by (destination, id). */
static int sends(const struct build *b, int c, int dir, int *tensor, int *dest) {
  const struct mr_lowered *L = b->L;
  char *need = calloc((size_t)L->n_local, 1);
  if (!need)
    return MR_ENOMEM;
  int n = 0;
  for (int d = 0; d < L->n_chunks; d++) {
    if (d == c)
      continue;
    memset(need, 0, (size_t)L->n_local);
    struct need_ctx nc = {b, d, need};
    for_reads(b, d, mark_need, &nc);
    for (int t = 0; t < L->n_local; t++)
      if (need[t] && b->prod_chunk[t] == c && b->prod_dir[t] == dir) {
        tensor[n] = t;
        dest[n++] = d;
      }
  }
  free(need);
  return n;
}

static int chunk_rank(const struct build *b, int c) {
  const struct mr_rank_program *p = b->p;
  return mr_lower_rank(&b->L->lay, c % b->L->lay.pp, p->data, p->model);
}

static int reads_input(const struct build *b, int c, int t) {
  const struct mr_graph *g = b->g;
  for (int k = 0; k < g->n_ops; k++) {
    if (b->L->op_chunk[k] != c)
      continue;
    for (int i = 0; i < g->ops[k].n_in; i++)
      if (g->ops[k].in[i] == t)
        return 1;
  }
  return 0;
}

static void emit_tmpl(struct build *b, struct mr_ins in) {
  push_ins(b, &b->p->tmpl, &b->p->n_tmpl, &b->cap_tmpl, in);
}

/* Reshard edge e into its local tensor, in pass pi. */
static void emit_reshard(struct build *b, int pi, int e) {
  struct mr_ins in = ins(MR_INS_RESHARD, pi);
  in.edge = e;
  in.tensor = b->g->n_tensors + e;
  emit_tmpl(b, in);
}

static int build_pass(struct build *b, int c, int dir) {
  struct mr_rank_program *p = b->p;
  const struct mr_lowered *L = b->L;
  const struct mr_graph *g = b->g;
  int pi = p->n_passes++;
  struct mr_pass *ps = &p->passes[pi];
  ps->chunk = c;
  ps->backward = dir;
  ps->first = p->n_tmpl;
  int *list = malloc((size_t)(2 * L->n_local + 1) * sizeof *list);
  char *gathered = calloc((size_t)g->n_tensors, 1);
  if (!list || !gathered) {
    free(list);
    free(gathered);
    return MR_ENOMEM;
  }
  int n = receives(b, c, dir, list);
  for (int i = 0; i < n; i++) {
    struct mr_ins in = ins(MR_INS_RECV, pi);
    in.tensor = list[i];
    in.peer = chunk_rank(b, b->prod_chunk[list[i]]);
    emit_tmpl(b, in);
  }
  if (!dir && (reads_input(b, c, L->model.input_ids) || reads_input(b, c, L->model.labels) ||
               (L->model.position_ids >= 0 && reads_input(b, c, L->model.position_ids)))) {
    emit_tmpl(b, ins(MR_INS_LOAD, pi));
  }
  if (dir && reads_input(b, c, L->seed)) {
    struct mr_ins in = ins(MR_INS_SEED, pi);
    in.tensor = L->seed;
    emit_tmpl(b, in);
  }
  int any_grad = 0, le = mr_lowered_loss_deferred(L) ? -1 : mr_lowered_loss_edge(L);
  for (int k = 0; k < g->n_ops; k++) {
    if (L->op_chunk[k] != c || g->ops[k].backward != dir)
      continue;
    if (L->lay.zero >= 3) { /* gather parameters before their first use here */
      for (int i = 0; i < g->ops[k].n_in; i++) {
        int t = g->ops[k].in[i];
        if (t >= 0 && p->param_of[t] >= 0 && !gathered[t]) {
          gathered[t] = 1;
          struct mr_ins in = ins(MR_INS_GATHER, pi);
          in.tensor = t;
          emit_tmpl(b, in);
        }
      }
    }
    for (int e = 0; e < L->dg.n_edges; e++)
      if (L->edge_at[e] == k)
        emit_reshard(b, pi, e);
    struct mr_ins kin = ins(MR_INS_KERNEL, pi);
    kin.op = k;
    emit_tmpl(b, kin);
    for (int j = 0; j < g->ops[k].n_out; j++) {
      int t = g->ops[k].out[j];
      if (t == g->loss) {
        if (le >= 0)
          emit_reshard(b, pi, le);
        struct mr_ins in = ins(MR_INS_LOSS, pi);
        in.tensor = le >= 0 ? g->n_tensors + le : t;
        emit_tmpl(b, in);
      }
      if (g->tensors[t].role == MR_ROLE_GRAD && g->tensors[t].grad_of >= 0 &&
          p->param_of[g->tensors[t].grad_of] >= 0) {
        struct mr_ins in = ins(MR_INS_GRAD, pi);
        in.tensor = g->tensors[t].grad_of;
        in.edge = mr__lower_sync_edge(L, in.tensor); /* its synchronisation, or -1 */
        emit_tmpl(b, in);
        any_grad = 1;
      }
    }
  }
  if (any_grad && L->lay.zero >= 2)
    emit_tmpl(b, ins(MR_INS_GRAD_WAIT, pi));
  int *dest = list + L->n_local;
  n = sends(b, c, dir, list, dest);
  for (int i = 0; i < n; i++) {
    struct mr_ins in = ins(MR_INS_SEND, pi);
    in.tensor = list[i];
    in.peer = chunk_rank(b, dest[i]);
    emit_tmpl(b, in);
  }
  free(list);
  free(gathered);
  ps->n = p->n_tmpl - ps->first;
  return b->rc;
}

/* ---- schedule ---- */

/* This rank's training schedule as (pass template, micro-batch) pairs;
 * returns the count. */
static int schedule(const struct build *b, const int *fpass, const int *bpass, int *out_pass,
                    int *out_micro) {
  const struct mr_layout *lay = &b->L->lay;
  int m = b->p->n_slots;
  struct mr_sched_pass *sp = malloc((size_t)(2 * m * lay->vp + 1) * sizeof *sp);
  if (sp == NULL)
    return MR_ENOMEM;
  int n = mr_pipeline_schedule(lay->schedule, lay->pp, b->p->pipe, lay->vp, m, sp);
  for (int i = 0; i < n; i++) {
    out_pass[i] = sp[i].backward ? bpass[sp[i].chunk] : fpass[sp[i].chunk];
    out_micro[i] = sp[i].micro;
  }
  free(sp);
  return n;
}

/* Reorders the schedule (pass, micro-batch) pairs so the phantom slots
 * (micro-batch n_micro and up) come first, each group in its order. */
static int phantoms_first(int *sp, int *sm, int n, int n_micro) {
  int *tp = malloc((size_t)n * sizeof *tp), *tm = malloc((size_t)n * sizeof *tm), k = 0;
  if (tp == NULL || tm == NULL) {
    free(tp), free(tm);
    return MR_ENOMEM;
  }
  for (int phantom = 1; phantom >= 0; phantom--)
    for (int i = 0; i < n; i++)
      if ((sm[i] >= n_micro) == phantom)
        tp[k] = sp[i], tm[k++] = sm[i];
  memcpy(sp, tp, (size_t)n * sizeof *sp);
  memcpy(sm, tm, (size_t)n * sizeof *sm);
  free(tp), free(tm);
  return 0;
}

/* A pass of micro-batch `micro` into the step; a phantom slot (past this
 * rank's micro-batches) keeps only the collectives every data rank joins:
 * ZeRO-3's gathers and ZeRO-2/3's gradient reduce-scatters (of zeros, not
 * waited in the pass). */
static void expand(struct build *b, int pass, int micro) {
  struct mr_rank_program *p = b->p;
  const struct mr_pass *ps = &p->passes[pass];
  int slots = p->stash_slots[ps->chunk] > 0 ? p->stash_slots[ps->chunk] : 1;
  for (int i = ps->first; i < ps->first + ps->n && b->rc == 0; i++) {
    struct mr_ins in = p->tmpl[i];
    if (micro >= p->n_micro && in.kind != MR_INS_GATHER && in.kind != MR_INS_GRAD)
      continue;
    in.micro = micro;
    in.slot = micro % slots;
    struct mr_ins *x = push_ins(b, &p->step, &p->n_step, &b->cap_step, in);
    if (x)
      mr__lower_events_of(b, x, &p->scratch_bytes);
  }
}

static void emit_step(struct build *b, enum mr_ins_kind k) {
  struct mr_ins *x = push_ins(b, &b->p->step, &b->p->n_step, &b->cap_step, ins(k, -1));
  if (x)
    mr__lower_events_of(b, x, &b->p->scratch_bytes);
}

/* After the step's passes: the gradient syncs waited, the optimizer,
 * tied parameters made equal again, the step's end. */
static void emit_step_tail(struct build *b) {
  const struct mr_rank_program *p = b->p;
  emit_step(b, MR_INS_SYNC_WAIT);
  emit_step(b, MR_INS_OPTIMIZER);
  int tied = 0;
  for (int i = 0; i < p->n_params; i++)
    tied |= p->params[i].replica_of >= 0 || p->params[i].n_replicas > 0;
  if (tied)
    emit_step(b, MR_INS_PARAM_SYNC);
  emit_step(b, MR_INS_STEP_END);
}

/* An evaluation batch: the forward passes fpass[], micro-batch outer,
 * chunks inner, with their communication and the loss's. */
static int plan_eval(struct build *b, const int *fpass) {
  struct mr_rank_program *p = b->p;
  const struct mr_layout *lay = &b->L->lay;
  p->eval_passes = malloc((size_t)(lay->n_micro * lay->vp) * sizeof *p->eval_passes);
  p->eval_micro = malloc((size_t)(lay->n_micro * lay->vp) * sizeof *p->eval_micro);
  if (!p->eval_passes || !p->eval_micro)
    return MR_ENOMEM;
  for (int m = 0; m < lay->n_micro; m++)
    for (int j = 0; j < lay->vp; j++) {
      p->eval_passes[p->n_eval] = fpass[j];
      p->eval_micro[p->n_eval++] = m;
      const struct mr_pass *ps = &p->passes[fpass[j]];
      for (int i = ps->first; i < ps->first + ps->n && b->rc == 0; i++) {
        struct mr_ins in = p->tmpl[i];
        in.micro = m;
        in.slot = 0;
        mr__lower_events_of(b, &in, &p->scratch_bytes);
      }
    }
  mr__lower_loss_events(b, NULL);
  if (lay->pp > 1)
    mr__lower_add_event(b, NULL, MR_CEV_BROADCAST, &p->pipe_group, -1, 1, MR_F32, lay->pp - 1,
                        -1, "the evaluation loss");
  return 0;
}

/* The staging buffers the optimizer's collectives need: ZeRO-2/3's
 * reduce-scatter landing blocks (one per parameter, and each phantom
 * slot's apart), an off-data gradient's stage, ZeRO-1's all-gather block. */
static void size_staging(struct mr_rank_program *p, const struct mr_layout *lay) {
  p->scratch_bytes = ALIGNED(p->scratch_bytes * 4);
  if (lay->zero >= 2) {
    int64_t z = 0, pad = 0;
    for (int i = 0; i < p->n_params; i++) {
      p->params[i].zero_tmp_offset = z;
      z += ALIGNED(p->params[i].block * 4);
      if (ALIGNED(p->params[i].block * lay->dp * 4) > pad)
        pad = ALIGNED(p->params[i].block * lay->dp * 4);
    }
    p->zero_landing_bytes = p->zero_tmp_bytes = z;
    if (p->n_slots > p->n_micro) /* each phantom's blocks land apart; the zeros they send */
      p->zero_tmp_bytes += (p->n_slots - p->n_micro) * z + pad;
  }
  for (int i = 0; i < p->n_params; i++) {
    struct mr_param_plan *pp = &p->params[i];
    int64_t need = pp->block * lay->dp > pp->numel ? pp->block * lay->dp : pp->numel;
    if (pp->off_data && ALIGNED(need * 4) > p->grad_stage_bytes)
      p->grad_stage_bytes = ALIGNED(need * 4);
  }
  if (lay->zero == 1) { /* the block an all-gather sends */
    for (int i = 0; i < p->n_params; i++)
      if (ALIGNED(p->params[i].block * 4) > p->zero_tmp_bytes)
        p->zero_tmp_bytes = ALIGNED(p->params[i].block * 4);
  }
}

int mr_rank_program_build(const struct mr_lowered *L, int rank, struct mr_rank_program *p) {
  memset(p, 0, sizeof *p);
  struct build b = {.p = p, .L = L, .g = &L->model.graph};
  const struct mr_layout *lay = &L->lay;
  int *sp = NULL, *sm = NULL, *fly = NULL; /* the schedule: pass, micro-batch */
  int rc;
  p->L = L;
  p->rank = rank;
  mr_lower_coords(lay, rank, &p->pipe, &p->data, &p->model);
  if (L->data_dim >= 0)
    p->coord[L->data_dim] = p->data;
  if (L->model_dim >= 0)
    p->coord[L->model_dim] = p->model;
  MR_TRY_GOTO(rc, micro_share(p, L), out);
  MR_TRY_GOTO(rc, make_groups(p), out);
  MR_TRY_GOTO(rc, local_graph(&b), out);
  rc = MR_ENOMEM;
  b.my_chunk = calloc((size_t)L->n_chunks, sizeof *b.my_chunk);
  p->passes = calloc((size_t)(2 * L->n_chunks), sizeof *p->passes);
  if (!b.my_chunk || !p->passes)
    goto out;
  for (int c = 0; c < L->n_chunks; c++)
    b.my_chunk[c] = c % lay->pp == p->pipe;
  MR_TRY_GOTO(rc, plan_params(&b), out);
  for (int i = 0; i < p->n_params; i++) {
    struct mr_param_plan *pp = &p->params[i];
    int e = mr__lower_sync_edge(L, pp->tensor);
    for (int s = 0; e >= 0 && s < L->dg.edges[e].plan.n_steps; s++)
      pp->off_data |= L->dg.edges[e].plan.steps[s].mesh_dim != L->data_dim;
  }
  MR_TRY_GOTO(rc, producers(&b), out);
  int fpass[64], bpass[64];
  if (lay->vp > 64) {
    rc = mr_error_set(MR_ENOTSUP, "lowering: more than 64 virtual stages");
    goto out;
  }
  for (int j = 0; j < lay->vp; j++) {
    int c = j * lay->pp + p->pipe;
    fpass[j] = p->n_passes;
    MR_TRY_GOTO(rc, build_pass(&b, c, 0), out);
    bpass[j] = p->n_passes;
    MR_TRY_GOTO(rc, build_pass(&b, c, 1), out);
  }
  /* stash slots: micro-batches in flight per chunk under the schedule */
  int cap = 2 * p->n_slots * lay->vp + 4;
  sp = malloc((size_t)cap * sizeof *sp);
  sm = malloc((size_t)cap * sizeof *sm);
  fly = calloc((size_t)L->n_chunks, sizeof *fly);
  p->stash_slots = calloc((size_t)L->n_chunks, sizeof *p->stash_slots);
  if (!sp || !sm || !fly || !p->stash_slots) {
    rc = MR_ENOMEM;
    goto out;
  }
  int ns = schedule(&b, fpass, bpass, sp, sm);
  MR_TRY_GOTO(rc, ns, out);
  if (p->n_slots > p->n_micro && lay->zero == 2 && lay->pp == 1)
    MR_TRY_GOTO(rc, phantoms_first(sp, sm, ns, p->n_micro), out);
  for (int i = 0; i < ns; i++) {
    int c = p->passes[sp[i]].chunk;
    fly[c] += p->passes[sp[i]].backward ? -1 : 1;
    if (fly[c] > p->stash_slots[c])
      p->stash_slots[c] = fly[c];
  }
  MR_TRY_GOTO(rc, mr__lower_plan_buffers(&b), out);
  for (int i = 0; i < ns && b.rc == 0; i++)
    expand(&b, sp[i], sm[i]);
  emit_step_tail(&b);
  p->n_ev_step = p->n_ev;
  MR_TRY_GOTO(rc, plan_eval(&b, fpass), out);
  size_staging(p, lay);
  rc = b.rc;
  for (int i = 0; i < p->n_step && rc == 0; i++) /* events name their instruction */
    for (int e = p->step[i].ev; e >= 0 && e < p->step[i].ev + p->step[i].n_ev; e++)
      p->ev[e].id = i;
out:
  free(sp);
  free(sm);
  free(fly);
  free(b.prod_chunk);
  free(b.prod_dir);
  free(b.my_chunk);
  if (rc < 0)
    mr_rank_program_close(p);
  return rc;
}

void mr_rank_program_close(struct mr_rank_program *p) {
  if (p == NULL)
    return;
  for (int i = 0; p->params && i < p->n_params; i++)
    free(p->params[i].replicas);
  free(p->buf);
  free(p->params);
  free(p->param_of);
  free(p->local.tensors);
  free(p->local.ops);
  free(p->stash_slots);
  free(p->stash_bytes);
  for (int i = 0; p->passes && i < p->n_passes; i++)
    free(p->passes[i].arena_off);
  free(p->passes);
  free(p->tmpl);
  free(p->step);
  free(p->eval_passes);
  free(p->eval_micro);
  for (int i = 0; p->ev_what && i < p->n_ev; i++)
    free(p->ev_what[i]);
  free(p->ev_what);
  free(p->ev);
  free(p->send_off);
  free(p->pipe_group.ranks);
  free(p->data_group.ranks);
  free(p->model_group.ranks);
  memset(p, 0, sizeof *p);
}

int64_t mr_rank_program_peak_bytes(const struct mr_rank_program *p) {
  int64_t stash = 0;
  for (int c = 0; c < p->L->n_chunks; c++)
    stash += p->stash_bytes[c] * p->stash_slots[c];
  return p->param_bytes + p->acc_bytes + (p->L->lay.offload ? 0 : p->optim_bytes) + stash +
         p->arena_bytes + p->send_bytes + p->zero_tmp_bytes + 3 * p->scratch_bytes +
         p->grad_stage_bytes;
}

struct mr_comm_trace mr_rank_program_trace(const struct mr_rank_program *p, int eval) {
  struct mr_comm_trace t;
  t.ev = eval ? p->ev + p->n_ev_step : p->ev;
  t.n = eval ? p->n_ev - p->n_ev_step : p->n_ev_step;
  return t;
}

