/* lower_program.c - one rank's program: passes, schedule, buffers and the
 * communication each instruction issues. */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/fit.h"
#include "common/ops.h"
#include "launcher/spmd/lower.h"
#include "launcher/planner/schedule.h"
#include "launcher/spmd/rules.h"

#define ALIGN 64
#define ALIGNED(b) (((b) + ALIGN - 1) / ALIGN * ALIGN)

struct build {
  struct mr_rank_program *p;
  const struct mr_lowered *L;
  const struct mr_graph *g;
  int cap_tmpl, cap_step, cap_ev;
  int rc;
  int *prod_chunk, *prod_dir;     // [n_local] where written, -1: input/param
  int *my_chunk;                  // [n_chunks] 1: on this rank
};

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

static struct mr_ins ins(enum mr_ins_kind k) {
  return (struct mr_ins){.kind = k, .pass = -1, .op = -1, .edge = -1, .tensor = -1,
                         .peer = -1, .ev = -1};
}

/* ---- coordinates, groups, local graph ---- */

static void group_desc(struct mr_group_desc *gd, const char *kind, const int *ranks, int n) {
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
}

static int make_groups(struct mr_rank_program *p) {
  const struct mr_layout *lay = &p->L->lay;
  int r[64];
  if (lay->pp > 64 || lay->dp > 64 || lay->tp > 64)
    return mr_error_set(MR_ENOTSUP, "lowering: a group of more than 64 ranks");
  for (int q = 0; q < lay->pp; q++)
    r[q] = mr_lower_rank(lay, q, p->data, p->model);
  group_desc(&p->pipe_group, "pipe", r, lay->pp);
  for (int d = 0; d < lay->dp; d++)
    r[d] = mr_lower_rank(lay, p->pipe, d, p->model);
  group_desc(&p->data_group, "data", r, lay->dp);
  for (int t = 0; t < lay->tp; t++)
    r[t] = mr_lower_rank(lay, p->pipe, p->data, t);
  group_desc(&p->model_group, "model", r, lay->tp);
  return 0;
}

/* The group of a mesh dim of L->mesh. */
static const struct mr_group_desc *dim_group(const struct mr_rank_program *p, int md) {
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
    const struct mr_spmd_rule *rule = mr_spmd_rule_find(mr_op_def(lo->kind)->name);
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
    if (pp->replica_of >= 0) { /* a copy: no gradient, no state, not counted */
      pp->norm = 0;
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
    opt += 2 * ALIGNED(pp->len * 4);
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
static int nth_in(const struct build *b, int k, int i) { return b->p->local.ops[k].in[i]; }

static int is_loss_edge(const struct mr_lowered *L, int e) {
  return L->dg.edges[e].kind == MR_EDGE_LOSS;
}

static int loss_edge(const struct mr_lowered *L) {
  for (int e = 0; e < L->dg.n_edges; e++)
    if (is_loss_edge(L, e))
      return e;
  return -1;
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
      if (nth_in(b, k, i) >= 0)
        fn(ctx, nth_in(b, k, i), g->ops[k].backward);
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
    struct mr_ins in = ins(MR_INS_RECV);
    in.pass = pi;
    in.tensor = list[i];
    in.peer = chunk_rank(b, b->prod_chunk[list[i]]);
    emit_tmpl(b, in);
  }
  if (!dir && (reads_input(b, c, L->model.input_ids) || reads_input(b, c, L->model.labels) ||
               (L->model.position_ids >= 0 && reads_input(b, c, L->model.position_ids)))) {
    struct mr_ins in = ins(MR_INS_LOAD);
    in.pass = pi;
    emit_tmpl(b, in);
  }
  if (dir && reads_input(b, c, L->seed)) {
    struct mr_ins in = ins(MR_INS_SEED);
    in.pass = pi;
    in.tensor = L->seed;
    emit_tmpl(b, in);
  }
  int any_grad = 0, le = loss_edge(L);
  for (int k = 0; k < g->n_ops; k++) {
    if (L->op_chunk[k] != c || g->ops[k].backward != dir)
      continue;
    if (L->lay.zero >= 3) { /* gather parameters before their first use here */
      for (int i = 0; i < g->ops[k].n_in; i++) {
        int t = g->ops[k].in[i];
        if (t >= 0 && p->param_of[t] >= 0 && !gathered[t]) {
          gathered[t] = 1;
          struct mr_ins in = ins(MR_INS_GATHER);
          in.pass = pi;
          in.tensor = t;
          emit_tmpl(b, in);
        }
      }
    }
    for (int e = 0; e < L->dg.n_edges; e++)
      if (L->edge_at[e] == k) {
        struct mr_ins in = ins(MR_INS_RESHARD);
        in.pass = pi;
        in.edge = e;
        in.tensor = g->n_tensors + e;
        emit_tmpl(b, in);
      }
    struct mr_ins kin = ins(MR_INS_KERNEL);
    kin.pass = pi;
    kin.op = k;
    emit_tmpl(b, kin);
    for (int j = 0; j < g->ops[k].n_out; j++) {
      int t = g->ops[k].out[j];
      if (t == g->loss) {
        if (le >= 0) {
          struct mr_ins in = ins(MR_INS_RESHARD);
          in.pass = pi;
          in.edge = le;
          in.tensor = g->n_tensors + le;
          emit_tmpl(b, in);
        }
        struct mr_ins in = ins(MR_INS_LOSS);
        in.pass = pi;
        in.tensor = le >= 0 ? g->n_tensors + le : t;
        emit_tmpl(b, in);
      }
      if (g->tensors[t].role == MR_ROLE_GRAD && g->tensors[t].grad_of >= 0 &&
          p->param_of[g->tensors[t].grad_of] >= 0) {
        struct mr_ins in = ins(MR_INS_GRAD);
        in.pass = pi;
        in.tensor = g->tensors[t].grad_of;
        emit_tmpl(b, in);
        any_grad = 1;
      }
    }
  }
  if (any_grad && L->lay.zero >= 2) {
    struct mr_ins in = ins(MR_INS_GRAD_WAIT);
    in.pass = pi;
    emit_tmpl(b, in);
  }
  int *dest = list + L->n_local;
  n = sends(b, c, dir, list, dest);
  for (int i = 0; i < n; i++) {
    struct mr_ins in = ins(MR_INS_SEND);
    in.pass = pi;
    in.tensor = list[i];
    in.peer = chunk_rank(b, dest[i]);
    emit_tmpl(b, in);
  }
  free(list);
  free(gathered);
  ps->n = p->n_tmpl - ps->first;
  return b->rc;
}

/* ---- buffers ---- */

/* Reads and writes of a template instruction (local ids); returns counts. */
static void ins_access(const struct build *b, const struct mr_ins *in, int *rd, int *nr, int *wr,
                       int *nw) {
  const struct mr_lowered *L = b->L;
  const struct mr_graph *g = b->g;
  *nr = *nw = 0;
  switch (in->kind) {
  case MR_INS_RECV:
  case MR_INS_SEED:
  case MR_INS_GATHER:
    wr[(*nw)++] = in->tensor;
    break;
  case MR_INS_LOAD:
    wr[(*nw)++] = L->model.input_ids;
    wr[(*nw)++] = L->model.labels;
    if (L->model.position_ids >= 0)
      wr[(*nw)++] = L->model.position_ids;
    break;
  case MR_INS_RESHARD:
    rd[(*nr)++] = L->dg.edges[in->edge].tensor;
    wr[(*nw)++] = in->tensor;
    break;
  case MR_INS_KERNEL:
    for (int i = 0; i < g->ops[in->op].n_in; i++)
      if (nth_in(b, in->op, i) >= 0)
        rd[(*nr)++] = nth_in(b, in->op, i);
    for (int j = 0; j < g->ops[in->op].n_out; j++)
      wr[(*nw)++] = g->ops[in->op].out[j];
    break;
  case MR_INS_LOSS:
  case MR_INS_SEND:
    rd[(*nr)++] = in->tensor;
    break;
  case MR_INS_GRAD:
    rd[(*nr)++] = g->tensors[in->tensor].grad;
    break;
  default:
    break;
  }
}

static int plan_buffers(struct build *b) {
  struct mr_rank_program *p = b->p;
  const struct mr_lowered *L = b->L;
  const struct mr_graph *g = b->g;
  const struct mr_layout *lay = &L->lay;
  int nl = L->n_local;
  /* which chunk's forward writes a tensor and whose backward reads it */
  int *fw = malloc((size_t)nl * sizeof *fw);
  int *first = malloc((size_t)nl * sizeof *first), *last = malloc((size_t)nl * sizeof *last);
  struct mr_fit fit = {malloc((size_t)(nl + 1) * sizeof(struct mr_fit_live)), 0};
  p->stash_bytes = calloc((size_t)L->n_chunks, sizeof *p->stash_bytes);
  p->send_off = malloc((size_t)nl * sizeof *p->send_off);
  int rd[MR_OP_MAX_IN + 2], wr[MR_OP_MAX_OUT + 3], nr, nw;
  if (!fw || !first || !last || !fit.lv || !p->stash_slots || !p->stash_bytes || !p->send_off) {
    free(fw);
    free(first);
    free(last);
    free(fit.lv);
    return MR_ENOMEM;
  }
  for (int t = 0; t < nl; t++) {
    fw[t] = -1;
    p->send_off[t] = -1;
  }
  /* parameters: persistent (under ZeRO-3 only their block) */
  int64_t param = 0;
  for (int i = 0; i < p->n_params; i++) {
    const struct mr_param_plan *pp = &p->params[i];
    struct mr_lbuf *bf = &p->buf[pp->tensor];
    int64_t padded = ALIGNED(pp->block * lay->dp * 4);
    if (lay->zero >= 3) {
      bf->region = MR_REG_ARENA;
      bf->bytes = padded;
      p->params[i].store_offset = param;
      param += ALIGNED(pp->block * 4);
    } else {
      bf->region = MR_REG_PARAM;
      if (lay->zero > 0)
        bf->bytes = padded;
      bf->offset = param;
      p->params[i].store_offset = param;
      param += bf->bytes;
    }
    if (lay->zero >= 2) /* reduce-scatter pads the gradient to dp blocks */
      p->buf[g->tensors[pp->tensor].grad].bytes = padded;
  }
  p->param_bytes = param;
  for (int pi = 0; pi < p->n_passes; pi++) {
    const struct mr_pass *ps = &p->passes[pi];
    if (ps->backward)
      continue;
    for (int i = ps->first; i < ps->first + ps->n; i++) {
      ins_access(b, &p->tmpl[i], rd, &nr, wr, &nw);
      for (int j = 0; j < nw; j++)
        if (wr[j] < g->n_tensors && g->tensors[wr[j]].role == MR_ROLE_PARAM)
          continue;
        else
          fw[wr[j]] = ps->chunk;
    }
  }
  for (int pi = 0; pi < p->n_passes; pi++) {
    const struct mr_pass *ps = &p->passes[pi];
    if (!ps->backward)
      continue;
    for (int i = ps->first; i < ps->first + ps->n; i++) {
      ins_access(b, &p->tmpl[i], rd, &nr, wr, &nw);
      for (int j = 0; j < nr; j++) {
        int t = rd[j];
        if (fw[t] == ps->chunk && p->buf[t].region == MR_REG_NONE) {
          p->buf[t].region = MR_REG_STASH;
          p->buf[t].chunk = ps->chunk;
          p->buf[t].offset = p->stash_bytes[ps->chunk];
          p->stash_bytes[ps->chunk] += p->buf[t].bytes;
        }
      }
    }
  }
  /* everything else: the arena, first fit per pass */
  int64_t arena = 0, send = 0;
  for (int pi = 0; pi < p->n_passes; pi++) {
    struct mr_pass *ps = &p->passes[pi];
    ps->arena_off = malloc((size_t)nl * sizeof *ps->arena_off);
    if (!ps->arena_off) {
      b->rc = MR_ENOMEM;
      break;
    }
    for (int t = 0; t < nl; t++) {
      ps->arena_off[t] = -1;
      first[t] = last[t] = -1;
    }
    int end = ps->n - 1;
    for (int i = 0; i < ps->n; i++) {
      const struct mr_ins *in = &p->tmpl[ps->first + i];
      ins_access(b, in, rd, &nr, wr, &nw);
      for (int j = 0; j < nw; j++)
        if (p->buf[wr[j]].region == MR_REG_NONE || p->buf[wr[j]].region == MR_REG_ARENA) {
          p->buf[wr[j]].region = MR_REG_ARENA;
          if (first[wr[j]] < 0)
            first[wr[j]] = last[wr[j]] = i;
        }
      for (int j = 0; j < nr; j++)
        if (first[rd[j]] >= 0)
          last[rd[j]] = i;
      if (in->kind == MR_INS_GRAD) {
        int gt = g->tensors[in->tensor].grad;
        if (lay->zero >= 2 && first[gt] >= 0) /* reduce-scatter in flight */
          last[gt] = end;
      }
      if (in->kind == MR_INS_SEND) {
        p->send_off[in->tensor] = ps->send_bytes;
        ps->send_bytes += p->buf[in->tensor].bytes;
      }
    }
    for (int i = 0; i < ps->n; i++) { /* everything read has a home */
      ins_access(b, &p->tmpl[ps->first + i], rd, &nr, wr, &nw);
      for (int j = 0; j < nr; j++)
        if (p->buf[rd[j]].region == MR_REG_NONE ||
            (p->buf[rd[j]].region == MR_REG_ARENA && first[rd[j]] < 0)) {
          b->rc = mr_error_set(MR_EPLAN, "lowering: rank %d reads %s in pass (chunk %d, %s) "
                               "but nothing there writes it", p->rank,
                               p->local.tensors[rd[j]].name, ps->chunk,
                               ps->backward ? "backward" : "forward");
          break;
        }
    }
    ps->send_base = send;
    send += ps->send_bytes * lay->n_micro;
    fit.n = 0;
    int64_t high = 0;
    for (int i = 0; i < ps->n; i++) {
      const struct mr_ins *in = &p->tmpl[ps->first + i];
      ins_access(b, in, rd, &nr, wr, &nw);
      for (int j = 0; j < nw; j++) {
        int t = wr[j];
        if (first[t] != i || ps->arena_off[t] >= 0)
          continue;
        ps->arena_off[t] = mr_fit_place(&fit, p->buf[t].bytes, t);
        if (ps->arena_off[t] + p->buf[t].bytes > high)
          high = ps->arena_off[t] + p->buf[t].bytes;
      }
      for (int t = 0; t < nl; t++) /* small graphs: a scan is fine */
        if (last[t] == i && ps->arena_off[t] >= 0)
          mr_fit_release(&fit, t);
    }
    if (high > arena)
      arena = high;
  }
  p->arena_bytes = arena;
  p->send_bytes = send;
  free(fw);
  free(first);
  free(last);
  free(fit.lv);
  return b->rc;
}

/* ---- reshard staging sizes ---- */

static int64_t local_numel(const struct mr_lowered *L, const int *coord,
                           const struct mr_dist_attr *da, int t) {
  const struct mr_tensor *tt = &L->model.graph.tensors[t];
  int64_t off[MR_MAX_DIMS], len[MR_MAX_DIMS], n = 1;
  mr_dist_local(&L->mesh, da, tt->ndim, tt->shape, coord, off, len);
  for (int d = 0; d < tt->ndim; d++)
    n *= len[d];
  return n;
}

/* Elements a collective step moves, as the comm API counts them (the
 * AllGather: all ranks' together), and the staging it needs. */
static int64_t step_count(const struct mr_lowered *L, const int *coord, int t,
                          const struct mr_dist_attr *before, const struct mr_reshard_step *s,
                          int64_t *staging) {
  const struct mr_tensor *tt = &L->model.graph.tensors[t];
  int64_t in = local_numel(L, coord, before, t), out = local_numel(L, coord, &s->after, t);
  int k = s->group_size;
  int64_t count = 0, stage = in > out ? in : out;
  switch (s->kind) {
  case MR_RS_ALL_REDUCE:
    count = in;
    break;
  case MR_RS_ALL_GATHER:
    count = 0;
    for (int i = 0; i < k; i++) {
      int c2[MR_MESH_MAX_DIMS];
      memcpy(c2, coord, sizeof c2);
      c2[s->mesh_dim] = i;
      count += local_numel(L, c2, before, t);
    }
    stage = count;
    break;
  case MR_RS_REDUCE_SCATTER: {
    /* pieces padded to the largest (the first) */
    int64_t lenf = 1;
    int64_t off[MR_MAX_DIMS], len[MR_MAX_DIMS];
    mr_dist_local(&L->mesh, before, tt->ndim, tt->shape, coord, off, len);
    for (int d = 0; d < tt->ndim; d++)
      lenf *= d == s->tdim ? mr_split_len(len[d], k, 0) : len[d];
    count = lenf;
    stage = lenf * (k + 1);
    break;
  }
  case MR_RS_ALL_TO_ALL: {
    /* blocks padded to the largest: the split dim's first piece times the
     * gathered dim's extent on group coordinate 0 (the largest) */
    int64_t off[MR_MAX_DIMS], len[MR_MAX_DIMS], o0[MR_MAX_DIMS], l0[MR_MAX_DIMS], blk = 1;
    int c0[MR_MESH_MAX_DIMS];
    memcpy(c0, coord, sizeof c0);
    c0[s->mesh_dim] = 0;
    mr_dist_local(&L->mesh, before, tt->ndim, tt->shape, coord, off, len);
    mr_dist_local(&L->mesh, before, tt->ndim, tt->shape, c0, o0, l0);
    for (int d = 0; d < tt->ndim; d++)
      blk *= d == s->tdim2 ? mr_split_len(l0[d], k, 0) : d == s->tdim ? l0[d] : len[d];
    count = blk;
    stage = 2 * blk * k;
    break;
  }
  default:
    count = 0;
  }
  if (staging && stage > *staging)
    *staging = stage;
  return count;
}

/* ---- schedule ---- */

/* This rank's training schedule as (pass template, micro-batch) pairs;
 * returns the count. */
static int schedule(const struct build *b, const int *fpass, const int *bpass, int *out_pass,
                    int *out_micro) {
  const struct mr_layout *lay = &b->L->lay;
  struct mr_sched_pass *sp = malloc((size_t)(2 * lay->n_micro * lay->vp + 1) * sizeof *sp);
  if (sp == NULL)
    return MR_ENOMEM;
  int n = mr_pipeline_schedule(lay->schedule, lay->pp, b->p->pipe, lay->vp, lay->n_micro, sp);
  for (int i = 0; i < n; i++) {
    out_pass[i] = sp[i].backward ? bpass[sp[i].chunk] : fpass[sp[i].chunk];
    out_micro[i] = sp[i].micro;
  }
  free(sp);
  return n;
}

/* ---- events ---- */

static int add_event(struct build *b, struct mr_ins *in, enum mr_comm_event_kind kind,
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

/* Events of edge e's steps: all (only -1), those off mesh dim `only`'s
 * complement... that is: only == -1 every step, only >= 0 the steps on that
 * mesh dim, only == -2 - d the steps off mesh dim d. */
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
      int64_t count = step_count(L, b->p->coord, ed->tensor, &before, st, staging);
      char what[160];
      snprintf(what, sizeof what, "%s of %.80s", mr_reshard_kind_name(st->kind),
               g->tensors[ed->tensor].name);
      add_event(b, in, step_event(st->kind), dim_group(b->p, st->mesh_dim), -1, count,
                g->tensors[ed->tensor].dtype, 0, -1, what);
    }
    before = st->after;
  }
}

/* The grad-sync edge of parameter t, or -1. */
static int sync_edge(const struct mr_lowered *L, int t) {
  int gt = L->model.graph.tensors[t].grad;
  for (int e = 0; e < L->dg.n_edges; e++)
    if (L->dg.edges[e].kind == MR_EDGE_GRAD_SYNC && L->dg.edges[e].tensor == gt)
      return e;
  return -1;
}

static void small_allreduces(struct build *b, struct mr_ins *in, const char *what, int max) {
  const struct mr_rank_program *p = b->p;
  const struct mr_group_desc *gs[3] = {&p->model_group, &p->data_group, &p->pipe_group};
  (void)max;
  for (int i = 0; i < 3; i++)
    if (gs[i]->n > 1)
      add_event(b, in, MR_CEV_ALL_REDUCE, gs[i], -1, 1, MR_F32, 0, -1, what);
}

/* Fills the events of instruction in (expanded, with micro). */
static void events_of(struct build *b, struct mr_ins *in, int64_t *staging) {
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
    add_event(b, in, in->kind == MR_INS_SEND ? MR_CEV_SEND : MR_CEV_RECV, &p->pipe_group,
              in->peer, p->buf[in->tensor].numel, lt->dtype, 0,
              in->kind == MR_INS_SEND ? MR_CEV_DETACHED : -1, what);
    break;
  }
  case MR_INS_GATHER: {
    const struct mr_param_plan *pp = &p->params[p->param_of[in->tensor]];
    snprintf(what, sizeof what, "ZeRO-3 gather of %.80s", g->tensors[in->tensor].name);
    add_event(b, in, MR_CEV_ALL_GATHER, &p->data_group, -1, pp->block * lay->dp, MR_F32, 0,
              -1, what);
    break;
  }
  case MR_INS_RESHARD:
    edge_events(b, in, in->edge, -1, staging);
    break;
  case MR_INS_GRAD: {
    struct mr_param_plan *pp = &p->params[p->param_of[in->tensor]];
    int e = sync_edge(L, in->tensor);
    snprintf(what, sizeof what, "gradient of %.80s", g->tensors[in->tensor].name);
    /* off the data dim (a slice to the parameter's shard, a sum over
     * sequence-parallel ranks): every micro-batch, before accumulating */
    if (e >= 0)
      edge_events(b, in, e, -2 - L->data_dim, staging);
    if (lay->zero >= 2) {
      add_event(b, in, MR_CEV_REDUCE_SCATTER, &p->data_group, -1, pp->block, MR_F32, 0, -1,
                what);
    } else if (in->micro == lay->n_micro - 1 && e >= 0 && L->data_dim >= 0) {
      int first = p->n_ev;
      edge_events(b, in, e, L->data_dim, NULL); /* in place on the accumulator */
      if (p->n_ev > first)
        pp->sync_ev = first;
    }
    break;
  }
  case MR_INS_OPTIMIZER:
    small_allreduces(b, in, "gradient norm", 0);
    if (lay->zero == 1 || lay->zero == 2)
      for (int i = 0; i < p->n_params; i++) {
        if (p->params[i].replica_of >= 0)
          continue;
        snprintf(what, sizeof what, "updated %.80s", g->tensors[p->params[i].tensor].name);
        add_event(b, in, MR_CEV_ALL_GATHER, &p->data_group, -1, p->params[i].block * lay->dp,
                  MR_F32, 0, -1, what);
      }
    break;
  case MR_INS_PARAM_SYNC:
    for (int i = 0; i < p->n_params; i++) {
      const struct mr_param_plan *pp = &p->params[i];
      snprintf(what, sizeof what, "updated %.80s", g->tensors[pp->tensor].name);
      if (pp->replica_of >= 0)
        add_event(b, in, MR_CEV_RECV, &p->pipe_group, pp->replica_of, pp->numel, MR_F32, 0, -1,
                  what);
      for (int k = 0; k < pp->n_replicas; k++)
        add_event(b, in, MR_CEV_SEND, &p->pipe_group, pp->replicas[k], pp->numel, MR_F32, 0,
                  MR_CEV_DETACHED, what);
    }
    break;
  case MR_INS_STEP_END:
    if (lay->pp > 1)
      add_event(b, in, MR_CEV_BROADCAST, &p->pipe_group, -1, 1, MR_F32, lay->pp - 1, -1,
                "the loss");
    break;
  default:
    break;
  }
}

static void expand(struct build *b, int pass, int micro) {
  struct mr_rank_program *p = b->p;
  const struct mr_pass *ps = &p->passes[pass];
  int slots = p->stash_slots[ps->chunk] > 0 ? p->stash_slots[ps->chunk] : 1;
  for (int i = ps->first; i < ps->first + ps->n && b->rc == 0; i++) {
    struct mr_ins in = p->tmpl[i];
    in.micro = micro;
    in.slot = micro % slots;
    struct mr_ins *x = push_ins(b, &p->step, &p->n_step, &b->cap_step, in);
    if (x)
      events_of(b, x, &p->scratch_bytes);
  }
}

static void emit_step(struct build *b, enum mr_ins_kind k) {
  struct mr_ins *x = push_ins(b, &b->p->step, &b->p->n_step, &b->cap_step, ins(k));
  if (x)
    events_of(b, x, &b->p->scratch_bytes);
}

int mr_rank_program_build(const struct mr_lowered *L, int rank, struct mr_rank_program *p) {
  memset(p, 0, sizeof *p);
  struct build b = {.p = p, .L = L, .g = &L->model.graph};
  const struct mr_layout *lay = &L->lay;
  int rc;
  p->L = L;
  p->rank = rank;
  mr_lower_coords(lay, rank, &p->pipe, &p->data, &p->model);
  if (L->data_dim >= 0)
    p->coord[L->data_dim] = p->data;
  if (L->model_dim >= 0)
    p->coord[L->model_dim] = p->model;
  MR_TRY_GOTO(rc, make_groups(p), err);
  MR_TRY_GOTO(rc, local_graph(&b), err);
  rc = MR_ENOMEM;
  b.my_chunk = calloc((size_t)L->n_chunks, sizeof *b.my_chunk);
  p->passes = calloc((size_t)(2 * L->n_chunks), sizeof *p->passes);
  if (!b.my_chunk || !p->passes)
    goto err;
  for (int c = 0; c < L->n_chunks; c++)
    b.my_chunk[c] = c % lay->pp == p->pipe;
  MR_TRY_GOTO(rc, plan_params(&b), err);
  MR_TRY_GOTO(rc, producers(&b), err);
  int fpass[64], bpass[64];
  if (lay->vp > 64) {
    rc = mr_error_set(MR_ENOTSUP, "lowering: more than 64 virtual stages");
    goto err;
  }
  for (int j = 0; j < lay->vp; j++) {
    int c = j * lay->pp + p->pipe;
    fpass[j] = p->n_passes;
    MR_TRY_GOTO(rc, build_pass(&b, c, 0), err);
    bpass[j] = p->n_passes;
    MR_TRY_GOTO(rc, build_pass(&b, c, 1), err);
  }
  /* stash slots: micro-batches in flight per chunk under the schedule */
  int cap = 2 * lay->n_micro * lay->vp + 4;
  int *sp = malloc((size_t)cap * sizeof *sp), *sm = malloc((size_t)cap * sizeof *sm);
  int *fly = calloc((size_t)L->n_chunks, sizeof *fly);
  p->stash_slots = calloc((size_t)L->n_chunks, sizeof *p->stash_slots);
  if (!sp || !sm || !fly || !p->stash_slots) {
    free(sp);
    free(sm);
    free(fly);
    rc = MR_ENOMEM;
    goto err;
  }
  int ns = schedule(&b, fpass, bpass, sp, sm);
  if (ns < 0) {
    free(sp);
    free(sm);
    free(fly);
    rc = ns;
    goto err;
  }
  for (int i = 0; i < ns; i++) {
    int c = p->passes[sp[i]].chunk;
    fly[c] += p->passes[sp[i]].backward ? -1 : 1;
    if (fly[c] > p->stash_slots[c])
      p->stash_slots[c] = fly[c];
  }
  free(fly);
  rc = plan_buffers(&b);
  if (rc < 0) {
    free(sp);
    free(sm);
    goto err;
  }
  for (int i = 0; i < ns && b.rc == 0; i++)
    expand(&b, sp[i], sm[i]);
  free(sp);
  free(sm);
  emit_step(&b, MR_INS_SYNC_WAIT);
  emit_step(&b, MR_INS_OPTIMIZER);
  int tied = 0;
  for (int i = 0; i < p->n_params; i++)
    tied |= p->params[i].replica_of >= 0 || p->params[i].n_replicas > 0;
  if (tied)
    emit_step(&b, MR_INS_PARAM_SYNC);
  emit_step(&b, MR_INS_STEP_END);
  p->n_ev_step = p->n_ev;
  /* an evaluation batch: forward passes, micro-batch outer, chunks inner */
  p->eval_passes = malloc((size_t)(lay->n_micro * lay->vp) * sizeof *p->eval_passes);
  p->eval_micro = malloc((size_t)(lay->n_micro * lay->vp) * sizeof *p->eval_micro);
  if (!p->eval_passes || !p->eval_micro) {
    rc = MR_ENOMEM;
    goto err;
  }
  for (int m = 0; m < lay->n_micro; m++)
    for (int j = 0; j < lay->vp; j++) {
      p->eval_passes[p->n_eval] = fpass[j];
      p->eval_micro[p->n_eval++] = m;
      const struct mr_pass *ps = &p->passes[fpass[j]];
      for (int i = ps->first; i < ps->first + ps->n && b.rc == 0; i++) {
        struct mr_ins in = p->tmpl[i];
        in.micro = m;
        in.slot = 0;
        events_of(&b, &in, &p->scratch_bytes);
      }
    }
  if (lay->pp > 1)
    add_event(&b, NULL, MR_CEV_BROADCAST, &p->pipe_group, -1, 1, MR_F32, lay->pp - 1, -1,
              "the evaluation loss");
  p->scratch_bytes = ALIGNED(p->scratch_bytes * 4);
  if (lay->zero >= 2) { /* reduce-scatter landing blocks, one per parameter */
    int64_t z = 0;
    for (int i = 0; i < p->n_params; i++)
      z += ALIGNED(p->params[i].block * 4);
    p->zero_tmp_bytes = z;
  }
  for (int i = 0; i < p->n_params; i++) {
    struct mr_param_plan *pp = &p->params[i];
    int e = sync_edge(L, pp->tensor);
    for (int s = 0; e >= 0 && s < L->dg.edges[e].plan.n_steps; s++)
      pp->off_data |= L->dg.edges[e].plan.steps[s].mesh_dim != L->data_dim;
    int64_t need = pp->block * lay->dp > pp->numel ? pp->block * lay->dp : pp->numel;
    if (pp->off_data && ALIGNED(need * 4) > p->grad_stage_bytes)
      p->grad_stage_bytes = ALIGNED(need * 4);
  }
  if (lay->zero == 1) { /* the block an all-gather sends */
    for (int i = 0; i < p->n_params; i++)
      if (ALIGNED(p->params[i].block * 4) > p->zero_tmp_bytes)
        p->zero_tmp_bytes = ALIGNED(p->params[i].block * 4);
  }
  if (b.rc < 0) {
    rc = b.rc;
    goto err;
  }
  for (int i = 0; i < p->n_step; i++) /* events name their instruction */
    for (int e = p->step[i].ev; e >= 0 && e < p->step[i].ev + p->step[i].n_ev; e++)
      p->ev[e].id = i;
  free(b.prod_chunk);
  free(b.prod_dir);
  free(b.my_chunk);
  return 0;
err:
  free(b.prod_chunk);
  free(b.prod_dir);
  free(b.my_chunk);
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

int mr_lower_check_all(const struct mr_job *job, int world) {
  struct mr_lowered L;
  MR_TRY(mr_lower_graph(job, world, &L));
  struct mr_rank_program *ps = calloc((size_t)world, sizeof *ps);
  struct mr_comm_trace *tr = calloc((size_t)world, sizeof *tr);
  int rc = MR_ENOMEM, built = 0;
  if (!ps || !tr)
    goto out;
  for (; built < world; built++)
    MR_TRY_GOTO(rc, mr_rank_program_build(&L, built, &ps[built]), out);
  for (int eval = 0; eval < 2; eval++) {
    for (int r = 0; r < world; r++)
      tr[r] = mr_rank_program_trace(&ps[r], eval);
    MR_TRY_GOTO(rc, mr_comm_check(tr, world), out);
  }
  rc = 0;
out:
  for (int r = 0; ps && r < built; r++)
    mr_rank_program_close(&ps[r]);
  free(ps);
  free(tr);
  mr_lowered_close(&L);
  return rc;
}

static const char *const kind_names[MR_INS_KIND_COUNT] = {
    "recv", "load", "seed", "gather", "reshard", "kernel", "loss", "grad",
    "grad_wait", "send", "sync_wait", "optimizer", "param_sync", "step_end"};

void mr_ins_describe(const struct mr_rank_program *p, const struct mr_ins *in, char *buf,
                     size_t n) {
  const struct mr_graph *g = &p->L->model.graph;
  int k = 0;
  if (in->pass >= 0)
    k = snprintf(buf, n, "%s c%d m%d ", p->passes[in->pass].backward ? "B" : "F",
                 p->passes[in->pass].chunk, in->micro);
  if (k < 0 || (size_t)k >= n)
    return;
  k += snprintf(buf + k, n - (size_t)k, "%s", kind_names[in->kind]);
  if ((size_t)k >= n)
    return;
  switch (in->kind) {
  case MR_INS_KERNEL:
    snprintf(buf + k, n - (size_t)k, " %s -> %s", mr_op_def(g->ops[in->op].kind)->name,
             g->tensors[g->ops[in->op].out[0]].name);
    break;
  case MR_INS_RECV:
  case MR_INS_SEND:
    snprintf(buf + k, n - (size_t)k, " %s %s rank %d", p->local.tensors[in->tensor].name,
             in->kind == MR_INS_SEND ? "to" : "from", in->peer);
    break;
  case MR_INS_RESHARD: {
    const struct mr_reshard_edge *e = &p->L->dg.edges[in->edge];
    char a[96], c[96];
    mr_dist_format(&e->src, a, sizeof a);
    mr_dist_format(&e->dst, c, sizeof c);
    snprintf(buf + k, n - (size_t)k, " %s %s -> %s", g->tensors[e->tensor].name, a, c);
    break;
  }
  case MR_INS_GATHER:
  case MR_INS_GRAD:
    snprintf(buf + k, n - (size_t)k, " %s", g->tensors[in->tensor].name);
    break;
  default:
    break;
  }
}

void mr_rank_program_dump(const struct mr_rank_program *p, FILE *f) {
  const struct mr_lowered *L = p->L;
  char lay[256];
  mr_layout_format(&L->lay, lay, sizeof lay);
  fprintf(f, "rank %d of %d: pipeline stage %d, data %d, model %d\nlayout: %s\n", p->rank,
          L->lay.world, p->pipe, p->data, p->model, lay);
  fprintf(f, "groups: %s %s %s\n", p->pipe_group.name, p->data_group.name, p->model_group.name);
  fprintf(f, "chunks:");
  for (int c = p->pipe; c < L->n_chunks; c += L->lay.pp)
    fprintf(f, " %d (layers %d..%d, %d micro-batches in flight, %lld bytes each)", c,
            L->chunk_first_layer[c], L->chunk_first_layer[c + 1] - 1, p->stash_slots[c],
            (long long)p->stash_bytes[c]);
  fprintf(f, "\nmemory (bytes): parameters %lld, gradients %lld, optimizer %lld%s, "
          "activations kept %lld, arena %lld, send buffers %lld, reshard staging %lld, "
          "ZeRO blocks %lld, gradient staging %lld; peak %lld\n",
          (long long)p->param_bytes, (long long)p->acc_bytes, (long long)p->optim_bytes,
          L->lay.offload ? " (offloaded)" : "",
          (long long)(mr_rank_program_peak_bytes(p) - p->param_bytes - p->acc_bytes -
                      (L->lay.offload ? 0 : p->optim_bytes) - p->arena_bytes -
                      p->send_bytes - 3 * p->scratch_bytes - p->zero_tmp_bytes -
                      p->grad_stage_bytes),
          (long long)p->arena_bytes, (long long)p->send_bytes, (long long)(3 * p->scratch_bytes),
          (long long)p->zero_tmp_bytes, (long long)p->grad_stage_bytes,
          (long long)mr_rank_program_peak_bytes(p));
  fprintf(f, "step: %d instructions, %d communication events\n", p->n_step, p->n_ev_step);
  for (int i = 0; i < p->n_step; i++) {
    char d[400];
    mr_ins_describe(p, &p->step[i], d, sizeof d);
    fprintf(f, "%5d  %s", i, d);
    for (int e = p->step[i].ev; e >= 0 && e < p->step[i].ev + p->step[i].n_ev; e++)
      fprintf(f, "%s%s %s count %lld", e == p->step[i].ev ? "  [" : "; ",
              mr_comm_event_kind_name(p->ev[e].kind), p->ev[e].group, (long long)p->ev[e].count);
    fprintf(f, "%s\n", p->step[i].n_ev > 0 ? "]" : "");
  }
}
