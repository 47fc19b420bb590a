/* completion.h - the distributed graph: every tensor of a training graph
 * with a DistAttr, and the reshards between producers and consumers.
 *
 * Completion seeds placements from the job's shard rules (regex on
 * parameter names), from the data (token inputs Shard(0) on the data mesh
 * dim, and on the sequence-parallel dim when asked) and from explicit seeds,
 * then propagates through the SPMD rules forward and backward to a fixed
 * point; what stays unknown is replicated.  A final forward pass records
 * for every op input the placement the op reads (`need`) and, where the
 * producer's placement differs, a reshard edge with its cheapest plan.
 * Consumers that need the same placement of a tensor share one edge.
 * Gradients of parameters are brought to their parameter's placement
 * (gradient sync), and a Partial loss to Replicate (for reporting).
 *
 * Conflict preference, in order: a parameter keeps its placement (rules
 * never reshard a parameter's seed; consumers reshard their copy); on a
 * mesh dim, a sharding proposed by a parameter (hint) beats one proposed by
 * an activation; any consistent Shard beats Replicate (less memory);
 * between activations, the earlier input of the op wins. */
#ifndef MR_SPMD_COMPLETION_H
#define MR_SPMD_COMPLETION_H

#include "compiler/graph.h"
#include "common/job.h"
#include "compiler/mesh.h"
#include "compiler/model.h"
#include "compiler/spmd/reshard.h"

enum mr_edge_kind {
  MR_EDGE_OPERAND = 0,    // before op `op` reads input `slot`
  MR_EDGE_GRAD_SYNC = 1,  // a parameter's gradient to its parameter's placement
  MR_EDGE_LOSS = 2,       // the loss to Replicate
};

struct mr_reshard_edge {
  enum mr_edge_kind kind;
  int tensor;
  int op, slot;                   // first consumer; -1 for sync / loss
  int backward;                   // the consumer is a backward op (sync: 1)
  struct mr_dist_attr src, dst;
  struct mr_reshard_plan plan;
  int next_of_tensor;             // previous edge of the same tensor, or -1
};

struct mr_dist_graph {
  const struct mr_graph *g;       // borrowed
  struct mr_mesh mesh;
  struct mr_dist_attr *tensor;    // [n_tensors] as produced (or seeded)
  struct mr_dist_attr *need;      // [n_ops * MR_OP_MAX_IN] as each op reads
  int *edge_of;                   // [n_ops * MR_OP_MAX_IN] edge index or -1
  int *last_edge;                 // [n_tensors] latest edge of the tensor, -1
  struct mr_reshard_edge *edges;
  int n_edges, cap_edges;
  int iterations;                 // propagation sweeps until the fixed point
};

struct mr_completion_opts {
  const struct mr_shard_rule *rules; // job shard rules (borrowed), may be NULL
  int n_rules;
  int data_dim;                   // mesh dim of the batch, -1: none
  int seq_dim;                    // sequence-parallel mesh dim, -1: none
  const struct mr_dist_attr *seed; // [n_tensors] extra seeds or NULL
  mr_reshard_cost_fn cost;        // NULL: bytes
  void *cost_ctx;
};

/* Completes g on mesh m into dg (caller-allocated; free with
 * mr_dist_graph_close).  Returns 0, MR_EINVAL (a bad regex or placement in
 * a shard rule, an op without a rule, a hint that cannot hold, with a
 * message naming it) or MR_ENOMEM. */
int mr_spmd_complete(const struct mr_graph *g, const struct mr_mesh *m,
                     const struct mr_completion_opts *o,
                     struct mr_dist_graph *dg);

void mr_dist_graph_close(struct mr_dist_graph *dg);

/* Builds the training graph (forward + backward) of model cfg for batch x
 * seq tokens into mo and completes it on m into dg (both caller-allocated;
 * on success the caller closes both, on failure both hold nothing).  The
 * loss is the fused cross_entropy unless that graph's logits come out split
 * by vocabulary (the head Shard(0) on a mesh dim), which the fused op would
 * have to gather: then the model is rebuilt with the vocabulary-parallel
 * loss (compiler/model.h), which reads the logits where they lie, and kept
 * when its reshards move fewer bytes (they do once V > 6: three [N]
 * all-reduces instead of an [N, V] all-gather).  o->seed must be NULL (the
 * forms number their tensors differently).  Returns 0, MR_EINVAL (as
 * mr_spmd_complete, or seeds given) or an error building the graph. */
int mr_spmd_complete_model(const struct mr_model_config *cfg, int64_t batch,
                           int64_t seq, const struct mr_mesh *m,
                           const struct mr_completion_opts *o,
                           struct mr_model *mo, struct mr_dist_graph *dg);

/* 1 when dg splits tensor t's dim `dim` over some mesh dim of size > 1. */
int mr_dist_graph_splits(const struct mr_dist_graph *dg, int t, int dim);

/* Steps of kind over all edges of edge kind ek (-1: any) on mesh dim md
 * (-1: any), forward (backward = 0), backward (1) or both (-1). */
int mr_dist_graph_count(const struct mr_dist_graph *dg, int ek,
                        enum mr_reshard_kind kind, int md, int backward);

/* Link bytes per rank summed over all edges. */
int64_t mr_dist_graph_bytes(const struct mr_dist_graph *dg);

#endif
