/* rules.h - SPMD rules: for each op, how input placements determine the
 * placements it needs and those it produces (forward inference), and how
 * output placements determine the inputs' (reverse inference), as Paddle's
 * InferSpmd / InferSpmdReverse.
 *
 * A rule describes its op in einsum notation: one letter per tensor dim
 * ("mk,nk->mn" for x W^T).  A mesh dim shards at most one letter; a letter
 * absent from an output and listed in `contract` makes that output
 * Partial(sum) where it is sharded (Partial(max) for a row maximum:
 * `contract_op`); letters in `forbid` are never sharded.
 * `atoms` says in how many indivisible pieces a dim comes (heads for
 * attention columns, whole sequences for RoPE rows): a mesh dim may shard it
 * only when its degree divides that count.  Ops linear in all inputs jointly
 * (add) pass Partial through when every float input is Partial; ops linear
 * in each input (matmul) pass it through when exactly one is.  Inputs marked
 * additive (a bias) must be Partial where the output is.
 *
 * An op's rule is in its row of the op registry (mr_op_def(kind)->spmd);
 * mr_spmd_rule_register() puts another in its place by op name (a plugin
 * with a better rule for a built-in op, or a version-1 plugin's own). */
#ifndef MR_SPMD_RULES_H
#define MR_SPMD_RULES_H

#include "compiler/graph.h"
#include "compiler/mesh.h"
#include "compiler/ops.h"

#define MR_SPMD_MAX_TENSORS 9 // MR_OP_MAX_IN + MR_OP_MAX_OUT

enum mr_spmd_linear {
  MR_SPMD_NONLINEAR = 0,
  MR_SPMD_LINEAR_JOINT = 1, // f(a + b) = f(a) + f(b) in all inputs at once
  MR_SPMD_MULTILINEAR = 2,  // linear in each input separately
};

struct mr_spmd_spec {
  int n_in, n_out;
  char in[MR_OP_MAX_IN][MR_TENSOR_MAX_DIMS + 1];   // letters per dim; "" absent
  char out[MR_OP_MAX_OUT][MR_TENSOR_MAX_DIMS + 1];
  int64_t in_atoms[MR_OP_MAX_IN][MR_TENSOR_MAX_DIMS];  // 0: any split
  int64_t out_atoms[MR_OP_MAX_OUT][MR_TENSOR_MAX_DIMS];
  char contract[8];           // letters summed away
  char forbid[8];             // letters never sharded
  char strict[8];             // letters whose indivisible sharding is an
                              // error, not a fallback to Replicate (heads)
  enum mr_spmd_linear linear;
  unsigned additive;          // bit i: input i is added to the output
  unsigned nonfloat;          // bit i: input i is integer (never Partial)
  enum mr_reduce_op contract_op; // how outputs reduce over a sharded
                              // contracted letter: sum (0), or max
};

/* Fills the spec of op in g.  Returns 0 or MR_EINVAL. */
typedef int (*mr_spmd_spec_fn)(const struct mr_graph *g, const struct mr_op *op,
                               struct mr_spmd_spec *s);

/* Writes into attr[MR_OP_MAX_ATTR] the attributes the op runs with on the
 * rank at mesh coordinate coord whose inputs have placements need[] (head
 * counts become local, a vocabulary shard learns its first row). */
typedef void (*mr_spmd_localize_fn)(const struct mr_graph *g,
                                    const struct mr_op *op,
                                    const struct mr_mesh *m,
                                    const struct mr_dist_attr *need,
                                    const int *coord, double *attr);

struct mr_spmd_rule {
  const char *op;             // op registry name
  mr_spmd_spec_fn spec;
  mr_spmd_localize_fn localize; // NULL: attributes unchanged
};

/* Registers a rule in place of the row's for op r->op (replacing one
 * registered before); the rule is borrowed and must outlive its use.
 * Returns 0 or MR_ENOMEM. */
int mr_spmd_rule_register(const struct mr_spmd_rule *r);

/* The rule of op kind: one registered for its name, else its row's; NULL
 * when it has none. */
const struct mr_spmd_rule *mr_spmd_rule_of(int kind);

/* The same by op name; NULL for no such op. */
const struct mr_spmd_rule *mr_spmd_rule_find(const char *op);

/* What resharding input `slot` from src to dst would cost the caller (it
 * may know that an earlier consumer pays for the same reshard already). */
struct mr_spmd_cost {
  double (*fn)(void *ctx, const struct mr_op *op, int slot,
               const struct mr_dist_attr *src, const struct mr_dist_attr *dst);
  void *ctx;
};

/* Forward inference.  in[n_in]: inputs' placements (known or not; hinted
 * bit i: input i's placement is a user hint, preferred in conflicts).
 * Where inputs propose different shardings of a mesh dim and none is a
 * hint, the Shard whose reshards cost least wins (cost NULL: link bytes
 * of the planned reshards), a Partial output counted as the AllReduce it
 * will need; ties go to the earlier input.  Replicate is chosen only when
 * no input proposes a Shard.
 * Writes need[n_in] (what each input must be resharded to) and out[n_out].
 * Returns 0, or MR_EINVAL with a message naming the op when a hinted
 * sharding cannot be honoured (heads not divisible by the degree). */
int mr_spmd_infer(const struct mr_spmd_rule *r, const struct mr_graph *g,
                  const struct mr_op *op, const struct mr_mesh *m,
                  const struct mr_dist_attr *in, unsigned hinted,
                  const struct mr_spmd_cost *cost, struct mr_dist_attr *need,
                  struct mr_dist_attr *out);

/* Reverse inference from out[n_out] (known or not): writes need[n_in]
 * and out_fixed[n_out].  Returns 0 or MR_EINVAL. */
int mr_spmd_infer_reverse(const struct mr_spmd_rule *r,
                          const struct mr_graph *g, const struct mr_op *op,
                          const struct mr_mesh *m,
                          const struct mr_dist_attr *out,
                          struct mr_dist_attr *need,
                          struct mr_dist_attr *out_fixed);

/* The built-in ops' rules, one per MR_OP_LIST entry, which their rows in
 * compiler/ops.c name. */
#define MR__SPMD_RULE_DECL(kind, name) extern const struct mr_spmd_rule mr_spmd_rule_##name;
MR_OP_LIST(MR__SPMD_RULE_DECL)
#undef MR__SPMD_RULE_DECL

#endif
