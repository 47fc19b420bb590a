/* lower.c - the shared distributed graph: layout, recomputation, pipeline
 * chunks, completion. */
#include "compiler/spmd/lower.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compiler/autodiff.h"
#include "common/error.h"
#include "compiler/ops.h"
#include "compiler/planner/partition.h"

/* strategy.data_parallel.micro_batches against the layout: one count per
 * data-parallel rank, adding up to the step's dp x n_micro slices; whole
 * rounds of the interleaved schedule.  (Under ZeRO-2/3 every micro-batch's
 * collectives span the data ranks: the ranks with fewer run phantom
 * slots, struct mr_rank_program.n_slots.) */
static int dp_micro_check(const struct mr_job *job, const struct mr_layout *lay) {
  const struct mr_strategy_hint *h = &job->strategy;
  if (h->n_dp_micro == 0)
    return 0;
  const char *f = "strategy.data_parallel.micro_batches";
  if (h->n_dp_micro != lay->dp)
    return mr_error_set(MR_EINVAL, "%s: %s: expected %d entries, one per data-parallel rank, "
                        "got %d", job->path, f, lay->dp, h->n_dp_micro);
  int64_t sum = 0;
  for (int d = 0; d < lay->dp; d++) {
    if (lay->vp > 1 && h->dp_micro[d] % lay->pp != 0)
      return mr_error_set(MR_EINVAL, "%s: %s[%d]: the interleaved schedule needs a multiple of "
                          "pipeline_parallel.degree (%d), got %d", job->path, f, d, lay->pp,
                          h->dp_micro[d]);
    sum += h->dp_micro[d];
  }
  if (sum != (int64_t)lay->dp * lay->n_micro)
    return mr_error_set(MR_EINVAL, "%s: %s: expected counts adding up to data_parallel.degree "
                        "(%d) x micro-batches per step (%d) = %d, got %lld", job->path, f,
                        lay->dp, lay->n_micro, lay->dp * lay->n_micro, (long long)sum);
  return 0;
}

int mr_layout_from_job(const struct mr_job *job, int world, struct mr_layout *lay) {
  const struct mr_strategy_hint *h = &job->strategy;
  memset(lay, 0, sizeof *lay);
  lay->world = world;
  lay->accum_in_op = h->grad_accum_in_op != 0;
  lay->tp = h->tp > 0 ? h->tp : 1;
  lay->pp = h->pp > 0 ? h->pp : 1;
  if (world % (lay->tp * lay->pp) != 0)
    return mr_error_set(MR_EINVAL, "%s: strategy: tensor_parallel.degree (%d) x "
                        "pipeline_parallel.degree (%d) does not divide the %d ranks",
                        job->path, lay->tp, lay->pp, world);
  lay->dp = h->dp > 0 ? h->dp : world / (lay->tp * lay->pp);
  if (lay->dp * lay->tp * lay->pp != world)
    return mr_error_set(MR_EINVAL, "%s: strategy: data (%d) x tensor (%d) x pipeline (%d) "
                        "parallel degrees must multiply to the %d ranks", job->path,
                        lay->dp, lay->tp, lay->pp, world);
  lay->mapping = h->mapping == MR_MAP_TP_PP_DP ? MR_MAP_TP_PP_DP : MR_MAP_TP_DP_PP;
  lay->schedule = h->pp_schedule_set ? h->pp_schedule : MR_PP_1F1B;
  lay->vp = lay->pp > 1 && h->virtual_stages > 1 ? h->virtual_stages : 1;
  if (lay->vp > 1)
    lay->schedule = MR_PP_INTERLEAVED;
  else if (lay->schedule == MR_PP_INTERLEAVED) /* one chunk per stage: plain 1F1B */
    lay->schedule = MR_PP_1F1B;
  int m = h->micro_batches > 0 ? h->micro_batches : 1;
  int accum = h->grad_accum_steps > 0 ? h->grad_accum_steps : 1;
  lay->n_micro = m * accum;
  int64_t b = job->train.global_batch;
  if (b % ((int64_t)lay->dp * lay->n_micro) != 0)
    return mr_error_set(MR_EINVAL, "%s: train.global_batch (%lld) must be a multiple of the "
                        "data-parallel degree (%d) x micro-batches per step (%d = "
                        "pipeline_parallel.micro_batches %d x gradient_accumulation_steps %d)",
                        job->path, (long long)b, lay->dp, lay->n_micro, m, accum);
  if (lay->vp > 1 && lay->n_micro % lay->pp != 0)
    return mr_error_set(MR_EINVAL, "%s: the interleaved schedule needs the micro-batches per "
                        "step (%d) to be a multiple of pipeline_parallel.degree (%d)",
                        job->path, lay->n_micro, lay->pp);
  lay->micro_seqs = b / lay->n_micro;
  lay->sp = h->sequence_parallel == 1 && lay->tp > 1;
  lay->zero = h->zero_stage > 0 && lay->dp > 1 ? h->zero_stage : 0;
  lay->offload = h->offload == 1 && h->zero_stage >= 1;
  lay->recompute = h->recompute == 1 ? (h->recompute_granularity == MR_RECOMPUTE_SELECTIVE
                                            ? MR_RC_SELECTIVE
                                            : MR_RC_FULL)
                                     : MR_RC_NONE;
  lay->recompute_every = h->recompute_every_n_layers > 0 ? h->recompute_every_n_layers : 1;
  lay->amp = h->amp_dtype;
  return dp_micro_check(job, lay);
}

void mr_layout_format(const struct mr_layout *lay, char *buf, size_t n) {
  static const char *const sched[] = {"1f1b", "gpipe", "interleaved"};
  static const char *const rc[] = {"none", "selective", "full"};
  int k = snprintf(buf, n, "dp%d x tp%d x pp%d", lay->dp, lay->tp, lay->pp);
  if (lay->pp > 1 && (size_t)k < n)
    k += snprintf(buf + k, n - (size_t)k, " (%s%s%.0d)", sched[lay->schedule],
                  lay->vp > 1 ? ", v" : "", lay->vp > 1 ? lay->vp : 0);
  if (lay->dp > 1 && lay->pp > 1 && (size_t)k < n)
    k += snprintf(buf + k, n - (size_t)k, ", mesh %s",
                  lay->mapping == MR_MAP_TP_DP_PP ? "tp,dp,pp" : "tp,pp,dp");
  if ((size_t)k < n)
    snprintf(buf + k, n - (size_t)k,
             ", %d micro-batches of %lld, sequence parallel %s, ZeRO-%d%s, recompute %s",
             lay->n_micro, (long long)lay->micro_seqs, lay->sp ? "on" : "off", lay->zero,
             lay->offload ? " (offload)" : "", rc[lay->recompute]);
}

void mr_lowered_format(const struct mr_lowered *L, char *buf, size_t n) {
  mr_layout_format(&L->lay, buf, n);
  size_t k = strlen(buf);
  for (int d = 0; L->dp_micro != NULL && d < L->lay.dp && k + 16 < n; d++)
    k += (size_t)snprintf(buf + k, n - k, "%s%d", d ? "," : " (by data rank: ", L->dp_micro[d]);
  if (L->dp_micro != NULL && k + 2 < n)
    snprintf(buf + k, n - k, ")");
}

int mr_lower_rank(const struct mr_layout *lay, int pipe, int data, int model) {
  if (lay->mapping == MR_MAP_TP_DP_PP)
    return (pipe * lay->dp + data) * lay->tp + model;
  return (data * lay->pp + pipe) * lay->tp + model;
}

void mr_lower_coords(const struct mr_layout *lay, int rank, int *pipe, int *data,
                     int *model) {
  *model = rank % lay->tp;
  int rest = rank / lay->tp;
  if (lay->mapping == MR_MAP_TP_DP_PP) {
    *data = rest % lay->dp;
    *pipe = rest / lay->dp;
  } else {
    *pipe = rest % lay->pp;
    *data = rest / lay->pp;
  }
}

/* Layer of a forward op from its output's name ("L3.q" -> 3); ops before
 * the first layer are -1 (embedding), after the last n_layers (head). */
static void forward_layers(const struct mr_graph *g, int n_layers, int *layer) {
  int seen = 0;
  for (int k = 0; k < g->n_forward_ops; k++) {
    int l;
    const char *name = g->tensors[g->ops[k].out[0]].name;
    if (sscanf(name, "L%d.", &l) == 1 && l >= 0 && l < n_layers) {
      layer[k] = l;
      seen = 1;
    } else {
      layer[k] = seen ? n_layers : -1;
    }
  }
}

/* Rebuilds g's op array in `order` (n old op ids), fixing producers. */
static int reorder_ops(struct mr_graph *g, const int *order, int n) {
  struct mr_op *ops = malloc((size_t)(n > 0 ? n : 1) * sizeof *ops);
  int *inv = malloc((size_t)(g->n_ops > 0 ? g->n_ops : 1) * sizeof *inv);
  if (!ops || !inv) {
    free(ops);
    free(inv);
    return MR_ENOMEM;
  }
  for (int k = 0; k < g->n_ops; k++)
    inv[k] = -1;
  for (int j = 0; j < n; j++) {
    ops[j] = g->ops[order[j]];
    inv[order[j]] = j;
  }
  for (int t = 0; t < g->n_tensors; t++)
    if (g->tensors[t].producer >= 0)
      g->tensors[t].producer = inv[g->tensors[t].producer];
  memcpy(g->ops, ops, (size_t)n * sizeof *ops);
  g->n_ops = n;
  free(ops);
  free(inv);
  return 0;
}

/* Recomputation.  Groups: full, `every` consecutive layers; selective,
 * each layer's attention op alone.  For each group the forward ops whose
 * outputs the group's backward reads (and what they need in turn) are
 * repeated just before the group's first backward op, and that backward
 * reads the repeats. */
static int recompute_pass(struct mr_graph *g, int n_layers, int kind, int every) {
  int n_fwd = g->n_forward_ops, n0 = g->n_ops, rc = 0;
  int *layer = malloc((size_t)n_fwd * sizeof *layer);
  int *copy_of = malloc((size_t)g->n_tensors * sizeof *copy_of);
  char *need = calloc((size_t)n_fwd, 1);
  int groups = kind == MR_RC_FULL ? (n_layers + every - 1) / every : n_layers;
  int *first_bwd = malloc((size_t)(groups > 0 ? groups : 1) * sizeof *first_bwd);
  int *gstart = malloc((size_t)(groups + 1) * sizeof *gstart);
  if (!layer || !copy_of || !need || !first_bwd || !gstart) {
    rc = MR_ENOMEM;
    goto out;
  }
  forward_layers(g, n_layers, layer);
  for (int t = 0; t < g->n_tensors; t++)
    copy_of[t] = -1;
  int n_tensors0 = g->n_tensors;
  for (int G = 0; G < groups; G++) {
    int lo = kind == MR_RC_FULL ? G * every : G;
    int hi = kind == MR_RC_FULL ? (lo + every < n_layers ? lo + every : n_layers) : G + 1;
    /* which forward ops of the group the group's backward reads */
    memset(need, 0, (size_t)n_fwd);
    first_bwd[G] = -1;
    for (int k = n_fwd; k < n0; k++) {
      int f = g->ops[k].fwd_op, l = f >= 0 ? layer[f] : -2;
      if (l < lo || l >= hi)
        continue;
      if (first_bwd[G] < 0)
        first_bwd[G] = k;
      for (int i = 0; i < g->ops[k].n_in; i++) {
        int t = g->ops[k].in[i];
        int p = t >= 0 && t < n_tensors0 ? g->tensors[t].producer : -1;
        if (p >= 0 && p < n_fwd && layer[p] >= lo && layer[p] < hi &&
            (kind == MR_RC_FULL || g->ops[p].kind == MR_OP_ATTENTION))
          need[p] = 1;
      }
    }
    if (kind == MR_RC_FULL) /* and what those read inside the group */
      for (int k = n_fwd - 1; k >= 0; k--) {
        if (!need[k])
          continue;
        for (int i = 0; i < g->ops[k].n_in; i++) {
          int t = g->ops[k].in[i], p = t >= 0 ? g->tensors[t].producer : -1;
          if (p >= 0 && p < n_fwd && layer[p] >= lo && layer[p] < hi)
            need[p] = 1;
        }
      }
    gstart[G] = g->n_ops;
    for (int k = 0; k < n_fwd; k++) {
      if (!need[k])
        continue;
      struct mr_op o = g->ops[k];
      int in[MR_OP_MAX_IN];
      for (int i = 0; i < o.n_in; i++)
        in[i] = o.in[i] >= 0 && copy_of[o.in[i]] >= 0 ? copy_of[o.in[i]] : o.in[i];
      char nm[MR_TENSOR_NAME_MAX];
      snprintf(nm, sizeof nm, "rc/%.80s", g->tensors[o.out[0]].name);
      int out[MR_OP_MAX_OUT];
      int id = mr_graph_op(g, o.kind, nm, in, o.n_in, o.attr, out);
      if (id < 0) {
        rc = id;
        goto out;
      }
      g->ops[id].backward = 1;
      g->ops[id].fwd_op = k;
      for (int j = 0; j < o.n_out; j++)
        copy_of[o.out[j]] = out[j];
    }
    /* the group's backward reads the repeats */
    for (int k = n_fwd; k < n0; k++) {
      int f = g->ops[k].fwd_op, l = f >= 0 ? layer[f] : -2;
      if (l < lo || l >= hi)
        continue;
      for (int i = 0; i < g->ops[k].n_in; i++) {
        int t = g->ops[k].in[i];
        if (t >= 0 && t < n_tensors0 && copy_of[t] >= 0)
          g->ops[k].in[i] = copy_of[t];
      }
    }
    for (int k = 0; k < n_fwd; k++) /* copies are per group */
      if (need[k])
        for (int j = 0; j < g->ops[k].n_out; j++)
          copy_of[g->ops[k].out[j]] = -1;
  }
  gstart[groups] = g->n_ops;
  /* move each group's repeats in front of its first backward op */
  int *order = malloc((size_t)g->n_ops * sizeof *order), n = 0;
  if (!order) {
    rc = MR_ENOMEM;
    goto out;
  }
  for (int k = 0; k < n0; k++) {
    for (int G = 0; G < groups; G++)
      if (first_bwd[G] == k)
        for (int j = gstart[G]; j < gstart[G + 1]; j++)
          order[n++] = j;
    order[n++] = k;
  }
  rc = reorder_ops(g, order, n);
  free(order);
out:
  free(layer);
  free(copy_of);
  free(need);
  free(first_bwd);
  free(gstart);
  return rc;
}

static double op_flops(const struct mr_graph *g, int k) {
  const struct mr_op_def *d = mr_op_def(g->ops[k].kind);
  return d->flops ? d->flops(g, &g->ops[k]) : 0;
}

/* Megatron's layout, used when tensor parallelism is on and the job gives
 * no shard rules: column-parallel projections in, row-parallel out, the
 * embedding and the head split by vocabulary (with the vocabulary-parallel
 * loss).  LLaMA weights are [out, in] (q/k/v biases split with their
 * outputs); GPT-2's Conv1D weights [in, out],
 * its fused q|k|v weight [C, 3, C] (bias [3, C]) split along its last dim:
 * each rank a slice of the heads of q, k and v alike. */
static struct mr_shard_rule_placement shard0 = {"model", "Shard(0)"};
static struct mr_shard_rule_placement shard1 = {"model", "Shard(1)"};
static struct mr_shard_rule_placement shard2 = {"model", "Shard(2)"};
static struct mr_shard_rule llama_rules[] = {
    {"q_proj|k_proj|v_proj|gate_proj|up_proj|embed_tokens|lm_head", &shard0, 1},
    {"o_proj\\.weight|down_proj", &shard1, 1}, /* o_proj's bias: completion's (whole) */
};
/* with sequence parallelism the embedding stays whole, so that its output
 * is split by rows from the start (a vocabulary split would make it a
 * partial sum every rank must reduce) */
static struct mr_shard_rule llama_sp_rules[] = {
    {"q_proj|k_proj|v_proj|gate_proj|up_proj|lm_head", &shard0, 1},
    {"o_proj\\.weight|down_proj", &shard1, 1},
};
static struct mr_shard_rule gpt2_rules[] = {
    {"attn\\.c_attn\\.weight", &shard2, 1},
    {"mlp\\.c_fc\\.weight|attn\\.c_attn\\.bias", &shard1, 1},
    {"mlp\\.c_fc\\.bias|mlp\\.c_proj\\.weight|attn\\.c_proj\\.weight|wte", &shard0, 1},
};

int mr_lower_graph(const struct mr_job *job, int world, struct mr_lowered *L) {
  return mr_lower_graph_form(job, world, MR_LOSS_FUSED, L);
}

/* The layer of every op and the pipeline chunk it runs in: chunks
 * balanced by FLOPs, or as the job's pipeline_parallel.layers says. */
static int assign_chunks(const struct mr_job *job, struct mr_lowered *L) {
  const struct mr_layout *lay = &L->lay;
  struct mr_graph *g = &L->model.graph;
  int n_layers = (int)job->model.num_hidden_layers;
  L->op_layer = malloc((size_t)g->n_ops * sizeof *L->op_layer);
  L->op_chunk = malloc((size_t)g->n_ops * sizeof *L->op_chunk);
  L->n_chunks = lay->pp * lay->vp;
  L->chunk_first_layer = malloc((size_t)(L->n_chunks + 1) * sizeof *L->chunk_first_layer);
  if (!L->op_layer || !L->op_chunk || !L->chunk_first_layer)
    return MR_ENOMEM;
  forward_layers(g, n_layers, L->op_layer);
  for (int k = g->n_forward_ops; k < g->n_ops; k++)
    L->op_layer[k] = g->ops[k].fwd_op >= 0 ? L->op_layer[g->ops[k].fwd_op] : n_layers;
  if (n_layers < L->n_chunks)
    return mr_error_set(MR_EINVAL, "%s: %d layers cannot be split over %d pipeline chunks "
                        "(pipeline_parallel.degree %d x virtual_stages %d)", job->path,
                        n_layers, L->n_chunks, lay->pp, lay->vp);
  double layer_f = 0, first_f = 0, last_f = 0;
  for (int k = 0; k < g->n_forward_ops; k++) {
    int l = L->op_layer[k];
    double f = op_flops(g, k);
    if (l < 0)
      first_f += f;
    else if (l >= n_layers)
      last_f += f;
    else if (l == 0)
      layer_f += f;
  }
  L->layer_flops = layer_f, L->first_flops = first_f, L->last_flops = last_f;
  const struct mr_strategy_hint *h = &job->strategy;
  if (h->n_chunk_layers > 0 && h->n_chunk_layers != L->n_chunks)
    return mr_error_set(MR_EINVAL, "%s: strategy.pipeline_parallel.layers: expected %d "
                        "entries (degree %d x virtual_stages %d), got %d", job->path,
                        L->n_chunks, lay->pp, lay->vp, h->n_chunk_layers);
  int *counts = malloc((size_t)L->n_chunks * sizeof *counts);
  if (!counts)
    return MR_ENOMEM;
  if (h->n_chunk_layers > 0) { /* the job's split, checked against the model when read */
    memcpy(counts, h->chunk_layers, (size_t)L->n_chunks * sizeof *counts);
  } else if (mr_partition_uniform(n_layers, layer_f > 0 ? layer_f : 1, first_f, last_f,
                                  L->n_chunks, counts) < 0) {
    free(counts);
    return mr_error_set(MR_EINVAL, "%s: cannot partition %d layers over %d chunks", job->path,
                        n_layers, L->n_chunks);
  }
  L->chunk_first_layer[0] = 0;
  for (int c = 0; c < L->n_chunks; c++)
    L->chunk_first_layer[c + 1] = L->chunk_first_layer[c] + counts[c];
  free(counts);
  for (int k = 0; k < g->n_ops; k++) {
    int l = L->op_layer[k], c = 0;
    if (l >= n_layers)
      c = L->n_chunks - 1;
    else if (l >= 0)
      while (c + 1 < L->n_chunks && L->chunk_first_layer[c + 1] <= l)
        c++;
    L->op_chunk[k] = c;
    g->ops[k].stage = c % lay->pp;
  }
  return 0;
}

/* One stage's mesh (the dims of size > 1) and every tensor's placement on
 * it, from the job's shard rules or the model family's defaults. */
static int complete(const struct mr_job *job, struct mr_lowered *L) {
  const struct mr_layout *lay = &L->lay;
  int shape[2], nd = 0;
  const char *names[2];
  if (lay->dp > 1) {
    shape[nd] = lay->dp;
    names[nd++] = "data";
  }
  if (lay->tp > 1) {
    shape[nd] = lay->tp;
    names[nd++] = "model";
  }
  if (nd == 0) {
    shape[nd] = 1;
    names[nd++] = "data";
  }
  MR_TRY(mr_mesh_init(&L->mesh, nd, shape, names));
  L->data_dim = lay->dp > 1 ? 0 : -1;
  L->model_dim = lay->tp > 1 ? (lay->dp > 1 ? 1 : 0) : -1;
  struct mr_completion_opts o;
  memset(&o, 0, sizeof o);
  o.rules = job->shard_rules;
  o.n_rules = job->n_shard_rules;
#define RULES(r) (o.rules = (r), o.n_rules = (int)(sizeof(r) / sizeof(r)[0]))
  if (lay->tp > 1 && job->n_shard_rules == 0) {
    if (job->model.family != MR_MODEL_LLAMA)
      RULES(gpt2_rules);
    else if (lay->sp)
      RULES(llama_sp_rules);
    else
      RULES(llama_rules);
  }
#undef RULES
  o.data_dim = L->data_dim >= 0 ? L->data_dim : (lay->dp == 1 && lay->tp == 1 ? 0 : -1);
  o.seq_dim = lay->sp ? L->model_dim : -1;
  return mr_spmd_complete(&L->model.graph, &L->mesh, &o, &L->dg);
}

/* Where each reshard edge runs (before its first consumer), and what the
 * runtime cannot run: a reshard across meshes, a data-parallel gradient
 * not summed, one edge feeding two pipeline chunks. */
static int place_edges(struct mr_lowered *L) {
  const struct mr_graph *g = &L->model.graph;
  const struct mr_dist_graph *dg = &L->dg;
  L->n_local = g->n_tensors + dg->n_edges;
  L->edge_at = malloc((size_t)(dg->n_edges > 0 ? dg->n_edges : 1) * sizeof *L->edge_at);
  if (!L->edge_at)
    return MR_ENOMEM;
  for (int e = 0; e < dg->n_edges; e++)
    L->edge_at[e] = -1;
  for (int k = g->n_ops - 1; k >= 0; k--)
    for (int i = 0; i < g->ops[k].n_in; i++) {
      int e = dg->edge_of[k * MR_OP_MAX_IN + i];
      if (e >= 0)
        L->edge_at[e] = k;
    }
  for (int e = 0; e < dg->n_edges; e++) {
    const struct mr_reshard_edge *ed = &dg->edges[e];
    for (int s = 0; s < ed->plan.n_steps; s++) {
      const struct mr_reshard_step *st = &ed->plan.steps[s];
      if (st->kind == MR_RS_SEND_RECV)
        return mr_error_set(MR_ENOTSUP, "lowering: reshard of %s crosses meshes",
                            g->tensors[ed->tensor].name);
      if (ed->kind == MR_EDGE_GRAD_SYNC && st->mesh_dim == L->data_dim &&
          st->group_size > 1 && !(st->kind == MR_RS_ALL_REDUCE && st->op == MR_REDUCE_SUM))
        return mr_error_set(MR_ENOTSUP, "lowering: the gradient of %s needs a %s on data; "
                            "data-parallel gradients are summed", g->tensors[ed->tensor].name,
                            mr_reshard_kind_name(st->kind));
    }
    if (ed->kind != MR_EDGE_OPERAND || L->edge_at[e] < 0)
      continue;
    /* consumers of one edge must share a chunk and a direction */
    for (int k = 0; k < g->n_ops; k++)
      for (int i = 0; i < g->ops[k].n_in; i++)
        if (dg->edge_of[k * MR_OP_MAX_IN + i] == e &&
            L->op_chunk[k] != L->op_chunk[L->edge_at[e]])
          return mr_error_set(MR_ENOTSUP, "lowering: a reshard of %s feeds two pipeline "
                              "chunks", g->tensors[ed->tensor].name);
  }
  return 0;
}

/* The job's graph lowered for `world` ranks: the layout, the model with
 * its backward (and recomputation), the chunks, the placements, the
 * edges.  A head split by vocabulary is lowered again with the
 * vocabulary-parallel loss. */
int mr_lower_graph_form(const struct mr_job *job, int world, int form, struct mr_lowered *L) {
  memset(L, 0, sizeof *L);
  int rc;
  MR_TRY(mr_layout_from_job(job, world, &L->lay));
  const struct mr_layout *lay = &L->lay;
  if (job->strategy.n_dp_micro > 0) {
    if ((L->dp_micro = malloc((size_t)lay->dp * sizeof *L->dp_micro)) == NULL)
      return MR_ENOMEM;
    memcpy(L->dp_micro, job->strategy.dp_micro, (size_t)lay->dp * sizeof *L->dp_micro);
  }
  MR_TRY_GOTO(rc, mr_model_build_loss(&job->model, lay->micro_seqs, job->train.seq_len,
                                      (enum mr_loss_form)form, &L->model),
              err);
  struct mr_graph *g = &L->model.graph;
  MR_TRY_GOTO(rc, mr_autodiff(g, L->model.loss, &L->seed), err);
  if (lay->recompute != MR_RC_NONE)
    MR_TRY_GOTO(rc, recompute_pass(g, (int)job->model.num_hidden_layers, lay->recompute,
                                   lay->recompute_every),
                err);
  MR_TRY_GOTO(rc, assign_chunks(job, L), err);
  MR_TRY_GOTO(rc, complete(job, L), err);
  if (form == MR_LOSS_FUSED && mr_dist_graph_splits(&L->dg, L->model.logits, 1)) {
    /* the head is split by vocabulary: the vocabulary-parallel loss reads
     * the logits where they lie instead of gathering them */
    mr_lowered_close(L);
    return mr_lower_graph_form(job, world, MR_LOSS_VOCAB_PARALLEL, L);
  }
  MR_TRY_GOTO(rc, place_edges(L), err);
  return 0;
err:
  mr_lowered_close(L);
  return rc;
}

void mr_lowered_close(struct mr_lowered *L) {
  if (L == NULL)
    return;
  mr_dist_graph_close(&L->dg);
  mr_model_close(&L->model);
  free(L->op_chunk);
  free(L->op_layer);
  free(L->chunk_first_layer);
  free(L->edge_at);
  free(L->dp_micro);
  memset(L, 0, sizeof *L);
}
