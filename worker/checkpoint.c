/* checkpoint.c - saving and loading a rank's checkpoint pieces. */
#include "worker/checkpoint.h"
#include "worker/trace.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/ckpt.h"
#include "common/ckpt_read.h"
#include "common/error.h"
#include "common/file.h"
#include "common/jsonv.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "common/checksum.h"
#include "common/test_hooks.h"
#include "common/tunable.h"
#include "compiler/spmd/lower.h"
#include "worker/optim.h"

#define MR_CKPT_FORMAT "meshrun-checkpoint-2"

/* One stored piece of the snapshot. */
struct snapshot_piece {
  char name[200];
  int ndim;
  int64_t off[MR_CKPT_MAX_DIMS], len[MR_CKPT_MAX_DIMS]; // the box within the global tensor
  int64_t begin, count;          // the range of the box stored
  float *data;                   // into the snapshot block
};

/* The snapshot's copy, in pieces that two threads take in turn (host
 * memory to host memory: the CPU backend). */
#define PIECE_FLOATS ((size_t)4 << 20) /* 16 MiB */
#define MAX_COUNT (INT64_C(1) << 53) /* a whole number a JSON double holds exactly */

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

static void copy_pieces(struct snapshot_copy *c) {
  for (int i; (i = atomic_fetch_add(&c->next, 1)) < c->n;)
    memcpy(c->pieces[i].dst, c->pieces[i].src, c->pieces[i].n * sizeof(float));
}

static void *copy_main(void *arg) {
  copy_pieces(arg);
  return NULL;
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

struct mr_ckpt_saver {
  int rank, world_size;
  const struct mr_job *job;      // borrowed
  pthread_t thread;
  int in_flight;
  atomic_int written;            // the writer thread has set result
  int result;                    // of the last save
  char error[512];
  /* the snapshot being written */
  float *block;
  size_t block_floats;
  struct snapshot_piece *pieces;
  int n, cap;
  int64_t step;
  struct mr_loss_scaler scaler;
  struct mr_reporter reporter;
  char *index;                   // rank 0: index.json text
  struct copy_piece *copies;     // the snapshot's copy, cut in pieces
  int n_copies, cap_copies;
  struct mr_trace *trace;        // the writes on the timeline; NULL: none
  int trace_held;                // this write is on it (mr_trace_hold)
};

void mr_ckpt_saver_set_trace(struct mr_ckpt_saver *s, struct mr_trace *trace) {
  s->trace = trace;
}

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

/* index.json: what a reader needs besides the pieces. */
static char *index_text(const struct mr_ckpt_saver *s, const struct mr_lowered *L) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "format", MR_CKPT_FORMAT);
  cJSON_AddNumberToObject(o, "step", (double)s->step);
  cJSON_AddNumberToObject(o, "world_size", s->world_size);
  char lay[256];
  mr_lowered_format(L, lay, sizeof lay);
  cJSON_AddStringToObject(o, "layout", lay);
  cJSON *st = cJSON_AddObjectToObject(o, "strategy");
  cJSON_AddNumberToObject(st, "data_parallel.degree", L->lay.dp);
  cJSON_AddNumberToObject(st, "tensor_parallel.degree", L->lay.tp);
  cJSON_AddNumberToObject(st, "pipeline_parallel.degree", L->lay.pp);
  cJSON_AddNumberToObject(st, "pipeline_parallel.virtual_stages", L->lay.vp);
  cJSON_AddNumberToObject(st, "sharding.stage", L->lay.zero);
  cJSON_AddBoolToObject(st, "sequence_parallel.enable", L->lay.sp);
  char mesh[128];
  mr_mesh_format(&L->mesh, mesh, sizeof mesh);
  cJSON_AddStringToObject(o, "stage_mesh", mesh);
  cJSON_AddNumberToObject(o, "seed", (double)s->job->train.seed);
  cJSON_AddItemToObject(o, "model", mr_job_model_object(s->job));
  cJSON_AddNumberToObject(o, "data_position_step", (double)s->step);
  cJSON *ls = cJSON_AddObjectToObject(o, "loss_scaler");
  cJSON_AddNumberToObject(ls, "scale", s->scaler.scale);
  cJSON_AddNumberToObject(ls, "clean_steps", (double)s->scaler.clean_steps);
  cJSON_AddNumberToObject(ls, "skipped", (double)s->scaler.skipped);
  cJSON *ts = cJSON_AddObjectToObject(o, "tensors");
  const struct mr_graph *g = &L->model.graph;
  for (int t = 0; t < g->n_tensors; t++) {
    if (g->tensors[t].role != MR_ROLE_PARAM || g->tensors[t].grad < 0)
      continue;
    cJSON *e = cJSON_AddObjectToObject(ts, g->tensors[t].name);
    cJSON *sh = cJSON_AddArrayToObject(e, "shape");
    for (int d = 0; d < g->tensors[t].ndim; d++)
      cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)g->tensors[t].shape[d]));
    if (g->tensors[t].merged) { /* what an export writes */
      int64_t fs[MR_MAX_DIMS];
      int nd = mr_tensor_file_shape(&g->tensors[t], fs);
      cJSON *f = cJSON_AddArrayToObject(e, "file_shape");
      for (int d = 0; d < nd; d++)
        cJSON_AddItemToArray(f, cJSON_CreateNumber((double)fs[d]));
    }
    cJSON_AddStringToObject(e, "dtype", "F32");
    char pl[128];
    mr_dist_format(&L->dg.tensor[t], pl, sizeof pl);
    cJSON_AddStringToObject(e, "placements", pl);
  }
  char *text = cJSON_Print(o);
  cJSON_Delete(o);
  return text;
}

/* The writer thread: the rank's file, fsync, checksums, then the report. */
static void *write_main(void *arg) {
  struct mr_ckpt_saver *s = arg;
  int64_t t0 = mr_trace_now();
  size_t bytes = 0;
  char dir[4096];
  mr_ckpt_step_dir(s->job->checkpoint.dir, s->step, dir, sizeof dir);
  int rc = mkdir_one(s->job->checkpoint.dir);
  if (rc == 0)
    rc = mkdir_one(dir);
  const char *names[2];
  char shas[2][MR_CHECKSUM_HEX];
  const char *sha_ptrs[2] = {shas[0], shas[1]};
  int nfiles = 0;
  char file[64];
  snprintf(file, sizeof file, "rank-%d.safetensors", s->rank);
  if (rc == 0 && s->n > 0) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    struct mr_st_writer *w = NULL;
    cJSON *pieces = cJSON_CreateObject();
    rc = pieces ? mr_st_writer_new(path, MR_ST_WRITE_DIRECT | MR_ST_WRITE_CHECKSUM, &w)
                : MR_ENOMEM;
    if (rc == 0) /* its bytes, for the heartbeat (and a slow disk, for tests) */
      mr_st_writer_meter(w, s->reporter.checkpoint_bytes,
                         mr_hook_ckpt_bytes_per_s());
    for (int i = 0; rc == 0 && i < s->n; i++) {
      const struct snapshot_piece *p = &s->pieces[i];
      rc = mr_st_writer_add(w, p->name, MR_F32, 1, &p->count, p->data);
      bytes += (size_t)p->count * sizeof(float);
      char *pj = rc == 0 ? mr_ckpt_piece_json(p->ndim, p->off, p->len, p->begin, p->count)
                         : NULL;
      if (rc == 0 && pj == NULL)
        rc = MR_ENOMEM;
      if (rc == 0)
        cJSON_AddItemToObject(pieces, p->name, cJSON_Parse(pj));
      free(pj);
    }
    char *ptext = rc == 0 ? cJSON_PrintUnformatted(pieces) : NULL;
    if (rc == 0 && ptext == NULL)
      rc = MR_ENOMEM;
    if (rc == 0)
      rc = mr_st_writer_add_metadata(w, "format", MR_CKPT_FORMAT);
    if (rc == 0)
      rc = mr_st_writer_add_metadata(w, "pieces", ptext);
    if (rc == 0)
      rc = mr_st_writer_finish(w);
    if (rc == 0) /* hashed as it was written: no second read */
      rc = mr_st_writer_checksum(w, shas[nfiles]);
    free(ptext);
    cJSON_Delete(pieces);
    mr_st_writer_free(w);
    if (rc == 0)
      names[nfiles++] = file;
    mr_hook_ckpt_file_written(); /* a window in which a save is half done */
  }
  if (rc == 0 && s->index != NULL) {
    char ip[4200];
    snprintf(ip, sizeof ip, "%s/%s", dir, MR_CKPT_INDEX);
    rc = mr_file_write_text(ip, s->index, MR_FILE_DURABLE);
    if (rc == 0) { /* hashed from its text */
      mr_checksum_bytes(s->index, strlen(s->index), shas[nfiles]);
      names[nfiles++] = MR_CKPT_INDEX;
    }
  }
  if (rc < 0) {
    snprintf(s->error, sizeof s->error, "%s", mr_error_message());
  } else if (s->reporter.checkpoint_written != NULL) {
    s->reporter.checkpoint_written(s->reporter.ctx, s->step, names, sha_ptrs, nfiles);
  }
  if (s->trace_held) {
    char args[96];
    snprintf(args, sizeof args, "\"bytes\": %zu%s", bytes, rc < 0 ? ", \"failed\": true" : "");
    mr_trace_slice(s->trace, MR_TRACE_CHECKPOINT, "checkpoint", "checkpoint write", t0,
                   mr_trace_now(), args);
    mr_trace_release(s->trace);
  }
  s->result = rc;
  atomic_store(&s->written, 1);
  return NULL;
}

int mr_ckpt_saver_wait(struct mr_ckpt_saver *s) {
  if (!s->in_flight)
    return 0;
  /* the heartbeat says so: a long write is watched by its bytes, not
   * taken for a rank stuck in its own work */
  int tell = !atomic_load(&s->written) && s->reporter.checkpoint_wait != NULL;
  if (tell)
    s->reporter.checkpoint_wait(s->reporter.ctx, 1);
  pthread_join(s->thread, NULL);
  if (tell)
    s->reporter.checkpoint_wait(s->reporter.ctx, 0);
  s->in_flight = 0;
  if (s->result < 0)
    return mr_error_set(s->result, "checkpoint of step %lld: %s", (long long)s->step, s->error);
  return 0;
}

int mr_ckpt_saver_poll(struct mr_ckpt_saver *s) {
  if (s == NULL || !s->in_flight || !atomic_load(&s->written))
    return 0;
  return mr_ckpt_saver_wait(s);
}

/* Queues the copy of n floats from src (state of rt) to dst (the block):
 * on host memory in pieces for the two copying threads, else at once from
 * the device (on_host: the offloaded optimizer state, host memory on any
 * backend). */
static int queue_copy(struct mr_ckpt_saver *s, struct mr_runtime *rt, float *dst, const float *src,
                      size_t n, int on_host) {
  if (!on_host && !mr_runtime_host_memory(rt))
    return mr_runtime_to_host(rt, dst, src, n * sizeof(float));
  for (size_t at = 0; at < n; at += PIECE_FLOATS) {
    if (s->n_copies == s->cap_copies) {
      int cap = s->cap_copies ? 2 * s->cap_copies : 64;
      struct copy_piece *c = realloc(s->copies, (size_t)cap * sizeof *c);
      if (c == NULL)
        return MR_ENOMEM;
      s->copies = c;
      s->cap_copies = cap;
    }
    s->copies[s->n_copies++] = (struct copy_piece){
        .dst = dst + at, .src = src + at, .n = n - at < PIECE_FLOATS ? n - at : PIECE_FLOATS};
  }
  return 0;
}

/* Adds piece prefix + p's name, elements [begin, +count) of its local
 * tensor, at *at in the block (moved past it), and queues its copy from
 * src. */
static int add_piece(struct mr_ckpt_saver *s, struct mr_runtime *rt, const char *prefix,
                     const struct mr_rt_param *p, int64_t begin, int64_t count,
                     const float *src, int on_host, float **at) {
  if (s->n == s->cap) {
    int cap = s->cap ? 2 * s->cap : 64;
    struct snapshot_piece *np = realloc(s->pieces, (size_t)cap * sizeof *np);
    if (np == NULL)
      return MR_ENOMEM;
    s->pieces = np;
    s->cap = cap;
  }
  struct snapshot_piece *d = &s->pieces[s->n++];
  snprintf(d->name, sizeof d->name, "%s%s", prefix, p->name);
  d->ndim = p->ndim;
  for (int k = 0; k < p->ndim && k < MR_CKPT_MAX_DIMS; k++) {
    d->off[k] = p->goff[k];
    d->len[k] = p->glen[k];
  }
  d->begin = begin;
  d->count = count;
  d->data = *at;
  *at += count;
  return queue_copy(s, rt, d->data, src, (size_t)count, on_host);
}

int mr_ckpt_save(struct mr_ckpt_saver *s, struct mr_runtime *rt, int64_t step,
                 const struct mr_reporter *reporter) {
  MR_TRY(mr_ckpt_saver_wait(s));
  const struct mr_rt_param *ps;
  int n = mr_runtime_params(rt, &ps);
  MR_TRY(n);
  size_t total = 0;
  for (int i = 0; i < n; i++)
    total += (ps[i].keeps_param ? (size_t)ps[i].plen : 0) +
             (ps[i].keeps_state ? 2 * (size_t)ps[i].len : 0);
  if (total > s->block_floats) { /* kept for later saves */
    free(s->block);
    s->block_floats = 0;
    if ((s->block = block_alloc(total)) == NULL)
      return mr_error_set(MR_ENOMEM, "no memory for a checkpoint snapshot of %zu MiB",
                          total * 4 >> 20);
    s->block_floats = total;
  }
  s->n = 0;
  s->n_copies = 0;
  float *at = s->block;
  for (int i = 0; i < n; i++) {
    const struct mr_rt_param *p = &ps[i];
    if (p->keeps_param && p->plen > 0)
      MR_TRY(add_piece(s, rt, "", p, p->pbegin, p->plen, p->param, 0, &at));
    if (p->keeps_state && p->len > 0) {
      MR_TRY(add_piece(s, rt, "optim.exp_avg.", p, p->begin, p->len, p->m, p->state_on_host,
                       &at));
      MR_TRY(add_piece(s, rt, "optim.exp_avg_sq.", p, p->begin, p->len, p->v,
                       p->state_on_host, &at));
    }
  }
  /* Two threads copy: the training waits for the snapshot anyway, and one
   * core's copy does not use all of the memory's bandwidth. */
  struct snapshot_copy copy = {.pieces = s->copies, .n = s->n_copies};
  atomic_init(&copy.next, 0);
  pthread_t copier;
  int two = copy.n > 1 && pthread_create(&copier, NULL, copy_main, &copy) == 0;
  copy_pieces(&copy);
  if (two)
    pthread_join(copier, NULL);
  s->step = step;
  s->scaler = *mr_runtime_scaler(rt);
  s->reporter = *reporter;
  s->error[0] = '\0';
  free(s->index);
  s->index = NULL;
  if (s->rank == 0 && (s->index = index_text(s, mr_runtime_lowered(rt))) == NULL)
    return MR_ENOMEM;
  atomic_store(&s->written, 0);
  s->trace_held = mr_trace_hold(s->trace);
  if (pthread_create(&s->thread, NULL, write_main, s) != 0) {
    if (s->trace_held)
      mr_trace_release(s->trace);
    return mr_error_set(MR_ESYS, "cannot start the checkpoint writer");
  }
  s->in_flight = 1;
  return 0;
}

void mr_ckpt_saver_free(struct mr_ckpt_saver *s) {
  if (s == NULL)
    return;
  mr_ckpt_saver_wait(s);
  free(s->block);
  free(s->pieces);
  free(s->copies);
  free(s->index);
  free(s);
}

static int same_shape(const cJSON *sh, int ndim, const int64_t *shape) {
  int same = cJSON_IsArray(sh) && cJSON_GetArraySize(sh) == ndim;
  for (int d = 0; same && d < ndim; d++) {
    int64_t got;
    same = mr_json_count(cJSON_GetArrayItem(sh, d), MAX_COUNT, &got) && got == shape[d];
  }
  return same;
}

/* p's shape as files hold it (its last two dims merged when p->merged)
 * into fs[]; returns its rank. */
static int file_shape(const struct mr_rt_param *p, int64_t *fs) {
  memcpy(fs, p->shape, (size_t)p->ndim * sizeof *fs);
  if (!p->merged)
    return p->ndim;
  fs[p->ndim - 2] *= fs[p->ndim - 1];
  return p->ndim - 1;
}

/* Checks index tensor `name` has the model's shape; *merged: it has the
 * shape files give it instead (GPT-2's fused q|k|v, [C, 3C], as
 * checkpoints held it before it was held [C, 3, C]). */
static int check_shape(const char *path, const cJSON *tensors, const struct mr_rt_param *p,
                       int *merged) {
  const cJSON *e = cJSON_GetObjectItemCaseSensitive(tensors, p->name);
  const cJSON *sh = e ? cJSON_GetObjectItemCaseSensitive(e, "shape") : NULL;
  int64_t fs[MR_CKPT_MAX_DIMS];
  int fnd = file_shape(p, fs);
  *merged = p->merged && same_shape(sh, fnd, fs);
  if (e == NULL)
    return mr_error_set(MR_EFORMAT, "%s: no tensor %s", path, p->name);
  if (!*merged && !same_shape(sh, p->ndim, p->shape))
    return mr_error_set(MR_EFORMAT, "%s: %s has another shape than this model's", path, p->name);
  return 0;
}

/* Elements [begin, +count) of p's local box of tensor `name` into dst.  A
 * tensor the checkpoint holds merged is read whole in that shape (the
 * bytes are the same), and the box taken from it. */
static int read_box(struct mr_ckpt_reader *rd, const char *name, const struct mr_rt_param *p,
                    int merged, int64_t begin, int64_t count, float *dst) {
  if (!merged)
    return mr_ckpt_reader_read(rd, name, p->ndim, p->shape, p->goff, p->glen, begin, count, dst);
  int64_t fs[MR_CKPT_MAX_DIMS], off[MR_CKPT_MAX_DIMS] = {0}, all = 1;
  int fnd = file_shape(p, fs);
  for (int d = 0; d < fnd; d++)
    all *= fs[d];
  float *whole = malloc((size_t)(all + p->numel) * sizeof *whole);
  if (whole == NULL)
    return MR_ENOMEM;
  int rc = mr_ckpt_reader_read(rd, name, fnd, fs, off, fs, 0, all, whole);
  if (rc == 0) {
    mr_box_gather(p->ndim, p->shape, p->goff, p->glen, whole, whole + all);
    memcpy(dst, whole + all + begin, (size_t)count * sizeof *dst);
  }
  free(whole);
  return rc;
}

int mr_ckpt_load(struct mr_runtime *rt, const char *dir, int64_t *step) {
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", dir, MR_CKPT_INDEX);
  cJSON *ix;
  MR_TRY(mr_json_load(path, &ix));
  const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(ix, "format");
  const cJSON *st = cJSON_GetObjectItemCaseSensitive(ix, "step");
  const cJSON *tensors = cJSON_GetObjectItemCaseSensitive(ix, "tensors");
  const cJSON *ls = cJSON_GetObjectItemCaseSensitive(ix, "loss_scaler");
  int64_t step_at = 0, clean = 0, skipped = 0;
  const cJSON *scale = cJSON_GetObjectItemCaseSensitive(ls, "scale");
  if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, MR_CKPT_FORMAT) != 0 ||
      !mr_json_count(st, MAX_COUNT, &step_at) || !cJSON_IsObject(tensors) ||
      !cJSON_IsNumber(scale) || !(scale->valuedouble > 0 && isfinite(scale->valuedouble)) ||
      !mr_json_count(cJSON_GetObjectItemCaseSensitive(ls, "clean_steps"), MAX_COUNT, &clean) ||
      !mr_json_count(cJSON_GetObjectItemCaseSensitive(ls, "skipped"), MAX_COUNT, &skipped)) {
    cJSON_Delete(ix);
    return mr_error_set(MR_EFORMAT, "%s: expected a %s index with step (a whole number), tensors and "
                        "loss_scaler {scale > 0, clean_steps, skipped}",
                        path, MR_CKPT_FORMAT);
  }
  struct mr_ckpt_reader *rd = NULL;
  const struct mr_rt_param *ps;
  float *host = NULL;
  int n = mr_runtime_params(rt, &ps), rc = n < 0 ? n : 0;
  int64_t most = 1;
  for (int i = 0; i < n; i++)
    most = ps[i].numel > most ? ps[i].numel : most;
  if (rc == 0 && (host = malloc((size_t)most * sizeof *host)) == NULL)
    rc = MR_ENOMEM;
  if (rc == 0)
    rc = mr_ckpt_reader_open(dir, &rd);
  for (int i = 0; rc == 0 && i < n; i++) {
    const struct mr_rt_param *p = &ps[i];
    int merged;
    MR_TRY_GOTO(rc, check_shape(path, tensors, p, &merged), out);
    char name[200];
    if (p->plen > 0) {
      MR_TRY_GOTO(rc, read_box(rd, p->name, p, merged, p->pbegin, p->plen, host), out);
      MR_TRY_GOTO(rc, mr_runtime_to_device(rt, p->param, host, (size_t)p->plen * 4), out);
    }
    const char *prefixes[2] = {"optim.exp_avg.", "optim.exp_avg_sq."};
    float *dst[2] = {p->m, p->v};
    for (int k = 0; k < 2 && p->len > 0; k++) {
      snprintf(name, sizeof name, "%s%s", prefixes[k], p->name);
      MR_TRY_GOTO(rc, read_box(rd, name, p, merged, p->begin, p->len, host), out);
      if (p->state_on_host)
        memcpy(dst[k], host, (size_t)p->len * 4);
      else
        MR_TRY_GOTO(rc, mr_runtime_to_device(rt, dst[k], host, (size_t)p->len * 4), out);
    }
  }
  if (rc == 0) {
    struct mr_loss_scaler *sc = mr_runtime_scaler(rt);
    sc->scale = scale->valuedouble;
    sc->clean_steps = clean;
    sc->skipped = skipped;
    *step = step_at;
  }
out:
  mr_ckpt_reader_free(rd);
  free(host);
  cJSON_Delete(ix);
  return rc;
}
