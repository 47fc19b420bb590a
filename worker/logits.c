/* logits.c - the forward pass of trained weights on one text. */
#include "worker/logits.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "compiler/model.h"
#include "common/model_config.h"
#include "worker/exec.h"
#include "worker/weights.h"

int mr_logits_main(int argc, char **argv) {
  static const struct option longopts[] = {{"text", required_argument, NULL, 't'},
                                           {"out", required_argument, NULL, 'o'},
                                           {"config", required_argument, NULL, 'c'},
                                           {"help", no_argument, NULL, 'h'},
                                           {NULL, 0, NULL, 0}};
  static const char *const use =
      "usage: meshrun logits WEIGHTS --text TEXT --out FILE [--config config.json]\n";
  const char *text = NULL, *out = NULL, *config = NULL;
  optind = 1;
  opterr = 0;
  int c;
  while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
    switch (c) {
    case 't': text = optarg; break;
    case 'o': out = optarg; break;
    case 'c': config = optarg; break;
    case 'h':
      printf("%s\nThe forward pass of trained weights (a safetensors file, or a folder with\n"
             "model.safetensors and config.json) on TEXT's bytes as token ids: the float32\n"
             "logits, [len(TEXT), vocab_size] row-major, written to FILE.\n", use);
      return 0;
    default:
      fprintf(stderr, "meshrun logits: unknown or incomplete option \"%s\"\n", argv[optind - 1]);
      return 2;
    }
  }
  if (optind != argc - 1 || text == NULL || out == NULL || text[0] == '\0') {
    fputs(use, stderr);
    return 2;
  }
  const char *weights = argv[optind];
  struct mr_model_config cfg;
  int rc = config != NULL ? mr_model_config_load(config, &cfg)
                          : mr_weights_read_config(weights, &cfg);
  if (rc < 0) {
    fprintf(stderr, "meshrun logits: %s\n", mr_error_message());
    return 2;
  }
  int64_t T = (int64_t)strlen(text);
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
      ids[i] = (unsigned char)text[i];
      lab[i] = (unsigned char)text[i + 1 < T ? i + 1 : i];
      if (ids[i] >= cfg.vocab_size)
        rc = mr_error_set(MR_EINVAL, "byte %d of the text is beyond the vocabulary (%lld)",
                          ids[i], (long long)cfg.vocab_size);
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
  mr_exec_close(&x);
  mr_model_close(&m);
  if (rc < 0) {
    fprintf(stderr, "meshrun logits: %s\n", mr_error_message());
    return rc == MR_EIO ? 1 : 2;
  }
  return 0;
}
