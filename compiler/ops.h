/* ops.h - the op registry: for every op kind its name, arity, shape
 * inference, gradient builder, cost (FLOPs, bytes moved), SPMD rule and
 * kernels per device backend.
 *
 * Adding an op means one line in MR_OP_LIST below, its row in ops.c (shape
 * inference, gradient, costs and its rule, mr_spmd_rule_<name>, defined in
 * compiler/spmd/rules_ops.c: a missing one does not link) and a kernel
 * k_<name> in each backend (bound from the list: a missing one does not
 * compile).  The kernels stay with their backends, which the compiler does
 * not link; each backend binds its whole list into the row at start-up.  Activations are 2-D [rows, features] with rows = batch *
 * sequence; ops that need the sequence structure (RoPE, attention) carry the
 * sequence length and head counts as attributes.
 *
 * Op kinds, inputs -> outputs, attributes (attr[i]):
 *   embedding        ids[N] i32, table[V,C]        -> out[N,C]
 *                    a1 > 0: table holds rows [a0, a0+V) of a vocabulary
 *                    of a1; other ids give zero rows (vocabulary shard)
 *   embedding_bwd    ids[N], dout[N,C]             -> dtable[V,C]   a0=V
 *                    a1, a2: first row and whole vocabulary of a shard
 *   matmul           A, B[, bias[N]]               -> C[M,N]
 *                    a0=transpose A, a1=transpose B; A is [M,K] ([K,M] if
 *                    transposed), B is [K,N] ([N,K] if transposed)
 *   bias_grad        dy[M,N]                       -> db[N] (column sums)
 *   add              a, b                          -> a + b
 *   rmsnorm          x[N,C], w[C]                  -> y, rstd[N]   a0=eps
 *   rmsnorm_bwd      dy, x, w, rstd                -> dx, dw
 *   layernorm        x[N,C], w[C], b[C]            -> y, mean[N], rstd[N]
 *   layernorm_bwd    dy, x, w, mean, rstd          -> dx, dw, db
 *   rope             x[N,H*D]                      -> y  a0=T a1=H a2=theta
 *                    a3=+1 forward rotation, -1 its inverse (the gradient)
 *                    a4..a8 the frequencies' scaling: kind (enum
 *                    mr_rope_kind), factor, low_freq_factor,
 *                    high_freq_factor, original_max_position_embeddings
 *   swiglu           gate, up                      -> silu(gate) * up
 *   swiglu_bwd       dy, gate, up                  -> dgate, dup
 *   gelu             x                             -> gelu_tanh(x)
 *   gelu_bwd         dy, x                         -> dx
 *   attention        q[N,H*D], k[N,KH*D], v        -> o[N,H*D], lse[B,H,T]
 *                    causal, scale 1/sqrt(D); a0=T a1=H a2=KH
 *                    a3=W > 0: a sliding window, query t sees keys
 *                    (t - W, t] (Mistral's); 0: all keys up to t
 *   attention_bwd    do, q, k, v, o, lse           -> dq, dk, dv
 *   split3           x[N,3C]                       -> x0, x1, x2 [N,C]
 *   concat3          x0, x1, x2                    -> x[N,3C]
 *   cross_entropy    logits[N,V], targets[N] i32   -> loss[1] (mean), lse[N]
 *                    a0 = rows the mean divides by (0: N; a row shard
 *                    passes the global row count)
 *   cross_entropy_bwd dloss[1], logits, targets, lse -> dlogits  a0 as above
 *
 * Cross-entropy in three steps, so that logits split by vocabulary are
 * consumed where they lie (each step's partial result is reduced over the
 * vocabulary shards: a max, then sums of [N] values):
 *   xent_max         logits[N,V]                   -> m[N] row maxima
 *                    (no gradient: m only shifts the exponentials, and
 *                    the loss does not depend on it)
 *   xent_sumexp      logits[N,V], targets[N] i32, m[N] -> s[N], tl[N]
 *                    s = sum_v exp(logits - m), tl = the target's logit;
 *                    a1 > 0: the logits are columns [a0, a0+V) of a
 *                    vocabulary of a1 (a target outside them gives tl 0)
 *   xent_sumexp_bwd  logits, targets, m[, ds[N][, dtl[N]]] -> dlogits
 *                    ds * exp(logits - m), plus dtl at the target's
 *                    column; an absent ds or dtl is zero; a0, a1 as above
 *   xent_finish      s, tl, m, targets             -> loss[1] (mean), lse[N]
 *                    lse = m + log s; loss = sum (lse - tl) over the rows
 *                    whose target is >= 0, over a0 (0: their count)
 *   xent_finish_bwd  s, targets[, dloss[1][, dlse]] -> ds, dtl  a0 as above;
 *                    an absent dloss or dlse is zero
 */
#ifndef MR_OPS_H
#define MR_OPS_H

#include "common/model_config.h"
#include "compiler/graph.h"

/* Every built-in op kind, once: X(KIND, name).  The enum, the registry's
 * names and each backend's kernel table (k_<name>, bound by
 * MR_OP_BIND_KERNELS) come from it, so a backend without a kernel for an
 * op does not compile. */
#define MR_OP_LIST(X)                                                        \
  X(EMBEDDING, embedding)                                                    \
  X(EMBEDDING_BWD, embedding_bwd)                                            \
  X(MATMUL, matmul)                                                          \
  X(BIAS_GRAD, bias_grad)                                                    \
  X(ADD, add)                                                                \
  X(RMSNORM, rmsnorm)                                                        \
  X(RMSNORM_BWD, rmsnorm_bwd)                                                \
  X(LAYERNORM, layernorm)                                                    \
  X(LAYERNORM_BWD, layernorm_bwd)                                            \
  X(ROPE, rope)                                                              \
  X(SWIGLU, swiglu)                                                          \
  X(SWIGLU_BWD, swiglu_bwd)                                                  \
  X(GELU, gelu)                                                              \
  X(GELU_BWD, gelu_bwd)                                                      \
  X(ATTENTION, attention)                                                    \
  X(ATTENTION_BWD, attention_bwd)                                            \
  X(SPLIT3, split3)                                                          \
  X(CONCAT3, concat3)                                                        \
  X(CROSS_ENTROPY, cross_entropy)                                            \
  X(CROSS_ENTROPY_BWD, cross_entropy_bwd)                                    \
  X(XENT_MAX, xent_max)                                                      \
  X(XENT_SUMEXP, xent_sumexp)                                                \
  X(XENT_SUMEXP_BWD, xent_sumexp_bwd)                                        \
  X(XENT_FINISH, xent_finish)                                                \
  X(XENT_FINISH_BWD, xent_finish_bwd)

#define MR__OP_ENUM(kind, name) MR_OP_##kind,
enum mr_op_kind { MR_OP_LIST(MR__OP_ENUM) MR_OP_COUNT };
#undef MR__OP_ENUM

/* In a backend's source: binds k_<name> for every built-in op to backend. */
#define MR__OP_BIND(kind, name) mr_op_set_kernel(MR_OP_##kind, mr__op_backend, k_##name);
#define MR_OP_BIND_KERNELS(backend)                                          \
  do {                                                                       \
    enum mr_backend_kind mr__op_backend = (backend);                         \
    MR_OP_LIST(MR__OP_BIND)                                                  \
  } while (0)


#define MR_OP_MAX_KINDS 64     // built-in kinds plus those registered later

enum mr_backend_kind { MR_BACKEND_CPU = 0, MR_BACKEND_CUDA = 1, MR_BACKEND_COUNT };

struct mr_spmd_rule;

/* An inferred output: shape and dtype. */
struct mr_shape {
  int ndim;
  int64_t d[MR_MAX_DIMS];
  enum mr_dtype dtype;
};

/* A kernel: runs op on buffers (one per input, then one per output, in
 * order; NULL for an absent optional input).  ctx is the backend's. */
typedef int (*mr_kernel_fn)(void *ctx, const struct mr_graph *g,
                            const struct mr_op *op, void *const *bufs);

struct mr_op_def {
  const char *name;
  int n_in_min, n_in_max;      // optional inputs trail
  int n_out;
  /* Fills out[0..n_out) from the inputs' shapes, or returns MR_ESHAPE with
   * a message naming what mismatched. */
  int (*infer)(const struct mr_graph *g, const struct mr_op *op,
               struct mr_shape *out);
  /* Appends the backward of op `op_id` to g.  dout[i] is the gradient of
   * output i (-1: none flows back).  Writes into din[j] a new tensor
   * holding the gradient of input j, or -1 (not differentiable / none).
   * NULL: the op has no gradient (a backward op itself). */
  int (*grad)(struct mr_graph *g, int op_id, const int *dout, int *din);
  /* Floating-point operations and bytes read + written by one execution. */
  double (*flops)(const struct mr_graph *g, const struct mr_op *op);
  double (*bytes)(const struct mr_graph *g, const struct mr_op *op);
  /* How placements propagate through the op (compiler/spmd/rules.h);
   * NULL: none (a plugin op without one cannot be sharded). */
  const struct mr_spmd_rule *spmd;
  /* Bit j: every backend's kernel honours mr_op.accum_out for output j
   * (adds into it).  Set for the ops producing parameter gradients, whose
   * gradient then accumulates over micro-batches in the op itself (a
   * weight-gradient GEMM with beta 1) rather than through a buffer added
   * afterwards.  0 (plugins): always overwritten. */
  unsigned accum_outs;
};

/* The definition of kind, or NULL when out of range. */
const struct mr_op_def *mr_op_def(int kind);

/* Kind of the op named name, or MR_EINVAL. */
int mr_op_kind_by_name(const char *name);

/* Registers a new op kind (a plugin's): def is copied, its strings and
 * functions are borrowed for the life of the process.  Returns the new
 * kind (>= MR_OP_COUNT), MR_EINVAL (incomplete definition, name taken) or
 * MR_ENOMEM (table full).  Not thread-safe: register before building
 * graphs. */
int mr_op_register(const struct mr_op_def *def);

/* Number of op kinds: MR_OP_COUNT plus those registered. */
int mr_op_count(void);

/* Binds a backend's kernel to an op kind (done once by each backend at
 * start-up); the table is process-wide. */
void mr_op_set_kernel(int kind, enum mr_backend_kind backend, mr_kernel_fn fn);

/* The bound kernel, or NULL. */
mr_kernel_fn mr_op_kernel(int kind, enum mr_backend_kind backend);

/* FLOPs of the whole graph (forward and backward ops as present). */
double mr_graph_flops(const struct mr_graph *g);

/* A rope op's frequencies (a2, a4..a8), and the attrs that hold r. */
static inline struct mr_rope mr_rope_of_attr(const double *a) {
  struct mr_rope r = {a[2], (enum mr_rope_kind)a[4], a[5], a[6], a[7], a[8]};
  return r;
}
static inline void mr_rope_to_attr(const struct mr_rope *r, double *a) {
  a[2] = r->theta, a[4] = r->kind, a[5] = r->factor, a[6] = r->low_freq_factor;
  a[7] = r->high_freq_factor, a[8] = r->original_max_positions;
}

#endif
