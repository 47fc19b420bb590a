/* cost.h - the analytical cost model: predicted step time and per-rank
 * memory of one strategy, from the model's shape, the batch and a cluster
 * spec.  Pure arithmetic: no I/O, no clocks, no allocation.
 *
 * The transformer is modelled layer by layer from its config, as Megatron's
 * papers do (Narayanan et al. 2021; Korthikanti et al. 2022): each GEMM
 * costs its FLOPs over peak times a shape-dependent efficiency, the other
 * ops their bytes over memory bandwidth, each collective α–β on the link
 * its mesh dimension maps to.  docs/PLANNER.md derives every formula and
 * names its source; each exported formula below is unit-tested against a
 * value worked by hand. */
#ifndef MR_COST_H
#define MR_COST_H

#include <stdint.h>

#include "common/model_config.h"
#include "compiler/planner/cluster.h"
#include "compiler/planner/strategy.h"

/* What is trained: the model and the batch of one optimizer step. */
struct mr_workload {
  const struct mr_model_config *model; // borrowed
  int64_t global_batch;                // sequences per optimizer step
  int64_t seq_len;                     // tokens per sequence
  const int *chunk_layers;             // borrowed; the job's layers per pipeline
  int n_chunk_layers;                  //   chunk, or NULL: balanced by cost
  const int *dp_micro;                 // borrowed; the job's micro-batches per
  int n_dp_micro;                      //   data-parallel rank, or NULL: even
};

/* The workload of a job: its model and batch, and the splits its hint
 * fixes (pipeline_parallel.layers, data_parallel.micro_batches; hint may
 * be NULL). */
struct mr_workload mr_workload_of(const struct mr_model_config *m,
                                  const struct mr_train_config *t,
                                  const struct mr_strategy_hint *h);

enum mr_collective {
  MR_COLL_ALLREDUCE = 0,
  MR_COLL_REDUCE_SCATTER = 1,
  MR_COLL_ALLGATHER = 2,
  MR_COLL_P2P = 3,
};

/* A link as the α–β model sees it. */
struct mr_link {
  double bandwidth; // bytes/s per rank (ring bus bandwidth)
  double latency;   // s per step
  int inter_node;   // 1 when the group spans nodes
};

/* Per-rank memory, bytes, on the rank that needs the most. */
struct mr_memory {
  double params;
  double grads;
  double optimizer;
  double activations;
  double buffers;     // communication buffers
  double workspace;   // runtime reservation from the cluster spec
  double total;
  double host;        // offloaded optimizer states, in host memory
};

struct mr_cost {
  double step_time_s;
  double compute_s;       // GEMM + memory-bound ops + tensor-parallel comm, m·v chunk slots
  double tp_comm_s;       // tensor/sequence-parallel collectives inside compute_s
  double recompute_s;     // recomputation inside compute_s
  double bubble_s;        // pipeline fill and drain
  double p2p_s;           // pipeline sends on the critical path
  double dp_comm_s;       // gradient/parameter sync not hidden behind backward
  double optimizer_s;     // optimizer step (incl. offload transfers)
  double tokens_per_s;
  double model_flops;     // per step, no recompute (the "72" form)
  double hardware_flops;  // per step, what actually runs
  double model_tflops_per_device;
  double mfu;             // model FLOP/s over peak
  double bubble_fraction; // (p-1)/(v·m) style, of the schedule
  int chunk_layers_max;   // most layers one pipeline chunk holds
  int first_chunk_layers, last_chunk_layers;
  struct mr_memory mem;
  int fits;               // mem.total <= device memory
};

/* Fraction of peak one GEMM of M×K by K×N reaches:
 * matmul_efficiency / (1 + g·(1/M + 1/N + 1/K)), g = gemm_half_dim.
 * Saturates to the measured large-GEMM rate; a dimension equal to g alone
 * halves it. */
double mr_cost_gemm_efficiency(const struct mr_cluster *c, double m, double n, double k);

/* Seconds for `batch` GEMMs of M×K by K×N in dtype. */
double mr_cost_gemm_time(const struct mr_cluster *c, enum mr_amp_dtype dt, double batch,
                         double m, double n, double k);

/* α–β time of one collective of `bytes` (the full buffer, per rank) over a
 * group of n ranks: allreduce 2(n−1)α + 2(n−1)/n·S/β; reduce-scatter and
 * all-gather (n−1)α + (n−1)/n·S/β; point-to-point α + S/β.  0 for n == 1
 * (except p2p). */
double mr_cost_collective_time(enum mr_collective kind, int n, double bytes,
                               const struct mr_link *link);

/* The link a group of n ranks spaced `stride` apart in rank order uses: a
 * node's bus when stride·n divides the devices per node (every group lies
 * inside one node), else the network, where each of
 * the min(stride, devices_per_node) concurrent flows leaving a node gets
 * its share of the node's bandwidth (a group straddling nodes unevenly:
 * one device's share). */
struct mr_link mr_cost_group_link(const struct mr_cluster *c, int stride, int n);

/* Seconds of one pipeline send of a micro-batch's activations (or their
 * gradient), T·h elements of w bytes, on the critical path.  Without
 * sequence parallelism the stage output is replicated over the t
 * tensor-parallel ranks, so each rank sends its 1/t slice on pp_link and
 * the receiver all-gathers the slices on tp_link before using them
 * (Narayanan et al. 2021, §4.1, scatter/gather): α + (T·h·w/t)/β plus
 * all-gather(t, T·h·w).  With sequence parallelism the slices stay
 * sharded: the send alone. */
double mr_cost_pipeline_send_time(double tokens, double hidden, double elem_bytes, int tp,
                                  int sequence_parallel, const struct mr_link *pp_link,
                                  const struct mr_link *tp_link);

/* Pipeline bubble over useful time: (p−1)/m for GPipe and 1F1B, (p−1)/(v·m)
 * interleaved; 0 for p == 1. */
double mr_cost_bubble_fraction(enum mr_pp_schedule sched, int p, int m, int v);

/* Activation bytes one transformer layer stores for one micro-batch of b
 * sequences, 16-bit activations (Korthikanti et al. 2022, Table 2 and
 * §4): s·b·h·(10 + 24/t + 5·a·s/(h·t)) with tensor parallelism (t = 1 is
 * the unsplit 34 + 5as/h), s·b·h/t·(34 + 5as/h) with sequence parallelism,
 * without the 5as/h term under selective recompute, 2·s·b·h (÷t with
 * sequence parallelism) under full recompute. */
double mr_cost_layer_activation_bytes(double s, double b, double h, double a, int t,
                                      int sp, enum mr_recompute_mode rc);

/* Model-state bytes per rank for psi parameters over n_d data-parallel
 * ranks (Rajbhandari et al. 2020 with K = 16): mixed precision Adam keeps
 * 16-bit weights 2Ψ and grads 2Ψ, and optimizer states KΨ = fp32 master,
 * momentum, variance and the fp32 copy of the gradient the update reads
 * (Megatron-Core's accounting: 20 bytes per parameter, 4 + 16/d
 * distributed); each term is divided by n_d from stage 3, 2, 1 on.  With
 * amp fp32: 4Ψ, 4Ψ, 8Ψ (no copies). */
void mr_cost_model_states(double psi, int n_d, int zero_stage, enum mr_amp_dtype dt,
                          double *params, double *grads, double *optimizer);

/* Model FLOPs of one training step without recompute (forward + backward,
 * 3× forward): for GPT 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)); with
 * `recompute_full` the forward of every layer runs twice (96·… + V/(16·l·h),
 * Narayanan et al. 2021).  Counted GEMM by GEMM from the config. */
double mr_cost_step_flops(const struct mr_workload *w, int recompute_full);

/* Parameters of one transformer layer, of the embeddings (token + learned
 * positions), and of the final norm. */
void mr_cost_param_split(const struct mr_model_config *m, double *per_layer,
                         double *embedding, double *final_norm);

/* Checks that s can run w on c: degrees multiply to the world size and
 * divide what they split (heads, layers, batch).  Returns 0 or MR_EINVAL
 * with a message naming the first problem. */
int mr_cost_check(const struct mr_workload *w, const struct mr_cluster *c,
                  const struct mr_strategy *s);

/* Times of one layer, one micro-batch, one rank, and of the embedding and
 * head on the first and last chunk. */
/* Elements per token one LLaMA layer of meshrun's engine keeps from its
 * forward pass for its backward (compiler/spmd/lower.h), on a rank of
 * tensor-parallel degree t, with sequence parallelism sp, under recompute
 * mode rc (full: the group input, per group).  docs/PLANNER.md derives it
 * tensor by tensor. */
double mr_cost_engine_layer_elems(const struct mr_model_config *m, int t, int sp,
                                  enum mr_recompute_mode rc);

struct mr_layer_times {
  double fwd, bwd, rc;      // s; bwd excludes recompute
  double tp_fwd;            // s of tensor-parallel collectives in fwd (bwd has as much)
  double emb, head;         // s, fwd + bwd
  double act_none;          // bytes one layer stores without recompute
  double act_stored;        // bytes one layer stores under the strategy's recompute
};

/* What a strategy's layer shapes decide (tp, micro-batch, sequence
 * parallel, recompute, pp, virtual stages, dtype), computed once and shared
 * by the strategies that differ only in ZeRO stage, offload or mapping. */
struct mr_cost_prep {
  struct mr_layer_times lt;
  double chunk_time;        // s, the slowest pipeline chunk, one micro-batch fwd + bwd
  int chunk_layers_max, first_chunk_layers, last_chunk_layers;
  int stage_layers[3];      // layers on stage 0, stage mid_stage, stage p-1
  int mid_stage;            // the middle stage holding most
};

void mr_cost_prepare(const struct mr_workload *w, const struct mr_cluster *c,
                     const struct mr_strategy *s, struct mr_cost_prep *prep);
void mr_cost_memory_prepared(const struct mr_workload *w, const struct mr_cluster *c,
                             const struct mr_strategy *s, const struct mr_cost_prep *prep,
                             struct mr_cost *out);
int mr_cost_evaluate_prepared(const struct mr_workload *w, const struct mr_cluster *c,
                              const struct mr_strategy *s, const struct mr_cost_prep *prep,
                              struct mr_cost *out);

/* The layer count of each of the pp × virtual_stages pipeline chunks, in
 * model order (chunk j runs on stage j mod pp): the workload's own, else
 * balanced by the cost model (the first chunk also runs the embedding, the
 * last the head).  counts has room for n entries.  Returns the number of
 * chunks or MR_EINVAL. */
int mr_cost_partition(const struct mr_workload *w, const struct mr_cluster *c,
                      const struct mr_strategy *s, int *counts, int n);

/* Predicts step time and memory of s (which mr_cost_check accepted).
 * Returns 0; out is filled completely (out->fits tells whether it fits). */
int mr_cost_evaluate(const struct mr_workload *w, const struct mr_cluster *c,
                     const struct mr_strategy *s, struct mr_cost *out);

/* Memory only (cheap), for pruning: fills out->mem and out->fits. */
void mr_cost_memory(const struct mr_workload *w, const struct mr_cluster *c,
                    const struct mr_strategy *s, struct mr_cost *out);

#endif
