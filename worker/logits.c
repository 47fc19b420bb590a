/* logits.c - the forward pass of trained weights on one text. */
#include "worker/logits.h"

#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "compiler/model.h"
#include "common/model_config.h"
#include "worker/exec.h"
#include "worker/weights.h"

/* "1,2,3" (commas or spaces) into ids[]: the count, or -1 with the error
 * set naming the entry that is not a token id. */
static int64_t parse_ids(const char *list, int32_t **ids_out) {
  size_t cap = strlen(list) / 2 + 1;
  int32_t *ids = malloc(cap * sizeof *ids);
  if (ids == NULL)
    return mr_error_set(MR_ENOMEM, "--tokens: no memory");
  int64_t n = 0;
  const char *p = list;
  while (*p) {
    while (*p == ',' || *p == ' ')
      p++;
    if (*p == '\0')
      break;
    char *end;
    long long v = strtoll(p, &end, 10);
    if (end == p || v < 0 || v > INT32_MAX || (*end && *end != ',' && *end != ' ')) {
      free(ids);
      return mr_error_set(MR_EINVAL, "--tokens: entry %lld (\"%.20s\") is not a token id "
                          "(expected non-negative integers separated by commas)",
                          (long long)n + 1, p);
    }
    ids[n++] = (int32_t)v;
    p = end;
  }
  if (n == 0) {
    free(ids);
    return mr_error_set(MR_EINVAL, "--tokens: no token ids in \"%s\"", list);
  }
  *ids_out = ids;
  return n;
}

int mr_logits_main(int argc, char **argv) {
  static const struct option longopts[] = {{"text", required_argument, NULL, 't'},
                                           {"tokens", required_argument, NULL, 'i'},
                                           {"out", required_argument, NULL, 'o'},
                                           {"config", required_argument, NULL, 'c'},
                                           {"help", no_argument, NULL, 'h'},
                                           {NULL, 0, NULL, 0}};
  static const char *const use =
      "usage: meshrun logits WEIGHTS (--text TEXT | --tokens ID,ID,...) --out FILE\n"
      "                      [--config config.json]\n";
  const char *text = NULL, *tokens = NULL, *out = NULL, *config = NULL;
  optind = 1;
  opterr = 0;
  int c;
  while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
    switch (c) {
    case 't': text = optarg; break;
    case 'i': tokens = optarg; break;
    case 'o': out = optarg; break;
    case 'c': config = optarg; break;
    case 'h':
      printf("%s\nThe forward pass of trained weights (a safetensors file, or a folder with\n"
             "model.safetensors and config.json) on TEXT's bytes as token ids, or on the\n"
             "token ids given: the float32 logits, [tokens, vocab_size] row-major, written\n"
             "to FILE.\n", use);
      return 0;
    default:
      fprintf(stderr, "meshrun logits: unknown or incomplete option \"%s\"\n", argv[optind - 1]);
      return 2;
    }
  }
  if (optind != argc - 1 || (text == NULL) == (tokens == NULL) || out == NULL ||
      (text != NULL && text[0] == '\0')) {
    fputs(use, stderr);
    return 2;
  }
  const char *weights = argv[optind];
  int32_t *given = NULL;
  int64_t T = 0;
  int rc = 0;
  if (text != NULL) {
    T = (int64_t)strlen(text);
    given = malloc((size_t)T * sizeof *given);
    if (given == NULL)
      rc = mr_error_set(MR_ENOMEM, "no memory for %lld tokens", (long long)T);
    for (int64_t i = 0; rc == 0 && i < T; i++)
      given[i] = (unsigned char)text[i];
  } else {
    T = parse_ids(tokens, &given);
    rc = T < 0 ? (int)T : 0;
  }
  struct mr_model_config cfg;
  if (rc == 0)
    rc = config != NULL ? mr_model_config_load(config, &cfg)
                        : mr_weights_read_config(weights, &cfg);
  for (int64_t i = 0; rc == 0 && i < T; i++)
    if (given[i] >= cfg.vocab_size)
      rc = mr_error_set(MR_EINVAL, "%s %lld (id %d) is beyond the vocabulary (%lld)",
                        text ? "byte" : "token", (long long)i, given[i],
                        (long long)cfg.vocab_size);
  if (rc < 0) {
    free(given);
    fprintf(stderr, "meshrun logits: %s\n", mr_error_message());
    return 2;
  }
  struct mr_model m;
  struct mr_exec x;
  memset(&x, 0, sizeof x);
  rc = mr_model_build(&cfg, 1, T, &m);
  if (rc == 0)
    rc = mr_exec_init(&x, &m.graph, 1, MR_AMP_NONE);
  if (rc == 0)
    rc = mr_weights_load(&m, &x, weights);
  if (rc == 0) {
    int32_t *ids = mr_exec_buf(&x, m.input_ids);
    int32_t *lab = mr_exec_buf(&x, m.labels);
    for (int64_t i = 0; i < T; i++) {
      ids[i] = given[i];
      lab[i] = given[i + 1 < T ? i + 1 : i];
    }
    if (m.position_ids >= 0) {
      int32_t *pos = mr_exec_buf(&x, m.position_ids);
      for (int64_t i = 0; i < T; i++)
        pos[i] = (int32_t)i;
    }
  }
  if (rc == 0)
    rc = mr_exec_run(&x, 0, m.graph.n_ops);
  if (rc == 0) {
    FILE *f = fopen(out, "wb");
    size_t n = (size_t)(T * cfg.vocab_size);
    if (f == NULL || fwrite(mr_exec_buf(&x, m.logits), sizeof(float), n, f) != n || fclose(f) != 0)
      rc = mr_error_set(MR_EIO, "%s: cannot write the logits", out);
  }
  free(given);
  mr_exec_close(&x);
  mr_model_close(&m);
  if (rc < 0) {
    fprintf(stderr, "meshrun logits: %s\n", mr_error_message());
    return rc == MR_EIO ? 1 : 2;
  }
  return 0;
}
