/* weights.c - parameter initialization and safetensors I/O. */
#include "worker/weights.h"

#include <cjson/cJSON.h>
#include <stdio.h>
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

static int open_file(const char *path, struct mr_st_file **f) {
  struct stat st;
  if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
    char full[4096];
    snprintf(full, sizeof full, "%s/model.safetensors", path);
    return mr_st_open(full, f);
  }
  return mr_st_open(path, f);
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
  struct mr_st_file *f;
  MR_TRY(open_file(path, &f));
  const struct mr_graph *g = &m->graph;
  int rc = 0;
  for (int i = 0; i < g->n_tensors && rc == 0; i++) {
    const struct mr_tensor *t = &g->tensors[i];
    if (t->role != MR_ROLE_PARAM)
      continue;
    const struct mr_st_tensor *s = mr_st_find(f, t->name);
    if (!s) {
      rc = mr_error_set(MR_EFORMAT, "%s: tensor %s: missing", mr_st_path(f),
                        t->name);
      break;
    }
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
  mr_st_free(f);
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
  struct stat st;
  if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) { /* an export's, a hub model's */
    char cp[4200];
    snprintf(cp, sizeof cp, "%s/config.json", path);
    return mr_model_config_load(cp, cfg);
  }
  struct mr_st_file *f;
  MR_TRY(open_file(path, &f));
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
