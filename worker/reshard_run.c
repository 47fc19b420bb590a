/* reshard_run.c - reshard steps on local shards. */
#include "worker/reshard_run.h"

#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/error.h"

int mr_box_copy(struct mr_backend *be, int ndim, const int64_t *len, void *dst,
                const int64_t *dshape, const int64_t *doff, const void *src,
                const int64_t *sshape, const int64_t *soff, size_t es) {
  for (int d = 0; d < ndim; d++)
    if (len[d] == 0)
      return 0;
  if (ndim == 1)
    return be->ops->copy2d(be, (char *)dst + (size_t)doff[0] * es, 0,
                           (const char *)src + (size_t)soff[0] * es, 0, (size_t)len[0] * es, 1);
  /* strides in elements */
  int64_t ds[MR_TENSOR_MAX_DIMS], ss[MR_TENSOR_MAX_DIMS];
  ds[ndim - 1] = ss[ndim - 1] = 1;
  for (int d = ndim - 2; d >= 0; d--) {
    ds[d] = ds[d + 1] * dshape[d + 1];
    ss[d] = ss[d + 1] * sshape[d + 1];
  }
  /* the last two dims are one 2-D copy; loop over the others */
  int64_t outer = 1;
  for (int d = 0; d < ndim - 2; d++)
    outer *= len[d];
  for (int64_t o = 0; o < outer; o++) {
    int64_t rem = o, dp = 0, sp = 0;
    for (int d = ndim - 3; d >= 0; d--) {
      int64_t i = rem % len[d];
      rem /= len[d];
      dp += (doff[d] + i) * ds[d];
      sp += (soff[d] + i) * ss[d];
    }
    dp += doff[ndim - 2] * ds[ndim - 2] + doff[ndim - 1];
    sp += soff[ndim - 2] * ss[ndim - 2] + soff[ndim - 1];
    MR_TRY(be->ops->copy2d(be, (char *)dst + (size_t)dp * es, (size_t)ds[ndim - 2] * es,
                           (const char *)src + (size_t)sp * es, (size_t)ss[ndim - 2] * es,
                           (size_t)len[ndim - 1] * es, (size_t)len[ndim - 2]));
  }
  return 0;
}

static int64_t numel(int ndim, const int64_t *len) {
  int64_t n = 1;
  for (int d = 0; d < ndim; d++)
    n *= len[d];
  return n;
}

/* The local box under d of the rank at coordinate i on mesh dim md (and
 * this rank's coordinates on the others). */
static void peer_local(const struct mr_reshard_ctx *x, int md, int i,
                       const struct mr_dist_attr *d, int ndim, const int64_t *shape,
                       int64_t *off, int64_t *len) {
  int c[MR_MESH_MAX_DIMS];
  memcpy(c, x->coord, sizeof c);
  c[md] = i;
  mr_dist_local(x->mesh, d, ndim, shape, c, off, len);
}

enum mr_red_op mr_reshard_red_op(enum mr_reduce_op op) {
  return op == MR_REDUCE_AVG ? MR_RED_AVG : op == MR_REDUCE_MAX ? MR_RED_MAX : MR_RED_SUM;
}

static int wait_req(struct mr_reshard_ctx *x, struct mr_comm_req *req) {
  double t0 = mr_clock_s();
  int rc = mr_comm_wait(req);
  x->wait_s += mr_clock_s() - t0;
  return rc;
}

/* One step's view of the tensor on this rank: its box before and after,
 * the group along the step's mesh dim and this rank's place in it. */
struct local {
  const struct mr_reshard_step *s;
  const struct mr_dist_attr *before;
  int ndim;
  const int64_t *shape;
  enum mr_dtype dt;
  size_t es;
  int64_t len[MR_TENSOR_MAX_DIMS], alen[MR_TENSOR_MAX_DIMS];
  int k, c;
  struct mr_comm_group *grp;
  size_t n_in, n_out;
};

static const int64_t zero[MR_TENSOR_MAX_DIMS];

/* Each peer's block gathered, laid out in mesh order along tdim. */
static int all_gather(struct mr_reshard_ctx *x, const struct local *l, const void *cur,
                      void *dst) {
  const struct mr_reshard_step *s = l->s;
  size_t *counts = malloc((size_t)l->k * sizeof *counts);
  if (counts == NULL)
    return MR_ENOMEM;
  int64_t o2[MR_TENSOR_MAX_DIMS], l2[MR_TENSOR_MAX_DIMS];
  for (int i = 0; i < l->k; i++) {
    peer_local(x, s->mesh_dim, i, l->before, l->ndim, l->shape, o2, l2);
    counts[i] = (size_t)numel(l->ndim, l2);
  }
  void *tmp = x->scratch[2];
  struct mr_comm_req *req;
  int rc = mr_comm_all_gather(l->grp, cur, tmp, l->n_in, counts, l->dt, &req);
  if (rc == 0)
    rc = wait_req(x, req);
  free(counts);
  MR_TRY(rc);
  size_t at = 0;
  int64_t doff[MR_TENSOR_MAX_DIMS] = {0};
  for (int i = 0; i < l->k; i++) {
    peer_local(x, s->mesh_dim, i, l->before, l->ndim, l->shape, o2, l2);
    int64_t plen[MR_TENSOR_MAX_DIMS];
    memcpy(plen, l->len, sizeof plen);
    plen[s->tdim] = l2[s->tdim];
    MR_TRY(mr_box_copy(x->be, l->ndim, plen, dst, l->alen, doff, (char *)tmp + at * l->es, plen,
                       zero, l->es));
    doff[s->tdim] += plen[s->tdim];
    at += (size_t)numel(l->ndim, l2);
  }
  return 0;
}

/* The local box split along dim into k pieces, piece i copied to
 * pack + i * stride elements; pad: the rest of each stride zeroed (for a
 * reduction, whose pieces must add up whole). */
static int pack_split(struct mr_reshard_ctx *x, const struct local *l, int dim, int64_t stride,
                      const void *cur, char *pack, int pad) {
  struct mr_backend *be = x->be;
  int64_t so[MR_TENSOR_MAX_DIMS] = {0};
  for (int i = 0; i < l->k; i++) {
    int64_t plen[MR_TENSOR_MAX_DIMS];
    memcpy(plen, l->len, sizeof plen);
    plen[dim] = mr_split_len(l->len[dim], l->k, i);
    so[dim] = mr_split_off(l->len[dim], l->k, i);
    int64_t used = numel(l->ndim, plen);
    MR_TRY(mr_box_copy(be, l->ndim, plen, pack + (size_t)(i * stride) * l->es, plen, zero, cur,
                       l->len, so, l->es));
    if (pad && used < stride)
      MR_TRY(be->ops->memset(be, NULL, pack + (size_t)(i * stride + used) * l->es, 0,
                             (size_t)(stride - used) * l->es));
  }
  return 0;
}

/* Pieces along tdim packed (each padded to the first's size), reduced,
 * this rank's piece kept. */
static int reduce_scatter(struct mr_reshard_ctx *x, const struct local *l, const void *cur,
                          void *dst) {
  const struct mr_reshard_step *s = l->s;
  struct mr_backend *be = x->be;
  int64_t piece = (int64_t)l->n_in / (l->len[s->tdim] ? l->len[s->tdim] : 1) *
                  mr_split_len(l->len[s->tdim], l->k, 0);
  char *pack = x->scratch[2];
  MR_TRY(pack_split(x, l, s->tdim, piece, cur, pack, 1));
  char *recv = pack + (size_t)(l->k * piece) * l->es;
  struct mr_comm_req *req;
  MR_TRY(mr_comm_reduce_scatter(l->grp, pack, recv, (size_t)piece, l->dt,
                                mr_reshard_red_op(s->op), &req));
  MR_TRY(wait_req(x, req));
  return be->ops->copy2d(be, dst, 0, recv, 0, l->n_out * l->es, 1);
}

/* tdim2 split into k pieces (block j to rank j), tdim gathered. */
static int all_to_all(struct mr_reshard_ctx *x, const struct local *l, const void *cur,
                      void *dst) {
  const struct mr_reshard_step *s = l->s;
  int64_t o0[MR_TENSOR_MAX_DIMS], l0[MR_TENSOR_MAX_DIMS];
  peer_local(x, s->mesh_dim, 0, l->before, l->ndim, l->shape, o0, l0);
  int64_t blen[MR_TENSOR_MAX_DIMS];
  memcpy(blen, l->len, sizeof blen);
  blen[s->tdim2] = mr_split_len(l->len[s->tdim2], l->k, 0);
  blen[s->tdim] = l0[s->tdim];
  int64_t block = numel(l->ndim, blen);
  char *pack = x->scratch[2], *recv = pack + (size_t)(l->k * block) * l->es;
  MR_TRY(pack_split(x, l, s->tdim2, block, cur, pack, 0));
  struct mr_comm_req *req;
  MR_TRY(mr_comm_all_to_all(l->grp, pack, recv, (size_t)block, l->dt, &req));
  MR_TRY(wait_req(x, req));
  int64_t doff[MR_TENSOR_MAX_DIMS] = {0};
  for (int i = 0; i < l->k; i++) {
    int64_t o2[MR_TENSOR_MAX_DIMS], l2[MR_TENSOR_MAX_DIMS];
    peer_local(x, s->mesh_dim, i, l->before, l->ndim, l->shape, o2, l2);
    int64_t plen[MR_TENSOR_MAX_DIMS];
    memcpy(plen, l->alen, sizeof plen);
    plen[s->tdim] = l2[s->tdim];
    MR_TRY(mr_box_copy(x->be, l->ndim, plen, dst, l->alen, doff, recv + (size_t)(i * block) * l->es,
                       plen, zero, l->es));
    doff[s->tdim] += l2[s->tdim];
  }
  return 0;
}

/* One step: cur (shape len under before) -> dst (shape after). */
static int step(struct mr_reshard_ctx *x, const struct mr_reshard_step *s,
                const struct mr_dist_attr *before, int ndim, const int64_t *shape,
                enum mr_dtype dt, const void *cur, void *dst) {
  struct mr_backend *be = x->be;
  struct local l = {.s = s, .before = before, .ndim = ndim, .shape = shape, .dt = dt,
                    .es = mr_dtype_size(dt), .k = s->group_size,
                    .c = s->mesh_dim >= 0 ? x->coord[s->mesh_dim] : 0,
                    .grp = s->mesh_dim >= 0 ? x->group[s->mesh_dim] : NULL};
  int64_t off[MR_TENSOR_MAX_DIMS], aoff[MR_TENSOR_MAX_DIMS];
  mr_dist_local(x->mesh, before, ndim, shape, x->coord, off, l.len);
  mr_dist_local(x->mesh, &s->after, ndim, shape, x->coord, aoff, l.alen);
  l.n_in = (size_t)numel(ndim, l.len);
  l.n_out = (size_t)numel(ndim, l.alen);
  if (l.grp == NULL && (s->kind == MR_RS_ALL_GATHER || s->kind == MR_RS_ALL_REDUCE ||
                        s->kind == MR_RS_REDUCE_SCATTER || s->kind == MR_RS_ALL_TO_ALL))
    return be->ops->copy2d(be, dst, 0, cur, 0, l.n_in * l.es, 1); /* a group of one */
  struct mr_comm_req *req;
  switch (s->kind) {
  case MR_RS_SLICE: {
    int64_t so[MR_TENSOR_MAX_DIMS] = {0};
    so[s->tdim] = mr_split_off(l.len[s->tdim], l.k, l.c);
    return mr_box_copy(be, ndim, l.alen, dst, l.alen, zero, cur, l.len, so, l.es);
  }
  case MR_RS_ALL_GATHER:
    return all_gather(x, &l, cur, dst);
  case MR_RS_ALL_REDUCE:
    MR_TRY(mr_comm_all_reduce(l.grp, cur, dst, l.n_in, dt, mr_reshard_red_op(s->op), &req));
    return wait_req(x, req);
  case MR_RS_REDUCE_SCATTER:
    return reduce_scatter(x, &l, cur, dst);
  case MR_RS_ALL_TO_ALL:
    return all_to_all(x, &l, cur, dst);
  case MR_RS_ZERO_NONROOT:
    if (l.c != 0)
      return be->ops->memset(be, NULL, dst, 0, l.n_out * l.es);
    return be->ops->copy2d(be, dst, 0, cur, 0, l.n_out * l.es, 1);
  case MR_RS_SCALE:
    return be->ops->axpby(be, dst, cur, 0.0f, (float)s->factor, l.n_out);
  default:
    return mr_error_set(MR_ENOTSUP, "reshard: step %s is not run within a stage",
                        mr_reshard_kind_name(s->kind));
  }
}

int mr_reshard_run(struct mr_reshard_ctx *x, const struct mr_reshard_plan *plan,
                   const struct mr_dist_attr *src, int ndim, const int64_t *shape,
                   enum mr_dtype dt, const void *in, void *out) {
  if (plan->n_steps == 0) {
    int64_t off[MR_TENSOR_MAX_DIMS], len[MR_TENSOR_MAX_DIMS];
    mr_dist_local(x->mesh, src, ndim, shape, x->coord, off, len);
    return x->be->ops->copy2d(x->be, out, 0, in, 0, (size_t)numel(ndim, len) * mr_dtype_size(dt),
                              1);
  }
  const void *cur = in;
  struct mr_dist_attr before = *src;
  for (int i = 0; i < plan->n_steps; i++) {
    void *dst = i == plan->n_steps - 1 ? out : x->scratch[i % 2];
    MR_TRY(step(x, &plan->steps[i], &before, ndim, shape, dt, cur, dst));
    before = plan->steps[i].after;
    cur = dst;
  }
  return 0;
}
