/* reshard.c - reshard planning: unshard what differs (innermost mesh dim
 * first), then shard what the target needs (outermost first), with fused
 * collectives where the order allows; the caller's cost picks the plan. */
#include "compiler/spmd/reshard.h"

#include <string.h>

#include "common/error.h"

const char *mr_reshard_kind_name(enum mr_reshard_kind k) {
  static const char *const n[MR_RS_KIND_COUNT] = {
      "Slice", "AllGather", "AllReduce", "ReduceScatter", "AllToAll",
      "ZeroNonRoot", "Scale", "SendRecv"};
  return (unsigned)k < MR_RS_KIND_COUNT ? n[k] : "?";
}

int64_t mr_reshard_step_bytes(enum mr_reshard_kind kind, int k, int64_t local) {
  switch (kind) {
  case MR_RS_ALL_REDUCE:
    return 2 * (int64_t)(k - 1) * local / k;
  case MR_RS_ALL_GATHER:
    return (int64_t)(k - 1) * local;
  case MR_RS_REDUCE_SCATTER:
  case MR_RS_ALL_TO_ALL:
    return (int64_t)(k - 1) * local / k;
  case MR_RS_SEND_RECV:
    return local;
  default:
    return 0;
  }
}

struct ctx {
  const struct mr_mesh *m;
  int tndim;
  const int64_t *shape;
  int elem_bytes;
  mr_reshard_cost_fn cost;
  void *cost_ctx;
  int on_dst;
};

static int64_t local_bytes(const struct ctx *c, const struct mr_dist_attr *d) {
  return mr_dist_local_numel_max(c->m, d, c->tndim, c->shape) * c->elem_bytes;
}

/* No mesh dim after mi shards tensor dim t: mi may split or gather t. */
static int innermost(const struct mr_dist_attr *d, int mi, int t) {
  for (int j = mi + 1; j < d->ndim; j++)
    if (d->p[j].kind == MR_SHARD && d->p[j].dim == t)
      return 0;
  return 1;
}

static int push(const struct ctx *c, struct mr_reshard_plan *p,
                enum mr_reshard_kind kind, int mi, int tdim, int tdim2,
                enum mr_reduce_op op, double factor,
                const struct mr_dist_attr *before,
                const struct mr_dist_attr *after) {
  if (p->n_steps == MR_RESHARD_MAX_STEPS)
    return -1;
  struct mr_reshard_step *s = &p->steps[p->n_steps++];
  memset(s, 0, sizeof *s);
  s->kind = kind;
  s->mesh_dim = mi;
  s->tdim = tdim;
  s->tdim2 = tdim2;
  s->op = op;
  s->factor = factor;
  s->group_size = c->m->shape[mi];
  /* the piece a rank holds going in (AllGather: the piece it contributes) */
  s->bytes = mr_reshard_step_bytes(kind, s->group_size, local_bytes(c, before));
  s->after = *after;
  s->on_dst = c->on_dst;
  double cost = c->cost ? c->cost(c->cost_ctx, s) : (double)s->bytes;
  p->cost += cost;
  p->bytes += s->bytes;
  return 0;
}

static int sum_avg(struct mr_placement p) {
  return p.kind == MR_PARTIAL && p.reduce != MR_REDUCE_MAX;
}

/* One candidate plan; fuse bit mi lets mesh dim mi use ReduceScatter or
 * AllToAll.  Returns 0, or -1 when the candidate is not realizable. */
static int build(const struct ctx *c, const struct mr_dist_attr *src,
                 const struct mr_dist_attr *dst, unsigned fuse,
                 struct mr_reshard_plan *p) {
  int nd = src->ndim, in_g[MR_MESH_MAX_DIMS] = {0};
  for (int i = 0; i < nd; i++)
    in_g[i] = !mr_placement_eq(src->p[i], dst->p[i]);
  /* Changing how mesh dim i splits tensor dim t changes the piece every
   * later mesh dim splitting t works on: those must be redone too. */
  for (int changed = 1; changed;) {
    changed = 0;
    for (int i = 0; i < nd; i++) {
      if (!in_g[i])
        continue;
      for (int j = i + 1; j < nd; j++) {
        if (in_g[j])
          continue;
        if ((src->p[i].kind == MR_SHARD && src->p[j].kind == MR_SHARD &&
             src->p[j].dim == src->p[i].dim) ||
            (dst->p[i].kind == MR_SHARD && dst->p[j].kind == MR_SHARD &&
             dst->p[j].dim == dst->p[i].dim) ||
            (src->p[i].kind == MR_SHARD && src->p[j].kind == MR_SHARD &&
             dst->p[i].kind == MR_SHARD && dst->p[i].dim == src->p[j].dim)) {
          in_g[j] = 1;
          changed = 1;
        }
      }
    }
  }
  struct mr_dist_attr st = *src, nx;
  for (int i = nd - 1; i >= 0; i--) {
    if (!in_g[i])
      continue;
    struct mr_placement s = st.p[i], t = dst->p[i];
    int fz = (fuse >> i) & 1;
    nx = st;
    if (s.kind == MR_PARTIAL) {
      if (sum_avg(s) && sum_avg(t))
        continue;
      if (t.kind == MR_SHARD && fz) {
        if (!innermost(&st, i, t.dim))
          return -1;
        nx.p[i] = t;
        if (push(c, p, MR_RS_REDUCE_SCATTER, i, t.dim, 0, s.reduce, 0, &st, &nx))
          return -1;
      } else {
        nx.p[i] = mr_replicate();
        if (push(c, p, MR_RS_ALL_REDUCE, i, 0, 0, s.reduce, 0, &st, &nx))
          return -1;
      }
    } else if (s.kind == MR_SHARD) {
      if (!innermost(&st, i, s.dim))
        return -1;
      if (t.kind == MR_SHARD && t.dim != s.dim && fz) {
        if (!innermost(&st, i, t.dim))
          return -1;
        nx.p[i] = t;
        if (push(c, p, MR_RS_ALL_TO_ALL, i, s.dim, t.dim, 0, 0, &st, &nx))
          return -1;
      } else {
        nx.p[i] = mr_replicate();
        if (push(c, p, MR_RS_ALL_GATHER, i, s.dim, 0, 0, 0, &st, &nx))
          return -1;
      }
    } else if (fz) {
      return -1; /* nothing to fuse: not a distinct candidate */
    }
    st = nx;
  }
  for (int i = 0; i < nd; i++) {
    struct mr_placement s = st.p[i], t = dst->p[i];
    if (mr_placement_eq(s, t))
      continue;
    nx = st;
    nx.p[i] = t;
    int k = c->m->shape[i];
    if (sum_avg(s) && sum_avg(t)) {
      /* sum of x_r = mean of k x_r */
      double f = s.reduce == MR_REDUCE_SUM ? (double)k : 1.0 / k;
      if (push(c, p, MR_RS_SCALE, i, 0, 0, 0, f, &st, &nx))
        return -1;
    } else if (s.kind != MR_REPLICATE) {
      return -1;
    } else if (t.kind == MR_SHARD) {
      if (!innermost(&st, i, t.dim))
        return -1;
      if (push(c, p, MR_RS_SLICE, i, t.dim, 0, 0, 0, &st, &nx))
        return -1;
    } else if (t.reduce == MR_REDUCE_SUM) {
      if (push(c, p, MR_RS_ZERO_NONROOT, i, 0, 0, 0, 0, &st, &nx))
        return -1;
    }
    /* Replicate -> Partial(avg|max): every rank already holds a valid
     * operand; nothing moves. */
    st = nx;
  }
  return mr_dist_eq(&st, dst) ? 0 : -1;
}

static int check(const struct mr_mesh *m, int tndim,
                 const struct mr_dist_attr *d, const char *what) {
  if (!d->known || d->ndim != m->ndim)
    return mr_error_set(MR_EINVAL, "reshard: %s DistAttr has %d placements "
                        "for a %d-d mesh", what, d->ndim, m->ndim);
  return mr_dist_check(d, tndim);
}

static int plan_one(const struct ctx *c, const struct mr_dist_attr *src,
                    const struct mr_dist_attr *dst,
                    struct mr_reshard_plan *best) {
  int found = 0;
  for (unsigned fuse = 0; fuse < (1u << src->ndim); fuse++) {
    struct mr_reshard_plan p;
    memset(&p, 0, sizeof p);
    if (build(c, src, dst, fuse, &p) < 0)
      continue;
    if (!found || p.cost < best->cost ||
        (p.cost == best->cost && p.n_steps < best->n_steps)) {
      *best = p;
      found = 1;
    }
  }
  return found ? 0 : mr_error_set(MR_EINVAL, "reshard: no plan found");
}

int mr_reshard_plan(const struct mr_mesh *m, int tndim, const int64_t *shape,
                    int elem_bytes, const struct mr_dist_attr *src,
                    const struct mr_dist_attr *dst, mr_reshard_cost_fn cost,
                    void *cost_ctx, struct mr_reshard_plan *plan) {
  memset(plan, 0, sizeof *plan);
  MR_TRY(check(m, tndim, src, "source"));
  MR_TRY(check(m, tndim, dst, "target"));
  struct ctx c = {m, tndim, shape, elem_bytes, cost, cost_ctx, 0};
  return plan_one(&c, src, dst, plan);
}

static int append(struct mr_reshard_plan *to, const struct mr_reshard_plan *from) {
  if (to->n_steps + from->n_steps > MR_RESHARD_MAX_STEPS)
    return -1;
  memcpy(&to->steps[to->n_steps], from->steps,
         (size_t)from->n_steps * sizeof from->steps[0]);
  to->n_steps += from->n_steps;
  to->cost += from->cost;
  to->bytes += from->bytes;
  return 0;
}

/* a-side plan src -> mid, the exchange, b-side plan mid' -> dst. */
static int via(const struct ctx *ca, const struct ctx *cb,
               const struct mr_dist_attr *src, const struct mr_dist_attr *mid,
               const struct mr_dist_attr *mid_b, const struct mr_dist_attr *dst,
               struct mr_reshard_plan *out) {
  struct mr_reshard_plan pa, pb;
  memset(out, 0, sizeof *out);
  if (plan_one(ca, src, mid, &pa) < 0 || plan_one(cb, mid_b, dst, &pb) < 0)
    return -1;
  if (append(out, &pa) < 0 || out->n_steps == MR_RESHARD_MAX_STEPS)
    return -1;
  struct mr_reshard_step *s = &out->steps[out->n_steps++];
  memset(s, 0, sizeof *s);
  s->kind = MR_RS_SEND_RECV;
  s->mesh_dim = -1;
  s->group_size = 2;
  s->bytes = local_bytes(ca, mid);
  s->after = *mid_b;
  s->on_dst = 1;
  out->cost += ca->cost ? ca->cost(ca->cost_ctx, s) : (double)s->bytes;
  out->bytes += s->bytes;
  return append(out, &pb);
}

int mr_reshard_plan_cross(const struct mr_mesh *a, const struct mr_mesh *b,
                          int tndim, const int64_t *shape, int elem_bytes,
                          const struct mr_dist_attr *src,
                          const struct mr_dist_attr *dst,
                          mr_reshard_cost_fn cost, void *cost_ctx,
                          struct mr_reshard_plan *plan) {
  memset(plan, 0, sizeof *plan);
  MR_TRY(check(a, tndim, src, "source"));
  MR_TRY(check(b, tndim, dst, "target"));
  struct ctx ca = {a, tndim, shape, elem_bytes, cost, cost_ctx, 0};
  struct ctx cb = {b, tndim, shape, elem_bytes, cost, cost_ctx, 1};
  int same = a->ndim == b->ndim;
  for (int i = 0; same && i < a->ndim; i++)
    same = a->shape[i] == b->shape[i];
  if (!same) {
    struct mr_dist_attr ra = mr_dist_replicated(a->ndim);
    struct mr_dist_attr rb = mr_dist_replicated(b->ndim);
    if (via(&ca, &cb, src, &ra, &rb, dst, plan) < 0)
      return mr_error_set(MR_EINVAL, "reshard across meshes: no plan");
    return 0;
  }
  /* Candidates: reshard on a then send; send then reshard on b; or send a
   * shard of what b wants replicated on some mesh dim and gather it on b. */
  struct mr_reshard_plan best, p;
  int found = 0;
  struct mr_dist_attr mids[1 + MR_MESH_MAX_DIMS * MR_TENSOR_MAX_DIMS];
  int nm = 0;
  mids[nm++] = *dst;
  mids[nm++] = *src;
  for (int i = 0; i < a->ndim; i++) {
    if (dst->p[i].kind != MR_REPLICATE)
      continue;
    for (int t = 0; t < tndim && nm < (int)MR_ARRAY_LEN(mids); t++) {
      struct mr_dist_attr mid = *dst;
      mid.p[i] = mr_shard(t);
      mids[nm++] = mid;
    }
  }
  for (int k = 0; k < nm; k++) {
    if (via(&ca, &cb, src, &mids[k], &mids[k], dst, &p) < 0)
      continue;
    if (!found || p.cost < best.cost) {
      best = p;
      found = 1;
    }
  }
  if (!found)
    return mr_error_set(MR_EINVAL, "reshard across meshes: no plan");
  *plan = best;
  return 0;
}
