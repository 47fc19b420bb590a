/* reshard.h - the cheapest way to move a tensor from one DistAttr to
 * another: a list of local slices and collectives, one mesh dim each.
 *
 * Steps act on each rank's current local piece, in order.  After every
 * step the pieces are exactly the local shards (compiler/mesh.h) of an
 * intermediate DistAttr, recorded in the step, so lowering and the tests
 * can follow the plan step by step.  Several plans are considered (fused
 * ReduceScatter / AllToAll against AllReduce / AllGather and a slice) and
 * the one the caller's cost function rates lowest is kept.  Across two
 * meshes (a pipeline stage boundary) the tensor travels by Send/Recv,
 * coordinate to coordinate, optionally scattered over a replicated mesh
 * dim before and gathered after. */
#ifndef MR_RESHARD_H
#define MR_RESHARD_H

#include <stdint.h>

#include "compiler/mesh.h"

#define MR_RESHARD_MAX_STEPS 24

enum mr_reshard_kind {
  MR_RS_SLICE = 0,       // keep piece coord[dim] of the local extent of tdim
  MR_RS_ALL_GATHER,      // concatenate the group's pieces along tdim
  MR_RS_ALL_REDUCE,      // reduce (op) over the group
  MR_RS_REDUCE_SCATTER,  // reduce (op), keep piece coord[dim] along tdim
  MR_RS_ALL_TO_ALL,      // split along tdim, gather along tdim2
  MR_RS_ZERO_NONROOT,    // Replicate -> Partial(sum): coord[dim] != 0 zeroes
  MR_RS_SCALE,           // multiply by factor (Partial sum <-> avg)
  MR_RS_SEND_RECV,       // src mesh coordinate -> dst mesh coordinate
  MR_RS_KIND_COUNT
};

struct mr_reshard_step {
  enum mr_reshard_kind kind;
  int mesh_dim;                   // the group: all ranks differing only here
  int tdim, tdim2;                // tensor dims (SLICE/GATHER/RS: tdim;
                                  // ALL_TO_ALL: split tdim2, gather tdim)
  enum mr_reduce_op op;           // ALL_REDUCE / REDUCE_SCATTER
  double factor;                  // SCALE
  int group_size;                 // ranks in the group
  int64_t bytes;                  // per rank, over links (0: local)
  struct mr_dist_attr after;      // the DistAttr once this step is done
  int on_dst;                     // 1: runs on the destination mesh
};

struct mr_reshard_plan {
  int n_steps;
  struct mr_reshard_step steps[MR_RESHARD_MAX_STEPS];
  double cost;                    // the caller's cost summed
  int64_t bytes;                  // sum of step bytes
};

/* A cost of one step; NULL means its bytes. */
typedef double (*mr_reshard_cost_fn)(void *ctx, const struct mr_reshard_step *s);

/* Name of a step kind ("AllReduce", ...). */
const char *mr_reshard_kind_name(enum mr_reshard_kind k);

/* Per-rank link bytes of a collective moving a local piece of `local`
 * bytes over k ranks (ring algorithms): AllReduce 2(k-1)/k, AllGather
 * (k-1) * piece, ReduceScatter and AllToAll (k-1)/k; local steps 0. */
int64_t mr_reshard_step_bytes(enum mr_reshard_kind kind, int k, int64_t local);

/* Plans src -> dst for a tensor of shape[tndim] with elem_bytes per
 * element on mesh m.  Returns 0 (plan->n_steps may be 0) or MR_EINVAL
 * (placements out of range). */
int mr_reshard_plan(const struct mr_mesh *m, int tndim, const int64_t *shape,
                    int elem_bytes, const struct mr_dist_attr *src,
                    const struct mr_dist_attr *dst, mr_reshard_cost_fn cost,
                    void *cost_ctx, struct mr_reshard_plan *plan);

/* Plans src on mesh a -> dst on mesh b (a pipeline boundary).  Meshes of
 * the same shape exchange coordinate to coordinate; otherwise the tensor
 * is made whole on a, sent to every rank of b and sliced there.  Steps
 * with on_dst = 1 run on b.  Returns 0 or MR_EINVAL. */
int mr_reshard_plan_cross(const struct mr_mesh *a, const struct mr_mesh *b,
                          int tndim, const int64_t *shape, int elem_bytes,
                          const struct mr_dist_attr *src,
                          const struct mr_dist_attr *dst,
                          mr_reshard_cost_fn cost, void *cost_ctx,
                          struct mr_reshard_plan *plan);

#endif
