/* checkpoint.c - saving and loading a rank's checkpoint shards. */
#include "worker/checkpoint.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/ckpt.h"
#include "common/error.h"
#include "common/jsonv.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "common/sha256.h"
#include "common/tunable.h"
#include "worker/optim.h"

#define MR_CKPT_FORMAT "meshrun-checkpoint-1"

struct snapshot_tensor {
  char name[160];
  int ndim;
  int64_t shape[4];
  int64_t numel;
  int64_t shard_begin, shard_len;
  float *param;            // into the snapshot block; NULL on ranks > 0
  float *m, *v;            // this rank's shard of the moments
};

/* The snapshot's copy, in pieces that two threads take in turn. */
#define PIECE_FLOATS ((size_t)4 << 20) /* 16 MiB */

struct copy_piece {
  float *dst;
  const float *src;
  size_t n; // floats
};

struct snapshot_copy {
  struct copy_piece *pieces; // borrowed from the saver
  int n;
  atomic_int next;           // the next piece to take
};

/* Appends the copy of n floats from src to dst, cut into pieces. */
static void add_pieces(struct snapshot_copy *c, float *dst, const float *src, size_t n) {
  for (size_t at = 0; at < n; at += PIECE_FLOATS)
    c->pieces[c->n++] = (struct copy_piece){
        .dst = dst + at, .src = src + at, .n = n - at < PIECE_FLOATS ? n - at : PIECE_FLOATS};
}

static void copy_pieces(struct snapshot_copy *c) {
  for (int i; (i = atomic_fetch_add(&c->next, 1)) < c->n;)
    memcpy(c->pieces[i].dst, c->pieces[i].src, c->pieces[i].n * sizeof(float));
}

static void *copy_main(void *arg) {
  copy_pieces(arg);
  return NULL;
}

struct mr_ckpt_saver {
  int rank, world_size;
  int zero;                  // moments sharded over the ranks
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
  struct copy_piece *pieces; // scratch for the copy
  size_t pieces_cap;
  int64_t step;
  struct mr_loss_scaler scaler;
  struct mr_reporter reporter;
};

int mr_ckpt_saver_new(int rank, int world_size, int zero, const struct mr_job *job,
                      struct mr_ckpt_saver **out) {
  struct mr_ckpt_saver *s = calloc(1, sizeof *s);
  if (s == NULL)
    return MR_ENOMEM;
  s->zero = zero && world_size > 1;
  s->rank = rank;
  s->world_size = world_size;
  s->job = job;
  *out = s;
  return 0;
}

/* A snapshot block of n floats (free it with free): 2 MiB-aligned and
 * backed by huge pages where the kernel allows, so the first save's page
 * faults are a few hundred instead of a few hundred thousand, and the copy
 * makes fewer TLB misses.  NULL when out of memory. */
static float *block_alloc(size_t n) {
  const size_t huge = 2u << 20;
  void *p;
  if (posix_memalign(&p, huge, n * sizeof(float)) != 0)
    return NULL;
  (void)madvise(p, n * sizeof(float), MADV_HUGEPAGE); /* advice: may be ignored */
  return p;
}

static int mkdir_one(const char *path) {
  if (mkdir(path, 0755) != 0 && errno != EEXIST)
    return mr_error_set(MR_EIO, "mkdir %s: %s", path, strerror(errno));
  return 0;
}

/* Writes dir/index.json durably; its SHA-256 into sha, hashed from the text
 * written rather than read back. */
static int write_index(struct mr_ckpt_saver *s, const char *dir, const char *file,
                       char sha[65]) {
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
  char *model = mr_model_config_to_json(&s->job->model);
  cJSON_AddItemToObject(o, "model", model != NULL ? cJSON_Parse(model) : cJSON_CreateNull());
  free(model);
  cJSON_AddNumberToObject(o, "data_position_step", (double)s->step);
  cJSON *ls = cJSON_AddObjectToObject(o, "loss_scaler");
  cJSON_AddNumberToObject(ls, "scale", s->scaler.scale);
  cJSON_AddNumberToObject(ls, "clean_steps", (double)s->scaler.clean_steps);
  cJSON_AddNumberToObject(ls, "skipped", (double)s->scaler.skipped);
  cJSON *ts = cJSON_AddObjectToObject(o, "tensors");
  for (int i = 0; i < s->n; i++) {
    const struct snapshot_tensor *t = &s->tensors[i];
    cJSON *e = cJSON_AddObjectToObject(ts, t->name);
    cJSON *sh = cJSON_AddArrayToObject(e, "shape");
    for (int d = 0; d < t->ndim; d++)
      cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)t->shape[d]));
    cJSON_AddStringToObject(e, "dtype", "F32");
    cJSON *pl = cJSON_AddArrayToObject(e, "placements");
    cJSON_AddItemToArray(pl, cJSON_CreateString("Replicate()"));
    cJSON_AddStringToObject(e, "file", file);
    const char *kinds[2] = {"optim.exp_avg.", "optim.exp_avg_sq."};
    for (int k = 0; k < 2; k++) {
      char name[200];
      snprintf(name, sizeof name, "%s%s", kinds[k], t->name);
      cJSON *oe = cJSON_AddObjectToObject(ts, name);
      cJSON *osh = cJSON_AddArrayToObject(oe, "shape");
      for (int d = 0; d < t->ndim; d++)
        cJSON_AddItemToArray(osh, cJSON_CreateNumber((double)t->shape[d]));
      cJSON_AddStringToObject(oe, "dtype", "F32");
      cJSON *opl = cJSON_AddArrayToObject(oe, "placements");
      cJSON_AddItemToArray(opl, cJSON_CreateString(s->zero ? "Shard(0) of the flattened tensor"
                                                            : "Replicate()"));
      cJSON *pieces = cJSON_AddArrayToObject(oe, "pieces");
      int ranks = s->zero ? s->world_size : 1;
      int64_t block = (t->numel + ranks - 1) / ranks;
      for (int r = 0; r < ranks; r++) {
        int64_t b = block * r, len = t->numel - b < block ? t->numel - b : block;
        if (len <= 0)
          continue;
        char rf[64];
        snprintf(rf, sizeof rf, "rank-%d.safetensors", r);
        cJSON *pc = cJSON_CreateObject();
        cJSON_AddStringToObject(pc, "file", rf);
        cJSON_AddNumberToObject(pc, "begin", (double)b);
        cJSON_AddNumberToObject(pc, "len", (double)len);
        cJSON_AddItemToArray(pieces, pc);
      }
    }
  }
  char *text = cJSON_Print(o);
  cJSON_Delete(o);
  if (text == NULL)
    return MR_ENOMEM;
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", dir, MR_CKPT_INDEX);
  struct mr_sha256 h;
  mr_sha256_init(&h);
  mr_sha256_update(&h, text, strlen(text));
  mr_sha256_final(&h, sha);
  FILE *f = fopen(path, "w");
  int rc = 0;
  if (f == NULL || fputs(text, f) < 0 || fflush(f) != 0 || fsync(fileno(f)) != 0)
    rc = mr_error_set(MR_EIO, "%s: %s", path, strerror(errno));
  if (f != NULL && fclose(f) != 0 && rc == 0)
    rc = mr_error_set(MR_EIO, "%s: %s", path, strerror(errno));
  free(text);
  return rc;
}

/* The writer thread: files, fsync, checksums, then the report.  Each file
 * is hashed from the bytes as they are written (never read back) and
 * written past the page cache by a second thread while this one hashes the
 * next piece (see mr_st_writer_new), so hashing overlaps the disk.  It runs
 * at the training's priority: a lower one (nice 10, 19) cost a CPU-bound
 * training no less time per save, measured, and made saves take 5 to 15
 * times as long to become durable (docs/PERFORMANCE.md, "Checkpoints"). */
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
  int has_data = s->rank == 0;
  for (int i = 0; i < s->n && !has_data; i++)
    has_data = s->tensors[i].shard_len > 0;
  if (rc == 0 && has_data) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    struct mr_st_writer *w = NULL;
    rc = mr_st_writer_new(path, MR_ST_WRITE_DIRECT | MR_ST_WRITE_SHA256, &w);
    for (int i = 0; rc == 0 && i < s->n; i++) {
      const struct snapshot_tensor *t = &s->tensors[i];
      char mname[200], vname[200];
      snprintf(mname, sizeof mname, "optim.exp_avg.%s", t->name);
      snprintf(vname, sizeof vname, "optim.exp_avg_sq.%s", t->name);
      if (t->param != NULL)
        rc = mr_st_writer_add(w, t->name, MR_F32, t->ndim, t->shape, t->param);
      if (rc == 0 && t->shard_len > 0) {
        rc = mr_st_writer_add(w, mname, MR_F32, 1, &t->shard_len, t->m);
        if (rc == 0)
          rc = mr_st_writer_add(w, vname, MR_F32, 1, &t->shard_len, t->v);
      }
    }
    if (rc == 0)
      rc = mr_st_writer_add_metadata(w, "format", MR_CKPT_FORMAT);
    if (rc == 0)
      rc = mr_st_writer_finish(w);
    if (rc == 0)
      rc = mr_st_writer_sha256(w, shas[nfiles]);
    mr_st_writer_free(w);
    if (rc == 0)
      names[nfiles++] = file;
    int64_t delay = mr_tunable_int(MR_TUNABLE_TEST_CKPT_DELAY_MS);
    if (delay > 0) /* test hook: widen the window in which a save is half done */
      usleep((useconds_t)delay * 1000u);
  }
  if (rc == 0 && s->rank == 0) {
    rc = write_index(s, dir, file, shas[nfiles]);
    if (rc == 0)
      names[nfiles++] = MR_CKPT_INDEX;
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
  if (!s->zero && s->rank != 0)
    n = 0; /* replicated state: rank 0 writes it all */
  size_t total = 0;
  for (int i = 0; i < n; i++)
    total += (s->rank == 0 ? (size_t)slots[i].numel : 0) + 2 * (size_t)slots[i].shard_len;
  if (total > s->block_floats) {
    free(s->block);
    s->block = block_alloc(total);
    s->block_floats = s->block != NULL ? total : 0;
    if (s->block == NULL)
      return mr_error_set(MR_ENOMEM, "no memory for a checkpoint snapshot of %zu MiB",
                          total * 4 >> 20);
  }
  struct snapshot_tensor *ts = realloc(s->tensors, (size_t)(n > 0 ? n : 1) * sizeof *ts);
  if (ts == NULL)
    return MR_ENOMEM;
  s->tensors = ts;
  s->n = n;
  size_t max_pieces = 0;
  for (int i = 0; i < n; i++)
    max_pieces += 3 + ((size_t)slots[i].numel + 2 * (size_t)slots[i].shard_len) / PIECE_FLOATS;
  if (max_pieces > s->pieces_cap) {
    struct copy_piece *np = realloc(s->pieces, max_pieces * sizeof *np);
    if (np == NULL)
      return MR_ENOMEM;
    s->pieces = np;
    s->pieces_cap = max_pieces;
  }
  struct snapshot_copy copy = {.pieces = s->pieces, .n = 0};
  float *p = s->block;
  for (int i = 0; i < n; i++) {
    struct snapshot_tensor *d = &ts[i];
    snprintf(d->name, sizeof d->name, "%s", slots[i].name);
    d->ndim = slots[i].ndim;
    memcpy(d->shape, slots[i].shape, (size_t)slots[i].ndim * sizeof(int64_t));
    d->numel = slots[i].numel;
    d->shard_begin = slots[i].shard_begin;
    d->shard_len = slots[i].shard_len;
    d->param = NULL;
    if (s->rank == 0) {
      d->param = p;
      add_pieces(&copy, p, slots[i].param, (size_t)d->numel);
      p += d->numel;
    }
    d->m = p;
    add_pieces(&copy, p, slots[i].m, (size_t)d->shard_len);
    p += d->shard_len;
    d->v = p;
    add_pieces(&copy, p, slots[i].v, (size_t)d->shard_len);
    p += d->shard_len;
  }
  /* Two threads copy: the training waits for the snapshot anyway, and one
   * core's copy does not use all of the memory's bandwidth. */
  pthread_t copier;
  int two = copy.n > 1 && pthread_create(&copier, NULL, copy_main, &copy) == 0;
  copy_pieces(&copy);
  if (two)
    pthread_join(copier, NULL);
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
  free(s->pieces);
  free(s);
}

/* An open file of the checkpoint, by name (a few at most per load). */
struct open_files {
  char names[8][64];
  struct mr_st_file *f[8];
  int n;
};

static int file_get(struct open_files *of, const char *dir, const char *name,
                    struct mr_st_file **out) {
  for (int i = 0; i < of->n; i++)
    if (strcmp(of->names[i], name) == 0) {
      *out = of->f[i];
      return 0;
    }
  if (strchr(name, '/') != NULL || strlen(name) >= sizeof of->names[0])
    return mr_error_set(MR_EFORMAT, "%s: file name \"%s\" is not a plain name", dir, name);
  if (of->n == 8) { /* keep the set small: drop the oldest */
    mr_st_free(of->f[0]);
    memmove(of->names[0], of->names[1], 7 * sizeof of->names[0]);
    memmove(of->f, of->f + 1, 7 * sizeof of->f[0]);
    of->n--;
  }
  char path[4400];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  MR_TRY(mr_st_open(path, &of->f[of->n]));
  snprintf(of->names[of->n], sizeof of->names[0], "%s", name);
  *out = of->f[of->n++];
  return 0;
}

static void files_close(struct open_files *of) {
  for (int i = 0; i < of->n; i++)
    mr_st_free(of->f[i]);
  of->n = 0;
}

/* The parameter itself: whole, checked against the model's shape. */
static int load_param(struct open_files *of, const char *dir, const cJSON *e,
                      const struct mr_train_slot *slot) {
  const cJSON *file = cJSON_GetObjectItemCaseSensitive(e, "file");
  if (!cJSON_IsString(file))
    return mr_error_set(MR_EFORMAT, "%s/index.json: tensors.%s.file: expected a file name", dir,
                        slot->name);
  struct mr_st_file *f;
  MR_TRY(file_get(of, dir, file->valuestring, &f));
  const struct mr_st_tensor *t = mr_st_find(f, slot->name);
  if (t == NULL)
    return mr_error_set(MR_EFORMAT, "%s: no tensor %s", mr_st_path(f), slot->name);
  int same = t->rank == slot->ndim;
  for (int d = 0; same && d < t->rank; d++)
    same = t->shape[d] == slot->shape[d];
  if (!same)
    return mr_error_set(MR_EFORMAT, "%s: %s has another shape than this model's", mr_st_path(f),
                        slot->name);
  return mr_st_read(f, t, MR_F32, slot->param);
}

/* Elements [begin, begin + len) of a flattened moment, gathered from the
 * pieces that overlap them: the reshard of a 1-D shard on load. */
static int load_range(struct open_files *of, const char *dir, const char *name, const cJSON *e,
                      int64_t numel, int64_t begin, int64_t len, float *dst) {
  const cJSON *pieces = cJSON_GetObjectItemCaseSensitive(e, "pieces");
  if (!cJSON_IsArray(pieces))
    return mr_error_set(MR_EFORMAT, "%s/index.json: tensors.%s.pieces: expected an array", dir,
                        name);
  int64_t covered = 0;
  const cJSON *pc;
  cJSON_ArrayForEach(pc, pieces) {
    const cJSON *file = cJSON_GetObjectItemCaseSensitive(pc, "file");
    const cJSON *pb = cJSON_GetObjectItemCaseSensitive(pc, "begin");
    const cJSON *pl = cJSON_GetObjectItemCaseSensitive(pc, "len");
    if (!cJSON_IsString(file) || !cJSON_IsNumber(pb) || !cJSON_IsNumber(pl))
      return mr_error_set(MR_EFORMAT, "%s/index.json: tensors.%s.pieces: expected {file, begin, len}",
                          dir, name);
    int64_t b = (int64_t)pb->valuedouble, l = (int64_t)pl->valuedouble;
    if (b < 0 || l < 0 || b + l > numel)
      return mr_error_set(MR_EFORMAT, "%s/index.json: tensors.%s: a piece lies outside the tensor",
                          dir, name);
    int64_t lo = b > begin ? b : begin;
    int64_t hi = b + l < begin + len ? b + l : begin + len;
    if (lo >= hi)
      continue;
    struct mr_st_file *f;
    MR_TRY(file_get(of, dir, file->valuestring, &f));
    const struct mr_st_tensor *t = mr_st_find(f, name);
    if (t == NULL || t->rank != 1 || t->shape[0] != l)
      return mr_error_set(MR_EFORMAT, "%s: %s: expected a 1-D piece of %lld elements",
                          mr_st_path(f), name, (long long)l);
    int64_t start = lo - b, count = hi - lo;
    MR_TRY(mr_st_read_slice(f, t, &start, &count, MR_F32, dst + (lo - begin)));
    covered += count;
  }
  if (covered != len)
    return mr_error_set(MR_EFORMAT, "%s/index.json: tensors.%s: the pieces cover %lld of the %lld "
                        "elements needed", dir, name, (long long)covered, (long long)len);
  return 0;
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
  struct open_files of = {.n = 0};
  for (int i = 0; rc == 0 && i < n; i++) {
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(tensors, slots[i].name);
    if (e == NULL) {
      rc = mr_error_set(MR_EFORMAT, "%s: no tensor %s", path, slots[i].name);
      break;
    }
    rc = load_param(&of, dir, e, &slots[i]);
    const char *prefixes[2] = {"optim.exp_avg.", "optim.exp_avg_sq."};
    float *dst[2] = {slots[i].m, slots[i].v};
    for (int k = 0; rc == 0 && k < 2; k++) {
      char name[200];
      snprintf(name, sizeof name, "%s%s", prefixes[k], slots[i].name);
      const cJSON *oe = cJSON_GetObjectItemCaseSensitive(tensors, name);
      if (oe == NULL) {
        rc = mr_error_set(MR_EFORMAT, "%s: no tensor %s", path, name);
        break;
      }
      if (slots[i].shard_len > 0)
        rc = load_range(&of, dir, name, oe, slots[i].numel, slots[i].shard_begin,
                        slots[i].shard_len, dst[k]);
    }
  }
  files_close(&of);
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
