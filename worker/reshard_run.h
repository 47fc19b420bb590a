/* reshard_run.h - carries out a reshard plan (compiler/spmd/reshard.h) on
 * one rank's local shard: local slices and packing through the device
 * backend, collectives through the comm backend, blocking.
 *
 * A tensor's local shard is row-major with the local extents mr_dist_local
 * gives for the DistAttr it is under; every step turns the shard under one
 * DistAttr into the shard under the step's `after`.  Collectives whose
 * pieces are uneven are padded to the largest piece (ReduceScatter,
 * AllToAll) or gathered with per-rank counts (AllGather). */
#ifndef MR_RESHARD_RUN_H
#define MR_RESHARD_RUN_H

#include "common/dtype.h"
#include "compiler/mesh.h"
#include "compiler/spmd/reshard.h"
#include "worker/backend/backend.h"
#include "worker/comm/comm.h"

struct mr_reshard_ctx {
  struct mr_backend *be;
  const struct mr_mesh *mesh;
  const int *coord;                              // this rank in mesh
  struct mr_comm_group *group[MR_MESH_MAX_DIMS]; // per mesh dim; NULL: size 1
  void *scratch[3];                              // each `scratch_bytes`
  double wait_s;                                 // time blocked, accumulated
};

/* The comm backend's reduction for a placement's. */
enum mr_red_op mr_reshard_red_op(enum mr_reduce_op op);

/* Runs plan on the local shard `in` of a tensor of global shape[ndim] and
 * dtype dt under src, writing the shard under the plan's last DistAttr to
 * out (in and out may not overlap the scratch buffers).  Returns 0 or a
 * comm error. */
int mr_reshard_run(struct mr_reshard_ctx *x, const struct mr_reshard_plan *plan,
                   const struct mr_dist_attr *src, int ndim, const int64_t *shape,
                   enum mr_dtype dt, const void *in, void *out);

/* Copies a box of lengths len[ndim] from src (shape sshape, at soff) to dst
 * (shape dshape, at doff), row-major, elements of es bytes. */
int mr_box_copy(struct mr_backend *be, int ndim, const int64_t *len, void *dst,
                const int64_t *dshape, const int64_t *doff, const void *src,
                const int64_t *sshape, const int64_t *soff, size_t es);

#endif
