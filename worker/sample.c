/* sample.c - autoregressive generation by rerunning the forward graph over
 * a window of the last max-positions tokens. */
#include "worker/sample.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "compiler/model.h"
#include "common/rng.h"
#include "common/tokenizer.h"
#include "worker/exec.h"
#include "worker/weights.h"

#define MAX_WINDOW 1024 /* tokens of context per forward */

static int64_t pick(const float *logits, int64_t v, double temp, uint64_t seed,
                    int64_t k) {
  int64_t best = 0;
  for (int64_t i = 1; i < v; i++)
    if (logits[i] > logits[best])
      best = i;
  if (temp <= 0)
    return best;
  double sum = 0;
  for (int64_t i = 0; i < v; i++)
    sum += exp((logits[i] - logits[best]) / temp);
  double u = mr_rng_uniform(seed, mr_hash_str("sample"), (uint64_t)k) * sum;
  for (int64_t i = 0; i < v; i++) {
    u -= exp((logits[i] - logits[best]) / temp);
    if (u < 0)
      return i;
  }
  return best;
}

int64_t mr_sample_generate_ids(const char *weights, const char *config_path,
                               const int32_t *prompt, int64_t plen, int64_t n_tokens,
                               double temperature, uint64_t seed, int32_t *out) {
  struct mr_model_config cfg;
  if (config_path)
    MR_TRY(mr_model_config_load(config_path, &cfg));
  else
    MR_TRY(mr_weights_read_config(weights, &cfg));
  if (plen == 0)
    return mr_error_set(MR_EINVAL, "--prompt: expected at least one token");
  for (int64_t i = 0; i < plen; i++)
    if (prompt[i] < 0 || prompt[i] >= cfg.vocab_size)
      return mr_error_set(MR_EINVAL, "prompt token %lld is %d, beyond the vocabulary (%lld)",
                          (long long)i, prompt[i], (long long)cfg.vocab_size);
  int64_t win = plen + n_tokens;
  if (win > cfg.max_position_embeddings)
    win = cfg.max_position_embeddings;
  if (win > MAX_WINDOW)
    win = MAX_WINDOW;
  if (cfg.arch == MR_ARCH_QWEN2 && cfg.sliding_window > 0 && win > cfg.sliding_window)
    win = cfg.sliding_window; /* its per-layer window: only within it */
  struct mr_model m;
  struct mr_exec x;
  int64_t rc = mr_model_build(&cfg, 1, win, &m);
  if (rc < 0) {
    mr_model_close(&m);
    return rc;
  }
  if ((rc = mr_exec_init(&x, &m.graph, 1, MR_AMP_NONE)) < 0) {
    mr_model_close(&m);
    return rc;
  }
  if ((rc = mr_weights_load(&m, &x, weights)) < 0)
    goto out;
  int32_t *ids = mr_exec_buf(&x, m.input_ids);
  if (m.position_ids >= 0) {
    int32_t *pos = mr_exec_buf(&x, m.position_ids);
    for (int64_t i = 0; i < win; i++)
      pos[i] = (int32_t)i;
  }
  /* the window holds the last `len` tokens of prompt + output */
  int64_t len = 0;
  for (int64_t i = plen > win ? plen - win : 0; i < plen; i++)
    ids[len++] = prompt[i];
  const float *logits = mr_exec_buf(&x, m.logits);
  int64_t v = cfg.vocab_size;
  for (int64_t k = 0; k < n_tokens; k++) {
    if ((rc = mr_exec_run(&x, 0, m.graph.n_ops)) < 0)
      goto out;
    int64_t t = pick(logits + (len - 1) * v, v, temperature, seed, k);
    out[k] = (int32_t)t;
    if (len == win) {
      memmove(ids, ids + 1, (size_t)(win - 1) * sizeof *ids);
      len--;
    }
    ids[len++] = (int32_t)t;
  }
  rc = n_tokens;
out:
  mr_exec_close(&x);
  mr_model_close(&m);
  return rc;
}

int64_t mr_sample_generate(const char *weights, const char *config_path,
                           const char *prompt, int64_t n_tokens,
                           double temperature, uint64_t seed, uint8_t *out) {
  int64_t plen = (int64_t)strlen(prompt);
  int32_t *p = malloc(sizeof *p * (size_t)(plen + 1)), *o = malloc(sizeof *o * (size_t)(n_tokens + 1));
  int64_t rc = p && o ? 0 : mr_error_set(MR_ENOMEM, "sample: no memory");
  for (int64_t i = 0; rc == 0 && i < plen; i++)
    p[i] = (uint8_t)prompt[i];
  if (rc == 0)
    rc = mr_sample_generate_ids(weights, config_path, p, plen, n_tokens, temperature, seed, o);
  for (int64_t k = 0; k < rc; k++) /* a token past the bytes is shown as '?' */
    out[k] = (uint8_t)(o[k] < 256 ? o[k] : '?');
  free(p);
  free(o);
  return rc;
}

/* --tokenizer: the prompt encoded and prompt + continuation decoded by the
 * model's own tokenizer. */
static int sample_tokenized(const char *weights, const char *config, const char *tok,
                            const char *prompt, int64_t n, double temp, uint64_t seed) {
  int32_t *p = NULL, *all = NULL;
  int64_t plen = 0;
  char *text = NULL;
  int64_t rc = mr_tokenizer_encode(tok, prompt, &p, &plen);
  if (rc == 0 && (all = malloc(sizeof *all * (size_t)(plen + n + 1))) == NULL)
    rc = mr_error_set(MR_ENOMEM, "sample: no memory");
  if (rc == 0) {
    memcpy(all, p, sizeof *all * (size_t)plen);
    rc = mr_sample_generate_ids(weights, config, p, plen, n, temp, seed, all + plen);
  }
  if (rc >= 0)
    rc = mr_tokenizer_decode(tok, all, plen + n, &text);
  if (rc >= 0)
    printf("%s\n", text);
  else
    fprintf(stderr, "sample: %s\n", mr_error_message());
  free(p);
  free(all);
  free(text);
  return rc < 0 ? (rc == MR_EINVAL ? 2 : 1) : 0;
}

static void usage_to(FILE *f) {
  fprintf(f, "usage: meshrun sample WEIGHTS --prompt TEXT [--config config.json] [--tokens N]\n"
             "                      [--temperature T] [--seed S] [--tokenizer TOK]\n"
             "\n"
             "Generates --tokens tokens after the prompt from trained weights: a safetensors\n"
             "file (meshrun's, holding its config) or a model folder (meshrun export's, or as\n"
             "the hub ships one).  Each byte of the prompt is a token, and each token\n"
             "generated a byte, unless --tokenizer TOK (a tokenizer.json or a folder holding\n"
             "one) encodes the prompt and decodes the text with the model's own tokenizer\n"
             "(through meshrun-tokenize and $MESHRUN_PYTHON, with Hugging Face's tokenizers).\n"
             "--temperature 0 is greedy (default 0.8).\n");
}

static int usage(void) {
  usage_to(stderr);
  return 2;
}

int mr_sample_main(int argc, char **argv) {
  const char *weights = NULL, *prompt = NULL, *config = NULL, *tok = NULL;
  int64_t n = 200;
  double temp = 0.8;
  uint64_t seed = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    char *end = NULL;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      usage_to(stdout);
      return 0;
    } else if (strcmp(a, "--prompt") == 0 && v) {
      prompt = v, i++;
    } else if (strcmp(a, "--config") == 0 && v) {
      config = v, i++;
    } else if (strcmp(a, "--tokenizer") == 0 && v) {
      tok = v, i++;
    } else if (strcmp(a, "--tokens") == 0 && v) {
      n = strtoll(v, &end, 10), i++;
      if (*end || n < 0 || n > 1000000) {
        fprintf(stderr, "sample: --tokens: expected 0..1000000, got %s\n", v);
        return 2;
      }
    } else if (strcmp(a, "--temperature") == 0 && v) {
      temp = strtod(v, &end), i++;
      if (*end || !(temp >= 0)) {
        fprintf(stderr, "sample: --temperature: expected a number >= 0, got %s\n", v);
        return 2;
      }
    } else if (strcmp(a, "--seed") == 0 && v) {
      seed = strtoull(v, &end, 10), i++;
      if (*end) {
        fprintf(stderr, "sample: --seed: expected an integer, got %s\n", v);
        return 2;
      }
    } else if (a[0] != '-' && !weights) {
      weights = a;
    } else {
      fprintf(stderr, "sample: unexpected argument %s\n", a);
      return usage();
    }
  }
  if (!weights || !prompt)
    return usage();
  if (tok != NULL)
    return sample_tokenized(weights, config, tok, prompt, n, temp, seed);
  uint8_t *out = malloc((size_t)n + 1);
  if (!out)
    return 1;
  int64_t got = mr_sample_generate(weights, config, prompt, n, temp, seed, out);
  if (got < 0) {
    fprintf(stderr, "sample: %s\n", mr_error_message());
    free(out);
    return 1;
  }
  fputs(prompt, stdout);
  fwrite(out, 1, (size_t)got, stdout);
  fputc('\n', stdout);
  free(out);
  return 0;
}
