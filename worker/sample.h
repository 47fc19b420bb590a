/* sample.h - text generation from trained weights, byte-level or through
 * the model's own tokenizer (--tokenizer, common/tokenizer.h).
 *
 *   meshrun sample WEIGHTS --prompt TEXT [--config config.json]
 *                  [--tokens N] [--temperature T] [--seed S]
 *
 * WEIGHTS is a safetensors file written by training (its __metadata__
 * holds the model config) or any Hugging Face checkpoint with --config.
 * Each prompt byte is one token; generated tokens are written as bytes.
 * Temperature 0 takes the most likely token; otherwise token k of the
 * output is drawn from softmax(logits / T) with the uniform
 * mr_rng_uniform(seed, mr_hash_str("sample"), k). */
#ifndef MR_SAMPLE_H
#define MR_SAMPLE_H

#include <stddef.h>
#include <stdint.h>

/* Generates n_tokens after prompt into out (caller-owned, n_tokens bytes).
 * config_path may be NULL (read from the weights' metadata).  Returns the
 * number of tokens written or a negative code with a message. */
int64_t mr_sample_generate(const char *weights, const char *config_path,
                           const char *prompt, int64_t n_tokens,
                           double temperature, uint64_t seed, uint8_t *out);

/* The same on token ids: prompt[plen] in, out[n_tokens] (caller-owned)
 * the tokens generated. */
int64_t mr_sample_generate_ids(const char *weights, const char *config_path,
                               const int32_t *prompt, int64_t plen, int64_t n_tokens,
                               double temperature, uint64_t seed, int32_t *out);

/* The `sample` subcommand; argv[0] is the command name.  Writes the prompt
 * and its continuation to stdout.  Returns the exit status: 0, 2 for bad
 * flags (usage on stderr), 1 when loading or running fails. */
int mr_sample_main(int argc, char **argv);

#endif
