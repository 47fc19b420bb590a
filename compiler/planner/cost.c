/* cost.c - the analytical cost model (docs/PLANNER.md derives each term). */
#include "compiler/planner/cost.h"

#include <math.h>
#include <string.h>

#include "common/error.h"
#include "compiler/planner/partition.h"
#include "compiler/planner/schedule.h"

/* Bytes per element of weights, gradients and activations. */
static double elem_bytes(enum mr_amp_dtype dt) { return dt == MR_AMP_FP32 ? 4.0 : 2.0; }

double mr_cost_gemm_efficiency(const struct mr_cluster *c, double m, double n, double k) {
  double g = c->gemm_half_dim;
  return c->matmul_efficiency / (1.0 + g * (1.0 / m + 1.0 / n + 1.0 / k));
}

double mr_cost_gemm_time(const struct mr_cluster *c, enum mr_amp_dtype dt, double batch,
                         double m, double n, double k) {
  double flops = 2.0 * batch * m * n * k;
  return flops / (c->peak_flops[dt] * mr_cost_gemm_efficiency(c, m, n, k));
}

double mr_cost_collective_time(enum mr_collective kind, int n, double bytes,
                               const struct mr_link *link) {
  double a = link->latency, bw = link->bandwidth;
  if (kind == MR_COLL_P2P)
    return a + bytes / bw;
  if (n <= 1)
    return 0.0;
  double steps = n - 1, frac = (double)(n - 1) / n;
  if (kind == MR_COLL_ALLREDUCE)
    return 2.0 * steps * a + 2.0 * frac * bytes / bw;
  return steps * a + frac * bytes / bw;
}

struct mr_link mr_cost_group_link(const struct mr_cluster *c, int stride, int n) {
  struct mr_link l;
  /* Inside a node only when the groups tile the node: a group of 6 on
   * 8-device nodes straddles two of them. */
  int64_t span = (int64_t)stride * n;
  if (n <= 1 || (span <= c->devices_per_node && c->devices_per_node % span == 0)) {
    l.bandwidth = c->intra_bus_bandwidth;
    l.latency = c->intra_latency;
    l.inter_node = 0;
    return l;
  }
  /* Groups made of whole node slices spread their rings over every
   * adapter of the node; a group that straddles nodes unevenly crosses on
   * one device's share. */
  int flows = stride < c->devices_per_node ? stride : c->devices_per_node;
  if (span % c->devices_per_node != 0)
    flows = c->devices_per_node;
  l.bandwidth = fmin(c->intra_bus_bandwidth, c->inter_bandwidth / flows);
  l.latency = c->inter_latency;
  l.inter_node = 1;
  return l;
}

double mr_cost_pipeline_send_time(double tokens, double hidden, double elem_bytes, int tp,
                                  int sequence_parallel, const struct mr_link *pp_link,
                                  const struct mr_link *tp_link) {
  double full = tokens * hidden * elem_bytes;
  double t = mr_cost_collective_time(MR_COLL_P2P, 2, full / tp, pp_link);
  if (tp > 1 && !sequence_parallel)
    t += mr_cost_collective_time(MR_COLL_ALLGATHER, tp, full, tp_link);
  return t;
}

double mr_cost_bubble_fraction(enum mr_pp_schedule sched, int p, int m, int v) {
  if (p <= 1)
    return 0.0;
  if (sched == MR_PP_INTERLEAVED)
    return (double)(p - 1) / ((double)v * m);
  return (double)(p - 1) / m;
}

double mr_cost_layer_activation_bytes(double s, double b, double h, double a, int t,
                                      int sp, enum mr_recompute_mode rc) {
  double sbh = s * b * h;
  if (rc == MR_RECOMPUTE_MODE_FULL)
    return sp ? 2.0 * sbh / t : 2.0 * sbh;
  double attn = rc == MR_RECOMPUTE_MODE_SELECTIVE ? 0.0 : 5.0 * a * s / h;
  if (sp)
    return sbh / t * (34.0 + attn);
  return sbh * (10.0 + 24.0 / t + attn / t);
}

double mr_cost_engine_layer_elems(const struct mr_model_config *m, int t, int sp,
                                  enum mr_recompute_mode rc) {
  double C = m->hidden_size, F = m->intermediate_size, H = m->num_attention_heads;
  double K = (double)m->num_key_value_heads * (double)mr_model_head_dim(m);
  double Q = H * (double)mr_model_head_dim(m); /* = C unless head_dim says otherwise */
  if (t < 2)
    sp = 0;
  if (rc == MR_RECOMPUTE_MODE_FULL) /* the layer group's input */
    return sp ? C / t : C;
  /* split by tensor parallelism: q and k after RoPE, v, the attention
   * output and its log-sum-exp, gate, up and their SwiGLU */
  double split = (2.0 * Q + 2.0 * K + 3.0 * F + H) / t;
  if (rc == MR_RECOMPUTE_MODE_SELECTIVE) /* the attention output and lse repeat */
    split -= (Q + H) / t;
  /* the block input and the residual after attention with their norms'
   * 1/rms (split by rows under sequence parallelism), and the two norm
   * outputs the projections' weight gradients read (gathered whole) */
  return split + (sp ? (2.0 * C + 2.0) / t : 2.0 * C + 2.0) + 2.0 * C;
}

void mr_cost_model_states(double psi, int n_d, int zero_stage, enum mr_amp_dtype dt,
                          double *params, double *grads, double *optimizer) {
  double w = elem_bytes(dt), o = dt == MR_AMP_FP32 ? 8.0 : 16.0;
  double nd = n_d < 1 ? 1 : n_d;
  *params = w * psi / (zero_stage >= 3 ? nd : 1);
  *grads = w * psi / (zero_stage >= 2 ? nd : 1);
  *optimizer = o * psi / (zero_stage >= 1 ? nd : 1);
}

/* Forward FLOPs of one layer's GEMMs over `tokens` tokens of sequences of
 * length s, unsplit.  attn_out receives the attention-core part. */
static double layer_fwd_flops(const struct mr_model_config *m, double tokens, double s,
                              double *attn_out) {
  double h = m->hidden_size, f = m->intermediate_size;
  double kv = (double)m->num_key_value_heads * (double)mr_model_head_dim(m);
  double q = (double)m->num_attention_heads * (double)mr_model_head_dim(m);
  double n_mlp = m->family == MR_MODEL_LLAMA ? 3.0 : 2.0;
  double attn = 4.0 * tokens * s * q;
  if (attn_out != NULL)
    *attn_out = attn;
  return 2.0 * tokens * (h * (q + 2.0 * kv) + q * h + n_mlp * h * f) + attn;
}

double mr_cost_step_flops(const struct mr_workload *w, int recompute_full) {
  const struct mr_model_config *m = w->model;
  double tokens = (double)w->global_batch * (double)w->seq_len;
  double layer = layer_fwd_flops(m, tokens, (double)w->seq_len, NULL);
  double head = 2.0 * tokens * (double)m->vocab_size * (double)m->hidden_size;
  double l = (double)m->num_hidden_layers;
  return (recompute_full ? 4.0 : 3.0) * l * layer + 3.0 * head;
}

void mr_cost_param_split(const struct mr_model_config *m, double *per_layer,
                         double *embedding, double *final_norm) {
  double h = m->hidden_size, f = m->intermediate_size, v = m->vocab_size;
  double kv = (double)m->num_key_value_heads * (double)mr_model_head_dim(m);
  double q = (double)m->num_attention_heads * (double)mr_model_head_dim(m);
  if (m->family == MR_MODEL_LLAMA) {
    *per_layer = h * (q + 2 * kv) + q * h + 3 * h * f + 2 * h +
                 (m->qkv_bias ? q + 2 * kv : 0) + (m->o_bias ? h : 0);
    *embedding = v * h;
    *final_norm = h;
  } else {
    *per_layer = 4 * h + (h * (h + 2 * kv) + h + 2 * kv) + h * h + h + 2 * h * f + f + h;
    *embedding = v * h + (double)m->max_position_embeddings * h;
    *final_norm = 2 * h;
  }
}

int mr_cost_check(const struct mr_workload *w, const struct mr_cluster *c,
                  const struct mr_strategy *s) {
  const struct mr_model_config *m = w->model;
  if (s->dp < 1 || s->tp < 1 || s->pp < 1)
    return mr_error_set(MR_EINVAL, "degrees must be positive, got dp %d tp %d pp %d", s->dp,
                        s->tp, s->pp);
  if ((int64_t)s->dp * s->tp * s->pp > mr_cluster_devices(c))
    return mr_error_set(MR_EINVAL, "dp %d x tp %d x pp %d = %lld ranks, the cluster has %lld",
                        s->dp, s->tp, s->pp, (long long)s->dp * s->tp * s->pp,
                        (long long)mr_cluster_devices(c));
  if (m->num_attention_heads % s->tp != 0 || m->num_key_value_heads % s->tp != 0)
    return mr_error_set(MR_EINVAL, "tensor parallel %d does not divide %lld attention heads "
                        "(%lld key/value heads)", s->tp, (long long)m->num_attention_heads,
                        (long long)m->num_key_value_heads);
  if (m->intermediate_size % s->tp != 0)
    return mr_error_set(MR_EINVAL, "tensor parallel %d does not divide intermediate_size %lld",
                        s->tp, (long long)m->intermediate_size);
  int v = s->virtual_stages < 1 ? 1 : s->virtual_stages;
  if ((int64_t)s->pp * v > m->num_hidden_layers)
    return mr_error_set(MR_EINVAL, "%d pipeline stages x %d virtual stages need at least %d "
                        "layers, the model has %lld", s->pp, v, s->pp * v,
                        (long long)m->num_hidden_layers);
  if ((int64_t)s->pp * v > MR_PARTITION_MAX_ITEMS)
    return mr_error_set(MR_EINVAL, "%d pipeline chunks: at most %d", s->pp * v,
                        MR_PARTITION_MAX_ITEMS);
  if (w->n_chunk_layers > 0 && w->n_chunk_layers != s->pp * v)
    return mr_error_set(MR_EINVAL, "pipeline_parallel.layers gives %d chunks, the strategy has "
                        "%d (degree %d x virtual stages %d)", w->n_chunk_layers, s->pp * v,
                        s->pp, v);
  if (v > 1 && (s->pp < 2 || s->schedule != MR_PP_INTERLEAVED))
    return mr_error_set(MR_EINVAL, "%d virtual stages need the interleaved schedule and "
                        "pipeline degree >= 2", v);
  if (s->schedule == MR_PP_INTERLEAVED && s->pp > 1 && s->micro_batches % s->pp != 0)
    return mr_error_set(MR_EINVAL, "the interleaved schedule needs micro-batches (%d) to be "
                        "a multiple of the pipeline degree (%d)", s->micro_batches, s->pp);
  if (s->micro_batch_size < 1 || s->micro_batches < 1 || s->grad_accum_steps < 1)
    return mr_error_set(MR_EINVAL, "micro-batch size, count and accumulation steps must be "
                        "positive");
  int64_t seqs = (int64_t)s->dp * s->micro_batch_size * s->micro_batches * s->grad_accum_steps;
  if (seqs != w->global_batch)
    return mr_error_set(MR_EINVAL, "dp %d x micro-batch %d x micro-batches %d x accumulation "
                        "%d = %lld sequences, train.global_batch is %lld", s->dp,
                        s->micro_batch_size, s->micro_batches, s->grad_accum_steps,
                        (long long)seqs, (long long)w->global_batch);
  if (s->sequence_parallel && s->tp < 2)
    return mr_error_set(MR_EINVAL, "sequence parallelism needs tensor parallel > 1");
  if (s->offload && s->zero_stage < 1)
    return mr_error_set(MR_EINVAL, "offload needs sharding stage >= 1");
  if (s->recompute == MR_RECOMPUTE_MODE_FULL &&
      (s->recompute_every_n < 1 || s->recompute_every_n > m->num_hidden_layers))
    return mr_error_set(MR_EINVAL, "recompute every %d layers: expected 1..%lld",
                        s->recompute_every_n, (long long)m->num_hidden_layers);
  return 0;
}

static void layer_times(const struct mr_workload *w, const struct mr_cluster *c,
                        const struct mr_strategy *s, struct mr_layer_times *lt) {
  const struct mr_model_config *m = w->model;
  enum mr_amp_dtype dt = s->amp_dtype;
  /* CPU ranks keep every activation in fp32 under amp (it rounds the
   * values, not the storage): the memory-bound ops move fp32's bytes */
  double wb = c->host_is_device ? 4.0 : elem_bytes(dt), t = s->tp, b = s->micro_batch_size;
  double S = (double)w->seq_len, h = m->hidden_size, a = m->num_attention_heads;
  double f = m->intermediate_size, V = m->vocab_size, d = (double)mr_model_head_dim(m);
  double kv = (double)m->num_key_value_heads * d, q = a * d;
  double T = b * S;
  double n_up = m->family == MR_MODEL_LLAMA ? 2.0 : 1.0;
  /* attention's products run at the amp type's rate, on CPU ranks too:
   * with AVX512_BF16 they are bf16 products, without it calibration gives
   * bf16 fp32's peak */
  double g_att = mr_cost_gemm_time(c, dt, b * a / t, S, S, d) +
                 mr_cost_gemm_time(c, dt, b * a / t, S, d, S);
  double gemm = mr_cost_gemm_time(c, dt, 1, T, (q + 2 * kv) / t, h) + g_att +
                mr_cost_gemm_time(c, dt, 1, T, h, q / t) +
                mr_cost_gemm_time(c, dt, 1, T, n_up * f / t, h) +
                mr_cost_gemm_time(c, dt, 1, T, h, f / t);
  /* Memory-bound ops: every stored activation is written once and read
   * once (2×), at the activation width of the run: Korthikanti et al.'s
   * count for the GPT family, the engine's own for LLaMA. */
  double scale = wb / 2.0;
  lt->act_none = scale * mr_cost_layer_activation_bytes(S, b, h, a, s->tp,
                                                        s->sequence_parallel,
                                                        MR_RECOMPUTE_NONE);
  lt->act_stored = scale * mr_cost_layer_activation_bytes(S, b, h, a, s->tp,
                                                          s->sequence_parallel, s->recompute);
  double att_bytes = scale * 5.0 * a * S / (h * t) * S * b * h;
  double traffic = lt->act_none;
  if (m->family == MR_MODEL_LLAMA) {
    /* meshrun's engine: what its tiled attention and SwiGLU write per
     * token (no s×s scores), as its memory count; selective recompute
     * repeats the attention output and its log-sum-exp */
    traffic = T * wb * mr_cost_engine_layer_elems(m, s->tp, s->sequence_parallel,
                                                  MR_RECOMPUTE_NONE);
    att_bytes = T * wb * (h + a) / t;
  }
  double mem = 2.0 * traffic / c->memory_bandwidth;
  double mem_att = 2.0 * att_bytes / c->memory_bandwidth;
  struct mr_link tl = mr_cost_group_link(c, 1, s->tp);
  double msg = T * h * wb;
  double tp = 0.0;
  if (s->tp > 1)
    tp = s->sequence_parallel
             ? 2.0 * (mr_cost_collective_time(MR_COLL_ALLGATHER, s->tp, msg, &tl) +
                      mr_cost_collective_time(MR_COLL_REDUCE_SCATTER, s->tp, msg, &tl))
             : 2.0 * mr_cost_collective_time(MR_COLL_ALLREDUCE, s->tp, msg, &tl);
  lt->tp_fwd = tp;
  lt->fwd = gemm + mem + tp;
  lt->bwd = 2.0 * gemm + 2.0 * mem + tp;
  lt->rc = s->recompute == MR_RECOMPUTE_MODE_FULL        ? lt->fwd
           : s->recompute == MR_RECOMPUTE_MODE_SELECTIVE ? g_att + mem_att
                                                         : 0.0;
  /* Embedding: a gather and the position add, forward and backward. */
  double emb_ar = s->tp > 1 ? mr_cost_collective_time(MR_COLL_ALLREDUCE, s->tp, msg, &tl) : 0;
  lt->emb = 6.0 * T * h * wb / c->memory_bandwidth + emb_ar;
  /* Head: final norm, logits GEMM (forward + two backward), fp32 softmax
   * cross-entropy over the vocabulary shard (4 passes), the input
   * gradient's all-reduce and three token-sized all-reduces of the
   * vocabulary-parallel loss. */
  double logits = T * ceil(V / t) * 4.0;
  double head = 3.0 * mr_cost_gemm_time(c, dt, 1, T, ceil(V / t), h) +
                (4.0 * logits + 4.0 * T * h * wb) / c->memory_bandwidth;
  if (s->tp > 1)
    head += mr_cost_collective_time(MR_COLL_ALLREDUCE, s->tp, msg, &tl) +
            3.0 * mr_cost_collective_time(MR_COLL_ALLREDUCE, s->tp, T * 4.0, &tl);
  lt->head = head;
}

/* Layers of pipeline stage i: the sum over its chunks i, i+p, ... */
static int stage_layers(const int *counts, int p, int v, int i) {
  int n = 0;
  for (int j = 0; j < v; j++)
    n += counts[j * p + i];
  return n;
}

/* Micro-batches set per data rank (the workload's, for this degree): the
 * most and the fewest any rank runs; 0 when the split is even. */
static int dp_micro_range(const struct mr_workload *w, const struct mr_strategy *s, int *kmin) {
  if (w->n_dp_micro != s->dp || s->dp < 1)
    return 0;
  int kmax = w->dp_micro[0];
  *kmin = w->dp_micro[0];
  for (int d = 1; d < s->dp; d++) {
    kmax = w->dp_micro[d] > kmax ? w->dp_micro[d] : kmax;
    *kmin = w->dp_micro[d] < *kmin ? w->dp_micro[d] : *kmin;
  }
  return kmax;
}

/* ZeRO-2/3 with micro-batches set per data rank: the rank with the fewest
 * keeps a landing set of its gradient blocks (fp32) per phantom slot, and
 * the zeros they send (the largest parameter's gradient). */
static double phantom_bytes(const struct mr_workload *w, const struct mr_strategy *s,
                            double psi) {
  int kmin = 0, kmax = dp_micro_range(w, s, &kmin);
  if (s->zero_stage < 2 || s->dp < 2 || kmax == 0)
    return 0;
  const struct mr_model_config *m = w->model;
  double largest = fmax((double)m->vocab_size, (double)m->intermediate_size) *
                   (double)m->hidden_size / s->tp;
  return kmax > kmin ? (kmax - kmin) * 4.0 * psi / s->dp + 4.0 * largest : 0;
}

struct stage_mem {
  struct mr_memory mem;
  double psi; // parameters held (before ZeRO sharding)
};

/* One stage's place in the model, for its activations and buffers. */
struct stage_view {
  int stage, layers, first, last;
  int engine_sp;          // the embedding kept whole under sequence parallelism
  double psi;             // the stage's parameters on this rank
  double per_layer;       // one decoder layer's parameters (all ranks)
  double T;               // tokens of a micro-batch
  double wb;              // bytes of an activation element
};

/* meshrun's engine (compiler/spmd/lower.h), the LLaMA family: what the
 * forward keeps per micro-batch slot under meshrun's own schedule, the
 * arena the passes share, and the reshard and send buffers. */
static void engine_memory(const struct mr_workload *w, const struct mr_strategy *s,
                          const struct stage_view *v, struct mr_memory *mm) {
  const struct mr_model_config *m = w->model;
  double h = m->hidden_size, V = m->vocab_size, t = s->tp;
  double ab = v->wb, rows = v->T; /* rows of a micro-batch on this rank */
  int m_ = s->micro_batches;
  double keep = mr_cost_engine_layer_elems(m, s->tp, s->sequence_parallel, s->recompute);
  double none = mr_cost_engine_layer_elems(m, s->tp, s->sequence_parallel, MR_RECOMPUTE_NONE);
  double stored = s->recompute == MR_RECOMPUTE_MODE_FULL
                      ? ceil((double)v->layers / s->recompute_every_n)
                      : (double)v->layers;
  /* micro-batches in flight under meshrun's own schedule (shared with
   * the lowering), as chunk-micro-batches of layers / vp layers each */
  int vp = s->virtual_stages > 1 ? s->virtual_stages : 1;
  int accum = s->grad_accum_steps > 0 ? s->grad_accum_steps : 1;
  int fly[64];
  double held = s->pp > 1 && vp <= 64
                    ? (double)mr_pipeline_in_flight(vp > 1 ? MR_PP_INTERLEAVED : s->schedule,
                                                    s->pp, v->stage, vp, m_ * accum, fly) /
                          vp
                    : 1.0;
  double act = rows * keep * ab * stored * held;
  if (v->last) /* final norm, the logits (the vocabulary shard), labels */
    act += rows * (3.0 * h + 4.0 + ceil(V / t)) * ab * held;
  if (v->first)
    act += rows * 4.0 * held;
  /* the arena: a backward's working set, about 0.6 of a layer's kept
   * tensors; the group a full recomputation repeats; the head's logit
   * gradient; under ZeRO-2/3 the pass's whole gradients until they are
   * reduce-scattered */
  double arena = 0.6 * rows * none * ab;
  if (s->recompute == MR_RECOMPUTE_MODE_FULL)
    arena += rows * none * ab * fmin(s->recompute_every_n, v->layers);
  if (v->last && rows * ceil(V / t) * ab > arena)
    arena = rows * ceil(V / t) * ab;
  if (s->zero_stage >= 2)
    arena += v->psi * 4.0;
  mm->activations = act + arena;
  double buf = 0;
  if (s->tp > 1) /* reshard staging: three activation-sized buffers (the whole
                  * embedding gradient under sequence parallelism, summed
                  * over the sequence shards, and its staging) */
    buf += 3.0 * fmax(rows * h, v->first && v->engine_sp ? V * h : 0) * ab +
           (v->first && v->engine_sp ? V * h * 4.0 : 0);
  if (s->pp > 1) /* boundary sends in flight for a step, both directions, per chunk */
    buf += 2.0 * vp * m_ * (double)accum * rows * h * ab /
           (s->sequence_parallel && s->tp > 1 ? t : 1);
  mm->buffers = buf + phantom_bytes(w, s, v->psi);
}

/* Korthikanti et al.'s activations (the layer's stored and unstored
 * bytes, lt) and Megatron's buffers, for the other families. */
static void formula_memory(const struct mr_workload *w, const struct mr_strategy *s,
                           const struct mr_layer_times *lt, const struct stage_view *v,
                           struct mr_memory *mm) {
  const struct mr_model_config *m = w->model;
  double h = m->hidden_size, V = m->vocab_size, t = s->tp, p = s->pp, T = v->T;
  /* micro-batches whose activations a stage holds at once */
  int m_ = s->micro_batches;
  double inflight = 1;
  if (s->pp > 1) {
    if (s->schedule == MR_PP_GPIPE)
      inflight = m_;
    else
      inflight = fmin(m_, p - v->stage);
    if (s->schedule == MR_PP_INTERLEAVED)
      inflight *= 1.0 + (p - 1) / (p * m_);
  }
  double act;
  if (s->recompute == MR_RECOMPUTE_MODE_FULL) {
    int n = s->recompute_every_n;
    double stored = ceil((double)v->layers / n);
    act = lt->act_stored * stored * inflight + lt->act_none * (n < v->layers ? n : v->layers);
  } else {
    act = lt->act_stored * v->layers * inflight;
  }
  if (v->last)
    act += 2.0 * T * ceil(V / t) * 4.0; // fp32 logits and their gradient
  mm->activations = act;
  double buf = 0;
  if (s->tp > 1)
    buf += 2.0 * T * h * v->wb;
  if (s->pp > 1)
    buf += 4.0 * T * h * v->wb / t;
  if (s->dp > 1)
    buf += 2.0 * fmin(v->psi, 25e6) * v->wb;
  if (s->zero_stage >= 3)
    buf += 2.0 * v->per_layer / t * v->wb;
  mm->buffers = buf + phantom_bytes(w, s, v->psi);
}

/* A stage's memory: its parameters and their states, its activations and
 * buffers (meshrun's engine for LLaMA, the published formulas else), the
 * device's reserved workspace. */
static void stage_memory(const struct mr_workload *w, const struct mr_cluster *c,
                         const struct mr_strategy *s, const struct mr_layer_times *lt,
                         int stage, int layers, struct stage_mem *out) {
  const struct mr_model_config *m = w->model;
  double t = s->tp;
  double per_layer, emb, norm;
  mr_cost_param_split(m, &per_layer, &emb, &norm);
  double h = m->hidden_size, V = m->vocab_size;
  struct stage_view v = {.stage = stage, .layers = layers, .first = stage == 0,
                         .last = stage == s->pp - 1,
                         .T = (double)s->micro_batch_size * w->seq_len,
                         .wb = elem_bytes(s->amp_dtype)};
  /* meshrun's engine keeps a LLaMA embedding whole under sequence
   * parallelism (compiler/spmd/lower.c) */
  v.engine_sp = m->family == MR_MODEL_LLAMA && s->sequence_parallel && s->tp > 1;
  v.per_layer = per_layer;
  v.psi = layers * per_layer / t;
  if (v.first)
    v.psi += (v.engine_sp ? V : ceil(V / t)) * h + (emb - V * h); // token shard + positions
  if (v.last) {
    v.psi += norm;
    if (!v.first || !m->tie_word_embeddings)
      v.psi += ceil(V / t) * h;                // the head (or the tied embedding's copy)
  }
  struct mr_memory *mm = &out->mem;
  memset(mm, 0, sizeof *mm);
  out->psi = v.psi;
  mr_cost_model_states(v.psi, s->dp, s->zero_stage, s->amp_dtype, &mm->params, &mm->grads,
                       &mm->optimizer);
  if (s->offload && !c->host_is_device) { /* on CPU ranks they stay in the same memory */
    mm->host = mm->optimizer;
    mm->optimizer = 0;
  }
  if (m->family == MR_MODEL_LLAMA)
    engine_memory(w, s, &v, mm);
  else
    formula_memory(w, s, lt, &v, mm);
  mm->workspace = c->reserved_bytes;
  mm->total = mm->params + mm->grads + mm->optimizer + mm->activations + mm->buffers +
              mm->workspace;
}

struct mr_workload mr_workload_of(const struct mr_model_config *m,
                                  const struct mr_train_config *t,
                                  const struct mr_strategy_hint *h) {
  struct mr_workload w = {m, t->global_batch, t->seq_len, NULL, 0, NULL, 0};
  if (h != NULL && h->n_chunk_layers > 0) {
    w.chunk_layers = h->chunk_layers;
    w.n_chunk_layers = h->n_chunk_layers;
  }
  if (h != NULL && h->n_dp_micro > 0) {
    w.dp_micro = h->dp_micro;
    w.n_dp_micro = h->n_dp_micro;
  }
  return w;
}

/* Layers per chunk into counts[k] and the slowest chunk's time: the
 * workload's split when it has one for k chunks, else the balanced one. */
static double chunk_split(const struct mr_workload *w, const struct mr_layer_times *lt, int k,
                          int *counts) {
  double per = lt->fwd + lt->bwd + lt->rc;
  int l = (int)w->model->num_hidden_layers;
  if (w->n_chunk_layers != k)
    return mr_partition_uniform(l, per, lt->emb, lt->head, k, counts);
  double worst = 0;
  for (int i = 0; i < k; i++) {
    counts[i] = w->chunk_layers[i];
    double t = counts[i] * per + (i == 0 ? lt->emb : 0) + (i == k - 1 ? lt->head : 0);
    worst = fmax(worst, t);
  }
  return worst;
}

void mr_cost_prepare(const struct mr_workload *w, const struct mr_cluster *c,
                     const struct mr_strategy *s, struct mr_cost_prep *prep) {
  layer_times(w, c, s, &prep->lt);
  int v = s->virtual_stages < 1 ? 1 : s->virtual_stages;
  int k = s->pp * v;
  int counts[MR_PARTITION_MAX_ITEMS];
  prep->chunk_time = chunk_split(w, &prep->lt, k, counts);
  int maxc = 0;
  for (int i = 0; i < k; i++)
    maxc = counts[i] > maxc ? counts[i] : maxc;
  prep->chunk_layers_max = maxc;
  prep->first_chunk_layers = counts[0];
  prep->last_chunk_layers = counts[k - 1];
  prep->stage_layers[0] = stage_layers(counts, s->pp, v, 0);
  /* the middle stage that holds most: stage 1 (the most micro-batches in
   * flight) unless a fixed split gives another more layers */
  prep->mid_stage = 1;
  prep->stage_layers[1] = s->pp > 2 ? stage_layers(counts, s->pp, v, 1) : 0;
  for (int i = 2; i < s->pp - 1; i++) {
    int n = stage_layers(counts, s->pp, v, i);
    if (n > prep->stage_layers[1])
      prep->mid_stage = i, prep->stage_layers[1] = n;
  }
  prep->stage_layers[2] = stage_layers(counts, s->pp, v, s->pp - 1);
}

int mr_cost_partition(const struct mr_workload *w, const struct mr_cluster *c,
                      const struct mr_strategy *s, int *counts, int n) {
  int v = s->virtual_stages < 1 ? 1 : s->virtual_stages;
  int k = s->pp * v;
  if (k > n || k > w->model->num_hidden_layers)
    return mr_error_set(MR_EINVAL, "%d pipeline chunks: room for %d, %lld layers", k, n,
                        (long long)w->model->num_hidden_layers);
  struct mr_layer_times lt;
  layer_times(w, c, s, &lt);
  double x = chunk_split(w, &lt, k, counts);
  return x < 0 ? (int)x : k;
}

/* Memory of the fullest stage; the first and last stage's parameters. */
static void memory_prepared(const struct mr_workload *w, const struct mr_cluster *c,
                            const struct mr_strategy *s, const struct mr_cost_prep *prep,
                            struct mr_cost *out, double *psi) {
  struct stage_mem first, last;
  out->chunk_layers_max = prep->chunk_layers_max;
  out->first_chunk_layers = prep->first_chunk_layers;
  out->last_chunk_layers = prep->last_chunk_layers;
  stage_memory(w, c, s, &prep->lt, 0, prep->stage_layers[0], &first);
  stage_memory(w, c, s, &prep->lt, s->pp - 1, prep->stage_layers[2], &last);
  out->mem = first.mem.total >= last.mem.total ? first.mem : last.mem;
  *psi = fmax(first.psi, last.psi);
  if (s->pp > 2) {
    struct stage_mem mid;
    stage_memory(w, c, s, &prep->lt, prep->mid_stage, prep->stage_layers[1], &mid);
    if (mid.mem.total > out->mem.total)
      out->mem = mid.mem;
    *psi = fmax(*psi, mid.psi);
  }
  out->fits = out->mem.total <= c->memory_bytes;
}

void mr_cost_memory_prepared(const struct mr_workload *w, const struct mr_cluster *c,
                             const struct mr_strategy *s, const struct mr_cost_prep *prep,
                             struct mr_cost *out) {
  double psi;
  memory_prepared(w, c, s, prep, out, &psi);
}

void mr_cost_memory(const struct mr_workload *w, const struct mr_cluster *c,
                    const struct mr_strategy *s, struct mr_cost *out) {
  struct mr_cost_prep prep;
  mr_cost_prepare(w, c, s, &prep);
  mr_cost_memory_prepared(w, c, s, &prep, out);
}

int mr_cost_evaluate(const struct mr_workload *w, const struct mr_cluster *c,
                     const struct mr_strategy *s, struct mr_cost *out) {
  struct mr_cost_prep prep;
  mr_cost_prepare(w, c, s, &prep);
  return mr_cost_evaluate_prepared(w, c, s, &prep, out);
}

int mr_cost_evaluate_prepared(const struct mr_workload *w, const struct mr_cluster *c,
                              const struct mr_strategy *s, const struct mr_cost_prep *prep,
                              struct mr_cost *out) {
  memset(out, 0, sizeof *out);
  double psi;
  memory_prepared(w, c, s, prep, out, &psi);
  const struct mr_layer_times lt = prep->lt;
  double x = prep->chunk_time;
  const struct mr_model_config *m = w->model;
  int v = s->virtual_stages < 1 ? 1 : s->virtual_stages;
  int p = s->pp, mb = s->micro_batches, ga = s->grad_accum_steps;
  double wb = elem_bytes(s->amp_dtype);
  double T = (double)s->micro_batch_size * w->seq_len, h = m->hidden_size;
  int stride_dp = s->mapping == MR_MAP_TP_DP_PP ? s->tp : s->tp * s->pp;
  int stride_pp = s->mapping == MR_MAP_TP_DP_PP ? s->tp * s->dp : s->tp;
  struct mr_link dl = mr_cost_group_link(c, stride_dp, s->dp);
  struct mr_link pl = mr_cost_group_link(c, stride_pp, s->pp);

  /* Pipeline: m·v + p − 1 slots of the slowest chunk.  Micro-batches set
   * per data rank: the busiest rank's count paces the step, k_max of the
   * m·g, so the per-micro-batch terms grow by k_max / (m·g). */
  double slots = (double)mb * v, share = 1.0;
  int kmin, kmax = dp_micro_range(w, s, &kmin);
  if (kmax > 0)
    share = (double)kmax / ((double)mb * (ga > 0 ? ga : 1));
  out->compute_s = share * ga * slots * x;
  out->bubble_s = ga * (p - 1) * x;
  out->bubble_fraction = mr_cost_bubble_fraction(s->schedule, p, mb, v);
  double chunk_layers = out->chunk_layers_max;
  out->tp_comm_s = share * ga * slots * chunk_layers * lt.tp_fwd *
                   (s->recompute == MR_RECOMPUTE_MODE_FULL ? 3.0 : 2.0);
  out->recompute_s = share * ga * slots * chunk_layers * lt.rc;
  if (p > 1) {
    struct mr_link tl = mr_cost_group_link(c, 1, s->tp);
    out->p2p_s = ga * (share * slots + p - 1) * 2.0 *
                 mr_cost_pipeline_send_time(T, h, wb, s->tp, s->sequence_parallel, &pl, &tl);
  }

  /* Gradient sync, hidden behind the backward of the last micro-batch on
   * the first stage except one bucket (a layer's worth). */
  double gbytes = wb * psi;
  double window = out->first_chunk_layers * (lt.bwd + lt.rc);
  double buckets = out->first_chunk_layers > 0 ? out->first_chunk_layers : 1;
  double dp_s = 0;
  if (s->dp > 1) {
    double ar = mr_cost_collective_time(MR_COLL_ALLREDUCE, s->dp, gbytes, &dl);
    double rs = mr_cost_collective_time(MR_COLL_REDUCE_SCATTER, s->dp, gbytes, &dl);
    double ag = mr_cost_collective_time(MR_COLL_ALLGATHER, s->dp, gbytes, &dl);
    double stage_work = (double)v * chunk_layers * (lt.fwd + lt.bwd + lt.rc);
    if (s->zero_stage <= 1) {
      dp_s = fmax(ar - window, ar / buckets);
    } else if (s->zero_stage == 2) {
      /* Gradients reduce-scattered every micro-batch (the busiest data
       * rank's count: the others join with zeros), parameters gathered
       * once after the update. */
      dp_s = share * ga * mb * fmax(0.0, rs - window) + rs / buckets + ag;
    } else {
      /* Parameters gathered for forward and again for backward, gradients
       * reduce-scattered, every micro-batch; prefetch hides them behind
       * that micro-batch's work but for the first layer's gather of each
       * pass. */
      double per_mb = 2.0 * ag + rs;
      dp_s = share * ga * mb * (fmax(0.0, per_mb - stage_work) + 2.0 * ag / buckets);
    }
  }
  if (p > 1 && m->tie_word_embeddings) {
    struct mr_link el = mr_cost_group_link(c, stride_pp, s->pp);
    dp_s += mr_cost_collective_time(MR_COLL_ALLREDUCE, 2,
                                    wb * ceil((double)m->vocab_size / s->tp) * h, &el);
  }
  out->dp_comm_s = dp_s;

  /* Optimizer: read and write fp32 master, two moments, read the grad and
   * write the weight, ~28 bytes per parameter it owns. */
  double owned = s->zero_stage >= 1 ? psi / s->dp : psi;
  if (s->offload)
    out->optimizer_s = owned * 2.0 * wb / c->host_link_bandwidth +
                       owned * 28.0 / c->host_memory_bandwidth;
  else
    out->optimizer_s = owned * 28.0 / c->memory_bandwidth;

  out->step_time_s = out->compute_s + out->bubble_s + out->p2p_s + out->dp_comm_s +
                     out->optimizer_s;
  double world = (double)s->dp * s->tp * s->pp;
  out->model_flops = mr_cost_step_flops(w, 0);
  out->hardware_flops = mr_cost_step_flops(w, s->recompute == MR_RECOMPUTE_MODE_FULL);
  if (s->recompute == MR_RECOMPUTE_MODE_SELECTIVE) {
    double attn;
    layer_fwd_flops(m, (double)w->global_batch * w->seq_len, (double)w->seq_len, &attn);
    out->hardware_flops += m->num_hidden_layers * attn;
  }
  out->tokens_per_s = (double)w->global_batch * w->seq_len / out->step_time_s;
  out->model_tflops_per_device = out->model_flops / out->step_time_s / world / 1e12;
  out->mfu = out->model_flops / (out->step_time_s * world * c->peak_flops[s->amp_dtype]);
  return 0;
}
