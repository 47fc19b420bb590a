/* lower_memory.c - a rank program's buffers: what lives where, planned
 * before anything runs. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "compiler/fit.h"
#include "compiler/ops.h"
#include "compiler/spmd/lower_internal.h"

#define ALIGN 64
#define ALIGNED(b) (((b) + ALIGN - 1) / ALIGN * ALIGN)

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
      if (mr__lower_nth_in(b, in->op, i) >= 0)
        rd[(*nr)++] = mr__lower_nth_in(b, in->op, i);
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

/* Whether op `op` can add into its output t (mr_op_def.accum_outs). */
static int accumulates_into(const struct mr_graph *g, int op, int t) {
  const struct mr_op *o = &g->ops[op];
  for (int j = 0; j < o->n_out; j++)
    if (o->out[j] == t)
      return (int)((mr_op_def(o->kind)->accum_outs >> j) & 1u);
  return 0;
}

/* Parameters are persistent (under ZeRO-3 only their block); a gradient
 * the op producing it can add into lives in its accumulator. */
static void place_params(struct build *b) {
  struct mr_rank_program *p = b->p;
  const struct mr_graph *g = b->g;
  const struct mr_layout *lay = &b->L->lay;
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
    /* reduce-scatter pads the gradient to dp blocks (a gradient larger than
     * the parameter's shard, sliced to it on the way, keeps its size) */
    struct mr_lbuf *gb = &p->buf[g->tensors[pp->tensor].grad];
    if (lay->zero >= 2 && padded > gb->bytes)
      gb->bytes = padded;
    /* the op producing the gradient writes the accumulator itself, where
     * its synchronisation then runs: with one micro-batch, or with several
     * where the op can add into it (the weight-gradient GEMM with beta 1,
     * the norms' and the embedding's column sums): no buffer per
     * micro-batch and no pass adding it to the accumulator */
    int producer = g->tensors[g->tensors[pp->tensor].grad].producer;
    int adds = lay->accum_in_op && producer >= 0 &&
               accumulates_into(g, producer, g->tensors[pp->tensor].grad);
    if ((lay->n_micro == 1 || adds) && lay->zero < 2 && !pp->off_data && pp->replica_of < 0) {
      gb->region = MR_REG_ACC;
      gb->offset = pp->acc_offset;
    }
  }
  p->param_bytes = param;
}

/* What a chunk's forward writes and its backward reads is kept between
 * them, in the chunk's stash (fw: scratch, a chunk per local tensor). */
static void place_stash(struct build *b, int *fw) {
  struct mr_rank_program *p = b->p;
  const struct mr_graph *g = b->g;
  int rd[MR_OP_MAX_IN + 2], wr[MR_OP_MAX_OUT + 3], nr, nw;
  for (int t = 0; t < b->L->n_local; t++)
    fw[t] = -1;
  for (int pi = 0; pi < p->n_passes; pi++) {
    const struct mr_pass *ps = &p->passes[pi];
    if (ps->backward)
      continue;
    for (int i = ps->first; i < ps->first + ps->n; i++) {
      ins_access(b, &p->tmpl[i], rd, &nr, wr, &nw);
      for (int j = 0; j < nw; j++)
        if (wr[j] >= g->n_tensors || g->tensors[wr[j]].role != MR_ROLE_PARAM)
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
}

/* One pass's live ranges in the arena: first[t] and last[t], the
 * instructions writing a tensor first and reading it last (a gradient
 * whose reduce-scatter is in flight lives to the pass's end); its sends'
 * offsets; and every read having a home.  Returns 0 or MR_EPLAN. */
static int pass_lifetimes(struct build *b, struct mr_pass *ps, int *first, int *last) {
  struct mr_rank_program *p = b->p;
  const struct mr_graph *g = b->g;
  int rd[MR_OP_MAX_IN + 2], wr[MR_OP_MAX_OUT + 3], nr, nw;
  for (int t = 0; t < b->L->n_local; t++)
    first[t] = last[t] = -1;
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
      if (b->L->lay.zero >= 2 && first[gt] >= 0) /* reduce-scatter in flight */
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
          (p->buf[rd[j]].region == MR_REG_ARENA && first[rd[j]] < 0))
        return mr_error_set(MR_EPLAN, "lowering: rank %d reads %s in pass (chunk %d, %s) "
                            "but nothing there writes it", p->rank,
                            p->local.tensors[rd[j]].name, ps->chunk,
                            ps->backward ? "backward" : "forward");
  }
  return 0;
}

/* First fit of one pass's arena tensors over their lifetimes; returns the
 * pass's high-water mark. */
static int64_t pass_fit(struct build *b, struct mr_pass *ps, const int *first, const int *last,
                        struct mr_fit *fit) {
  struct mr_rank_program *p = b->p;
  int rd[MR_OP_MAX_IN + 2], wr[MR_OP_MAX_OUT + 3], nr, nw;
  fit->n = 0;
  int64_t high = 0;
  for (int i = 0; i < ps->n; i++) {
    const struct mr_ins *in = &p->tmpl[ps->first + i];
    ins_access(b, in, rd, &nr, wr, &nw);
    for (int j = 0; j < nw; j++) {
      int t = wr[j];
      if (first[t] != i || ps->arena_off[t] >= 0)
        continue;
      ps->arena_off[t] = mr_fit_place(fit, p->buf[t].bytes, t);
      if (ps->arena_off[t] + p->buf[t].bytes > high)
        high = ps->arena_off[t] + p->buf[t].bytes;
    }
    for (int t = 0; t < b->L->n_local; t++) /* small graphs: a scan is fine */
      if (last[t] == i && ps->arena_off[t] >= 0)
        mr_fit_release(fit, t);
  }
  return high;
}

/* Every local tensor's home: parameters, the accumulators, each chunk's
 * stash, and the arena, first fit per pass; the send slots. */
int mr__lower_plan_buffers(struct build *b) {
  struct mr_rank_program *p = b->p;
  const struct mr_lowered *L = b->L;
  int nl = L->n_local;
  int *fw = malloc((size_t)nl * sizeof *fw);
  int *first = malloc((size_t)nl * sizeof *first), *last = malloc((size_t)nl * sizeof *last);
  struct mr_fit fit = {malloc((size_t)(nl + 1) * sizeof(struct mr_fit_live)), 0};
  p->stash_bytes = calloc((size_t)L->n_chunks, sizeof *p->stash_bytes);
  p->send_off = malloc((size_t)nl * sizeof *p->send_off);
  if (!fw || !first || !last || !fit.lv || !p->stash_slots || !p->stash_bytes || !p->send_off) {
    free(fw);
    free(first);
    free(last);
    free(fit.lv);
    return MR_ENOMEM;
  }
  for (int t = 0; t < nl; t++)
    p->send_off[t] = -1;
  place_params(b);
  place_stash(b, fw);
  int64_t arena = 0, send = 0;
  for (int pi = 0; pi < p->n_passes && b->rc == 0; pi++) {
    struct mr_pass *ps = &p->passes[pi];
    ps->arena_off = malloc((size_t)nl * sizeof *ps->arena_off);
    if (!ps->arena_off) {
      b->rc = MR_ENOMEM;
      break;
    }
    for (int t = 0; t < nl; t++)
      ps->arena_off[t] = -1;
    b->rc = pass_lifetimes(b, ps, first, last);
    ps->send_base = send;
    /* a slot per micro-batch: this rank's of a step, an evaluation's */
    send += ps->send_bytes * (p->n_micro > L->lay.n_micro ? p->n_micro : L->lay.n_micro);
    int64_t high = pass_fit(b, ps, first, last, &fit);
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
int64_t mr__lower_step_count(const struct mr_lowered *L, const int *coord, int t,
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

