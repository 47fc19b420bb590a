/* spmd_sim.h - a simulated SPMD executor for the tests: every rank of a
 * mesh is a local buffer in this process.  Tensors are cut into local
 * shards, reshard steps run as reference collectives written out here
 * (serial loops over the group), and sharded tensors are materialized back
 * (Partial operands reduced) to compare with unsharded results. */
#ifndef MR_SPMD_SIM_H
#define MR_SPMD_SIM_H

#include <stdint.h>

#include "compiler/mesh.h"
#include "compiler/spmd/reshard.h"

#define SIM_MAX_RANKS 16

struct sim_buf {
  int ndim;
  int64_t shape[MR_TENSOR_MAX_DIMS];
  float *d;                       // owned
};

struct sim_tensor {
  const struct mr_mesh *mesh;     // borrowed
  int nranks;
  struct mr_dist_attr da;
  struct sim_buf r[SIM_MAX_RANKS]; // by row-major mesh index
};

int64_t sim_numel(int ndim, const int64_t *shape);

/* Cuts global (shape[ndim]) into the local shards of da; a Partial mesh
 * dim puts the whole value on coordinate 0 and zeros elsewhere for sum,
 * the value on every rank for avg/max — unless `operands` is non-NULL:
 * then rank r's operand is operands + r * numel (random summands). */
void sim_scatter(struct sim_tensor *t, const struct mr_mesh *m,
                 const struct mr_dist_attr *da, int ndim, const int64_t *shape,
                 const float *global, const float *const *operands);

/* Materializes t into out (numel of shape): local blocks placed at their
 * offsets, Partial mesh dims reduced.  Returns the largest disagreement
 * between ranks that should hold the same value (0 when consistent), or
 * -1 when a local buffer's shape differs from its DistAttr's shard. */
double sim_gather(const struct sim_tensor *t, int ndim, const int64_t *shape,
                  float *out);

/* Runs one reshard step on t (reference collectives); for SEND_RECV, dst
 * receives on mesh b.  Returns 0 or -1 (shape mismatch in the group). */
int sim_step(struct sim_tensor *t, const struct mr_reshard_step *s,
             const struct mr_mesh *b);

/* Runs a whole plan; t ends on mesh b when the plan crosses meshes. */
int sim_plan(struct sim_tensor *t, const struct mr_reshard_plan *p,
             const struct mr_mesh *b);

void sim_tensor_free(struct sim_tensor *t);

/* Largest |a-b| / max(1, |b|) over n. */
double sim_rel_err(const float *a, const float *b, int64_t n);

struct mr_dist_graph;
struct mr_graph;

/* Runs a completed graph on simulated ranks with the real CPU kernels:
 * global_in[t] holds the global value of every tensor without a producer
 * (ids as floats); every reshard edge runs through sim_plan before its
 * consumers and each op runs per rank on local shards with its rule's
 * local attributes.  global_out[t] receives a malloc'd materialized copy
 * of every tensor (parameter gradients after their gradient sync).
 * Returns 0, or -1 / a kernel's error. */
int sim_run_graph(const struct mr_dist_graph *dg, float *const *global_in,
                  float **global_out);

/* The same graph on one rank through the executor (worker/exec.h);
 * global_out as above.  Returns 0 or an error. */
int sim_run_reference(const struct mr_graph *g, float *const *global_in,
                      float **global_out);

#endif
