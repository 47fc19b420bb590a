/* model_config.h - a transformer's shape, read from a Hugging Face
 * config.json (LlamaForCausalLM or GPT2LMHeadModel).
 *
 * Field names follow transformers.  Unknown keys of a config are ignored, as
 * transformers ignores them; missing keys take transformers' defaults; wrong
 * types and impossible values (heads that do not divide the hidden size) are
 * errors naming the file and the key. */
#ifndef MR_MODEL_CONFIG_H
#define MR_MODEL_CONFIG_H

#include <stdint.h>

struct cJSON;

enum mr_model_family {
  MR_MODEL_LLAMA = 0, // LlamaForCausalLM: RMSNorm, RoPE, GQA, SwiGLU
  MR_MODEL_GPT2 = 1,  // GPT2LMHeadModel: LayerNorm, learned positions, GELU
};

/* The transformers class a config names; Qwen2 and Mistral are the LLaMA
 * family's graph with their differences as fields (biases, window). */
enum mr_model_arch {
  MR_ARCH_LLAMA = 0,   // LlamaForCausalLM
  MR_ARCH_GPT2 = 1,    // GPT2LMHeadModel
  MR_ARCH_QWEN2 = 2,   // Qwen2ForCausalLM: biases on q, k, v
  MR_ARCH_MISTRAL = 3, // MistralForCausalLM: a sliding attention window
};

/* RoPE's frequencies as transformers' rope types scale them:
 *   default  inv[i] = theta^(-2i/D)
 *   linear   inv[i] / factor (positions interpolated)
 *   llama3   Llama 3.1's: wavelengths 2 pi / inv past original / low_freq
 *            divided by factor, below original / high_freq kept, between
 *            them a smooth blend of the two
 * ("dynamic" NTK scaling changes nothing for sequences within
 * max_position_embeddings, the only ones built, so it reads as default.) */
enum mr_rope_kind {
  MR_ROPE_DEFAULT = 0,
  MR_ROPE_LINEAR = 1,
  MR_ROPE_LLAMA3 = 2,
};

struct mr_rope {
  double theta;
  enum mr_rope_kind kind;
  double factor;                  // linear, llama3
  double low_freq_factor;         // llama3
  double high_freq_factor;        // llama3
  double original_max_positions;  // llama3: original_max_position_embeddings
};

/* inv[0 .. D/2) for head dimension D (even). */
void mr_rope_inv_freq(const struct mr_rope *r, int D, double *inv);

/* cos_t[P, D/2] and sin_t[P, D/2] for positions 0..P-1: angle p inv[i], in
 * double (Hugging Face's cos/sin tensors are these halves repeated twice
 * along D).  MR_EINVAL for P < 0, an odd or non-positive D, theta <= 0 or
 * a scaling factor <= 0. */
int mr_rope_table(const struct mr_rope *r, int P, int D, float *cos_t, float *sin_t);

struct mr_model_config {
  enum mr_model_family family;
  enum mr_model_arch arch;
  int64_t vocab_size;
  int64_t hidden_size;          // GPT-2: n_embd
  int64_t intermediate_size;    // GPT-2: 4 * n_embd unless n_inner
  int64_t num_hidden_layers;    // GPT-2: n_layer
  int64_t num_attention_heads;  // GPT-2: n_head
  int64_t num_key_value_heads;  // GPT-2: = num_attention_heads
  int64_t head_dim;             // LLaMA family: 0 for hidden / heads, else
                                // the config's (q and o are heads x head_dim)
  int64_t max_position_embeddings; // GPT-2: n_positions
  double rms_norm_eps;          // LLaMA
  double layer_norm_epsilon;    // GPT-2
  double rope_theta;            // LLaMA
  struct mr_rope rope;          // LLaMA: theta (= rope_theta) and scaling
  double initializer_range;
  int tie_word_embeddings;      // LLaMA default 0; GPT-2 always 1
  int qkv_bias;                 // q, k, v projections have biases (Qwen2;
                                // LLaMA's attention_bias)
  int o_bias;                   // o_proj has one (LLaMA's attention_bias)
  int64_t sliding_window;       // Mistral, Qwen2 with use_sliding_window: a
                                // query sees at most this many keys; 0: all.
                                // Mistral's is built (every layer); Qwen2's
                                // only for sequences within it
};

/* Parses a config object; `where` names it in errors (a file path, or
 * "job.json: model").  Returns 0 or MR_EJOB with mr_error_message set. */
int mr_model_config_parse(const struct cJSON *obj, const char *where,
                          struct mr_model_config *out);

/* Reads and parses a config.json file, or the one in a model folder. */
int mr_model_config_load(const char *path, struct mr_model_config *out);

/* The same, and the file's object in *obj (the caller's, cJSON_Delete;
 * NULL on an error). */
int mr_model_config_load_json(const char *path, struct mr_model_config *out,
                              struct cJSON **obj);

/* Writes the config as Hugging Face config.json text (malloc'd). */
char *mr_model_config_to_json(const struct mr_model_config *cfg);

/* Head dimension: head_dim where the config gives one, else
 * hidden_size / num_attention_heads. */
int64_t mr_model_head_dim(const struct mr_model_config *cfg);

/* 0 when sequences of seq_len tokens are built for cfg, else MR_ENOTSUP
 * naming sliding_window (Qwen2's per-layer window is not built; within the
 * window it is full causal attention). */
int mr_model_check_seq(const struct mr_model_config *cfg, int64_t seq_len);

/* Number of parameters (embedding counted once when tied). */
int64_t mr_model_param_count(const struct mr_model_config *cfg);

#endif
