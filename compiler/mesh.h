/* mesh.h - ProcessMesh, Placement and DistAttr: how a tensor lies across
 * ranks, and the arithmetic of each rank's local shard.
 *
 * A mesh is an N-d array of ranks with named dims; rank ids are affine in
 * the coordinate (base + sum coord[i] * stride[i]), so a pipeline stage's
 * sub-mesh (a slice of a larger mesh) is a mesh too.  A DistAttr gives one
 * placement per mesh dim: Shard(d) splits tensor dim d over that mesh dim,
 * Replicate() copies, Partial(op) holds one operand of a pending reduction.
 * Several mesh dims may shard the same tensor dim: they split in mesh-dim
 * order, each splitting the piece the earlier ones left.  A split of n rows
 * over k ranks gives the first n % k shards one row more. */
#ifndef MR_MESH_H
#define MR_MESH_H

#include <stddef.h>
#include <stdint.h>

#define MR_MESH_MAX_DIMS 4
#define MR_MESH_NAME_MAX 16
#define MR_TENSOR_MAX_DIMS 4

struct mr_mesh {
  int ndim;
  int shape[MR_MESH_MAX_DIMS];
  char names[MR_MESH_MAX_DIMS][MR_MESH_NAME_MAX];
  int base;                       // rank id at coordinate 0
  int stride[MR_MESH_MAX_DIMS];   // rank id step per coordinate
};

enum mr_placement_kind { MR_REPLICATE = 0, MR_SHARD = 1, MR_PARTIAL = 2 };
enum mr_reduce_op { MR_REDUCE_SUM = 0, MR_REDUCE_AVG = 1, MR_REDUCE_MAX = 2 };

struct mr_placement {
  enum mr_placement_kind kind;
  int dim;                        // tensor dim for MR_SHARD
  enum mr_reduce_op reduce;       // for MR_PARTIAL
};

struct mr_dist_attr {
  int known;                      // 0: not yet inferred
  int ndim;                       // mesh dims (placements used)
  struct mr_placement p[MR_MESH_MAX_DIMS];
};

/* Parses "data=2,model=4" into a row-major mesh of ranks 0..N-1.  Returns 0
 * or MR_EINVAL with a message naming the bad entry. */
int mr_mesh_parse(const char *spec, struct mr_mesh *m);

/* Builds a row-major mesh from shape and names (names may be NULL: "d0"..). */
int mr_mesh_init(struct mr_mesh *m, int ndim, const int *shape,
                 const char *const *names);

/* Number of ranks. */
int mr_mesh_size(const struct mr_mesh *m);

/* Index of the dim named name, or -1. */
int mr_mesh_dim(const struct mr_mesh *m, const char *name);

/* Rank id of coordinate coord[ndim]; coordinates of the i-th rank in
 * row-major order (0 <= i < size). */
int mr_mesh_rank(const struct mr_mesh *m, const int *coord);
void mr_mesh_coord(const struct mr_mesh *m, int index, int *coord);

/* The sub-mesh at index `at` along dim `dim` (that dim removed): a pipeline
 * stage of a [pp, ...] mesh.  Returns 0 or MR_EINVAL. */
int mr_mesh_slice(const struct mr_mesh *m, int dim, int at, struct mr_mesh *out);

/* Writes "data=2,model=4" into buf; returns the length (snprintf's). */
int mr_mesh_format(const struct mr_mesh *m, char *buf, size_t n);

/* Placement constructors. */
struct mr_placement mr_shard(int dim);
struct mr_placement mr_replicate(void);
struct mr_placement mr_partial(enum mr_reduce_op op);

/* 1 when a and b are the same placement. */
int mr_placement_eq(struct mr_placement a, struct mr_placement b);

/* Parses "Shard(0)", "Replicate()", "Partial()", "Partial(sum|avg|max)"
 * (spaces allowed).  Returns 0 or MR_EINVAL naming the text. */
int mr_placement_parse(const char *text, struct mr_placement *p);

/* Writes the notation above; returns the length. */
int mr_placement_format(struct mr_placement p, char *buf, size_t n);

/* A DistAttr replicated on all ndim mesh dims (known). */
struct mr_dist_attr mr_dist_replicated(int ndim);

/* 1 when both are known and equal placement for placement. */
int mr_dist_eq(const struct mr_dist_attr *a, const struct mr_dist_attr *b);

/* Parses "[Shard(0), Replicate()]" (brackets optional) for a mesh of ndim
 * dims.  Returns 0 or MR_EINVAL. */
int mr_dist_parse(const char *text, int ndim, struct mr_dist_attr *d);

/* Writes "[Shard(0), Replicate()]" or "?" when unknown; returns the length. */
int mr_dist_format(const struct mr_dist_attr *d, char *buf, size_t n);

/* Checks d against a tensor of rank tndim: every Shard dim in range.
 * Returns 0 or MR_EINVAL. */
int mr_dist_check(const struct mr_dist_attr *d, int tndim);

/* Length and offset of piece i of n split over k (first n % k get one more). */
int64_t mr_split_len(int64_t n, int k, int i);
int64_t mr_split_off(int64_t n, int k, int i);

/* The local shard of a tensor of global shape[tndim] at mesh coordinate
 * coord: off[d], len[d] per tensor dim.  Partial and Replicate leave dims
 * whole. */
void mr_dist_local(const struct mr_mesh *m, const struct mr_dist_attr *d,
                   int tndim, const int64_t *shape, const int *coord,
                   int64_t *off, int64_t *len);

/* Largest local shard (elements) over all coordinates. */
int64_t mr_dist_local_numel_max(const struct mr_mesh *m,
                                const struct mr_dist_attr *d, int tndim,
                                const int64_t *shape);

/* Number of ways tensor dim `tdim` is split by d (product of the mesh dims
 * sharding it). */
int mr_dist_split_degree(const struct mr_mesh *m, const struct mr_dist_attr *d,
                         int tdim);

#endif
