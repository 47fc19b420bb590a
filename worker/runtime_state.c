/* runtime_state.c - a rank's parameters in and out: the first values,
 * their views for checkpoints, the final weights. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/discovery.h"
#include "common/error.h"
#include "compiler/ops.h"
#include "common/rng.h"
#include "common/safetensors.h"
#include "common/tunable.h"
#include "worker/runtime_internal.h"
#include "worker/weights.h"

/* ---- initialization ---- */

/* Threads that draw the first weights: the host's cores shared among its
 * ranks (LOCAL_WORLD_SIZE, as the launcher and torchrun set it), at least
 * the rank's compute threads.  A GPU rank's host cores are otherwise idle
 * while it starts; drawn serially, a 1.1B model took 38 s. */
static int init_threads(void) {
  const char *lw = getenv("LOCAL_WORLD_SIZE");
  int local = lw != NULL ? atoi(lw) : 1;
  int n = mr_cpu_cores() / (local > 0 ? local : 1);
  int t = (int)mr_tunable_int(MR_TUNABLE_THREADS);
  if (n < t)
    n = t;
  return n < 1 ? 1 : n > 64 ? 64 : n;
}

/* Fills the local shard of parameter i from the seeded initializer: element
 * by element the same global values whatever the sharding, drawn over the
 * threads (a shard of columns too). */
static void init_param(struct mr_runtime *rt, const struct mr_param_plan *pp, float *dst,
                       int threads) {
  const struct mr_tensor *t = &rt->L->model.graph.tensors[pp->tensor];
  if (t->init == MR_INIT_NORMAL) {
    mr_rng_normal_fill_box(threads, rt->job->train.seed, mr_hash_str(t->name), t->ndim,
                           t->shape, pp->goff, pp->glen, 0.0f,
                           (float)rt->job->model.initializer_range, dst);
    return;
  }
  int64_t n = 1;
  for (int d = 0; d < t->ndim; d++)
    n *= pp->glen[d];
  for (int64_t c = 0; c < n; c++)
    dst[c] = t->init == MR_INIT_ONES ? 1.0f : 0.0f;
}

static int load_param(struct mr_runtime *rt, struct mr_weights_src *src,
                      const struct mr_param_plan *pp, float *dst) {
  const struct mr_tensor *t = &rt->L->model.graph.tensors[pp->tensor];
  const struct mr_st_tensor *s;
  struct mr_st_file *f;
  MR_TRY(mr_weights_src_find(src, t->name, &s, &f));
  if (!mr_weights_file_matches(s, t))
    return mr_error_set(MR_EFORMAT, "%s: tensor %s: shape does not match the model config",
                        mr_st_path(f), t->name);
  struct mr_st_tensor held = *s; /* the same bytes in the model's shape */
  held.rank = t->ndim;
  memcpy(held.shape, t->shape, (size_t)t->ndim * sizeof *t->shape);
  return mr_st_read_slice(f, &held, pp->goff, pp->glen, MR_F32, dst);
}

/* The parameters' first values, through a host buffer. */
int mr__rt_init_params(struct mr_runtime *rt) {
  const char *init = rt->job->train.init;
  struct mr_weights_src src, *f = NULL;
  if (init != NULL && strcmp(init, "random") != 0) {
    MR_TRY(mr_weights_src_open(init, &src));
    f = &src;
  }
  int rc = 0;
  int threads = init_threads();
  const struct mr_layout *lay = &rt->L->lay;
  for (int i = 0; i < rt->p.n_params && rc == 0; i++) {
    const struct mr_param_plan *pp = &rt->p.params[i];
    float *host = calloc((size_t)(pp->block * lay->dp > pp->numel ? pp->block * lay->dp
                                                                  : pp->numel) + 1,
                         sizeof *host);
    if (!host) {
      rc = MR_ENOMEM;
      break;
    }
    if (f != NULL)
      rc = load_param(rt, f, pp, host);
    else
      init_param(rt, pp, host, threads);
    if (rc == 0) {
      char *dst = rt->param + pp->store_offset;
      if (lay->zero >= 3) /* only this rank's block */
        rc = rt->be->ops->copy(rt->be, NULL, dst, host + pp->begin, (size_t)pp->len * 4,
                               MR_COPY_HOST_TO_DEVICE);
      else
        rc = rt->be->ops->copy(rt->be, NULL, dst, host, (size_t)pp->numel * 4,
                               MR_COPY_HOST_TO_DEVICE);
    }
    free(host);
  }
  if (f)
    mr_weights_src_close(f);
  return rc;
}

/* One copy of each shard along the model dim: model coordinate 0 unless
 * the parameter is split over model. */
int mr__rt_writes_model(const struct mr_runtime *rt, const struct mr_param_plan *pp) {
  const struct mr_lowered *L = rt->L;
  return L->model_dim < 0 || L->dg.tensor[pp->tensor].p[L->model_dim].kind == MR_SHARD ||
         rt->p.model == 0;
}

int mr_runtime_host_memory(const struct mr_runtime *rt) {
  return rt->be->ops->registry == MR_BACKEND_CPU;
}

int mr_runtime_to_host(struct mr_runtime *rt, void *host, const void *dev, size_t bytes) {
  return rt->be->ops->copy(rt->be, NULL, host, dev, bytes, MR_COPY_DEVICE_TO_HOST);
}

int mr_runtime_to_device(struct mr_runtime *rt, void *dev, const void *host, size_t bytes) {
  return rt->be->ops->copy(rt->be, NULL, dev, host, bytes, MR_COPY_HOST_TO_DEVICE);
}

const struct mr_lowered *mr_runtime_lowered(const struct mr_runtime *rt) { return rt->L; }

int mr_runtime_params(struct mr_runtime *rt, const struct mr_rt_param **out) {
  const struct mr_rank_program *p = &rt->p;
  if (rt->views == NULL) {
    rt->views = calloc((size_t)(p->n_params > 0 ? p->n_params : 1), sizeof *rt->views);
    if (!rt->views)
      return MR_ENOMEM;
    const struct mr_graph *g = &rt->L->model.graph;
    for (int i = 0; i < p->n_params; i++) {
      const struct mr_param_plan *pp = &p->params[i];
      const struct mr_tensor *t = &g->tensors[pp->tensor];
      float *m = (float *)(rt->optim + pp->state_offset);
      int z3 = rt->L->lay.zero >= 3, model_ok = mr__rt_writes_model(rt, pp);
      rt->views[i] = (struct mr_rt_param){
          .name = t->name, .ndim = t->ndim, .shape = t->shape, .goff = pp->goff,
          .glen = pp->glen, .numel = pp->numel, .param = (float *)(rt->param + pp->store_offset),
          .pbegin = z3 ? pp->begin : 0, .plen = z3 ? pp->len : pp->numel, .m = m,
          .v = (float *)((char *)m + mr_param_moment_stride(pp)), .begin = pp->begin,
          .len = pp->replica_of >= 0 ? 0 : pp->len,
          .state_on_host = rt->offload_host,
          .keeps_param = model_ok && (z3 || rt->p.data == 0) && pp->replica_of < 0,
          .keeps_state = model_ok && (rt->L->lay.zero >= 1 || rt->p.data == 0),
          .merged = t->merged};
    }
  }
  *out = rt->views;
  return rt->p.n_params;
}

/* ---- final weights ---- */

/* Whether this rank writes parameter i's local tensor: one copy of each
 * distinct shard (data coordinate 0, and model coordinate 0 unless the
 * parameter is split over model). */
static int writes_param(const struct mr_runtime *rt, const struct mr_param_plan *pp) {
  return rt->p.data == 0 && pp->replica_of < 0 && mr__rt_writes_model(rt, pp);
}

static int write_part(struct mr_runtime *rt, const char *path) {
  const struct mr_layout *lay = &rt->L->lay;
  struct mr_st_writer *w = NULL;
  cJSON *pieces = cJSON_CreateObject();
  float *host = NULL, *dev = NULL;
  int64_t max = 0, total = 0;
  for (int i = 0; i < rt->p.n_params; i++) {
    if (rt->p.params[i].block * lay->dp > max)
      max = rt->p.params[i].block * lay->dp;
    total += rt->p.params[i].numel;
  }
  int rc = MR_ENOMEM;
  /* the writer keeps pointers until it finishes: one buffer for all */
  host = malloc((size_t)(total + 1) * sizeof *host);
  float *at = host;
  if (!pieces || !host)
    goto out;
  if (lay->zero >= 3)
    MR_TRY_GOTO(rc, rt->be->ops->alloc(rt->be, (size_t)(max + 1) * 4, (void **)&dev), out);
  MR_TRY_GOTO(rc, mr_st_writer_new(path, 0, &w), out);
  for (int i = 0; i < rt->p.n_params; i++) {
    const struct mr_param_plan *pp = &rt->p.params[i];
    const char *src = rt->param + pp->store_offset;
    if (lay->zero >= 3) { /* every data rank takes part in the gather */
      struct mr_comm_req *req;
      if (rt->data_g != NULL) {
        MR_TRY_GOTO(rc, mr_comm_all_gather(rt->data_g, src, dev, (size_t)pp->block, NULL, MR_F32,
                                           &req), out);
        MR_TRY_GOTO(rc, mr_comm_wait(req), out);
        src = (const char *)dev;
      }
    }
    if (!writes_param(rt, pp))
      continue;
    MR_TRY_GOTO(rc, rt->be->ops->copy(rt->be, NULL, at, src, (size_t)pp->numel * 4,
                                      MR_COPY_DEVICE_TO_HOST), out);
    const struct mr_tensor *t = &rt->L->model.graph.tensors[pp->tensor];
    MR_TRY_GOTO(rc, mr_st_writer_add(w, t->name, MR_F32, 1, &pp->numel, at), out);
    at += pp->numel;
    cJSON *a = cJSON_AddArrayToObject(pieces, t->name);
    for (int d = 0; d < t->ndim; d++)
      cJSON_AddItemToArray(a, cJSON_CreateNumber((double)pp->goff[d]));
    for (int d = 0; d < t->ndim; d++)
      cJSON_AddItemToArray(a, cJSON_CreateNumber((double)pp->glen[d]));
  }
  char *text = cJSON_PrintUnformatted(pieces);
  rc = text ? mr_st_writer_add_metadata(w, "pieces", text) : MR_ENOMEM;
  free(text);
  if (rc == 0)
    rc = mr_st_writer_finish(w);
out:
  mr_st_writer_free(w);
  cJSON_Delete(pieces);
  free(host);
  if (dev)
    rt->be->ops->free(rt->be, dev);
  return rc;
}

/* path.part-R: rank R's part of the final weights. */
static void part_path(const char *path, int rank, char *buf, size_t n) {
  snprintf(buf, n, "%s.part-%d", path, rank);
}

/* Rank 0: every part's pieces placed into whole tensors, written as one
 * file. */
static int merge_parts(struct mr_runtime *rt, const char *path) {
  const struct mr_graph *g = &rt->L->model.graph;
  int world = rt->L->lay.world, rc = 0;
  struct mr_st_file **parts = calloc((size_t)world, sizeof *parts);
  float **full = calloc((size_t)g->n_tensors, sizeof *full);
  if (!parts || !full) {
    rc = MR_ENOMEM;
    goto out;
  }
  for (int r = 0; r < world && rc == 0; r++) {
    char pp[4200];
    part_path(path, r, pp, sizeof pp);
    if (access(pp, F_OK) == 0)
      rc = mr_st_open(pp, &parts[r]);
  }
  for (int t = 0; t < g->n_tensors && rc == 0; t++) {
    if (g->tensors[t].role != MR_ROLE_PARAM)
      continue;
    const struct mr_tensor *tt = &g->tensors[t];
    if (!(full[t] = calloc((size_t)mr_tensor_numel(tt), sizeof(float)))) {
      rc = MR_ENOMEM;
      break;
    }
    for (int r = 0; r < world && rc == 0; r++) {
      if (parts[r] == NULL)
        continue;
      const struct mr_st_tensor *s = mr_st_find(parts[r], tt->name);
      const char *meta = mr_st_metadata(parts[r], "pieces");
      if (s == NULL || meta == NULL)
        continue;
      cJSON *o = cJSON_Parse(meta);
      const cJSON *a = o ? cJSON_GetObjectItemCaseSensitive(o, tt->name) : NULL;
      if (!cJSON_IsArray(a) || cJSON_GetArraySize(a) != 2 * tt->ndim) {
        cJSON_Delete(o);
        rc = mr_error_set(MR_EFORMAT, "%s: pieces of %s", mr_st_path(parts[r]), tt->name);
        break;
      }
      int64_t off[MR_MAX_DIMS], len[MR_MAX_DIMS], n = 1;
      for (int d = 0; d < tt->ndim; d++) {
        off[d] = (int64_t)cJSON_GetArrayItem(a, d)->valuedouble;
        len[d] = (int64_t)cJSON_GetArrayItem(a, tt->ndim + d)->valuedouble;
        n *= len[d];
      }
      cJSON_Delete(o);
      float *piece = malloc((size_t)(n + 1) * sizeof *piece);
      if (!piece) {
        rc = MR_ENOMEM;
        break;
      }
      rc = mr_st_read(parts[r], s, MR_F32, piece);
      if (rc == 0) /* on the host: a plain strided copy */
        mr_box_scatter(tt->ndim, tt->shape, off, len, piece, full[t]);
      free(piece);
    }
  }
  if (rc == 0)
    rc = mr_weights_write(g, &rt->job->model, full, path);
out:
  for (int r = 0; parts && r < world; r++) {
    mr_st_free(parts[r]);
    char pp[4200];
    part_path(path, r, pp, sizeof pp);
    unlink(pp);
  }
  for (int t = 0; full && t < g->n_tensors; t++)
    free(full[t]);
  free(full);
  free(parts);
  return rc;
}

/* Whether this rank holds every parameter whole: one pipeline stage, no
 * ZeRO-3, no parameter split over a mesh dim.  Every rank gets the same
 * answer (a split leaves each rank a piece; stages each a subset). */
static int holds_all_whole(const struct mr_runtime *rt) {
  const struct mr_graph *g = &rt->L->model.graph;
  if (rt->L->lay.zero >= 3)
    return 0;
  int n = 0;
  for (int t = 0; t < g->n_tensors; t++)
    n += g->tensors[t].role == MR_ROLE_PARAM;
  if (rt->p.n_params != n)
    return 0;
  for (int i = 0; i < rt->p.n_params; i++) {
    const struct mr_param_plan *pp = &rt->p.params[i];
    if (pp->replica_of >= 0 || pp->numel != mr_tensor_numel(&g->tensors[pp->tensor]))
      return 0;
  }
  return 1;
}

/* The final file straight from this rank's parameters (holds_all_whole). */
static int write_whole(struct mr_runtime *rt, const char *path) {
  const struct mr_graph *g = &rt->L->model.graph;
  int64_t total = 0;
  for (int i = 0; i < rt->p.n_params; i++)
    total += rt->p.params[i].numel;
  float *host = malloc((size_t)(total + 1) * sizeof *host);
  float **data = calloc((size_t)g->n_tensors, sizeof *data);
  int rc = host != NULL && data != NULL ? 0 : MR_ENOMEM;
  float *at = host;
  for (int i = 0; i < rt->p.n_params && rc == 0; i++) {
    const struct mr_param_plan *pp = &rt->p.params[i];
    rc = rt->be->ops->copy(rt->be, NULL, at, rt->param + pp->store_offset,
                           (size_t)pp->numel * 4, MR_COPY_DEVICE_TO_HOST);
    data[pp->tensor] = at;
    at += pp->numel;
  }
  if (rc == 0)
    rc = mr_weights_write(g, &rt->job->model, data, path);
  free(data);
  free(host);
  return rc;
}

int mr_runtime_save_weights(struct mr_runtime *rt, const char *path) {
  /* every rank holds the whole model: rank 0 writes it, no parts to merge */
  if (holds_all_whole(rt))
    return rt->p.rank == 0 ? write_whole(rt, path) : 0;
  char part[4200];
  part_path(path, rt->p.rank, part, sizeof part);
  int rc = write_part(rt, part);
  int any;
  /* every part is on disk before rank 0 reads them (the agreement is a
   * barrier over every rank) */
  int rc2 = mr_runtime_agree(rt, rc < 0, &any);
  if (rc < 0)
    return rc;
  MR_TRY(rc2);
  if (any)
    return mr_error_set(MR_EIO, "writing the final weights failed on another rank");
  if (rt->p.rank == 0)
    return merge_parts(rt, path);
  return 0;
}

