/* runtime.c - a rank program's instructions, run. */
#include "worker/runtime.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/error.h"
#include "common/log.h"
#include "common/ops.h"
#include "common/rng.h"
#include "common/safetensors.h"
#include "common/tokens.h"
#include "common/tunable.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/backend/cpu/pool.h"
#include "worker/optim.h"
#include "worker/reshard_run.h"
#include "worker/weights.h"

#define MAX_PENDING 4096

struct pending {
  struct mr_comm_req *req;
  int param;                    // reduce-scatter: the parameter's index
};

struct mr_runtime {
  const struct mr_job *job;
  const struct mr_lowered *L;
  struct mr_rank_program p;
  struct mr_backend *be;
  struct mr_comm *comm;
  struct mr_comm_group *pipe_g, *data_g, *model_g; // NULL: a group of one
  struct mr_reshard_ctx rs;
  char *param, *acc, *optim, *arena, *send, *zero_tmp, *gstage;
  char **stash;                 // [n_chunks]
  int64_t *zero_tmp_off;        // [n_params] ZeRO-2/3 landing block
  int64_t allocated;             // device memory held now, and at most
  int64_t peak_allocated;
  int offload_host;             // optim is host memory (offload)
  /* offload on a device: the optimizer runs on the host, on staged copies
   * of the rank's blocks (pinned where the backend has such memory) */
  float *off_param, *off_grad;  // [off_floats] each
  int64_t off_floats;
  struct mr_pool *off_pool;
  int32_t *host_ids, *host_labels, *host_pos; // staging for loads
  struct mr_tokens train, val;
  int have_val;
  struct pending step_req[MAX_PENDING];
  int n_step_req;
  struct pending pass_req[MAX_PENDING];
  int n_pass_req;
  double loss_sum;
  int loss_n;
  struct mr_loss_scaler scaler;
  struct mr_adamw adamw;
  int64_t inject_step;
  int overlap;                  // MESHRUN_GRAD_SYNC_OVERLAP
  double comm_wait_s;           // this step
  const struct mr_reporter *rep;
  int64_t cur_step;
  struct mr_rt_param *views;
};

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- memory ---- */

static int alloc_region(struct mr_runtime *rt, int64_t bytes, char **out) {
  void *p;
  MR_TRY(rt->be->ops->alloc(rt->be, (size_t)(bytes > 0 ? bytes : 64), &p));
  MR_TRY(rt->be->ops->memset(rt->be, NULL, p, 0, (size_t)(bytes > 0 ? bytes : 64)));
  rt->allocated += bytes > 0 ? bytes : 64;
  if (rt->allocated > rt->peak_allocated)
    rt->peak_allocated = rt->allocated;
  *out = p;
  return 0;
}

static void free_region(struct mr_runtime *rt, char *p) {
  if (p)
    rt->be->ops->free(rt->be, p);
}

/* Host memory outside the device pool (offloaded optimizer state): the
 * backend's page-locked memory where it has it, zeroed. */
static int host_region(struct mr_runtime *rt, int64_t bytes, char **out) {
  size_t n = (size_t)(bytes > 0 ? bytes : 64);
  void *p = NULL;
  if (rt->be->ops->host_alloc != NULL)
    MR_TRY(rt->be->ops->host_alloc(rt->be, n, &p));
  else if ((p = malloc(n)) == NULL)
    return MR_ENOMEM;
  memset(p, 0, n);
  *out = p;
  return 0;
}

static void free_host(struct mr_runtime *rt, char *p) {
  if (p == NULL)
    return;
  if (rt->be->ops->host_free != NULL)
    rt->be->ops->host_free(rt->be, p);
  else
    free(p);
}

/* Where local tensor t lives in pass ps for stash slot `slot`. */
static void *tbuf(const struct mr_runtime *rt, int t, const struct mr_pass *ps, int slot) {
  const struct mr_lbuf *b = &rt->p.buf[t];
  switch (b->region) {
  case MR_REG_PARAM:
    return rt->param + b->offset;
  case MR_REG_STASH:
    return rt->stash[b->chunk] + slot * rt->p.stash_bytes[b->chunk] + b->offset;
  case MR_REG_ARENA:
    if (ps != NULL && ps->arena_off[t] >= 0)
      return rt->arena + ps->arena_off[t];
    return NULL;
  default:
    return NULL;
  }
}

/* ---- progress and waiting ---- */

static void waiting(struct mr_runtime *rt, int idx, const struct mr_ins *in, const char *what) {
  if (rt->rep == NULL || rt->rep->progress == NULL)
    return;
  char d[512];
  if (in != NULL)
    mr_ins_describe(&rt->p, in, d, sizeof d);
  else
    snprintf(d, sizeof d, "%s", what);
  rt->rep->progress(rt->rep->ctx, rt->cur_step, idx - 1, idx, d);
}

static void done(struct mr_runtime *rt, int idx) {
  if (rt->rep != NULL && rt->rep->progress != NULL)
    rt->rep->progress(rt->rep->ctx, rt->cur_step, idx, -1, "");
}

static int wait_req(struct mr_runtime *rt, struct mr_comm_req *req) {
  double t0 = now();
  int rc = mr_comm_wait(req);
  rt->comm_wait_s += now() - t0;
  return rc;
}

static int wait_all(struct mr_runtime *rt, struct pending *list, int *n) {
  int rc = 0;
  for (int i = 0; i < *n; i++) {
    int r = wait_req(rt, list[i].req);
    if (rc == 0)
      rc = r;
  }
  *n = 0;
  return rc;
}

static int push_req(struct mr_runtime *rt, struct pending *list, int *n, struct mr_comm_req *req,
                    int param) {
  if (*n == MAX_PENDING) {
    int rc = wait_all(rt, list, n);
    if (rc < 0)
      return rc;
  }
  list[(*n)++] = (struct pending){req, param};
  return 0;
}

/* ---- initialization ---- */

/* Fills the local shard of parameter i from the seeded initializer: element
 * by element the same global values whatever the sharding. */
static void init_param(struct mr_runtime *rt, const struct mr_param_plan *pp, float *dst) {
  const struct mr_graph *g = &rt->L->model.graph;
  const struct mr_tensor *t = &g->tensors[pp->tensor];
  int64_t rows = t->ndim > 1 ? pp->glen[0] : 1, cols = t->ndim > 1 ? pp->glen[1] : pp->glen[0];
  int64_t gcols = t->ndim > 1 ? t->shape[1] : t->shape[0];
  for (int64_t r = 0; r < rows; r++) {
    float *row = dst + r * cols;
    if (t->init == MR_INIT_NORMAL) {
      int64_t first = t->ndim > 1 ? (pp->goff[0] + r) * gcols + pp->goff[1] : pp->goff[0];
      mr_rng_normal_fill(rt->job->train.seed, mr_hash_str(t->name), (uint64_t)first,
                         (size_t)cols, 0.0f, (float)rt->job->model.initializer_range, row);
    } else {
      for (int64_t c = 0; c < cols; c++)
        row[c] = t->init == MR_INIT_ONES ? 1.0f : 0.0f;
    }
  }
}

static int load_param(struct mr_runtime *rt, struct mr_st_file *f, const struct mr_param_plan *pp,
                      float *dst) {
  const struct mr_tensor *t = &rt->L->model.graph.tensors[pp->tensor];
  const struct mr_st_tensor *s = mr_st_find(f, t->name);
  if (!s)
    return mr_error_set(MR_EFORMAT, "%s: tensor %s: missing", mr_st_path(f), t->name);
  int same = s->rank == t->ndim;
  for (int d = 0; same && d < t->ndim; d++)
    same = s->shape[d] == t->shape[d];
  if (!same)
    return mr_error_set(MR_EFORMAT, "%s: tensor %s: shape does not match the model config",
                        mr_st_path(f), t->name);
  return mr_st_read_slice(f, s, pp->goff, pp->glen, MR_F32, dst);
}

/* The parameters' first values, through a host buffer. */
static int init_params(struct mr_runtime *rt) {
  const char *init = rt->job->train.init;
  struct mr_st_file *f = NULL;
  if (init != NULL && strcmp(init, "random") != 0) {
    char full[4096];
    snprintf(full, sizeof full, "%s/model.safetensors", init);
    FILE *probe = fopen(full, "rb");
    if (probe != NULL) {
      fclose(probe);
      MR_TRY(mr_st_open(full, &f));
    } else {
      MR_TRY(mr_st_open(init, &f));
    }
  }
  int rc = 0;
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
      init_param(rt, pp, host);
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
  mr_st_free(f);
  return rc;
}

/* ---- groups ---- */

static int make_group(struct mr_runtime *rt, const struct mr_group_desc *gd,
                      struct mr_comm_group **out) {
  *out = NULL;
  if (gd->n <= 1 || rt->comm == NULL)
    return 0;
  char name[16];
  snprintf(name, sizeof name, "%.*s", (int)(strchr(gd->name, '{') - gd->name), gd->name);
  return rt->comm->ops->group_new(rt->comm, name, gd->ranks, gd->n, out);
}

void mr_runtime_free(struct mr_runtime *rt) {
  if (rt == NULL)
    return;
  struct mr_comm_group *gs[3] = {rt->pipe_g, rt->data_g, rt->model_g};
  for (int i = 0; i < 3; i++)
    if (gs[i] != NULL)
      rt->comm->ops->group_free(gs[i]);
  free_region(rt, rt->param);
  free_region(rt, rt->acc);
  if (rt->offload_host) {
    free_host(rt, rt->optim);
    free_host(rt, (char *)rt->off_param);
    free_host(rt, (char *)rt->off_grad);
    mr_pool_free(rt->off_pool);
  } else {
    free_region(rt, rt->optim);
  }
  free_region(rt, rt->arena);
  free_region(rt, rt->send);
  free_region(rt, rt->zero_tmp);
  free_region(rt, rt->gstage);
  for (int i = 0; i < 3; i++)
    free_region(rt, rt->rs.scratch[i]);
  for (int c = 0; rt->stash && c < rt->L->n_chunks; c++)
    free_region(rt, rt->stash[c]);
  free(rt->stash);
  free(rt->zero_tmp_off);
  free(rt->host_ids);
  free(rt->host_labels);
  free(rt->host_pos);
  free(rt->views);
  mr_tokens_close(&rt->train);
  mr_tokens_close(&rt->val);
  mr_rank_program_close(&rt->p);
  free(rt);
}

int mr_runtime_new(const struct mr_job *job, const struct mr_lowered *L, int rank,
                   struct mr_backend *be, struct mr_comm *comm, struct mr_runtime **out) {
  struct mr_runtime *rt = calloc(1, sizeof *rt);
  if (!rt)
    return MR_ENOMEM;
  int rc;
  rt->job = job;
  rt->L = L;
  rt->be = be;
  rt->comm = comm;
  MR_TRY_GOTO(rc, mr_rank_program_build(L, rank, &rt->p), fail);
  struct mr_rank_program *p = &rt->p;
  if (L->lay.world > 1 && comm == NULL) {
    rc = mr_error_set(MR_EINVAL, "runtime: %d ranks need a communicator", L->lay.world);
    goto fail;
  }
  /* every rank creates its groups in the same order: pipe, data, model */
  MR_TRY_GOTO(rc, make_group(rt, &p->pipe_group, &rt->pipe_g), fail);
  MR_TRY_GOTO(rc, make_group(rt, &p->data_group, &rt->data_g), fail);
  MR_TRY_GOTO(rc, make_group(rt, &p->model_group, &rt->model_g), fail);
  rt->rs.be = be;
  rt->rs.mesh = &L->mesh;
  rt->rs.coord = p->coord;
  if (L->data_dim >= 0)
    rt->rs.group[L->data_dim] = rt->data_g;
  if (L->model_dim >= 0)
    rt->rs.group[L->model_dim] = rt->model_g;
  MR_TRY_GOTO(rc, alloc_region(rt, p->param_bytes, &rt->param), fail);
  MR_TRY_GOTO(rc, alloc_region(rt, p->acc_bytes, &rt->acc), fail);
  if (L->lay.offload) {
    /* optimizer states outside the device pool: host memory the optimizer
     * step streams through (on CPU ranks the same RAM, but not counted in
     * the rank's device memory) */
    rt->offload_host = 1;
    MR_TRY_GOTO(rc, host_region(rt, p->optim_bytes, &rt->optim), fail);
    if (be->ops->registry != MR_BACKEND_CPU) {
      for (int i = 0; i < p->n_params; i++)
        if (p->params[i].len > rt->off_floats)
          rt->off_floats = p->params[i].len;
      MR_TRY_GOTO(rc, host_region(rt, rt->off_floats * 4, (char **)&rt->off_param), fail);
      MR_TRY_GOTO(rc, host_region(rt, rt->off_floats * 4, (char **)&rt->off_grad), fail);
      MR_TRY_GOTO(rc, mr_pool_new((int)mr_tunable_int(MR_TUNABLE_THREADS), &rt->off_pool),
                  fail);
    }
  } else {
    MR_TRY_GOTO(rc, alloc_region(rt, p->optim_bytes, &rt->optim), fail);
  }
  MR_TRY_GOTO(rc, alloc_region(rt, p->arena_bytes, &rt->arena), fail);
  MR_TRY_GOTO(rc, alloc_region(rt, p->send_bytes, &rt->send), fail);
  MR_TRY_GOTO(rc, alloc_region(rt, p->zero_tmp_bytes, &rt->zero_tmp), fail);
  MR_TRY_GOTO(rc, alloc_region(rt, p->grad_stage_bytes, &rt->gstage), fail);
  for (int i = 0; i < 3; i++) {
    char *s;
    MR_TRY_GOTO(rc, alloc_region(rt, p->scratch_bytes, &s), fail);
    rt->rs.scratch[i] = s;
  }
  rt->stash = calloc((size_t)L->n_chunks, sizeof *rt->stash);
  rt->zero_tmp_off = calloc((size_t)(p->n_params > 0 ? p->n_params : 1), sizeof(int64_t));
  if (!rt->stash || !rt->zero_tmp_off) {
    rc = MR_ENOMEM;
    goto fail;
  }
  for (int c = 0; c < L->n_chunks; c++)
    if (c % L->lay.pp == p->pipe)
      MR_TRY_GOTO(rc, alloc_region(rt, p->stash_bytes[c] * p->stash_slots[c], &rt->stash[c]),
                  fail);
  if (L->lay.zero >= 2) {
    int64_t off = 0;
    for (int i = 0; i < p->n_params; i++) {
      rt->zero_tmp_off[i] = off;
      off += (p->params[i].block * 4 + 63) / 64 * 64;
    }
  }
  int64_t n_in = p->buf[L->model.input_ids].numel;
  rt->host_ids = malloc((size_t)(n_in + 1) * sizeof(int32_t));
  rt->host_labels = malloc((size_t)(n_in + 1) * sizeof(int32_t));
  rt->host_pos = malloc((size_t)(n_in + 1) * sizeof(int32_t));
  if (!rt->host_ids || !rt->host_labels || !rt->host_pos) {
    rc = MR_ENOMEM;
    goto fail;
  }
  MR_TRY_GOTO(rc, init_params(rt), fail);
  rt->adamw = mr_adamw_defaults();
  rt->adamw.beta1 = (float)job->train.beta1;
  rt->adamw.beta2 = (float)job->train.beta2;
  rt->adamw.eps = (float)job->train.eps;
  rt->adamw.weight_decay = (float)job->train.weight_decay;
  double init_scale =
      job->strategy.init_loss_scaling > 0 ? job->strategy.init_loss_scaling : 1024.0;
  mr_loss_scaler_init(&rt->scaler, L->lay.amp == MR_AMP_FP16, init_scale,
                      mr_tunable_int(MR_TUNABLE_LOSS_SCALE_GROWTH));
  rt->inject_step = mr_tunable_int(MR_TUNABLE_INJECT_OVERFLOW_STEP);
  rt->overlap = mr_tunable_int(MR_TUNABLE_GRAD_SYNC_OVERLAP) != 0;
  MR_TRY_GOTO(rc, mr_tokens_open(&rt->train, job->data_train, job->model.vocab_size), fail);
  if (job->data_val) {
    MR_TRY_GOTO(rc, mr_tokens_open(&rt->val, job->data_val, job->model.vocab_size), fail);
    rt->have_val = 1;
  }
  *out = rt;
  return 0;
fail:
  mr_runtime_free(rt);
  return rc;
}

void mr_runtime_set_reporter(struct mr_runtime *rt, const struct mr_reporter *rep) {
  rt->rep = rep;
}

const struct mr_rank_program *mr_runtime_program(const struct mr_runtime *rt) { return &rt->p; }

int64_t mr_runtime_allocated_bytes(const struct mr_runtime *rt) { return rt->peak_allocated; }

struct mr_loss_scaler *mr_runtime_scaler(struct mr_runtime *rt) { return &rt->scaler; }

/* ---- instructions ---- */

/* Token inputs of micro-batch `micro`: this rank's rows of the flattened
 * [micro_seqs * T] inputs; sequence s of micro-batch m is row m *
 * micro_seqs + s of the step's global batch (or of evaluation batch
 * eval_batch when >= 0). */
static int load(struct mr_runtime *rt, const struct mr_pass *ps, int slot, int64_t step,
                int micro, int64_t eval_batch) {
  const struct mr_lowered *L = rt->L;
  const struct mr_model *m = &L->model;
  int64_t T = m->seq;
  int64_t off[MR_MAX_DIMS], len[MR_MAX_DIMS];
  const struct mr_tensor *it = &m->graph.tensors[m->input_ids];
  mr_dist_local(&L->mesh, &L->dg.tensor[m->input_ids], 1, it->shape, rt->p.coord, off, len);
  int32_t seq_ids[8192], seq_lab[8192];
  int32_t *si = T <= 8192 ? seq_ids : malloc((size_t)T * sizeof *si);
  int32_t *sl = T <= 8192 ? seq_lab : malloc((size_t)T * sizeof *sl);
  if (!si || !sl)
    return MR_ENOMEM;
  int rc = 0;
  int64_t B = rt->job->train.global_batch;
  for (int64_t r = off[0]; r < off[0] + len[0] && rc == 0;) {
    int64_t s = r / T, pos = r % T, n = T - pos;
    if (r + n > off[0] + len[0])
      n = off[0] + len[0] - r;
    int64_t row = (int64_t)micro * L->lay.micro_seqs + s;
    if (eval_batch < 0)
      rc = mr_tokens_batch_row(&rt->train, rt->job->train.seed, step, row, T, si, sl);
    else
      rc = mr_tokens_eval_row(rt->have_val ? &rt->val : &rt->train, eval_batch, row, B, T, si,
                              sl);
    for (int64_t i = 0; i < n; i++) {
      rt->host_ids[r - off[0] + i] = si[pos + i];
      rt->host_labels[r - off[0] + i] = sl[pos + i];
      rt->host_pos[r - off[0] + i] = (int32_t)(pos + i);
    }
    r += n;
  }
  if (si != seq_ids)
    free(si);
  if (sl != seq_lab)
    free(sl);
  MR_TRY(rc);
  int ts[3] = {m->input_ids, m->labels, m->position_ids};
  const int32_t *src[3] = {rt->host_ids, rt->host_labels, rt->host_pos};
  for (int i = 0; i < 3; i++) {
    if (ts[i] < 0)
      continue;
    void *dst = tbuf(rt, ts[i], ps, slot);
    if (dst != NULL)
      MR_TRY(rt->be->ops->copy(rt->be, NULL, dst, src[i], (size_t)len[0] * sizeof(int32_t),
                               MR_COPY_HOST_TO_DEVICE));
  }
  return 0;
}

static int run_kernel(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps) {
  const struct mr_graph *lg = &rt->p.local;
  const struct mr_op *op = &lg->ops[in->op];
  void *bufs[MR_OP_MAX_IN + MR_OP_MAX_OUT];
  int n = 0;
  for (int j = 0; j < op->n_out; j++)
    if (rt->p.buf[op->out[j]].numel == 0)
      return 0; /* an empty shard computes nothing */
  for (int j = 0; j < op->n_in; j++)
    bufs[n++] = op->in[j] >= 0 ? tbuf(rt, op->in[j], ps, in->slot) : NULL;
  for (int j = 0; j < op->n_out; j++)
    bufs[n++] = tbuf(rt, op->out[j], ps, in->slot);
  mr_kernel_fn fn = mr_op_kernel(op->kind, rt->be->ops->registry);
  if (fn == NULL)
    return mr_error_set(MR_ENOTSUP, "op %s has no %s kernel", mr_op_def(op->kind)->name,
                        rt->be->ops->name);
  int rc = fn(rt->be->ops->kernel_ctx(rt->be), lg, op, bufs);
  if (rc < 0)
    MR_ERROR("exec", "op %d (%s -> %s): %s", in->op, mr_op_def(op->kind)->name,
             lg->tensors[op->out[0]].name, mr_error_message());
  return rc;
}

static int reshard(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps) {
  const struct mr_reshard_edge *e = &rt->L->dg.edges[in->edge];
  const struct mr_tensor *t = &rt->L->model.graph.tensors[e->tensor];
  const void *src = tbuf(rt, e->tensor, ps, in->slot);
  void *dst = tbuf(rt, in->tensor, ps, in->slot);
  rt->rs.wait_s = 0;
  int rc = mr_reshard_run(&rt->rs, &e->plan, &e->src, t->ndim, t->shape, t->dtype, src, dst);
  rt->comm_wait_s += rt->rs.wait_s;
  return rc;
}

static int grad_wait_one(struct mr_runtime *rt, const struct mr_ins *in);

/* This micro-batch's gradient of a parameter is final: accumulate it (the
 * mean over micro-batches), and on the last micro-batch start its
 * synchronisation; under ZeRO-2/3 reduce-scatter it now. */
static int grad(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps) {
  const struct mr_lowered *L = rt->L;
  const struct mr_layout *lay = &L->lay;
  int pi = rt->p.param_of[in->tensor];
  const struct mr_param_plan *pp = &rt->p.params[pi];
  int gt = L->model.graph.tensors[in->tensor].grad;
  float *gr = tbuf(rt, gt, ps, in->slot);
  float *acc = (float *)(rt->acc + pp->acc_offset);
  struct mr_backend *be = rt->be;
  struct mr_comm_req *req;
  int e = -1;
  for (int k = 0; k < L->dg.n_edges; k++)
    if (L->dg.edges[k].kind == MR_EDGE_GRAD_SYNC && L->dg.edges[k].tensor == gt)
      e = k;
  const struct mr_reshard_plan *plan = e >= 0 ? &L->dg.edges[e].plan : NULL;
  if (pp->off_data) { /* to the parameter's shard first (slices, sums off data) */
    struct mr_reshard_plan off = *plan;
    off.n_steps = 0;
    for (int s = 0; s < plan->n_steps; s++)
      if (plan->steps[s].mesh_dim != L->data_dim)
        off.steps[off.n_steps++] = plan->steps[s];
    const struct mr_tensor *t = &L->model.graph.tensors[gt];
    rt->rs.wait_s = 0;
    MR_TRY(mr_reshard_run(&rt->rs, &off, &L->dg.edges[e].src, t->ndim, t->shape, t->dtype, gr,
                          rt->gstage));
    rt->comm_wait_s += rt->rs.wait_s;
    gr = (float *)rt->gstage;
  }
  if (lay->zero >= 2) {
    int64_t padded = pp->block * lay->dp;
    if (padded > pp->numel)
      MR_TRY(be->ops->memset(be, NULL, gr + pp->numel, 0, (size_t)(padded - pp->numel) * 4));
    MR_TRY(mr_comm_reduce_scatter(rt->data_g, gr, rt->zero_tmp + rt->zero_tmp_off[pi],
                                  (size_t)pp->block, MR_F32, MR_RED_SUM, &req));
    MR_TRY(push_req(rt, rt->pass_req, &rt->n_pass_req, req, pi));
    if (pp->off_data) /* the staging buffer is needed again: land it now */
      return grad_wait_one(rt, in);
    return 0;
  }
  int last = in->micro == lay->n_micro - 1;
  float scale = last ? 1.0f / (float)lay->n_micro : 1.0f;
  MR_TRY(be->ops->axpby(be, acc, gr, in->micro == 0 ? 0.0f : scale, scale, (size_t)pp->numel));
  if (!last || plan == NULL || rt->data_g == NULL)
    return 0;
  /* the data-parallel sum, left in flight (or waited at once, to measure
   * what the overlap hides) */
  for (int s = 0; s < plan->n_steps; s++) {
    const struct mr_reshard_step *st = &plan->steps[s];
    if (st->mesh_dim != L->data_dim || st->group_size <= 1)
      continue;
    MR_TRY(mr_comm_all_reduce(rt->data_g, acc, acc, (size_t)pp->numel, MR_F32, MR_RED_SUM, &req));
    if (!rt->overlap)
      return wait_req(rt, req);
    return push_req(rt, rt->step_req, &rt->n_step_req, req, pi);
  }
  return 0;
}

/* ZeRO-2/3: the pass's reduce-scatters landed; add the blocks to the
 * accumulators. */
static int grad_wait_one(struct mr_runtime *rt, const struct mr_ins *in) {
  const struct mr_layout *lay = &rt->L->lay;
  int n = rt->n_pass_req;
  int list[MAX_PENDING];
  for (int i = 0; i < n; i++)
    list[i] = rt->pass_req[i].param;
  MR_TRY(wait_all(rt, rt->pass_req, &rt->n_pass_req));
  int last = in->micro == lay->n_micro - 1;
  float scale = last ? 1.0f / (float)lay->n_micro : 1.0f;
  for (int i = 0; i < n; i++) {
    const struct mr_param_plan *pp = &rt->p.params[list[i]];
    MR_TRY(rt->be->ops->axpby(rt->be, (float *)(rt->acc + pp->acc_offset),
                              (const float *)(rt->zero_tmp + rt->zero_tmp_off[list[i]]),
                              in->micro == 0 ? 0.0f : scale, scale, (size_t)pp->block));
  }
  return 0;
}

static int send(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps) {
  const struct mr_lbuf *b = &rt->p.buf[in->tensor];
  char *slot = rt->send + ps->send_base + (int64_t)in->micro * ps->send_bytes +
               rt->p.send_off[in->tensor];
  size_t es = mr_dtype_size(rt->p.local.tensors[in->tensor].dtype);
  MR_TRY(rt->be->ops->copy2d(rt->be, slot, 0, tbuf(rt, in->tensor, ps, in->slot), 0,
                             (size_t)b->numel * es, 1));
  int peer_pipe, d, t;
  mr_lower_coords(&rt->L->lay, in->peer, &peer_pipe, &d, &t);
  struct mr_comm_req *req;
  MR_TRY(mr_comm_send(rt->pipe_g, slot, (size_t)b->numel, rt->p.local.tensors[in->tensor].dtype,
                      peer_pipe, &req));
  return push_req(rt, rt->step_req, &rt->n_step_req, req, -1);
}

static int recv(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps) {
  const struct mr_lbuf *b = &rt->p.buf[in->tensor];
  int peer_pipe, d, t;
  mr_lower_coords(&rt->L->lay, in->peer, &peer_pipe, &d, &t);
  struct mr_comm_req *req;
  MR_TRY(mr_comm_recv(rt->pipe_g, tbuf(rt, in->tensor, ps, in->slot), (size_t)b->numel,
                      rt->p.local.tensors[in->tensor].dtype, peer_pipe, &req));
  return wait_req(rt, req);
}

/* The loss gradient: the loss scale where the loss is a whole value or
 * the first summand of a Partial(sum) one, zero on the other summands. */
static int seed(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps) {
  const struct mr_dist_attr *da = &rt->L->dg.tensor[in->tensor];
  float v = (float)rt->scaler.scale;
  for (int d = 0; d < da->ndim; d++)
    if (da->p[d].kind == MR_PARTIAL && da->p[d].reduce == MR_REDUCE_SUM && rt->p.coord[d] != 0)
      v = 0.0f;
  return rt->be->ops->copy(rt->be, NULL, tbuf(rt, in->tensor, ps, in->slot), &v, sizeof v,
                           MR_COPY_HOST_TO_DEVICE);
}

static int gather_param(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps) {
  const struct mr_param_plan *pp = &rt->p.params[rt->p.param_of[in->tensor]];
  struct mr_comm_req *req;
  void *full = tbuf(rt, in->tensor, ps, in->slot);
  if (rt->data_g == NULL)
    return rt->be->ops->copy2d(rt->be, full, 0, rt->param + pp->store_offset, 0,
                               (size_t)pp->numel * 4, 1);
  MR_TRY(mr_comm_all_gather(rt->data_g, rt->param + pp->store_offset, full, (size_t)pp->block,
                            NULL, MR_F32, &req));
  return wait_req(rt, req);
}

/* Sum of one float over the model, data and pipe groups. */
static int allreduce_all(struct mr_runtime *rt, float *v, enum mr_red_op op) {
  struct mr_comm_group *gs[3] = {rt->model_g, rt->data_g, rt->pipe_g};
  float *dev;
  MR_TRY(alloc_region(rt, 64, (char **)&dev));
  int rc = rt->be->ops->copy(rt->be, NULL, dev, v, sizeof *v, MR_COPY_HOST_TO_DEVICE);
  for (int i = 0; i < 3 && rc == 0; i++) {
    if (gs[i] == NULL)
      continue;
    struct mr_comm_req *req;
    rc = mr_comm_all_reduce(gs[i], dev, dev, 1, MR_F32, op, &req);
    if (rc == 0)
      rc = wait_req(rt, req);
  }
  if (rc == 0)
    rc = rt->be->ops->copy(rt->be, NULL, v, dev, sizeof *v, MR_COPY_DEVICE_TO_HOST);
  rt->be->ops->free(rt->be, dev);
  rt->allocated -= 64;
  return rc;
}

static int optimizer(struct mr_runtime *rt, int64_t step, struct mr_step_report *r) {
  const struct mr_lowered *L = rt->L;
  const struct mr_layout *lay = &L->lay;
  struct mr_backend *be = rt->be;
  if (step == rt->inject_step && rt->p.n_params > 0) { /* test hook: an overflow */
    float inf = INFINITY;
    MR_TRY(be->ops->copy(be, NULL, rt->acc + rt->p.params[0].acc_offset, &inf, sizeof inf,
                         MR_COPY_HOST_TO_DEVICE));
  }
  double ss = 0;
  for (int i = 0; i < rt->p.n_params; i++) {
    const struct mr_param_plan *pp = &rt->p.params[i];
    if (!pp->norm || pp->len == 0)
      continue;
    const float *acc = (const float *)(rt->acc + pp->acc_offset) + (lay->zero == 1 ? pp->begin : 0);
    double part;
    MR_TRY(be->ops->sumsq(be, acc, (size_t)pp->len, &part));
    ss += part;
  }
  float ssf = (float)ss;
  MR_TRY(allreduce_all(rt, &ssf, MR_RED_SUM));
  ss = ssf;
  double scale = rt->scaler.scale;
  r->loss_scale = scale;
  r->lr = mr_lr_at(&rt->job->train, step - 1);
  r->grad_norm = sqrt(ss) / scale;
  r->skipped = mr_loss_scaler_update(&rt->scaler, !isfinite(ss));
  if (r->skipped) {
    if (rt->p.rank == 0)
      MR_WARN("train", "step %lld: gradients not finite at loss scale %g; update skipped "
              "(%lld so far), scale now %g", (long long)step, scale,
              (long long)rt->scaler.skipped, rt->scaler.scale);
    return 0;
  }
  struct mr_adamw h = rt->adamw;
  h.lr = (float)r->lr;
  h.grad_scale = (float)(mr_clip_factor(r->grad_norm, rt->job->train.grad_clip) / scale);
  int64_t opt_step = step - rt->scaler.skipped;
  for (int i = 0; i < rt->p.n_params; i++) {
    const struct mr_param_plan *pp = &rt->p.params[i];
    if (pp->len == 0)
      continue;
    float *param = (float *)(rt->param + pp->store_offset) + (lay->zero >= 3 ? 0 : pp->begin);
    const float *acc = (const float *)(rt->acc + pp->acc_offset) + (lay->zero == 1 ? pp->begin : 0);
    float *m = (float *)(rt->optim + pp->state_offset);
    float *v = m + ((pp->len * 4 + 63) / 64 * 64) / 4;
    if (rt->off_pool == NULL) {
      MR_TRY(be->ops->adamw(be, param, acc, m, v, (size_t)pp->len, &h, opt_step));
      continue;
    }
    /* offloaded on a device: the block and its gradient to the host, the
     * update there, the block back */
    MR_TRY(be->ops->copy(be, NULL, rt->off_param, param, (size_t)pp->len * 4,
                         MR_COPY_DEVICE_TO_HOST));
    MR_TRY(be->ops->copy(be, NULL, rt->off_grad, acc, (size_t)pp->len * 4,
                         MR_COPY_DEVICE_TO_HOST));
    MR_TRY(be->ops->synchronize(be, NULL));
    MR_TRY(mr_cpu_adamw_step(rt->off_pool, rt->off_param, rt->off_grad, m, v, (size_t)pp->len,
                             &h, opt_step));
    MR_TRY(be->ops->copy(be, NULL, param, rt->off_param, (size_t)pp->len * 4,
                         MR_COPY_HOST_TO_DEVICE));
    MR_TRY(be->ops->synchronize(be, NULL));
  }
  if (lay->zero == 1 || lay->zero == 2) /* every rank updated its block: gather */
    for (int i = 0; i < rt->p.n_params; i++) {
      const struct mr_param_plan *pp = &rt->p.params[i];
      if (pp->replica_of >= 0)
        continue;
      char *full = rt->param + pp->store_offset;
      char *mine = lay->zero == 2 ? rt->zero_tmp + rt->zero_tmp_off[i] : rt->zero_tmp;
      MR_TRY(be->ops->memset(be, NULL, mine, 0, (size_t)pp->block * 4));
      MR_TRY(be->ops->copy2d(be, mine, 0, full + pp->begin * 4, 0, (size_t)pp->len * 4, 1));
      struct mr_comm_req *req;
      MR_TRY(mr_comm_all_gather(rt->data_g, mine, full, (size_t)pp->block, NULL, MR_F32, &req));
      MR_TRY(wait_req(rt, req));
    }
  return 0;
}

/* Tied parameters: each owner sends its updated values to the stages
 * holding copies, which receive them. */
static int param_sync(struct mr_runtime *rt) {
  int rc = 0;
  for (int i = 0; i < rt->p.n_params && rc == 0; i++) {
    const struct mr_param_plan *pp = &rt->p.params[i];
    void *buf = rt->param + pp->store_offset;
    struct mr_comm_req *req;
    int peer, d, t;
    if (pp->replica_of >= 0) {
      mr_lower_coords(&rt->L->lay, pp->replica_of, &peer, &d, &t);
      rc = mr_comm_recv(rt->pipe_g, buf, (size_t)pp->numel, MR_F32, peer, &req);
      if (rc == 0)
        rc = wait_req(rt, req);
    }
    for (int k = 0; k < pp->n_replicas && rc == 0; k++) {
      mr_lower_coords(&rt->L->lay, pp->replicas[k], &peer, &d, &t);
      rc = mr_comm_send(rt->pipe_g, buf, (size_t)pp->numel, MR_F32, peer, &req);
      if (rc == 0)
        rc = push_req(rt, rt->step_req, &rt->n_step_req, req, i);
    }
  }
  int r2 = wait_all(rt, rt->step_req, &rt->n_step_req);
  return rc < 0 ? rc : r2;
}

/* The loss of the last stage to every stage. */
static int share_loss(struct mr_runtime *rt, float *loss) {
  if (rt->pipe_g == NULL)
    return 0;
  float *dev;
  MR_TRY(alloc_region(rt, 64, (char **)&dev));
  int rc = rt->be->ops->copy(rt->be, NULL, dev, loss, sizeof *loss, MR_COPY_HOST_TO_DEVICE);
  struct mr_comm_req *req;
  if (rc == 0)
    rc = mr_comm_broadcast(rt->pipe_g, dev, 1, MR_F32, rt->L->lay.pp - 1, &req);
  if (rc == 0)
    rc = wait_req(rt, req);
  if (rc == 0)
    rc = rt->be->ops->copy(rt->be, NULL, loss, dev, sizeof *loss, MR_COPY_DEVICE_TO_HOST);
  rt->be->ops->free(rt->be, dev);
  rt->allocated -= 64;
  return rc;
}

/* Runs one instruction; idx is its number in the step (progress). */
static int exec(struct mr_runtime *rt, const struct mr_ins *in, int idx, int64_t step,
                int64_t eval_batch) {
  const struct mr_pass *ps = in->pass >= 0 ? &rt->p.passes[in->pass] : NULL;
  switch (in->kind) {
  case MR_INS_RECV:
    waiting(rt, idx, in, NULL);
    return recv(rt, in, ps);
  case MR_INS_LOAD:
    return load(rt, ps, in->slot, step - 1, in->micro, eval_batch);
  case MR_INS_SEED:
    return seed(rt, in, ps);
  case MR_INS_GATHER:
    waiting(rt, idx, in, NULL);
    return gather_param(rt, in, ps);
  case MR_INS_RESHARD:
    if (in->n_ev > 0)
      waiting(rt, idx, in, NULL);
    return reshard(rt, in, ps);
  case MR_INS_KERNEL:
    return run_kernel(rt, in, ps);
  case MR_INS_LOSS: {
    float v;
    MR_TRY(rt->be->ops->copy(rt->be, NULL, &v, tbuf(rt, in->tensor, ps, in->slot), sizeof v,
                             MR_COPY_DEVICE_TO_HOST));
    rt->loss_sum += v;
    rt->loss_n++;
    return 0;
  }
  case MR_INS_GRAD:
    return grad(rt, in, ps);
  case MR_INS_GRAD_WAIT:
    waiting(rt, idx, in, NULL);
    return grad_wait_one(rt, in);
  case MR_INS_SEND:
    return send(rt, in, ps);
  case MR_INS_SYNC_WAIT:
    waiting(rt, idx, in, "gradient synchronisation");
    return wait_all(rt, rt->step_req, &rt->n_step_req);
  default:
    return 0;
  }
}

int mr_runtime_step(struct mr_runtime *rt, int64_t step, struct mr_step_report *r) {
  const struct mr_rank_program *p = &rt->p;
  double t0 = now();
  memset(r, 0, sizeof *r);
  r->step = step;
  r->val_loss = NAN;
  rt->cur_step = step;
  rt->comm_wait_s = 0;
  rt->loss_sum = 0;
  rt->loss_n = 0;
  int rc = 0;
  for (int i = 0; i < p->n_step && rc == 0; i++) {
    const struct mr_ins *in = &p->step[i];
    if (in->kind == MR_INS_OPTIMIZER) {
      waiting(rt, i, in, "optimizer");
      rc = optimizer(rt, step, r);
    } else if (in->kind == MR_INS_PARAM_SYNC) {
      waiting(rt, i, in, "tied parameters");
      rc = param_sync(rt);
    } else if (in->kind == MR_INS_STEP_END) {
      float loss = rt->loss_n > 0 ? (float)(rt->loss_sum / rt->loss_n) : 0.0f;
      rc = share_loss(rt, &loss);
      r->loss = loss;
    } else {
      rc = exec(rt, in, i, step, -1);
    }
    if (rc == 0)
      done(rt, i);
  }
  if (rc < 0) { /* nothing may stay in flight on buffers about to be reused */
    wait_all(rt, rt->pass_req, &rt->n_pass_req);
    wait_all(rt, rt->step_req, &rt->n_step_req);
    return rc;
  }
  r->step_time_s = now() - t0;
  r->comm_wait_s = rt->comm_wait_s;
  r->tokens_per_s = (double)(rt->job->train.global_batch * rt->job->train.seq_len) /
                    r->step_time_s;
  r->peak_memory_bytes = (uint64_t)rt->peak_allocated; /* measured by the allocator */
  return 0;
}

int mr_runtime_eval(struct mr_runtime *rt, double *loss) {
  const struct mr_rank_program *p = &rt->p;
  int64_t nb = rt->job->train.eval_batches > 0 ? rt->job->train.eval_batches : 1;
  double sum = 0;
  int rc = 0;
  for (int64_t b = 0; b < nb && rc == 0; b++) {
    rt->loss_sum = 0;
    rt->loss_n = 0;
    for (int k = 0; k < p->n_eval && rc == 0; k++) {
      const struct mr_pass *ps = &p->passes[p->eval_passes[k]];
      for (int i = ps->first; i < ps->first + ps->n && rc == 0; i++) {
        struct mr_ins in = p->tmpl[i];
        in.micro = p->eval_micro[k];
        in.slot = 0;
        rc = exec(rt, &in, -1, 0, b);
      }
    }
    int r2 = wait_all(rt, rt->step_req, &rt->n_step_req);
    if (rc == 0)
      rc = r2;
    float l = rt->loss_n > 0 ? (float)(rt->loss_sum / rt->loss_n) : 0.0f;
    if (rc == 0)
      rc = share_loss(rt, &l);
    sum += l;
  }
  *loss = sum / (double)nb;
  return rc;
}

int mr_runtime_agree(struct mr_runtime *rt, int flag, int *any) {
  float v = flag ? 1.0f : 0.0f;
  MR_TRY(allreduce_all(rt, &v, MR_RED_MAX));
  *any = v > 0.0f;
  return 0;
}

/* One copy of each shard along the model dim: model coordinate 0 unless
 * the parameter is split over model. */
static int writes_model(const struct mr_runtime *rt, const struct mr_param_plan *pp) {
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
      int z3 = rt->L->lay.zero >= 3, model_ok = writes_model(rt, pp);
      rt->views[i] = (struct mr_rt_param){
          .name = t->name, .ndim = t->ndim, .shape = t->shape, .goff = pp->goff,
          .glen = pp->glen, .numel = pp->numel, .param = (float *)(rt->param + pp->store_offset),
          .pbegin = z3 ? pp->begin : 0, .plen = z3 ? pp->len : pp->numel, .m = m,
          .v = m + ((pp->len * 4 + 63) / 64 * 64) / 4, .begin = pp->begin, .len = pp->len,
          .state_on_host = rt->offload_host,
          .keeps_param = model_ok && (z3 || rt->p.data == 0) && pp->replica_of < 0,
          .keeps_state = model_ok && (rt->L->lay.zero >= 1 || rt->p.data == 0)};
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
  return rt->p.data == 0 && pp->replica_of < 0 && writes_model(rt, pp);
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
    snprintf(pp, sizeof pp, "%s.part-%d", path, r);
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
      int64_t zero[MR_MAX_DIMS] = {0};
      if (rc == 0) { /* on the host: a plain strided copy */
        int64_t rows = tt->ndim > 1 ? len[0] : 1, cols = tt->ndim > 1 ? len[1] : len[0];
        int64_t gcols = tt->ndim > 1 ? tt->shape[1] : tt->shape[0];
        int64_t r0 = tt->ndim > 1 ? off[0] : 0, c0 = tt->ndim > 1 ? off[1] : off[0];
        (void)zero;
        for (int64_t i = 0; i < rows; i++)
          memcpy(full[t] + (r0 + i) * gcols + c0, piece + i * cols, (size_t)cols * sizeof(float));
      }
      free(piece);
    }
  }
  if (rc == 0)
    rc = mr_weights_write(g, &rt->job->model, full, path);
out:
  for (int r = 0; parts && r < world; r++) {
    mr_st_free(parts[r]);
    char pp[4200];
    snprintf(pp, sizeof pp, "%s.part-%d", path, r);
    unlink(pp);
  }
  for (int t = 0; full && t < g->n_tensors; t++)
    free(full[t]);
  free(full);
  free(parts);
  return rc;
}

int mr_runtime_save_weights(struct mr_runtime *rt, const char *path) {
  char part[4200];
  snprintf(part, sizeof part, "%s.part-%d", path, rt->p.rank);
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
