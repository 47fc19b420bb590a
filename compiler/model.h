/* model.h - the forward graph of a causal language model from its Hugging
 * Face config: LlamaForCausalLM or GPT2LMHeadModel.
 *
 * Parameter names, shapes and layouts are exactly transformers' so that its
 * checkpoints load: LLaMA linear weights are [out, in]; GPT-2's Conv1D
 * weights are [in, out] (the graph multiplies by them untransposed).  The
 * graph reads token ids and next-token targets ([batch * seq] int32,
 * row-major by sequence) and ends in the mean cross-entropy loss, computed
 * in one of two forms (the same numbers): one fused cross_entropy op, or
 * the vocabulary-parallel steps xent_max -> xent_sumexp -> xent_finish,
 * which take logits split by vocabulary where they lie (completion then
 * all-reduces [N]-sized row statistics instead of gathering the logits).
 * The fused form reads the logits once; the planner chooses the other
 * where the vocabulary is split (compiler/spmd/completion.h). */
#ifndef MR_MODEL_H
#define MR_MODEL_H

#include <stdint.h>

#include "compiler/graph.h"
#include "common/model_config.h"

enum mr_loss_form {
  MR_LOSS_FUSED = 0,          // cross_entropy (softmax fused)
  MR_LOSS_VOCAB_PARALLEL = 1, // xent_max, xent_sumexp, xent_finish
};

struct mr_model {
  struct mr_graph graph;
  struct mr_model_config cfg;
  int64_t batch, seq;
  int input_ids;    // [batch*seq] int32
  int labels;       // [batch*seq] int32
  int position_ids; // [batch*seq] int32, GPT-2 only, else -1
  int logits;       // [batch*seq, vocab]
  int loss;         // [1]
  enum mr_loss_form loss_form;
};

/* Builds the forward graph for batch x seq tokens into m (caller-allocated).
 * Returns 0, MR_EINVAL when seq exceeds max_position_embeddings or the
 * config is inconsistent, or MR_ENOMEM. */
int mr_model_build(const struct mr_model_config *cfg, int64_t batch,
                   int64_t seq, struct mr_model *m);

/* The same with the loss in the given form (mr_model_build: fused). */
int mr_model_build_loss(const struct mr_model_config *cfg, int64_t batch,
                        int64_t seq, enum mr_loss_form form,
                        struct mr_model *m);

/* A pass over a model's forward graph (a plugin's fusion), run by
 * mr_model_build_loss after the model's ops and before its loss, in the
 * order registered.  run returns 0 or a negative MR_E* code with its
 * message. */
struct mr_model_pass {
  const char *name;
  int (*run)(struct mr_graph *g);
};

/* Registers a pass (borrowed for the life of the process).  Returns 0, or
 * MR_EINVAL (no name or function; a pass of that name registered already)
 * or MR_ENOMEM (more than 16).  Not thread-safe: register before building. */
int mr_model_pass_register(const struct mr_model_pass *p);

/* Frees the graph; a zeroed model is fine. */
void mr_model_close(struct mr_model *m);

#endif
