/* search.c - enumerate, prune by memory, rank by step time. */
#include "compiler/planner/search.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "compiler/planner/partition.h"

struct search {
  const struct mr_plan_request *req;
  struct mr_workload w;
  struct mr_strategy_hint h;  // effective hint (copied: relaxations edit it)
  int world;
  int top_k;
  int memory_only;            // stop at the first fit; no timing
  int any_fit;
  struct mr_plan_result *out;
  int have_least;
};

/* Whether a strategy predicted at t (s) ranks before one at u (r).  Equal
 * predictions go to fewer, larger micro-batches: each micro-batch pays
 * fixed costs the model does not count (every op issued once more, the
 * gradients accumulated once more), so the tie is not a tie in practice
 * (where small shapes cost the GEMMs nothing, a shapes-only model ties
 * every micro-batch size).  Otherwise the order enumerated stands. */
static int ranks_before(double t, const struct mr_strategy *s, double u,
                        const struct mr_strategy *r) {
  if (fabs(t - u) > 1e-9 * fmax(t, u))
    return t < u;
  return s->micro_batches < r->micro_batches;
}

static void consider(struct search *se, const struct mr_strategy *s,
                     const struct mr_cost_prep *prep) {
  struct mr_plan_result *out = se->out;
  out->considered++;
  struct mr_cost cost;
  memset(&cost, 0, sizeof cost);
  mr_cost_memory_prepared(&se->w, se->req->cluster, s, prep, &cost);
  if (!se->have_least || cost.mem.total < out->least_memory.cost.mem.total) {
    out->least_memory.strategy = *s;
    out->least_memory.cost = cost;
    se->have_least = 1;
  }
  if (!cost.fits) {
    out->pruned_memory++;
    return;
  }
  se->any_fit = 1;
  if (se->memory_only)
    return;
  mr_cost_evaluate_prepared(&se->w, se->req->cluster, s, prep, &cost);
  double t = cost.step_time_s;
  int n = out->n_top;
  if (n == se->top_k && !ranks_before(t, s, out->top[n - 1].cost.step_time_s,
                                      &out->top[n - 1].strategy))
    return;
  int i = n < se->top_k ? n : n - 1;
  while (i > 0 && ranks_before(t, s, out->top[i - 1].cost.step_time_s,
                               &out->top[i - 1].strategy)) {
    out->top[i] = out->top[i - 1];
    i--;
  }
  out->top[i].strategy = *s;
  out->top[i].cost = cost;
  if (n < se->top_k)
    out->n_top++;
}

/* The innermost loops: everything that does not change the layer shapes. */
static void search_states(struct search *se, struct mr_strategy *s) {
  const struct mr_strategy_hint *h = &se->h;
  struct mr_cost_prep prep;
  mr_cost_prepare(&se->w, se->req->cluster, s, &prep);
  for (int z = 0; z <= 3; z++) {
    if (h->zero_stage >= 0 && z != h->zero_stage)
      continue;
    if (z > 0 && s->dp == 1 && h->zero_stage < 0)
      continue; // nothing to shard over
    for (int off = 0; off <= 1; off++) {
      if (h->offload >= 0 && off != h->offload)
        continue;
      if (off && z == 0)
        continue;
      for (int map = 0; map <= 1; map++) {
        if (h->mapping >= 0 ? map != h->mapping : map == 1 && (s->dp == 1 || s->pp == 1))
          continue; // fixed by the job, or the same layout as map 0
        s->zero_stage = z;
        s->offload = off;
        s->mapping = (enum mr_mesh_mapping)map;
        consider(se, s, &prep);
        if (se->memory_only && se->any_fit)
          return;
      }
    }
  }
}

static void search_recompute(struct search *se, struct mr_strategy *s) {
  const struct mr_strategy_hint *h = &se->h;
  for (int sp = 0; sp <= 1; sp++) {
    if (sp && s->tp == 1)
      continue;
    if (h->sequence_parallel >= 0 && sp != h->sequence_parallel)
      continue;
    for (int rc = 0; rc <= 2; rc++) {
      if (h->recompute == 0 && rc != MR_RECOMPUTE_NONE)
        continue;
      if (h->recompute == 1) {
        int want = h->recompute_granularity == MR_RECOMPUTE_SELECTIVE
                       ? MR_RECOMPUTE_MODE_SELECTIVE
                       : MR_RECOMPUTE_MODE_FULL;
        if (rc != want)
          continue;
      }
      s->sequence_parallel = sp;
      s->recompute = (enum mr_recompute_mode)rc;
      s->recompute_every_n =
          rc == MR_RECOMPUTE_MODE_FULL && h->recompute_every_n_layers > 0
              ? h->recompute_every_n_layers
              : 1;
      search_states(se, s);
      if (se->memory_only && se->any_fit)
        return;
    }
  }
}

static void search_schedule(struct search *se, struct mr_strategy *s) {
  const struct mr_strategy_hint *h = &se->h;
  int l = (int)se->w.model->num_hidden_layers;
  if (s->pp == 1) {
    if (h->virtual_stages > 1)
      return;
    s->schedule = MR_PP_1F1B;
    s->virtual_stages = 1;
    search_recompute(se, s);
    return;
  }
  static const int vs[] = {1, 2, 3, 4, 6, 8};
  for (int sc = 0; sc <= 2; sc++) {
    if (h->pp_schedule_set && (int)h->pp_schedule != sc)
      continue;
    for (size_t vi = 0; vi < sizeof vs / sizeof vs[0]; vi++) {
      int v = vs[vi];
      if (h->virtual_stages > 0 && v != h->virtual_stages)
        continue;
      if ((sc == MR_PP_INTERLEAVED) != (v > 1))
        continue;
      if ((int64_t)s->pp * v > l || s->pp * v > MR_PARTITION_MAX_ITEMS)
        continue;
      if (sc == MR_PP_INTERLEAVED && s->micro_batches % s->pp != 0)
        continue;
      s->schedule = (enum mr_pp_schedule)sc;
      s->virtual_stages = v;
      search_recompute(se, s);
      if (se->memory_only && se->any_fit)
        return;
    }
  }
}

static void search_all(struct search *se) {
  const struct mr_strategy_hint *h = &se->h;
  const struct mr_model_config *m = se->w.model;
  int W = se->world;
  int64_t B = se->w.global_batch;
  struct mr_strategy s;
  memset(&s, 0, sizeof s);
  s.amp_dtype = h->amp_dtype;
  for (int t = 1; t <= W; t++) {
    if (W % t != 0 || (h->tp > 0 && t != h->tp))
      continue;
    if (m->num_attention_heads % t != 0 || m->num_key_value_heads % t != 0 ||
        m->intermediate_size % t != 0)
      continue;
    for (int p = 1; p <= W / t; p++) {
      if ((W / t) % p != 0 || (h->pp > 0 && p != h->pp) || p > m->num_hidden_layers)
        continue;
      int d = W / t / p;
      if (h->dp > 0 && d != h->dp)
        continue;
      if (B % d != 0)
        continue;
      int64_t per_rank = B / d;
      int ga = h->grad_accum_steps > 0 ? h->grad_accum_steps : 1;
      if (per_rank % ga != 0)
        continue;
      int64_t per_flush = per_rank / ga;
      for (int64_t b = 1; b <= per_flush && b <= 64; b++) {
        if (per_flush % b != 0)
          continue;
        int64_t mb = per_flush / b;
        if (h->micro_batches > 0 && mb != h->micro_batches)
          continue;
        s.dp = d, s.tp = t, s.pp = p;
        s.micro_batch_size = (int)b;
        s.micro_batches = (int)mb;
        s.grad_accum_steps = ga;
        search_schedule(se, &s);
        if (se->memory_only && se->any_fit)
          return;
      }
    }
  }
}

/* Contradictions within the hint and against the world, named by field. */
static int check_hint(const struct mr_plan_request *req, const struct mr_strategy_hint *h,
                      int W) {
  const struct mr_model_config *m = req->model;
  const char *names[3] = {"strategy.data_parallel.degree", "strategy.tensor_parallel.degree",
                          "strategy.pipeline_parallel.degree"};
  int deg[3] = {h->dp, h->tp, h->pp};
  int64_t fixed = 1;
  for (int i = 0; i < 3; i++) {
    if (deg[i] <= 0)
      continue;
    if (W % deg[i] != 0)
      return mr_error_set(MR_EINVAL, "%s %d does not divide the world size %d", names[i],
                          deg[i], W);
    fixed *= deg[i];
  }
  if (W % fixed != 0 || (h->dp > 0 && h->tp > 0 && h->pp > 0 && fixed != W))
    return mr_error_set(MR_EINVAL, "strategy: data × tensor × pipeline parallel degrees "
                        "fixed to %d × %d × %d do not multiply to the world size %d",
                        h->dp > 0 ? h->dp : 1, h->tp > 0 ? h->tp : 1,
                        h->pp > 0 ? h->pp : 1, W);
  if (h->tp > 0 && m->num_attention_heads % h->tp != 0)
    return mr_error_set(MR_EINVAL, "strategy.tensor_parallel.degree %d does not divide "
                        "the model's %lld attention heads", h->tp,
                        (long long)m->num_attention_heads);
  if (h->pp > 0 && h->pp > m->num_hidden_layers)
    return mr_error_set(MR_EINVAL, "strategy.pipeline_parallel.degree %d exceeds the "
                        "model's %lld layers", h->pp, (long long)m->num_hidden_layers);
  if (h->virtual_stages > 1 && h->pp == 1)
    return mr_error_set(MR_EINVAL, "strategy.pipeline_parallel.virtual_stages %d needs a "
                        "pipeline degree >= 2, but pipeline_parallel.degree is 1",
                        h->virtual_stages);
  if (h->virtual_stages > 1 && h->pp_schedule_set && h->pp_schedule != MR_PP_INTERLEAVED)
    return mr_error_set(MR_EINVAL, "strategy.pipeline_parallel.virtual_stages %d needs "
                        "schedule \"interleaved\"", h->virtual_stages);
  if (h->sequence_parallel == 1 && h->tp == 1)
    return mr_error_set(MR_EINVAL, "strategy.sequence_parallel.enable needs "
                        "tensor_parallel.degree > 1, got 1");
  if (h->offload == 1 && h->zero_stage == 0)
    return mr_error_set(MR_EINVAL, "strategy.sharding.offload needs stage >= 1, got 0");
  if (h->recompute == 0 && h->recompute_every_n_layers > 0)
    return mr_error_set(MR_EINVAL, "strategy.recompute.checkpoint_every_n_layers is set "
                        "but recompute.enable is false");
  if (h->micro_batches > 0 && h->dp > 0) {
    int64_t ga = h->grad_accum_steps > 0 ? h->grad_accum_steps : 1;
    int64_t per = (int64_t)h->dp * h->micro_batches * ga;
    if (req->train->global_batch % per != 0)
      return mr_error_set(MR_EINVAL, "strategy.pipeline_parallel.micro_batches %d × "
                          "data_parallel.degree %d × accumulation %lld does not divide "
                          "train.global_batch %lld", h->micro_batches, h->dp,
                          (long long)ga, (long long)req->train->global_batch);
  }
  return 0;
}

static int world_of(const struct mr_plan_request *req) {
  int64_t W = req->world > 0 ? req->world : mr_cluster_devices(req->cluster);
  return W > (1 << 24) ? -1 : (int)W;
}

static void init_search(struct search *se, const struct mr_plan_request *req,
                        struct mr_plan_result *out, int world) {
  memset(se, 0, sizeof *se);
  se->req = req;
  se->w = mr_workload_of(req->model, req->train, req->hint);
  if (req->hint != NULL) {
    se->h = *req->hint;
  } else {
    se->h.zero_stage = se->h.offload = se->h.recompute = se->h.sequence_parallel = -1;
    se->h.mapping = -1;
    se->h.amp_dtype = MR_AMP_BF16;
  }
  se->world = world;
  se->top_k = req->top_k > 0 ? (req->top_k > MR_PLAN_TOP_MAX ? MR_PLAN_TOP_MAX : req->top_k) : 5;
  se->out = out;
}

/* Does anything fit with the hint relaxed as given, on `world` ranks? */
static int fits_relaxed(const struct mr_plan_request *req, int world, int offload,
                        int recompute, int any_zero, int free_degrees) {
  struct mr_plan_result tmp;
  memset(&tmp, 0, sizeof tmp);
  struct search se;
  init_search(&se, req, &tmp, world);
  se.memory_only = 1;
  if (offload)
    se.h.offload = -1, se.h.zero_stage = se.h.zero_stage == 0 ? -1 : se.h.zero_stage;
  if (recompute)
    se.h.recompute = -1, se.h.recompute_every_n_layers = 0;
  if (any_zero)
    se.h.zero_stage = -1;
  if (free_degrees)
    se.h.dp = 0, se.h.micro_batches = 0;
  if (check_hint(req, &se.h, world) < 0)
    return 0;
  search_all(&se);
  return se.any_fit;
}

int mr_plan_search(const struct mr_plan_request *req, struct mr_plan_result *out) {
  memset(out, 0, sizeof *out);
  int W = world_of(req);
  if (W < 1)
    return mr_error_set(MR_EINVAL, "world size %d: expected 1 .. %d ranks", req->world,
                        1 << 24);
  if ((int64_t)W > mr_cluster_devices(req->cluster))
    return mr_error_set(MR_EINVAL, "world size %d exceeds the cluster's %lld devices", W,
                        (long long)mr_cluster_devices(req->cluster));
  if (req->train->global_batch < 1 || req->train->seq_len < 1)
    return mr_error_set(MR_EINVAL, "train.global_batch and train.seq_len must be positive");
  struct search se;
  init_search(&se, req, out, W);
  int rc = check_hint(req, &se.h, W);
  if (rc < 0)
    return rc;
  search_all(&se);
  if (out->considered == 0) {
    const struct mr_model_config *m = req->model;
    return mr_error_set(MR_EINVAL, "world size %d cannot be split over this model and "
                        "strategy: tensor parallel must divide %lld heads and intermediate "
                        "size %lld, pipeline parallel at most %lld layers, data parallel "
                        "must divide train.global_batch %lld (with the degrees, "
                        "micro-batches and schedule the job fixes)", W,
                        (long long)m->num_attention_heads, (long long)m->intermediate_size,
                        (long long)m->num_hidden_layers,
                        (long long)req->train->global_batch);
  }
  if (out->n_top > 0)
    return 0;
  out->fits_with_offload = fits_relaxed(req, W, 1, 0, 0, 0);
  out->fits_with_recompute = fits_relaxed(req, W, 0, 1, 0, 0);
  out->fits_with_both = fits_relaxed(req, W, 1, 1, 1, 0);
  out->devices_to_fit = 0;
  for (int64_t w2 = (int64_t)W * 2; w2 <= (int64_t)W * 64 && w2 <= (1 << 24); w2 *= 2) {
    struct mr_cluster big = *req->cluster;
    int64_t nodes = (w2 + big.devices_per_node - 1) / big.devices_per_node;
    big.nodes = (int)nodes;
    struct mr_plan_request r2 = *req;
    r2.cluster = &big;
    if (fits_relaxed(&r2, (int)w2, 0, 0, 0, 1)) {
      out->devices_to_fit = w2;
      break;
    }
  }
  return mr_error_set(MR_ENOFIT, "no strategy fits in %.1f GiB per device: the least any "
                      "needs is %.1f GiB", req->cluster->memory_bytes / 1073741824.0,
                      out->least_memory.cost.mem.total / 1073741824.0);
}

int mr_plan_manual(const struct mr_plan_request *req, struct mr_strategy *out) {
  const struct mr_strategy_hint *h = req->hint;
  int W = world_of(req);
  if (h == NULL || W < 1)
    return mr_error_set(MR_EINVAL, "manual strategy needs a hint and a world size");
  int rc = check_hint(req, h, W);
  if (rc < 0)
    return rc;
  memset(out, 0, sizeof *out);
  out->tp = h->tp > 0 ? h->tp : 1;
  out->pp = h->pp > 0 ? h->pp : 1;
  out->dp = h->dp > 0 ? h->dp : W / (out->tp * out->pp);
  if ((int64_t)out->dp * out->tp * out->pp != W)
    return mr_error_set(MR_EINVAL, "strategy: data × tensor × pipeline parallel degrees "
                        "%d × %d × %d do not multiply to the world size %d", out->dp,
                        out->tp, out->pp, W);
  out->mapping = h->mapping == MR_MAP_TP_PP_DP ? MR_MAP_TP_PP_DP : MR_MAP_TP_DP_PP;
  out->sequence_parallel = h->sequence_parallel > 0;
  out->zero_stage = h->zero_stage > 0 ? h->zero_stage : 0;
  out->offload = h->offload > 0;
  out->recompute = h->recompute == 1 ? (h->recompute_granularity == MR_RECOMPUTE_SELECTIVE
                                            ? MR_RECOMPUTE_MODE_SELECTIVE
                                            : MR_RECOMPUTE_MODE_FULL)
                                     : MR_RECOMPUTE_NONE;
  out->recompute_every_n = h->recompute_every_n_layers > 0 ? h->recompute_every_n_layers : 1;
  out->micro_batches = h->micro_batches > 0 ? h->micro_batches : 1;
  out->grad_accum_steps = h->grad_accum_steps > 0 ? h->grad_accum_steps : 1;
  out->virtual_stages = h->virtual_stages > 0 ? h->virtual_stages : 1;
  out->schedule = h->pp_schedule_set ? h->pp_schedule
                  : out->virtual_stages > 1 ? MR_PP_INTERLEAVED
                                            : MR_PP_1F1B;
  out->amp_dtype = h->amp_dtype;
  int64_t per = (int64_t)out->dp * out->micro_batches * out->grad_accum_steps;
  if (req->train->global_batch % per != 0)
    return mr_error_set(MR_EINVAL, "train.global_batch %lld is not a multiple of data "
                        "parallel %d × micro-batches %d × accumulation %d",
                        (long long)req->train->global_batch, out->dp, out->micro_batches,
                        out->grad_accum_steps);
  out->micro_batch_size = (int)(req->train->global_batch / per);
  struct mr_workload w = mr_workload_of(req->model, req->train, req->hint);
  return mr_cost_check(&w, req->cluster, out);
}

int mr_plan_choose(const struct mr_plan_request *req, struct mr_plan_candidate *out) {
  memset(out, 0, sizeof *out);
  if (req->hint != NULL && req->hint->auto_mode == MR_AUTO_MANUAL) {
    int rc = mr_plan_manual(req, &out->strategy);
    if (rc < 0)
      return rc;
    struct mr_workload w = mr_workload_of(req->model, req->train, req->hint);
    mr_cost_evaluate(&w, req->cluster, &out->strategy, &out->cost);
    if (!out->cost.fits)
      return mr_error_set(MR_ENOFIT, "the job's strategy needs %.1f GiB per device, the "
                          "device has %.1f GiB", out->cost.mem.total / 1073741824.0,
                          req->cluster->memory_bytes / 1073741824.0);
    return 0;
  }
  struct mr_plan_result *r = calloc(1, sizeof *r);
  if (r == NULL)
    return mr_error_set(MR_ENOMEM, "plan: out of memory");
  int rc = mr_plan_search(req, r);
  if (rc == 0)
    *out = r->top[0];
  else if (rc == MR_ENOFIT)
    *out = r->least_memory;
  free(r);
  return rc;
}

void mr_plan_explain(const struct mr_plan_candidate *best, const struct mr_plan_candidate *alt,
                     char *buf, size_t n) {
  const struct mr_cost *a = &best->cost, *b = &alt->cost;
  struct {
    const char *what;
    double d;
  } parts[] = {
      {"compute", (b->compute_s - b->tp_comm_s - b->recompute_s) -
                      (a->compute_s - a->tp_comm_s - a->recompute_s)},
      {"tensor-parallel comm", b->tp_comm_s - a->tp_comm_s},
      {"recompute", b->recompute_s - a->recompute_s},
      {"pipeline bubble", b->bubble_s - a->bubble_s},
      {"pipeline sends", b->p2p_s - a->p2p_s},
      {"gradient sync", b->dp_comm_s - a->dp_comm_s},
      {"optimizer/offload", b->optimizer_s - a->optimizer_s},
  };
  int np = (int)(sizeof parts / sizeof parts[0]);
  double rel = a->step_time_s > 0 ? (b->step_time_s / a->step_time_s - 1) * 100 : 0;
  size_t len = (size_t)snprintf(buf, n, "+%.1f%% step time:", rel);
  int shown = 0;
  for (int k = 0; k < 2; k++) { // the two largest losses
    int bi = -1;
    for (int i = 0; i < np; i++)
      if (parts[i].d > 0 && (bi < 0 || parts[i].d > parts[bi].d))
        bi = i;
    if (bi < 0)
      break;
    if (len < n)
      len += (size_t)snprintf(buf + len, n - len, "%s %s +%.3g s", shown ? "," : "",
                              parts[bi].what, parts[bi].d);
    parts[bi].d = 0;
    shown++;
  }
  if (shown == 0 && len < n)
    snprintf(buf + len, n - len, " same step time");
}
