/* spmd_sim.c - reference collectives over simulated ranks. */
#include "tests/spmd_sim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int64_t sim_numel(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++)
    n *= shape[i];
  return n;
}

static int64_t lin(int ndim, const int64_t *shape, const int64_t *idx) {
  int64_t o = 0;
  for (int i = 0; i < ndim; i++)
    o = o * shape[i] + idx[i];
  return o;
}

/* Copies the box of size box[] from src at soff to dst at doff. */
static void box_copy(float *dst, const int64_t *dshape, const int64_t *doff,
                     const float *src, const int64_t *sshape,
                     const int64_t *soff, const int64_t *box, int ndim) {
  int64_t n = sim_numel(ndim, box), c[MR_TENSOR_MAX_DIMS] = {0};
  for (int64_t e = 0; e < n; e++) {
    int64_t a[MR_TENSOR_MAX_DIMS], b[MR_TENSOR_MAX_DIMS];
    for (int i = 0; i < ndim; i++) {
      a[i] = doff[i] + c[i];
      b[i] = soff[i] + c[i];
    }
    dst[lin(ndim, dshape, a)] = src[lin(ndim, sshape, b)];
    for (int i = ndim - 1; i >= 0; i--) {
      if (++c[i] < box[i])
        break;
      c[i] = 0;
    }
  }
}

static void buf_alloc(struct sim_buf *b, int ndim, const int64_t *shape) {
  b->ndim = ndim;
  memcpy(b->shape, shape, sizeof b->shape[0] * (size_t)ndim);
  int64_t n = sim_numel(ndim, shape);
  b->d = calloc((size_t)(n ? n : 1), sizeof(float));
}

void sim_tensor_free(struct sim_tensor *t) {
  for (int r = 0; r < t->nranks; r++) {
    free(t->r[r].d);
    t->r[r].d = NULL;
  }
  t->nranks = 0;
}

void sim_scatter(struct sim_tensor *t, const struct mr_mesh *m,
                 const struct mr_dist_attr *da, int ndim, const int64_t *shape,
                 const float *global, const float *const *operands) {
  memset(t, 0, sizeof *t);
  t->mesh = m;
  t->nranks = mr_mesh_size(m);
  t->da = *da;
  int64_t zero[MR_TENSOR_MAX_DIMS] = {0};
  for (int r = 0; r < t->nranks; r++) {
    int coord[MR_MESH_MAX_DIMS];
    int64_t off[MR_TENSOR_MAX_DIMS], len[MR_TENSOR_MAX_DIMS];
    mr_mesh_coord(m, r, coord);
    mr_dist_local(m, da, ndim, shape, coord, off, len);
    buf_alloc(&t->r[r], ndim, len);
    const float *src = operands ? operands[r] : global;
    int keep = 1;
    for (int i = 0; i < da->ndim && !operands; i++)
      if (da->p[i].kind == MR_PARTIAL && da->p[i].reduce == MR_REDUCE_SUM &&
          coord[i] != 0)
        keep = 0;
    if (keep)
      box_copy(t->r[r].d, len, zero, src, shape, off, len, ndim);
  }
}

static float reduce2(enum mr_reduce_op op, float a, float b) {
  return op == MR_REDUCE_MAX ? (a > b ? a : b) : a + b;
}

double sim_gather(const struct sim_tensor *t, int ndim, const int64_t *shape,
                  float *out) {
  const struct mr_mesh *m = t->mesh;
  const struct mr_dist_attr *da = &t->da;
  int64_t n = sim_numel(ndim, shape);
  /* operand index: the coordinate over the Partial mesh dims */
  int np = 1;
  for (int i = 0; i < da->ndim; i++)
    if (da->p[i].kind == MR_PARTIAL)
      np *= m->shape[i];
  float *val = malloc(sizeof(float) * (size_t)(n * np));
  char *set = calloc((size_t)(n * np), 1);
  double worst = 0;
  for (int r = 0; r < t->nranks; r++) {
    int coord[MR_MESH_MAX_DIMS];
    int64_t off[MR_TENSOR_MAX_DIMS], len[MR_TENSOR_MAX_DIMS];
    mr_mesh_coord(m, r, coord);
    mr_dist_local(m, da, ndim, shape, coord, off, len);
    for (int i = 0; i < ndim; i++)
      if (t->r[r].shape[i] != len[i] || t->r[r].ndim != ndim)
        worst = -1;
    if (worst < 0)
      break;
    int p = 0;
    for (int i = 0; i < da->ndim; i++)
      if (da->p[i].kind == MR_PARTIAL)
        p = p * m->shape[i] + coord[i];
    int64_t ln = sim_numel(ndim, len), c[MR_TENSOR_MAX_DIMS] = {0};
    for (int64_t e = 0; e < ln; e++) {
      int64_t g[MR_TENSOR_MAX_DIMS];
      for (int i = 0; i < ndim; i++)
        g[i] = off[i] + c[i];
      int64_t gi = lin(ndim, shape, g) * np + p;
      float v = t->r[r].d[e];
      if (set[gi]) {
        double dd = fabs((double)val[gi] - v);
        if (dd > worst)
          worst = dd;
      } else {
        val[gi] = v;
        set[gi] = 1;
      }
      for (int i = ndim - 1; i >= 0; i--) {
        if (++c[i] < len[i])
          break;
        c[i] = 0;
      }
    }
  }
  enum mr_reduce_op op = MR_REDUCE_SUM;
  int avg = 1;
  for (int i = 0; i < da->ndim; i++)
    if (da->p[i].kind == MR_PARTIAL) {
      if (da->p[i].reduce == MR_REDUCE_MAX)
        op = MR_REDUCE_MAX;
      if (da->p[i].reduce == MR_REDUCE_AVG)
        avg *= m->shape[i];
    }
  for (int64_t e = 0; worst >= 0 && e < n; e++) {
    float acc = val[e * np];
    for (int p = 1; p < np; p++)
      acc = reduce2(op, acc, val[e * np + p]);
    out[e] = avg > 1 ? acc / (float)avg : acc;
    for (int p = 0; p < np; p++)
      if (!set[e * np + p])
        worst = -1;
  }
  free(val);
  free(set);
  return worst;
}

/* Ranks of the group of mesh dim md through rank index r, in coordinate
 * order; returns the group size. */
static int group_of(const struct mr_mesh *m, int md, int r, int *ranks) {
  int coord[MR_MESH_MAX_DIMS];
  mr_mesh_coord(m, r, coord);
  for (int c = 0; c < m->shape[md]; c++) {
    coord[md] = c;
    int idx = 0;
    for (int i = 0; i < m->ndim; i++)
      idx = idx * m->shape[i] + coord[i];
    ranks[c] = idx;
  }
  return m->shape[md];
}

static int same_shape(const struct sim_buf *a, const struct sim_buf *b) {
  if (a->ndim != b->ndim)
    return 0;
  for (int i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i])
      return 0;
  return 1;
}

/* Piece c of k along dim t of buf, as a new buffer. */
static void cut(const struct sim_buf *in, int t, int k, int c,
                struct sim_buf *out) {
  int64_t off[MR_TENSOR_MAX_DIMS] = {0}, len[MR_TENSOR_MAX_DIMS], z[MR_TENSOR_MAX_DIMS] = {0};
  memcpy(len, in->shape, sizeof len);
  off[t] = mr_split_off(in->shape[t], k, c);
  len[t] = mr_split_len(in->shape[t], k, c);
  buf_alloc(out, in->ndim, len);
  box_copy(out->d, len, z, in->d, in->shape, off, len, in->ndim);
}

/* Concatenation of parts[0..k) along dim t. */
static void join(const struct sim_buf *parts, int k, int t, struct sim_buf *out) {
  int64_t shape[MR_TENSOR_MAX_DIMS];
  memcpy(shape, parts[0].shape, sizeof shape);
  shape[t] = 0;
  for (int i = 0; i < k; i++)
    shape[t] += parts[i].shape[t];
  buf_alloc(out, parts[0].ndim, shape);
  int64_t off[MR_TENSOR_MAX_DIMS] = {0}, z[MR_TENSOR_MAX_DIMS] = {0};
  for (int i = 0; i < k; i++) {
    box_copy(out->d, shape, off, parts[i].d, parts[i].shape, z, parts[i].shape,
             parts[0].ndim);
    off[t] += parts[i].shape[t];
  }
}

int sim_step(struct sim_tensor *t, const struct mr_reshard_step *s,
             const struct mr_mesh *b) {
  const struct mr_mesh *m = t->mesh;
  struct sim_buf next[SIM_MAX_RANKS];
  memset(next, 0, sizeof next);
  if (s->kind == MR_RS_SEND_RECV) {
    int nb = mr_mesh_size(b);
    for (int r = 0; r < nb; r++) {
      const struct sim_buf *src = &t->r[r % t->nranks];
      buf_alloc(&next[r], src->ndim, src->shape);
      memcpy(next[r].d, src->d, sizeof(float) * (size_t)sim_numel(src->ndim, src->shape));
    }
    sim_tensor_free(t);
    t->mesh = b;
    t->nranks = nb;
    memcpy(t->r, next, sizeof next);
    t->da = s->after;
    return 0;
  }
  int k = m->shape[s->mesh_dim], grp[SIM_MAX_RANKS];
  for (int r = 0; r < t->nranks; r++) {
    int coord[MR_MESH_MAX_DIMS];
    mr_mesh_coord(m, r, coord);
    int me = coord[s->mesh_dim];
    group_of(m, s->mesh_dim, r, grp);
    const struct sim_buf *mine = &t->r[r];
    int64_t n = sim_numel(mine->ndim, mine->shape);
    switch (s->kind) {
    case MR_RS_SLICE:
      cut(mine, s->tdim, k, me, &next[r]);
      break;
    case MR_RS_ALL_GATHER: {
      struct sim_buf parts[SIM_MAX_RANKS];
      for (int i = 0; i < k; i++)
        parts[i] = t->r[grp[i]];
      join(parts, k, s->tdim, &next[r]);
      break;
    }
    case MR_RS_ALL_REDUCE:
    case MR_RS_REDUCE_SCATTER: {
      struct sim_buf sum;
      buf_alloc(&sum, mine->ndim, mine->shape);
      for (int i = 0; i < k; i++) {
        if (!same_shape(&t->r[grp[i]], mine))
          return -1;
        for (int64_t e = 0; e < n; e++)
          sum.d[e] = i ? reduce2(s->op, sum.d[e], t->r[grp[i]].d[e])
                       : t->r[grp[i]].d[e];
      }
      if (s->op == MR_REDUCE_AVG)
        for (int64_t e = 0; e < n; e++)
          sum.d[e] /= (float)k;
      if (s->kind == MR_RS_ALL_REDUCE) {
        next[r] = sum;
      } else {
        cut(&sum, s->tdim, k, me, &next[r]);
        free(sum.d);
      }
      break;
    }
    case MR_RS_ALL_TO_ALL: {
      /* piece `me` along tdim2 of every member, joined along tdim */
      struct sim_buf parts[SIM_MAX_RANKS];
      for (int i = 0; i < k; i++)
        cut(&t->r[grp[i]], s->tdim2, k, me, &parts[i]);
      join(parts, k, s->tdim, &next[r]);
      for (int i = 0; i < k; i++)
        free(parts[i].d);
      break;
    }
    case MR_RS_ZERO_NONROOT:
    case MR_RS_SCALE:
      buf_alloc(&next[r], mine->ndim, mine->shape);
      for (int64_t e = 0; e < n; e++)
        next[r].d[e] = s->kind == MR_RS_SCALE ? mine->d[e] * (float)s->factor
                                              : (me == 0 ? mine->d[e] : 0.0f);
      break;
    default:
      return -1;
    }
  }
  sim_tensor_free(t);
  t->nranks = mr_mesh_size(m);
  memcpy(t->r, next, sizeof next);
  t->da = s->after;
  return 0;
}

int sim_plan(struct sim_tensor *t, const struct mr_reshard_plan *p,
             const struct mr_mesh *b) {
  for (int i = 0; i < p->n_steps; i++)
    if (sim_step(t, &p->steps[i], p->steps[i].on_dst ? b : t->mesh) < 0)
      return -1;
  return 0;
}

double sim_rel_err(const float *a, const float *b, int64_t n) {
  double w = 0;
  for (int64_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - b[i]);
    double s = fabs((double)b[i]);
    d /= s > 1 ? s : 1;
    if (d > w || d != d)
      w = d != d ? 1e30 : d;
  }
  return w;
}
