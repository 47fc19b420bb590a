/* weights.c - parameter initialization and safetensors I/O. */
#include "worker/weights.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/error.h"
#include "common/rng.h"
#include "common/safetensors.h"

void mr_weights_init(const struct mr_model *m, struct mr_exec *x,
                     uint64_t seed) {
  const struct mr_graph *g = &m->graph;
  for (int i = 0; i < g->n_tensors; i++) {
    const struct mr_tensor *t = &g->tensors[i];
    if (t->role != MR_ROLE_PARAM)
      continue;
    float *p = mr_exec_buf(x, i);
    size_t n = (size_t)mr_tensor_numel(t);
    if (t->init == MR_INIT_NORMAL)
      mr_rng_normal_fill(seed, mr_hash_str(t->name), 0, n, 0.0f,
                         (float)m->cfg.initializer_range, p);
    else
      for (size_t k = 0; k < n; k++)
        p[k] = t->init == MR_INIT_ONES ? 1.0f : 0.0f;
  }
}

static int is_dir(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

int mr_weights_src_open(const char *path, struct mr_weights_src *s) {
  memset(s, 0, sizeof *s);
  if (!is_dir(path))
    return mr_st_open(path, &s->single);
  char full[4096];
  if (snprintf(full, sizeof full, "%s/model.safetensors.index.json", path) >= (int)sizeof full)
    return mr_error_set(MR_EINVAL, "%s: path too long", path);
  struct stat st;
  if (stat(full, &st) != 0) {
    snprintf(full, sizeof full, "%s/model.safetensors", path);
    return mr_st_open(full, &s->single);
  }
  MR_TRY(mr_st_index_read(full, &s->index));
  int n = mr_st_index_count(s->index);
  s->dir = strdup(path);
  s->shards = calloc((size_t)n + 1, sizeof *s->shards);
  s->shard_names = calloc((size_t)n + 1, sizeof *s->shard_names);
  if (!s->dir || !s->shards || !s->shard_names) {
    mr_weights_src_close(s);
    return mr_error_set(MR_ENOMEM, "%s: no memory for the index", full);
  }
  for (int i = 0; i < n; i++) {
    const char *name, *file;
    mr_st_index_at(s->index, i, &name, &file);
    if (file[0] == '\0' || file[0] == '.' || strchr(file, '/')) {
      int rc = mr_error_set(MR_EFORMAT, "%s: weight_map.%s: \"%s\" is not a file name in "
                            "the folder", full, name, file);
      mr_weights_src_close(s);
      return rc;
    }
    int k = 0;
    while (k < s->n_shards && strcmp(s->shard_names[k], file) != 0)
      k++;
    if (k == s->n_shards && !(s->shard_names[s->n_shards++] = strdup(file))) {
      mr_weights_src_close(s);
      return mr_error_set(MR_ENOMEM, "%s: no memory for the index", full);
    }
  }
  return 0;
}

void mr_weights_src_close(struct mr_weights_src *s) {
  mr_st_free(s->single);
  for (int i = 0; i < s->n_shards; i++) {
    mr_st_free(s->shards[i]);
    free(s->shard_names[i]);
  }
  free(s->shards);
  free(s->shard_names);
  mr_st_index_free(s->index);
  free(s->dir);
  memset(s, 0, sizeof *s);
}

/* The tensor stored as `name` exactly, or NULL (MR_OK) / an error. */
static int find_exact(struct mr_weights_src *s, const char *name,
                      const struct mr_st_tensor **t, struct mr_st_file **f) {
  *t = NULL;
  if (s->single) {
    *f = s->single;
    *t = mr_st_find(s->single, name);
    return 0;
  }
  const char *file = mr_st_index_file(s->index, name);
  if (!file)
    return 0;
  int k = 0;
  while (strcmp(s->shard_names[k], file) != 0)
    k++;
  if (!s->shards[k]) {
    char full[4096];
    snprintf(full, sizeof full, "%s/%s", s->dir, file);
    MR_TRY(mr_st_open(full, &s->shards[k]));
  }
  *f = s->shards[k];
  *t = mr_st_find(s->shards[k], name);
  if (!*t)
    return mr_error_set(MR_EFORMAT, "%s: tensor %s: missing (the index names this shard)",
                        mr_st_path(*f), name);
  return 0;
}

int mr_weights_src_find(struct mr_weights_src *s, const char *name,
                        const struct mr_st_tensor **t, struct mr_st_file **f) {
  static const char *const prefixes[] = {"transformer.", "model."};
  MR_TRY(find_exact(s, name, t, f));
  for (size_t i = 0; !*t && i < sizeof prefixes / sizeof *prefixes; i++) {
    size_t n = strlen(prefixes[i]);
    char alias[MR_ST_MAX_NAME + 16];
    if (strncmp(name, prefixes[i], n) == 0)
      snprintf(alias, sizeof alias, "%s", name + n); /* the base model's own name */
    else
      snprintf(alias, sizeof alias, "%s%s", prefixes[i], name);
    MR_TRY(find_exact(s, alias, t, f));
  }
  if (!*t)
    return mr_error_set(MR_EFORMAT, "%s: tensor %s: missing",
                        s->single ? mr_st_path(s->single) : s->dir, name);
  return 0;
}

int mr_weights_file_matches(const struct mr_st_tensor *s, const struct mr_tensor *t) {
  int64_t shape[MR_MAX_DIMS];
  int nd = mr_tensor_file_shape(t, shape), same = s->rank == nd;
  for (int d = 0; same && d < nd; d++)
    same = s->shape[d] == shape[d];
  return same;
}

int mr_weights_load(const struct mr_model *m, struct mr_exec *x,
                    const char *path) {
  struct mr_weights_src src;
  MR_TRY(mr_weights_src_open(path, &src));
  const struct mr_graph *g = &m->graph;
  int rc = 0;
  for (int i = 0; i < g->n_tensors && rc == 0; i++) {
    const struct mr_tensor *t = &g->tensors[i];
    if (t->role != MR_ROLE_PARAM)
      continue;
    const struct mr_st_tensor *s;
    struct mr_st_file *f;
    if ((rc = mr_weights_src_find(&src, t->name, &s, &f)) < 0)
      break;
    if (!mr_weights_file_matches(s, t)) {
      int64_t shape[MR_MAX_DIMS];
      int nd = mr_tensor_file_shape(t, shape);
      rc = mr_error_set(MR_EFORMAT, "%s: tensor %s: shape does not match "
                        "the model config (expected [%lld%s%lld])",
                        mr_st_path(f), t->name, (long long)shape[0],
                        nd > 1 ? ", " : "", nd > 1 ? (long long)shape[1] : 0LL);
      break;
    }
    rc = mr_st_read(f, s, MR_F32, mr_exec_buf(x, i));
  }
  mr_weights_src_close(&src);
  return rc;
}

int mr_weights_write(const struct mr_graph *g, const struct mr_model_config *cfg,
                     float *const *data, const char *path) {
  struct mr_st_writer *w;
  MR_TRY(mr_st_writer_new(path, MR_ST_WRITE_DIRECT, &w));
  int rc = 0;
  for (int i = 0; i < g->n_tensors && rc == 0; i++) {
    const struct mr_tensor *t = &g->tensors[i];
    int64_t shape[MR_MAX_DIMS]; /* as Hugging Face files hold it */
    if (t->role == MR_ROLE_PARAM)
      rc = mr_st_writer_add(w, t->name, MR_F32, mr_tensor_file_shape(t, shape), shape, data[i]);
  }
  char *text = mr_model_config_to_json(cfg);
  if (rc == 0 && !text)
    rc = MR_ENOMEM;
  if (rc == 0)
    rc = mr_st_writer_add_metadata(w, "format", "pt");
  if (rc == 0)
    rc = mr_st_writer_add_metadata(w, "config", text);
  if (rc == 0)
    rc = mr_st_writer_finish(w);
  cJSON_free(text);
  mr_st_writer_free(w);
  return rc;
}

int mr_weights_save(const struct mr_model *m, const struct mr_exec *x,
                    const char *path) {
  return mr_weights_write(&m->graph, &m->cfg, (float *const *)x->buf, path);
}

int mr_weights_read_config(const char *path, struct mr_model_config *cfg) {
  if (is_dir(path)) /* an export's, a hub model's */
    return mr_model_config_load(path, cfg);
  struct mr_st_file *f;
  MR_TRY(mr_st_open(path, &f));
  const char *text = mr_st_metadata(f, "config");
  int rc;
  if (!text) {
    rc = mr_error_set(MR_EFORMAT, "%s: __metadata__: no \"config\" entry; "
                      "pass --config config.json", mr_st_path(f));
  } else {
    cJSON *o = cJSON_Parse(text);
    char where[4200];
    snprintf(where, sizeof where, "%s: __metadata__.config", mr_st_path(f));
    rc = o ? mr_model_config_parse(o, where, cfg)
           : mr_error_set(MR_EFORMAT, "%s: not valid JSON", where);
    cJSON_Delete(o);
  }
  mr_st_free(f);
  return rc;
}
