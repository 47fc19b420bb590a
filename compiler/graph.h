/* graph.h - the training graph: tensors and the ops between them, as plain
 * data.
 *
 * A graph is two arrays, tensors and ops, indexed by int ids.  A tensor has
 * a global shape, a dtype, a role (parameter, input, activation, gradient,
 * optimizer state) and a Hugging Face name where it is a parameter.  An op
 * names its kind (an index into the op registry, compiler/ops.h), its input
 * and output tensor ids and a few numeric attributes whose meaning the
 * registry documents per op.  Nothing here points into other memory, so a
 * graph can be copied, serialized into a plan and annotated per tensor
 * (placements) and per op (pipeline stage) by later passes.  Ops are kept in
 * a valid execution order: an op only reads tensors produced earlier. */
#ifndef MR_GRAPH_H
#define MR_GRAPH_H

#include <stdint.h>

#include "common/box.h"
#include "common/dtype.h"

#define MR_OP_MAX_IN 6
#define MR_OP_MAX_OUT 3
#define MR_OP_MAX_ATTR 9 /* rope: T, H, theta, direction and its scaling */
#define MR_TENSOR_NAME_MAX 96

enum mr_tensor_role {
  MR_ROLE_INPUT = 0,      // fed by the runtime each step (tokens, seeds)
  MR_ROLE_PARAM = 1,      // trained weight, persistent
  MR_ROLE_ACTIVATION = 2, // produced and consumed within a step
  MR_ROLE_GRAD = 3,       // gradient of a parameter (persistent) or activation
  MR_ROLE_OPT_STATE = 4,  // AdamW moments, persistent
};

/* How a parameter starts when no checkpoint is given. */
enum mr_init_kind {
  MR_INIT_NONE = 0,
  MR_INIT_NORMAL = 1, // N(0, initializer_range) from (seed, name, index)
  MR_INIT_ONES = 2,
  MR_INIT_ZEROS = 3,
};

struct mr_tensor {
  char name[MR_TENSOR_NAME_MAX]; // HF name for parameters
  enum mr_dtype dtype;
  enum mr_tensor_role role;
  enum mr_init_kind init;
  int ndim;
  int64_t shape[MR_MAX_DIMS];
  int producer;  // op id writing it, -1 for inputs and parameters
  int grad;      // id of this tensor's gradient, -1 when none
  int grad_of;   // for gradients: the tensor differentiated, else -1
  int merged;    // parameters: Hugging Face files hold it with its last two
                 // dims as one (GPT-2's fused q|k|v, [C, 3, C] as [C, 3C])
};

struct mr_op {
  int kind;                    // index into the op registry
  int n_in, n_out;
  int in[MR_OP_MAX_IN];        // tensor ids; -1 for an absent optional input
  int out[MR_OP_MAX_OUT];
  double attr[MR_OP_MAX_ATTR]; // meaning per op kind, see ops.h
  int backward;                // 1 for ops emitted by autodiff
  int fwd_op;                  // backward ops: the forward op whose gradient
                               // builder emitted it (recomputation: the op
                               // it repeats); -1 for forward ops
  int stage;                   // pipeline stage, 0 until partitioned
  unsigned accum_out;          // bit j: the kernel adds output j into what
                               // its buffer holds instead of overwriting it
                               // (only outputs its definition's accum_outs
                               // allow).  0 in graphs; the runtime sets it on
                               // a copy for a parameter gradient written into
                               // its accumulator after the first micro-batch
};

/* Whether op's kernel adds output j into its buffer (see accum_out). */
static inline int mr_op_accum(const struct mr_op *op, int j) {
  return (int)((op->accum_out >> j) & 1u);
}

struct mr_graph {
  struct mr_tensor *tensors;
  int n_tensors, cap_tensors;
  struct mr_op *ops;
  int n_ops, cap_ops;
  int loss;                    // the scalar loss tensor, -1 until set
  int n_forward_ops;           // ops before autodiff appended the backward
};

/* Initializes an empty graph (caller-allocated). */
void mr_graph_init(struct mr_graph *g);

/* Frees what g owns; a zeroed graph is fine. */
void mr_graph_close(struct mr_graph *g);

/* Adds a tensor; returns its id or MR_ENOMEM / MR_EINVAL (ndim out of
 * range, a non-positive dim, a name too long).  Name is copied. */
int mr_graph_tensor(struct mr_graph *g, const char *name, enum mr_dtype dtype,
                    enum mr_tensor_role role, int ndim, const int64_t *shape);

/* Adds a parameter with its initializer; returns its id or an error. */
int mr_graph_param(struct mr_graph *g, const char *name, enum mr_init_kind init,
                   int ndim, const int64_t *shape);

/* Appends an op of registry kind `kind`: checks arity and infers the
 * outputs' shapes through the registry, creating n_out activation tensors
 * named "<name>" / "<name>.1" ...; out_ids (may be NULL) receives their
 * ids.  attr may be NULL (all zero).  Returns the op id, MR_ESHAPE with a
 * message naming the op and the mismatching dims, or MR_EINVAL. */
int mr_graph_op(struct mr_graph *g, int kind, const char *name,
                const int *in, int n_in, const double *attr, int *out_ids);

/* Like mr_graph_op but the outputs exist already (autodiff writing into a
 * gradient tensor).  Shapes are checked against inference. */
int mr_graph_op_into(struct mr_graph *g, int kind, const int *in, int n_in,
                     const double *attr, const int *out, int n_out);

/* Replaces the forward ops ops[0..n_ops) with one op of `kind` writing
 * into the existing tensors out[] (checked against its shape inference),
 * placed where the first of them was; the rest leave the order and the
 * ops after them move up.  Its inputs must be produced before that place,
 * and every output of the replaced ops must be one of out[].  Before
 * autodiff only.  Returns the fused op's id, or MR_EINVAL / MR_ESHAPE with
 * a message naming the op and the tensor. */
int mr_graph_fuse(struct mr_graph *g, const int *ops, int n_ops, int kind, const int *in,
                  int n_in, const double *attr, const int *out, int n_out);

/* Elements of tensor t. */
int64_t mr_tensor_numel(const struct mr_tensor *t);

/* Elements of t after its first dim (1 for a 1-D tensor): t seen as a
 * matrix of its first dim by the rest. */
int64_t mr_tensor_cols(const struct mr_tensor *t);

/* The shape Hugging Face files give t (its last two dims merged when
 * t->merged) into shape[]; returns its rank. */
int mr_tensor_file_shape(const struct mr_tensor *t, int64_t *shape);

/* Bytes of tensor t. */
int64_t mr_tensor_bytes(const struct mr_tensor *t);

/* Id of the tensor named name, or -1. */
int mr_graph_find(const struct mr_graph *g, const char *name);

/* Writes a readable listing of the graph (one op per line) to a malloc'd
 * string; NULL on allocation failure. */
char *mr_graph_dump(const struct mr_graph *g);

#endif
