/* export.c - `meshrun export CKPT --out DIR`: a checkpoint as a Hugging
 * Face model directory (config.json, generation_config.json, the weights
 * in one safetensors file or in shards with their index) that
 * transformers' from_pretrained loads. */
#include "launcher/export.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/ckpt.h"
#include "common/ckpt_read.h"
#include "common/error.h"
#include "common/file.h"
#include "common/jsonv.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "launcher/cli.h"

static void usage(FILE *f) {
  fprintf(f, "usage: meshrun export CKPT --out DIR [--max-shard-size 5GB]\n"
             "  CKPT: a checkpoint folder (ROOT/step-N) or a checkpoint root (its newest\n"
             "  complete checkpoint).  Writes a Hugging Face model folder: DIR/config.json\n"
             "  (the model's own config, every field carried), generation_config.json, and\n"
             "  the weights as float32 safetensors: model.safetensors, or, above\n"
             "  --max-shard-size (GB and MB are powers of 1000, GiB and MiB of 1024),\n"
             "  shards model-0000K-of-0000N.safetensors with model.safetensors.index.json.\n");
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

/* One tensor of the checkpoint's index: as the model holds it, as
 * Hugging Face files hold it, and which output file it goes to. */
struct entry {
  const char *name;
  int nd, fnd, shard;
  int64_t shape[MR_CKPT_MAX_DIMS], file[MR_CKPT_MAX_DIMS], numel;
};

static int read_entries(const char *ckpt, const cJSON *tensors, struct entry **out, int *n_out) {
  int n = cJSON_GetArraySize(tensors);
  struct entry *es = calloc((size_t)n + 1, sizeof *es);
  if (es == NULL)
    return mr_error_set(MR_ENOMEM, "no memory for %d tensors", n);
  int i = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, tensors) {
    struct entry *t = &es[i++];
    int64_t file_numel = 0;
    t->name = e->string;
    t->nd = dims(cJSON_GetObjectItemCaseSensitive(e, "shape"), t->shape, &t->numel);
    const cJSON *fs = cJSON_GetObjectItemCaseSensitive(e, "file_shape");
    t->fnd = fs != NULL ? dims(fs, t->file, &file_numel) : t->nd;
    if (fs == NULL) {
      memcpy(t->file, t->shape, sizeof t->file);
      file_numel = t->numel;
    }
    if (t->nd < 1 || t->fnd < 1 || t->numel <= 0 || file_numel != t->numel) {
      free(es);
      return mr_error_set(MR_EFORMAT, "%s/index.json: tensors.%s: expected a shape of 1 to %d "
                          "positive dims (and a file_shape of as many elements)", ckpt, e->string,
                          MR_CKPT_MAX_DIMS);
    }
  }
  *out = es;
  *n_out = n;
  return 0;
}

/* The tensors of shard k into path, read from the checkpoint's pieces
 * (whatever sharding wrote them) one at a time as the writer streams. */
static int write_shard(struct mr_ckpt_reader *rd, const struct entry *es, int n, int k,
                       const char *path) {
  struct mr_st_writer *w = NULL;
  int rc = mr_st_writer_new(path, MR_ST_WRITE_FSYNC, &w);
  if (rc == 0)
    rc = mr_st_writer_add_metadata(w, "format", "pt");
  float **bufs = calloc((size_t)n + 1, sizeof *bufs);
  if (rc == 0 && bufs == NULL)
    rc = MR_ENOMEM;
  for (int i = 0; i < n && rc == 0; i++) {
    if (es[i].shard != k)
      continue;
    int64_t off[MR_CKPT_MAX_DIMS] = {0};
    if ((bufs[i] = malloc((size_t)es[i].numel * sizeof(float))) == NULL) {
      rc = MR_ENOMEM;
      break;
    }
    rc = mr_ckpt_reader_read(rd, es[i].name, es[i].nd, es[i].shape, off, es[i].shape, 0,
                             es[i].numel, bufs[i]);
    if (rc == 0)
      rc = mr_st_writer_add(w, es[i].name, MR_F32, es[i].fnd, es[i].file, bufs[i]);
  }
  if (rc == 0)
    rc = mr_st_writer_finish(w);
  mr_st_writer_free(w);
  for (int i = 0; bufs != NULL && i < n; i++)
    free(bufs[i]);
  free(bufs);
  return rc;
}

/* Every parameter of the index as float32 safetensors in out: one
 * model.safetensors when all fit in max_bytes, else shards of at most
 * max_bytes each (a tensor larger than that alone in its own), in index
 * order, named model-0000K-of-0000N.safetensors, and
 * model.safetensors.index.json mapping each tensor to its shard, as
 * transformers' save_pretrained writes them. */
static int write_weights(const char *ckpt, const cJSON *tensors, const char *out,
                         uint64_t max_bytes) {
  struct entry *es = NULL;
  int n = 0;
  MR_TRY(read_entries(ckpt, tensors, &es, &n));
  int shards = 0;
  uint64_t in_shard = 0, total = 0;
  for (int i = 0; i < n; i++) {
    uint64_t b = (uint64_t)es[i].numel * 4;
    if (shards == 0 || (in_shard > 0 && in_shard + b > max_bytes)) {
      shards++;
      in_shard = 0;
    }
    es[i].shard = shards - 1;
    in_shard += b;
    total += b;
  }
  struct mr_ckpt_reader *rd = NULL;
  struct mr_st_index *ix = NULL;
  int rc = mr_ckpt_reader_open(ckpt, &rd);
  if (rc == 0 && shards > 1)
    rc = mr_st_index_new(&ix);
  char path[4200], file[64];
  for (int k = 0; k < shards && rc == 0; k++) {
    if (shards == 1)
      snprintf(file, sizeof file, "model.safetensors");
    else
      snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", k + 1, shards);
    snprintf(path, sizeof path, "%s/%s", out, file);
    rc = write_shard(rd, es, n, k, path);
    for (int i = 0; i < n && rc == 0 && ix != NULL; i++)
      if (es[i].shard == k)
        rc = mr_st_index_add(ix, es[i].name, file);
  }
  if (rc == 0 && ix != NULL) {
    mr_st_index_set_total_size(ix, total);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", out);
    rc = mr_st_index_write(ix, path);
  }
  mr_st_index_free(ix);
  mr_ckpt_reader_free(rd);
  free(es);
  return rc;
}

/* config.json: the model's own config as the job gave it (every field
 * carried: bos/eos, dtype, fields meshrun does not read), completed with
 * what transformers needs that it lacks (architectures, model_type, the
 * shape fields, from the parsed config; rope_theta and rope_scaling only
 * where no rope_parameters holds them).  generation_config.json: the token ids a
 * generation starts, ends and pads with, as transformers derives it from
 * the model config. */
static int write_configs(const cJSON *given, const struct mr_model_config *cfg, const char *out) {
  char *norm_text = mr_model_config_to_json(cfg);
  cJSON *norm = norm_text ? cJSON_Parse(norm_text) : NULL;
  cJSON *merged = cJSON_Duplicate(given, 1);
  free(norm_text);
  if (norm == NULL || merged == NULL) {
    cJSON_Delete(norm);
    cJSON_Delete(merged);
    return mr_error_set(MR_ENOMEM, "no memory for config.json");
  }
  const cJSON *f;
  cJSON_ArrayForEach(f, norm) {
    if (cJSON_GetObjectItemCaseSensitive(merged, f->string) != NULL)
      continue;
    if ((strcmp(f->string, "rope_theta") == 0 || strcmp(f->string, "rope_scaling") == 0) &&
        cJSON_GetObjectItemCaseSensitive(merged, "rope_parameters") != NULL)
      continue; /* 5.x's form holds them */
    cJSON_AddItemToObject(merged, f->string, cJSON_Duplicate(f, 1));
  }
  cJSON *gen = cJSON_CreateObject();
  static const char *const ids[] = {"bos_token_id", "eos_token_id", "pad_token_id",
                                    "decoder_start_token_id"};
  for (size_t i = 0; i < sizeof ids / sizeof *ids; i++) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(merged, ids[i]);
    if (v != NULL && !cJSON_IsNull(v))
      cJSON_AddItemToObject(gen, ids[i], cJSON_Duplicate(v, 1));
  }
  cJSON_AddBoolToObject(gen, "_from_model_config", 1);
  char *text = cJSON_Print(merged), *gtext = cJSON_Print(gen);
  char path[4200];
  int rc = text && gtext ? 0 : mr_error_set(MR_ENOMEM, "no memory for config.json");
  snprintf(path, sizeof path, "%s/config.json", out);
  if (rc == 0)
    rc = mr_file_write_text(path, text, MR_FILE_NEWLINE);
  snprintf(path, sizeof path, "%s/generation_config.json", out);
  if (rc == 0)
    rc = mr_file_write_text(path, gtext, MR_FILE_NEWLINE);
  cJSON_free(text);
  cJSON_free(gtext);
  cJSON_Delete(gen);
  cJSON_Delete(merged);
  cJSON_Delete(norm);
  return rc;
}

/* The files of the model folder the job came from (MR_CKPT_MODEL_SOURCE
 * in the checkpoint root) that the hub ships beside the weights: the
 * tokenizer's, and its generation config (over the one written from the
 * config's token ids).  Those not there are left out; a copy that fails is
 * the error. */
static int carry_model_files(const char *ckpt, const char *out) {
  static const char *const files[] = {
      "tokenizer.json",   "tokenizer_config.json", "special_tokens_map.json",
      "tokenizer.model",  "vocab.json",            "merges.txt",
      "added_tokens.json", "generation_config.json"};
  char path[4200], root[4096];
  snprintf(root, sizeof root, "%s", ckpt);
  char *slash = strrchr(root, '/'); /* ckpt is ROOT/step-N */
  if (slash != NULL)
    *slash = '\0';
  snprintf(path, sizeof path, "%s/%s", root, MR_CKPT_MODEL_SOURCE);
  cJSON *src;
  if (access(path, R_OK) != 0 || mr_json_load(path, &src) < 0)
    return 0; /* no record: what the checkpoint holds is all there is */
  const cJSON *folder = cJSON_GetObjectItemCaseSensitive(src, "folder");
  int rc = 0;
  for (size_t i = 0; cJSON_IsString(folder) && rc == 0 && i < sizeof files / sizeof *files; i++) {
    char dst[4200];
    snprintf(path, sizeof path, "%s/%s", folder->valuestring, files[i]);
    snprintf(dst, sizeof dst, "%s/%s", out, files[i]);
    if (access(path, R_OK) == 0)
      rc = mr_file_copy(path, dst);
  }
  cJSON_Delete(src);
  return rc;
}

int mr_cmd_export(int argc, char **argv) {
  static const struct option longopts[] = {{"out", required_argument, NULL, 'o'},
                                           {"max-shard-size", required_argument, NULL, 's'},
                                           {"help", no_argument, NULL, 'h'},
                                           {NULL, 0, NULL, 0}};
  const char *out = NULL;
  uint64_t max_shard = 5000000000ull; /* transformers' default, "5GB" */
  optind = 1;
  opterr = 0;
  int c;
  while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
    if (c == 'o') {
      out = optarg;
    } else if (c == 's') {
      if (mr_parse_bytes(optarg, &max_shard) < 0 || max_shard == 0) {
        fprintf(stderr, "meshrun export: --max-shard-size: \"%s\": expected a size such as "
                        "5GB, 500MB or 1000000 (bytes), above 0\n", optarg);
        return 2;
      }
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
  if (write_configs(model, &cfg, out) < 0) {
    fprintf(stderr, "meshrun export: %s\n", mr_error_message());
    code = 1;
  }
  if (code == 0 && (write_weights(ckpt, tensors, out, max_shard) < 0 ||
                    carry_model_files(ckpt, out) < 0)) {
    fprintf(stderr, "meshrun export: %s\n", mr_error_message());
    code = 1;
  }
  if (code == 0)
    printf("meshrun: exported %s (step %lld) to %s\n", ckpt, (long long)step, out);
  cJSON_Delete(ix);
  return code;
}
