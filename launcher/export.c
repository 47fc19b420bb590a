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
#include "common/error.h"
#include "common/jsonv.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "launcher/cli.h"

static void usage(FILE *f) {
  fprintf(f, "usage: meshrun export CKPT --out DIR\n"
             "  CKPT: a checkpoint folder (ROOT/step-N) or a checkpoint root (its newest\n"
             "  complete checkpoint).  Writes DIR/config.json and DIR/model.safetensors.\n");
}

/* Copies every parameter (the index's tensors that are not optimizer
 * state) from the checkpoint's files into one safetensors file. */
static int write_weights(const char *ckpt, const cJSON *tensors, const char *out_path) {
  struct mr_st_writer *w;
  MR_TRY(mr_st_writer_new(out_path, MR_ST_WRITE_FSYNC, &w));
  int rc = mr_st_writer_add_metadata(w, "format", "pt");
  int n_files = 0;
  struct mr_st_file *files[16];
  char names[16][64];
  float **bufs = NULL;
  int n_bufs = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, tensors) {
    if (rc < 0)
      break;
    if (strncmp(e->string, "optim.", 6) == 0)
      continue;
    const cJSON *file = cJSON_GetObjectItemCaseSensitive(e, "file");
    if (!cJSON_IsString(file) || strchr(file->valuestring, '/') != NULL ||
        strlen(file->valuestring) >= sizeof names[0]) {
      rc = mr_error_set(MR_EFORMAT, "%s/index.json: tensors.%s.file: expected a plain file name",
                        ckpt, e->string);
      break;
    }
    int k;
    for (k = 0; k < n_files && strcmp(names[k], file->valuestring) != 0; k++)
      ;
    if (k == n_files) {
      if (n_files == 16) {
        rc = mr_error_set(MR_ENOTSUP, "%s: more than 16 files hold parameters", ckpt);
        break;
      }
      char path[4400];
      snprintf(path, sizeof path, "%s/%s", ckpt, file->valuestring);
      if ((rc = mr_st_open(path, &files[k])) < 0)
        break;
      snprintf(names[k], sizeof names[k], "%s", file->valuestring);
      n_files++;
    }
    const struct mr_st_tensor *t = mr_st_find(files[k], e->string);
    if (t == NULL) {
      rc = mr_error_set(MR_EFORMAT, "%s/%s: no tensor %s", ckpt, names[k], e->string);
      break;
    }
    float **nb = realloc(bufs, (size_t)(n_bufs + 1) * sizeof *bufs);
    if (nb == NULL) {
      rc = MR_ENOMEM;
      break;
    }
    bufs = nb;
    bufs[n_bufs] = malloc((size_t)(t->numel > 0 ? t->numel : 1) * sizeof(float));
    if (bufs[n_bufs] == NULL) {
      rc = MR_ENOMEM;
      break;
    }
    if ((rc = mr_st_read(files[k], t, MR_F32, bufs[n_bufs])) == 0)
      rc = mr_st_writer_add(w, t->name, MR_F32, t->rank, t->shape, bufs[n_bufs]);
    n_bufs++;
  }
  if (rc == 0)
    rc = mr_st_writer_finish(w);
  mr_st_writer_free(w);
  for (int i = 0; i < n_bufs; i++)
    free(bufs[i]);
  free(bufs);
  for (int i = 0; i < n_files; i++)
    mr_st_free(files[i]);
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
  if (mr_ckpt_verify(given, &step) == 0) {
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
  FILE *f = fopen(path, "w");
  if (config == NULL || f == NULL || fputs(config, f) < 0 || fclose(f) != 0) {
    fprintf(stderr, "meshrun export: %s: %s\n", path, strerror(errno));
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
