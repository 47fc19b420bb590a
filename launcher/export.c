/* export.c - `meshrun export CKPT --out DIR`: a checkpoint as a Hugging
 * Face model directory (config.json + model.safetensors) that
 * transformers' from_pretrained loads. */
#include "launcher/export.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/ckpt.h"
#include "common/ckpt_read.h"
#include "common/error.h"
#include "common/file.h"
#include "common/jsonv.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "launcher/cli.h"

static void usage(FILE *f) {
  fprintf(f, "usage: meshrun export CKPT --out DIR\n"
             "  CKPT: a checkpoint folder (ROOT/step-N) or a checkpoint root (its newest\n"
             "  complete checkpoint).  Writes DIR/config.json and DIR/model.safetensors.\n");
}

/* The dims of a JSON shape into shape[] and their product into *numel;
 * returns how many (0: not 1 to MR_CKPT_MAX_DIMS positive whole numbers). */
static int dims(const cJSON *sh, int64_t *shape, int64_t *numel) {
  int nd = cJSON_IsArray(sh) ? cJSON_GetArraySize(sh) : 0;
  if (nd < 1 || nd > MR_CKPT_MAX_DIMS)
    return 0;
  *numel = 1;
  for (int d = 0; d < nd; d++) {
    if (!mr_json_count(cJSON_GetArrayItem(sh, d), INT64_C(1) << 40, &shape[d]) ||
        shape[d] < 1 || __builtin_mul_overflow(*numel, shape[d], numel))
      return 0;
  }
  return nd;
}

/* Assembles every parameter of the index from the checkpoint's pieces
 * (whatever sharding wrote them) into one safetensors file. */
static int write_weights(const char *ckpt, const cJSON *tensors, const char *out_path) {
  struct mr_ckpt_reader *rd;
  MR_TRY(mr_ckpt_reader_open(ckpt, &rd));
  struct mr_st_writer *w = NULL;
  int rc = mr_st_writer_new(out_path, MR_ST_WRITE_FSYNC, &w);
  if (rc == 0)
    rc = mr_st_writer_add_metadata(w, "format", "pt");
  float **bufs = NULL;
  int n_bufs = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, tensors) {
    if (rc < 0)
      break;
    /* read as the model holds it, written as Hugging Face files hold it */
    int64_t shape[MR_CKPT_MAX_DIMS], file[MR_CKPT_MAX_DIMS], off[MR_CKPT_MAX_DIMS] = {0};
    int64_t numel = 0, file_numel = 0;
    int nd = dims(cJSON_GetObjectItemCaseSensitive(e, "shape"), shape, &numel);
    const cJSON *fs = cJSON_GetObjectItemCaseSensitive(e, "file_shape");
    int fnd = fs != NULL ? dims(fs, file, &file_numel) : nd;
    if (fs == NULL) {
      memcpy(file, shape, sizeof file);
      file_numel = numel;
    }
    if (nd < 1 || fnd < 1 || numel <= 0 || file_numel != numel) {
      rc = mr_error_set(MR_EFORMAT, "%s/index.json: tensors.%s: expected a shape of 1 to %d "
                        "positive dims (and a file_shape of as many elements)", ckpt, e->string,
                        MR_CKPT_MAX_DIMS);
      break;
    }
    float **nb = realloc(bufs, (size_t)(n_bufs + 1) * sizeof *bufs);
    if (nb == NULL) {
      rc = MR_ENOMEM;
      break;
    }
    bufs = nb;
    if ((bufs[n_bufs] = malloc((size_t)numel * sizeof(float))) == NULL) {
      rc = MR_ENOMEM;
      break;
    }
    rc = mr_ckpt_reader_read(rd, e->string, nd, shape, off, shape, 0, numel, bufs[n_bufs]);
    if (rc == 0)
      rc = mr_st_writer_add(w, e->string, MR_F32, fnd, file, bufs[n_bufs]);
    n_bufs++;
  }
  if (rc == 0)
    rc = mr_st_writer_finish(w);
  mr_st_writer_free(w);
  for (int i = 0; i < n_bufs; i++)
    free(bufs[i]);
  free(bufs);
  mr_ckpt_reader_free(rd);
  return rc;
}

int mr_cmd_export(int argc, char **argv) {
  static const struct option longopts[] = {{"out", required_argument, NULL, 'o'},
                                           {"help", no_argument, NULL, 'h'},
                                           {NULL, 0, NULL, 0}};
  const char *out = NULL;
  optind = 1;
  opterr = 0;
  int c;
  while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
    if (c == 'o') {
      out = optarg;
    } else if (c == 'h') {
      usage(stdout);
      return 0;
    } else {
      fprintf(stderr, "meshrun export: unknown or incomplete option \"%s\"\n", argv[optind - 1]);
      usage(stderr);
      return 2;
    }
  }
  if (optind != argc - 1 || out == NULL) {
    fprintf(stderr, "meshrun export: expected one checkpoint and --out DIR\n");
    usage(stderr);
    return 2;
  }
  const char *given = argv[optind];
  char ckpt[4096];
  int64_t step;
  if (mr_ckpt_check(given, &step) == 0) {
    snprintf(ckpt, sizeof ckpt, "%s", given);
  } else if (mr_ckpt_find_latest(given, ckpt, sizeof ckpt, &step) != 1) {
    fprintf(stderr, "meshrun export: %s: no complete checkpoint there (%s)\n", given,
            mr_error_message());
    return 2;
  }
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", ckpt, MR_CKPT_INDEX);
  cJSON *ix;
  if (mr_json_load(path, &ix) < 0) {
    fprintf(stderr, "meshrun export: %s\n", mr_error_message());
    return 2;
  }
  const cJSON *model = cJSON_GetObjectItemCaseSensitive(ix, "model");
  const cJSON *tensors = cJSON_GetObjectItemCaseSensitive(ix, "tensors");
  struct mr_model_config cfg;
  int code = 0;
  if (!cJSON_IsObject(model) || !cJSON_IsObject(tensors) ||
      mr_model_config_parse(model, path, &cfg) < 0) {
    fprintf(stderr, "meshrun export: %s: expected \"model\" (a config) and \"tensors\"%s%s\n", path,
            cJSON_IsObject(model) ? ": " : "", cJSON_IsObject(model) ? mr_error_message() : "");
    cJSON_Delete(ix);
    return 2;
  }
  if (mr_mkdir_p(out) < 0) {
    fprintf(stderr, "meshrun export: --out: %s\n", mr_error_message());
    cJSON_Delete(ix);
    return 2;
  }
  char *config = mr_model_config_to_json(&cfg);
  snprintf(path, sizeof path, "%s/config.json", out);
  if (config == NULL || mr_file_write_text(path, config, MR_FILE_NEWLINE) < 0) {
    fprintf(stderr, "meshrun export: %s\n",
            config == NULL ? "out of memory" : mr_error_message());
    code = 1;
  }
  free(config);
  snprintf(path, sizeof path, "%s/model.safetensors", out);
  if (code == 0 && write_weights(ckpt, tensors, path) < 0) {
    fprintf(stderr, "meshrun export: %s\n", mr_error_message());
    code = 1;
  }
  if (code == 0)
    printf("meshrun: exported %s (step %lld) to %s\n", ckpt, (long long)step, out);
  cJSON_Delete(ix);
  return code;
}
