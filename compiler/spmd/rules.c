/* rules.c - the generic inference over einsum specs, and the registry. */
#include "compiler/spmd/rules.h"

#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/dtype.h"
#include "compiler/ops.h"
#include "compiler/spmd/reshard.h"

#define MAX_RULES 128 /* rules registered in place of a row's */

static const struct mr_spmd_rule *registry[MAX_RULES];
static int n_registry;

int mr_spmd_rule_register(const struct mr_spmd_rule *r) {
  for (int i = 0; i < n_registry; i++)
    if (!strcmp(registry[i]->op, r->op)) {
      registry[i] = r;
      return 0;
    }
  if (n_registry == MAX_RULES)
    return mr_error_set(MR_ENOMEM, "spmd: more than %d rules", MAX_RULES);
  registry[n_registry++] = r;
  return 0;
}

static const struct mr_spmd_rule *registered(const char *op) {
  for (int i = 0; i < n_registry; i++)
    if (!strcmp(registry[i]->op, op))
      return registry[i];
  return NULL;
}

const struct mr_spmd_rule *mr_spmd_rule_of(int kind) {
  const struct mr_op_def *def = mr_op_def(kind);
  if (def == NULL)
    return NULL;
  const struct mr_spmd_rule *r = registered(def->name);
  return r != NULL ? r : def->spmd;
}

const struct mr_spmd_rule *mr_spmd_rule_find(const char *op) {
  for (int k = 0; k < mr_op_count(); k++)
    if (!strcmp(mr_op_def(k)->name, op))
      return mr_spmd_rule_of(k);
  return registered(op);
}

/* A choice per mesh dim: the letter it shards, or a Partial carried
 * through (carrier: the input holding it for multilinear ops, -1 all). */
struct assign {
  char letter[MR_MESH_MAX_DIMS];
  int partial[MR_MESH_MAX_DIMS];
  enum mr_reduce_op pop[MR_MESH_MAX_DIMS];
  int carrier[MR_MESH_MAX_DIMS];
};

static int has(const char *s, char c) { return c && strchr(s, c) != NULL; }

static int pos(const char *s, char c) {
  const char *p = strchr(s, c);
  return p ? (int)(p - s) : -1;
}

static const char *opname(const struct mr_op *op) {
  const struct mr_op_def *d = mr_op_def(op->kind);
  return d ? d->name : "?";
}

/* May mesh dim md shard letter c, given the mesh dims before it? */
static int choosable(const struct mr_spmd_spec *s, const struct mr_mesh *m,
                     const struct assign *a, int md, char c, int64_t *bad_atoms) {
  if (has(s->forbid, c))
    return 0;
  for (int o = 0; o < s->n_out; o++)
    if (!has(s->out[o], c) && !has(s->contract, c))
      return 0;
  int64_t deg = m->shape[md];
  for (int i = 0; i < md; i++)
    if (a->letter[i] == c)
      deg *= m->shape[i];
  for (int t = 0; t < s->n_in + s->n_out; t++) {
    const char *lt = t < s->n_in ? s->in[t] : s->out[t - s->n_in];
    const int64_t *at = t < s->n_in ? s->in_atoms[t] : s->out_atoms[t - s->n_in];
    int p = pos(lt, c);
    if (p >= 0 && at[p] > 0 && at[p] % deg) {
      *bad_atoms = at[p];
      return 0;
    }
  }
  return 1;
}

static void apply(const struct mr_spmd_spec *s, const struct mr_mesh *m,
                  const struct assign *a, struct mr_dist_attr *need,
                  struct mr_dist_attr *out) {
  for (int i = 0; i < s->n_in; i++) {
    need[i] = mr_dist_replicated(m->ndim);
    for (int md = 0; md < m->ndim; md++) {
      int p = pos(s->in[i], a->letter[md]);
      /* the output (0) is a Partial(sum) of per-rank terms: a bias added
       * on every rank must be an operand too */
      int summed = (a->letter[md] && !has(s->out[0], a->letter[md]) &&
                    s->contract_op == MR_REDUCE_SUM) ||
                   (a->partial[md] && a->pop[md] == MR_REDUCE_SUM);
      if (a->letter[md] && p >= 0)
        need[i].p[md] = mr_shard(p);
      else if ((s->additive >> i) & 1) {
        if (summed)
          need[i].p[md] = mr_partial(MR_REDUCE_SUM);
      } else if (a->partial[md] && !((s->nonfloat >> i) & 1) &&
                 (a->carrier[md] < 0 || a->carrier[md] == i))
        need[i].p[md] = mr_partial(a->pop[md]);
    }
  }
  for (int o = 0; o < s->n_out; o++) {
    out[o] = mr_dist_replicated(m->ndim);
    for (int md = 0; md < m->ndim; md++) {
      char c = a->letter[md];
      if (c && has(s->out[o], c))
        out[o].p[md] = mr_shard(pos(s->out[o], c));
      else if (c)
        out[o].p[md] = mr_partial(s->contract_op); /* contracted */
      else if (a->partial[md])
        out[o].p[md] = mr_partial(a->pop[md]);
    }
  }
}

/* Partial pass-through for mesh dim md from input placements. */
static void pass_partial(const struct mr_spmd_spec *s,
                         const struct mr_dist_attr *in, int md,
                         struct assign *a) {
  if (s->linear == MR_SPMD_NONLINEAR)
    return;
  int n_float = 0, n_part = 0, carrier = -1, ok = 1;
  enum mr_reduce_op op = MR_REDUCE_SUM;
  for (int i = 0; i < s->n_in; i++) {
    if (!s->in[i][0] || ((s->nonfloat >> i) & 1) || ((s->additive >> i) & 1))
      continue;
    n_float++;
    if (!in[i].known || in[i].p[md].kind != MR_PARTIAL)
      continue;
    if (in[i].p[md].reduce == MR_REDUCE_MAX || (n_part && in[i].p[md].reduce != op))
      ok = 0;
    op = in[i].p[md].reduce;
    n_part++;
    carrier = i;
  }
  if (!ok || !n_part)
    return;
  if (s->linear == MR_SPMD_LINEAR_JOINT && n_part == n_float) {
    a->partial[md] = 1;
    a->carrier[md] = -1;
    a->pop[md] = op;
  } else if (s->linear == MR_SPMD_MULTILINEAR && n_part == 1) {
    a->partial[md] = 1;
    a->carrier[md] = carrier;
    a->pop[md] = op;
  }
}

static int get_spec(const struct mr_spmd_rule *r, const struct mr_graph *g,
                    const struct mr_op *op, struct mr_spmd_spec *s) {
  memset(s, 0, sizeof *s);
  MR_TRY(r->spec(g, op, s));
  return 0;
}

/* Cost of assignment a: the inputs' reshards plus an AllReduce for every
 * Partial output. */
static double assign_cost(const struct mr_spmd_spec *s, const struct mr_graph *g,
                          const struct mr_op *op, const struct mr_mesh *m,
                          const struct assign *a, const struct mr_dist_attr *in,
                          const struct mr_spmd_cost *cost) {
  struct mr_dist_attr need[MR_OP_MAX_IN], out[MR_OP_MAX_OUT];
  apply(s, m, a, need, out);
  double c = 0;
  for (int i = 0; i < s->n_in; i++) {
    if (op->in[i] < 0 || !in[i].known || mr_dist_eq(&in[i], &need[i]))
      continue;
    if (cost) {
      c += cost->fn(cost->ctx, op, i, &in[i], &need[i]);
      continue;
    }
    const struct mr_tensor *t = &g->tensors[op->in[i]];
    struct mr_reshard_plan p;
    if (mr_reshard_plan(m, t->ndim, t->shape, (int)mr_dtype_size(t->dtype),
                        &in[i], &need[i], NULL, NULL, &p) == 0)
      c += (double)p.bytes;
  }
  for (int o = 0; o < s->n_out; o++) {
    const struct mr_tensor *t = &g->tensors[op->out[o]];
    for (int md = 0; md < m->ndim; md++)
      if (out[o].p[md].kind == MR_PARTIAL)
        c += (double)mr_reshard_step_bytes(
            MR_RS_ALL_REDUCE, m->shape[md],
            mr_dist_local_numel_max(m, &out[o], t->ndim, t->shape) *
                (int64_t)mr_dtype_size(t->dtype));
  }
  return c;
}

int mr_spmd_infer(const struct mr_spmd_rule *r, const struct mr_graph *g,
                  const struct mr_op *op, const struct mr_mesh *m,
                  const struct mr_dist_attr *in, unsigned hinted,
                  const struct mr_spmd_cost *cost, struct mr_dist_attr *need,
                  struct mr_dist_attr *out) {
  struct mr_spmd_spec s;
  MR_TRY(get_spec(r, g, op, &s));
  struct assign a;
  memset(&a, 0, sizeof a);
  for (int md = 0; md < m->ndim; md++) {
    char cand[MR_OP_MAX_IN];
    int nc = 0;
    /* a hinted input's sharding is taken as it is */
    for (int pass = 0; pass < 2 && !a.letter[md]; pass++)
      for (int i = 0; i < s.n_in && !a.letter[md]; i++) {
        int h = (hinted >> i) & 1;
        if (h != (pass == 0) || !in[i].known || !s.in[i][0] ||
            in[i].p[md].kind != MR_SHARD)
          continue;
        char c = s.in[i][in[i].p[md].dim];
        int64_t bad = 0;
        if (choosable(&s, m, &a, md, c, &bad)) {
          if (h)
            a.letter[md] = c;
          else if (!memchr(cand, c, (size_t)nc))
            cand[nc++] = c;
        } else if ((h || has(s.strict, c)) && bad) {
          return mr_error_set(MR_EINVAL, "op %s (%s): %s comes sharded "
                              "over mesh dim %s (size %d), but the op's %lld "
                              "heads (or sequences) do not divide over it",
                              opname(op), g->tensors[op->out[0]].name,
                              g->tensors[op->in[i]].name, m->names[md],
                              m->shape[md], (long long)bad);
        }
      }
    if (a.letter[md])
      continue;
    if (nc == 0) {
      pass_partial(&s, in, md, &a);
      continue;
    }
    /* a Shard beats Replicate (the work stays split); among Shards the
     * cheapest reshard wins */
    double best = 0;
    struct assign pick = a;
    for (int k = nc - 1; k >= 0; k--) { /* ties: the earlier input */
      struct assign t = a;
      t.letter[md] = cand[k];
      double c = assign_cost(&s, g, op, m, &t, in, cost);
      if (k == nc - 1 || c <= best) {
        best = c;
        pick = t;
      }
    }
    a = pick;
  }
  apply(&s, m, &a, need, out);
  return 0;
}

int mr_spmd_infer_reverse(const struct mr_spmd_rule *r,
                          const struct mr_graph *g, const struct mr_op *op,
                          const struct mr_mesh *m,
                          const struct mr_dist_attr *out,
                          struct mr_dist_attr *need,
                          struct mr_dist_attr *out_fixed) {
  struct mr_spmd_spec s;
  MR_TRY(get_spec(r, g, op, &s));
  struct assign a;
  memset(&a, 0, sizeof a);
  for (int md = 0; md < m->ndim; md++) {
    for (int o = 0; o < s.n_out && !a.letter[md] && !a.partial[md]; o++) {
      if (!out[o].known)
        continue;
      struct mr_placement p = out[o].p[md];
      int64_t bad = 0;
      if (p.kind == MR_SHARD) {
        char c = s.out[o][p.dim];
        if (choosable(&s, m, &a, md, c, &bad))
          a.letter[md] = c;
      } else if (p.kind == MR_PARTIAL) {
        for (const char *c = s.contract; *c && !a.letter[md]; c++)
          if (!has(s.out[o], *c) && p.reduce == s.contract_op &&
              choosable(&s, m, &a, md, *c, &bad))
            a.letter[md] = *c;
        if (!a.letter[md] && s.linear != MR_SPMD_NONLINEAR &&
            p.reduce != MR_REDUCE_MAX) {
          a.partial[md] = 1;
          a.pop[md] = p.reduce;
          a.carrier[md] = -1;
          if (s.linear == MR_SPMD_MULTILINEAR)
            for (int i = 0; i < s.n_in; i++)
              if (s.in[i][0] && !((s.nonfloat >> i) & 1) &&
                  !((s.additive >> i) & 1)) {
                a.carrier[md] = i;
                break;
              }
        }
      }
    }
  }
  apply(&s, m, &a, need, out_fixed);
  return 0;
}
