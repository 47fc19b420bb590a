/* checkpoint.c - saving and loading a rank's checkpoint shards. */
#include "worker/checkpoint.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/ckpt.h"
#include "common/error.h"
#include "common/jsonv.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "common/tunable.h"
#include "worker/optim.h"

#define MR_CKPT_FORMAT "meshrun-checkpoint-1"

struct snapshot_tensor {
  char name[160];
  int ndim;
  int64_t shape[4];
  int64_t numel;
  float *param, *m, *v;    // into the snapshot block
};

struct mr_ckpt_saver {
  int rank, world_size;
  const struct mr_job *job;  // borrowed
  pthread_t thread;
  int in_flight;
  int result;                // of the last save
  char error[512];
  /* the snapshot being written */
  float *block;
  size_t block_floats;
  struct snapshot_tensor *tensors;
  int n;
  int64_t step;
  struct mr_loss_scaler scaler;
  struct mr_reporter reporter;
};

int mr_ckpt_saver_new(int rank, int world_size, const struct mr_job *job,
                      struct mr_ckpt_saver **out) {
  struct mr_ckpt_saver *s = calloc(1, sizeof *s);
  if (s == NULL)
    return MR_ENOMEM;
  s->rank = rank;
  s->world_size = world_size;
  s->job = job;
  *out = s;
  return 0;
}

static int mkdir_one(const char *path) {
  if (mkdir(path, 0755) != 0 && errno != EEXIST)
    return mr_error_set(MR_EIO, "mkdir %s: %s", path, strerror(errno));
  return 0;
}

static int write_index(struct mr_ckpt_saver *s, const char *dir, const char *file) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "format", MR_CKPT_FORMAT);
  cJSON_AddNumberToObject(o, "step", (double)s->step);
  cJSON_AddNumberToObject(o, "world_size", s->world_size);
  cJSON *mesh = cJSON_AddObjectToObject(o, "mesh");
  cJSON *shape = cJSON_AddArrayToObject(mesh, "shape");
  cJSON_AddItemToArray(shape, cJSON_CreateNumber(s->world_size));
  cJSON *dims = cJSON_AddArrayToObject(mesh, "dim_names");
  cJSON_AddItemToArray(dims, cJSON_CreateString("data"));
  cJSON *strat = cJSON_AddObjectToObject(o, "strategy");
  cJSON_AddNumberToObject(strat, "data_parallel.degree", s->world_size);
  cJSON_AddNumberToObject(o, "seed", (double)s->job->train.seed);
  cJSON_AddNumberToObject(o, "data_position_step", (double)s->step);
  cJSON *ls = cJSON_AddObjectToObject(o, "loss_scaler");
  cJSON_AddNumberToObject(ls, "scale", s->scaler.scale);
  cJSON_AddNumberToObject(ls, "clean_steps", (double)s->scaler.clean_steps);
  cJSON_AddNumberToObject(ls, "skipped", (double)s->scaler.skipped);
  cJSON *ts = cJSON_AddObjectToObject(o, "tensors");
  for (int i = 0; i < s->n; i++) {
    const struct snapshot_tensor *t = &s->tensors[i];
    const char *kinds[3] = {"", "optim.exp_avg.", "optim.exp_avg_sq."};
    for (int k = 0; k < 3; k++) {
      char name[200];
      snprintf(name, sizeof name, "%s%s", kinds[k], t->name);
      cJSON *e = cJSON_AddObjectToObject(ts, name);
      cJSON *sh = cJSON_AddArrayToObject(e, "shape");
      for (int d = 0; d < t->ndim; d++)
        cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)t->shape[d]));
      cJSON_AddStringToObject(e, "dtype", "F32");
      cJSON *pl = cJSON_AddArrayToObject(e, "placements");
      cJSON_AddItemToArray(pl, cJSON_CreateString("Replicate()"));
      cJSON_AddStringToObject(e, "file", file);
    }
  }
  char *text = cJSON_Print(o);
  cJSON_Delete(o);
  if (text == NULL)
    return MR_ENOMEM;
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", dir, MR_CKPT_INDEX);
  FILE *f = fopen(path, "w");
  int rc = 0;
  if (f == NULL || fputs(text, f) < 0 || fflush(f) != 0 || fsync(fileno(f)) != 0)
    rc = mr_error_set(MR_EIO, "%s: %s", path, strerror(errno));
  if (f != NULL)
    fclose(f);
  free(text);
  return rc;
}

/* The writer thread: files, fsync, checksums, then the report. */
static void *write_main(void *arg) {
  struct mr_ckpt_saver *s = arg;
  char dir[4096];
  mr_ckpt_step_dir(s->job->checkpoint.dir, s->step, dir, sizeof dir);
  int rc = mkdir_one(s->job->checkpoint.dir);
  if (rc == 0)
    rc = mkdir_one(dir);
  const char *names[2];
  char shas[2][65];
  const char *sha_ptrs[2] = {shas[0], shas[1]};
  int nfiles = 0;
  char file[64];
  snprintf(file, sizeof file, "rank-%d.safetensors", s->rank);
  if (rc == 0 && s->rank == 0) { /* replicated state: rank 0 holds it all */
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    struct mr_st_writer *w = NULL;
    rc = mr_st_writer_new(path, MR_ST_WRITE_FSYNC, &w);
    for (int i = 0; rc == 0 && i < s->n; i++) {
      const struct snapshot_tensor *t = &s->tensors[i];
      char mname[200], vname[200];
      snprintf(mname, sizeof mname, "optim.exp_avg.%s", t->name);
      snprintf(vname, sizeof vname, "optim.exp_avg_sq.%s", t->name);
      rc = mr_st_writer_add(w, t->name, MR_F32, t->ndim, t->shape, t->param);
      if (rc == 0)
        rc = mr_st_writer_add(w, mname, MR_F32, t->ndim, t->shape, t->m);
      if (rc == 0)
        rc = mr_st_writer_add(w, vname, MR_F32, t->ndim, t->shape, t->v);
    }
    if (rc == 0)
      rc = mr_st_writer_add_metadata(w, "format", MR_CKPT_FORMAT);
    if (rc == 0)
      rc = mr_st_writer_finish(w);
    mr_st_writer_free(w);
    if (rc == 0)
      rc = mr_sha256_file(path, shas[nfiles]);
    if (rc == 0)
      names[nfiles++] = file;
    int64_t delay = mr_tunable_int(MR_TUNABLE_TEST_CKPT_DELAY_MS);
    if (delay > 0) /* test hook: widen the window in which a save is half done */
      usleep((useconds_t)delay * 1000u);
    if (rc == 0)
      rc = write_index(s, dir, file);
    if (rc == 0) {
      char ip[4200];
      snprintf(ip, sizeof ip, "%s/%s", dir, MR_CKPT_INDEX);
      rc = mr_sha256_file(ip, shas[nfiles]);
      if (rc == 0)
        names[nfiles++] = MR_CKPT_INDEX;
    }
  }
  if (rc < 0) {
    snprintf(s->error, sizeof s->error, "%s", mr_error_message());
  } else if (s->reporter.checkpoint_written != NULL) {
    s->reporter.checkpoint_written(s->reporter.ctx, s->step, names, sha_ptrs, nfiles);
  }
  s->result = rc;
  return NULL;
}

int mr_ckpt_saver_wait(struct mr_ckpt_saver *s) {
  if (!s->in_flight)
    return 0;
  pthread_join(s->thread, NULL);
  s->in_flight = 0;
  if (s->result < 0)
    return mr_error_set(s->result, "checkpoint of step %lld: %s", (long long)s->step, s->error);
  return 0;
}

int mr_ckpt_save(struct mr_ckpt_saver *s, struct mr_trainer *t, int64_t step,
                 const struct mr_reporter *reporter) {
  MR_TRY(mr_ckpt_saver_wait(s));
  const struct mr_train_slot *slots;
  int n = mr_trainer_slots(t, &slots);
  MR_TRY(n);
  size_t total = 0;
  for (int i = 0; i < n; i++)
    total += 3 * (size_t)slots[i].numel;
  if (s->rank != 0)
    total = 0; /* replicated: only rank 0 keeps a copy */
  if (total > s->block_floats) {
    float *nb = realloc(s->block, total * sizeof(float));
    if (nb == NULL)
      return mr_error_set(MR_ENOMEM, "no memory for a checkpoint snapshot of %zu MiB",
                          total * 4 >> 20);
    s->block = nb;
    s->block_floats = total;
  }
  struct snapshot_tensor *ts = realloc(s->tensors, (size_t)(n > 0 ? n : 1) * sizeof *ts);
  if (ts == NULL)
    return MR_ENOMEM;
  s->tensors = ts;
  s->n = s->rank == 0 ? n : 0;
  float *p = s->block;
  for (int i = 0; i < s->n; i++) {
    struct snapshot_tensor *d = &ts[i];
    snprintf(d->name, sizeof d->name, "%s", slots[i].name);
    d->ndim = slots[i].ndim;
    memcpy(d->shape, slots[i].shape, (size_t)slots[i].ndim * sizeof(int64_t));
    d->numel = slots[i].numel;
    size_t bytes = (size_t)d->numel * sizeof(float);
    d->param = p;
    memcpy(p, slots[i].param, bytes);
    p += d->numel;
    d->m = p;
    memcpy(p, slots[i].m, bytes);
    p += d->numel;
    d->v = p;
    memcpy(p, slots[i].v, bytes);
    p += d->numel;
  }
  s->step = step;
  s->scaler = *mr_trainer_scaler(t);
  s->reporter = *reporter;
  s->error[0] = '\0';
  if (pthread_create(&s->thread, NULL, write_main, s) != 0)
    return mr_error_set(MR_ESYS, "cannot start the checkpoint writer");
  s->in_flight = 1;
  return 0;
}

void mr_ckpt_saver_free(struct mr_ckpt_saver *s) {
  if (s == NULL)
    return;
  mr_ckpt_saver_wait(s);
  free(s->block);
  free(s->tensors);
  free(s);
}

/* Reads the whole tensor `name` of f into dst, checking its shape. */
static int load_tensor(struct mr_st_file *f, const char *name, const struct mr_train_slot *slot,
                       float *dst) {
  const struct mr_st_tensor *t = mr_st_find(f, name);
  if (t == NULL)
    return mr_error_set(MR_EFORMAT, "%s: no tensor %s", mr_st_path(f), name);
  int same = t->rank == slot->ndim;
  for (int d = 0; same && d < t->rank; d++)
    same = t->shape[d] == slot->shape[d];
  if (!same)
    return mr_error_set(MR_EFORMAT, "%s: %s has another shape than this model's", mr_st_path(f),
                        name);
  return mr_st_read(f, t, MR_F32, dst);
}

int mr_ckpt_load(struct mr_trainer *t, const char *dir, int64_t *step) {
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", dir, MR_CKPT_INDEX);
  cJSON *ix;
  MR_TRY(mr_json_load(path, &ix));
  int rc = 0;
  const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(ix, "format");
  const cJSON *st = cJSON_GetObjectItemCaseSensitive(ix, "step");
  const cJSON *tensors = cJSON_GetObjectItemCaseSensitive(ix, "tensors");
  const cJSON *ls = cJSON_GetObjectItemCaseSensitive(ix, "loss_scaler");
  if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, MR_CKPT_FORMAT) != 0 ||
      !cJSON_IsNumber(st) || !cJSON_IsObject(tensors) || !cJSON_IsObject(ls)) {
    cJSON_Delete(ix);
    return mr_error_set(MR_EFORMAT, "%s: expected a %s index with step, tensors and loss_scaler",
                        path, MR_CKPT_FORMAT);
  }
  const struct mr_train_slot *slots;
  int n = mr_trainer_slots(t, &slots);
  struct mr_st_file *f = NULL;
  char open_name[256] = "";
  for (int i = 0; rc == 0 && i < n; i++) {
    const char *prefixes[3] = {"", "optim.exp_avg.", "optim.exp_avg_sq."};
    float *dst[3] = {slots[i].param, slots[i].m, slots[i].v};
    for (int k = 0; rc == 0 && k < 3; k++) {
      char name[200];
      snprintf(name, sizeof name, "%s%s", prefixes[k], slots[i].name);
      const cJSON *e = cJSON_GetObjectItemCaseSensitive(tensors, name);
      const cJSON *file = e != NULL ? cJSON_GetObjectItemCaseSensitive(e, "file") : NULL;
      if (!cJSON_IsString(file) || strchr(file->valuestring, '/') != NULL) {
        rc = mr_error_set(MR_EFORMAT, "%s: tensors.%s: missing, or no plain file name", path,
                          name);
        break;
      }
      if (strcmp(open_name, file->valuestring) != 0) {
        mr_st_free(f);
        f = NULL;
        char fp[4400];
        snprintf(fp, sizeof fp, "%s/%s", dir, file->valuestring);
        rc = mr_st_open(fp, &f);
        snprintf(open_name, sizeof open_name, "%s", rc == 0 ? file->valuestring : "");
      }
      if (rc == 0)
        rc = load_tensor(f, name, &slots[i], dst[k]);
    }
  }
  mr_st_free(f);
  if (rc == 0) {
    struct mr_loss_scaler *sc = mr_trainer_scaler(t);
    const cJSON *v;
    if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(ls, "scale")))
      sc->scale = v->valuedouble;
    if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(ls, "clean_steps")))
      sc->clean_steps = (int64_t)v->valuedouble;
    if (cJSON_IsNumber(v = cJSON_GetObjectItemCaseSensitive(ls, "skipped")))
      sc->skipped = (int64_t)v->valuedouble;
    *step = (int64_t)st->valuedouble;
  }
  cJSON_Delete(ix);
  return rc;
}
