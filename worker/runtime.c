/* runtime.c - a rank program's instructions, run: regions, progress, the
 * step loop. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "compiler/ops.h"
#include "common/test_hooks.h"
#include "common/tunable.h"
#include "worker/backend/cpu/pool.h"
#include "worker/runtime_internal.h"
#include "worker/trace.h"

/* ---- memory ---- */

int mr__rt_alloc(struct mr_runtime *rt, int64_t bytes, char **out) {
  size_t n = (size_t)(bytes > 0 ? bytes : 64);
  void *p;
  MR_TRY(rt->be->ops->alloc(rt->be, n, &p));
  MR_TRY(rt->be->ops->memset(rt->be, NULL, p, 0, n));
  rt->allocated += (int64_t)n;
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
void *mr__rt_buf(const struct mr_runtime *rt, int t, const struct mr_pass *ps, int slot) {
  const struct mr_lbuf *b = &rt->p.buf[t];
  switch (b->region) {
  case MR_REG_PARAM:
    return rt->param + b->offset;
  case MR_REG_STASH:
    return rt->stash[b->chunk] + slot * rt->p.stash_bytes[b->chunk] + b->offset;
  case MR_REG_ACC:
    return rt->acc + b->offset;
  case MR_REG_ARENA:
    if (ps != NULL && ps->arena_off[t] >= 0)
      return rt->arena + ps->arena_off[t];
    return NULL;
  default:
    return NULL;
  }
}

/* ---- progress and waiting ---- */

void mr__rt_waiting(struct mr_runtime *rt, int idx, const struct mr_ins *in, const char *what) {
  if (rt->rep == NULL || rt->rep->progress == NULL)
    return;
  char d[512];
  if (in != NULL)
    mr_ins_describe(&rt->p, in, d, sizeof d);
  else
    snprintf(d, sizeof d, "%s", what);
  rt->rep->progress(rt->rep->ctx, rt->cur_step, idx - 1, idx, d);
}

void mr__rt_done(struct mr_runtime *rt, int idx) {
  if (rt->rep != NULL && rt->rep->progress != NULL)
    rt->rep->progress(rt->rep->ctx, rt->cur_step, idx, -1, "");
}

int mr__rt_wait_req(struct mr_runtime *rt, struct mr_comm_req *req) {
  double t0 = mr_clock_s();
  mr_hook_comm_wait();
  int rc = mr_comm_wait(req);
  rt->comm_wait_s += mr_clock_s() - t0;
  if (rc == 0 && rt->rep != NULL && rt->rep->comm_done != NULL)
    atomic_fetch_add(rt->rep->comm_done, 1);
  return rc;
}

int mr__rt_wait_all(struct mr_runtime *rt, struct pending *list, int *n) {
  int rc = 0;
  for (int i = 0; i < *n; i++) {
    int r = mr__rt_wait_req(rt, list[i].req);
    if (rc == 0)
      rc = r;
  }
  *n = 0;
  return rc;
}

int mr__rt_push_req(struct mr_runtime *rt, struct pending *list, int *n, struct mr_comm_req *req,
                    int param) {
  if (*n == MAX_PENDING) {
    int rc = mr__rt_wait_all(rt, list, n);
    if (rc < 0)
      return rc;
  }
  list[(*n)++] = (struct pending){req, param};
  return 0;
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
  free_region(rt, (char *)rt->scalar);
  for (int i = 0; i < 3; i++)
    free_region(rt, rt->rs.scratch[i]);
  for (int c = 0; rt->stash && c < rt->L->n_chunks; c++)
    free_region(rt, rt->stash[c]);
  free(rt->stash);
  free(rt->phantom_grad);
  free(rt->host_ids);
  free(rt->host_labels);
  free(rt->host_pos);
  free(rt->views);
  free(rt->prof_op);
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
  MR_TRY_GOTO(rc, mr__rt_alloc(rt, p->param_bytes, &rt->param), fail);
  MR_TRY_GOTO(rc, mr__rt_alloc(rt, p->acc_bytes, &rt->acc), fail);
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
    MR_TRY_GOTO(rc, mr__rt_alloc(rt, p->optim_bytes, &rt->optim), fail);
  }
  MR_TRY_GOTO(rc, mr__rt_alloc(rt, p->arena_bytes, &rt->arena), fail);
  MR_TRY_GOTO(rc, mr__rt_alloc(rt, p->send_bytes, &rt->send), fail);
  MR_TRY_GOTO(rc, mr__rt_alloc(rt, p->zero_tmp_bytes, &rt->zero_tmp), fail);
  MR_TRY_GOTO(rc, mr__rt_alloc(rt, p->grad_stage_bytes, &rt->gstage), fail);
  MR_TRY_GOTO(rc, mr__rt_alloc(rt, 64, (char **)&rt->scalar), fail);
  for (int i = 0; i < 3; i++) {
    char *s;
    MR_TRY_GOTO(rc, mr__rt_alloc(rt, p->scratch_bytes, &s), fail);
    rt->rs.scratch[i] = s;
  }
  rt->phantom_grad = calloc((size_t)(p->n_params > 0 ? p->n_params : 1), 1);
  if (!rt->phantom_grad) {
    rc = MR_ENOMEM;
    goto fail;
  }
  rt->stash = calloc((size_t)L->n_chunks, sizeof *rt->stash);
  if (!rt->stash) {
    rc = MR_ENOMEM;
    goto fail;
  }
  for (int c = 0; c < L->n_chunks; c++)
    if (c % L->lay.pp == p->pipe)
      MR_TRY_GOTO(rc, mr__rt_alloc(rt, p->stash_bytes[c] * p->stash_slots[c], &rt->stash[c]),
                  fail);
  int64_t n_in = p->buf[L->model.input_ids].numel;
  rt->host_ids = malloc((size_t)(n_in + 1) * sizeof(int32_t));
  rt->host_labels = malloc((size_t)(n_in + 1) * sizeof(int32_t));
  rt->host_pos = malloc((size_t)(n_in + 1) * sizeof(int32_t));
  if (!rt->host_ids || !rt->host_labels || !rt->host_pos) {
    rc = MR_ENOMEM;
    goto fail;
  }
  MR_TRY_GOTO(rc, mr__rt_init_params(rt), fail);
  rt->adamw = mr_adamw_of_job(&job->train);
  mr_loss_scaler_of_job(&rt->scaler, job, L->lay.amp == MR_AMP_FP16);
  rt->inject_step = mr_tunable_int(MR_TUNABLE_INJECT_OVERFLOW_STEP);
  rt->slow = mr_hook_slow_of(rank);
  rt->overlap = mr_tunable_int(MR_TUNABLE_GRAD_SYNC_OVERLAP) != 0;
  if (mr_tunable_int(MR_TUNABLE_PROFILE) &&
      (rt->prof_op = calloc((size_t)mr_op_count(), sizeof *rt->prof_op)) == NULL) {
    rc = MR_ENOMEM;
    goto fail;
  }
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

void mr_runtime_set_trace(struct mr_runtime *rt, struct mr_trace *trace) { rt->trace = trace; }

const struct mr_rank_program *mr_runtime_program(const struct mr_runtime *rt) { return &rt->p; }

struct mr_loss_scaler *mr_runtime_scaler(struct mr_runtime *rt) { return &rt->scaler; }

/* Runs one instruction; idx is its number in the step (progress). */
static int exec(struct mr_runtime *rt, const struct mr_ins *in, int idx, int64_t step,
                int64_t eval_batch) {
  const struct mr_pass *ps = in->pass >= 0 ? &rt->p.passes[in->pass] : NULL;
  switch (in->kind) {
  case MR_INS_RECV:
    mr__rt_waiting(rt, idx, in, NULL);
    return mr__rt_recv(rt, in, ps);
  case MR_INS_LOAD:
    return mr__rt_load(rt, ps, in->slot, step - 1, in->micro, eval_batch);
  case MR_INS_SEED:
    return mr__rt_seed(rt, in, ps);
  case MR_INS_GATHER:
    mr__rt_waiting(rt, idx, in, NULL);
    return mr__rt_gather(rt, in, ps);
  case MR_INS_RESHARD:
    if (in->n_ev > 0)
      mr__rt_waiting(rt, idx, in, NULL);
    return mr__rt_reshard(rt, in, ps);
  case MR_INS_KERNEL:
    return mr__rt_kernel(rt, in, ps);
  case MR_INS_LOSS: {
    float v;
    MR_TRY(rt->be->ops->copy(rt->be, NULL, &v, mr__rt_buf(rt, in->tensor, ps, in->slot), sizeof v,
                             MR_COPY_DEVICE_TO_HOST));
    rt->loss_sum += v;
    rt->loss_n++;
    return 0;
  }
  case MR_INS_GRAD:
    return mr__rt_grad(rt, in, ps);
  case MR_INS_GRAD_WAIT:
    mr__rt_waiting(rt, idx, in, NULL);
    return mr__rt_grad_wait(rt, in);
  case MR_INS_SEND:
    return mr__rt_send(rt, in, ps);
  case MR_INS_SYNC_WAIT:
    mr__rt_waiting(rt, idx, in, "gradient synchronisation");
    MR_TRY(mr__rt_wait_all(rt, rt->step_req, &rt->n_step_req));
    return mr__rt_phantom_sum(rt);
  default:
    return 0;
  }
}

/* MESHRUN_PROFILE: charges the time since t0 to in's kind (and op), once
 * the device has finished what it queued. */
static int profile(struct mr_runtime *rt, const struct mr_ins *in, double t0) {
  MR_TRY(rt->be->ops->synchronize(rt->be, NULL));
  double dt = mr_clock_s() - t0;
  rt->prof_kind[in->kind] += dt;
  if (in->kind == MR_INS_KERNEL)
    rt->prof_op[rt->L->model.graph.ops[in->op].kind] += dt;
  return 0;
}

/* The trace's slice of instruction in, run since t0 (the device done with
 * what it queued, so the slice is the work's). */
static int trace_ins(struct mr_runtime *rt, const struct mr_ins *in, int64_t t0) {
  MR_TRY(rt->be->ops->synchronize(rt->be, NULL));
  const struct mr_graph *g = &rt->L->model.graph;
  const char *cat = "runtime", *name = mr_ins_kind_name(in->kind);
  char buf[96], args[160] = "";
  if (in->pass >= 0)
    snprintf(args, sizeof args, "\"micro\": %d", in->micro);
  size_t n = strlen(args);
  const char *sep = n ? ", " : "";
  switch (in->kind) {
  case MR_INS_KERNEL: {
    const struct mr_op *op = &g->ops[in->op];
    cat = op->backward ? "backward" : "forward";
    name = mr_op_def(op->kind)->name;
    if (op->n_out > 0 && op->out[0] >= 0 && op->out[0] < g->n_tensors)
      snprintf(args + n, sizeof args - n, "%s\"op\": %d, \"out\": \"%s\"", sep, in->op,
               g->tensors[op->out[0]].name);
    break;
  }
  case MR_INS_RECV: /* waiting for the stage before: the pipeline's bubble */
    cat = "bubble";
    snprintf(buf, sizeof buf, "recv from rank %d", in->peer);
    name = buf;
    break;
  case MR_INS_SEND:
    cat = "pipeline";
    snprintf(buf, sizeof buf, "send to rank %d", in->peer);
    name = buf;
    break;
  case MR_INS_GATHER:
  case MR_INS_RESHARD:
  case MR_INS_GRAD:
  case MR_INS_GRAD_WAIT:
  case MR_INS_SYNC_WAIT:
  case MR_INS_PARAM_SYNC:
    cat = "comm";
    break;
  case MR_INS_OPTIMIZER:
    cat = "optimizer";
    break;
  default:
    break;
  }
  mr_trace_slice(rt->trace, MR_TRACE_COMPUTE, cat, name, t0, mr_trace_now(), args);
  return 0;
}

/* The largest v[k] > 0 not yet taken (marking it), or -1. */
static int next_largest(const double *v, char *taken, int n) {
  int best = -1;
  for (int k = 0; k < n; k++)
    if (!taken[k] && v[k] > 0 && (best < 0 || v[k] > v[best]))
      best = k;
  if (best >= 0)
    taken[best] = 1;
  return best;
}

int mr_runtime_profile(const struct mr_runtime *rt, char *buf, size_t n) {
  if (rt->prof_op == NULL || rt->prof_steps == 0 || n == 0)
    return 0;
  double per = 1e3 / (double)rt->prof_steps, total = 0;
  for (int k = 0; k < MR_INS_KIND_COUNT; k++)
    total += rt->prof_kind[k];
  int len = snprintf(buf, n, "ms per step over %lld steps: %.2f in all", (long long)rt->prof_steps,
                     total * per);
  /* instruction kinds, then op kinds, each largest first */
  int nop = mr_op_count();
  char *taken = calloc((size_t)(nop > MR_INS_KIND_COUNT ? nop : MR_INS_KIND_COUNT), 1);
  if (taken == NULL)
    return 1;
  for (int k; (size_t)len < n && (k = next_largest(rt->prof_kind, taken, MR_INS_KIND_COUNT)) >= 0;)
    len += snprintf(buf + len, n - (size_t)len, "; %s %.2f", mr_ins_kind_name((enum mr_ins_kind)k),
                    rt->prof_kind[k] * per);
  memset(taken, 0, (size_t)nop);
  for (int k, first = 1; (size_t)len < n && (k = next_largest(rt->prof_op, taken, nop)) >= 0;
       first = 0)
    len += snprintf(buf + len, n - (size_t)len, "%s%s %.2f", first ? " (kernels: " : ", ",
                    mr_op_def(k)->name, rt->prof_op[k] * per);
  if ((size_t)len < n && strstr(buf, "(kernels: ") != NULL)
    snprintf(buf + len, n - (size_t)len, ")");
  free(taken);
  return 1;
}

int mr_runtime_step(struct mr_runtime *rt, int64_t step, struct mr_step_report *r) {
  const struct mr_rank_program *p = &rt->p;
  double t0 = mr_clock_s();
  memset(r, 0, sizeof *r);
  r->step = step;
  r->val_loss = NAN;
  r->stage = p->pipe;
  mr_hook_slow_step(&rt->slow);
  rt->cur_step = step;
  rt->comm_wait_s = 0;
  rt->loss_sum = 0;
  rt->loss_n = 0;
  int rc = 0, passes_done = 0;
  int tracing = mr_trace_recording(rt->trace);
  double passes_t0 = mr_clock_s();
  for (int i = 0; i < p->n_step && rc == 0; i++) {
    const struct mr_ins *in = &p->step[i];
    double ti = rt->prof_op != NULL ? mr_clock_s() : 0;
    int64_t tt = tracing ? mr_trace_now() : 0;
    if (in->kind == MR_INS_SYNC_WAIT && !passes_done) { /* the schedule's passes are done */
      passes_done = 1;
      r->micro_work_s = fmax(0.0, mr_clock_s() - passes_t0 - rt->comm_wait_s);
    }
    if (in->kind == MR_INS_OPTIMIZER) {
      mr__rt_waiting(rt, i, in, "optimizer");
      rc = mr__rt_optimizer(rt, step, r);
    } else if (in->kind == MR_INS_PARAM_SYNC) {
      mr__rt_waiting(rt, i, in, "tied parameters");
      rc = mr__rt_param_sync(rt);
    } else if (in->kind == MR_INS_STEP_END) {
      float loss = rt->loss_n > 0 ? (float)(rt->loss_sum / rt->loss_n) : 0.0f;
      rc = mr__rt_step_loss(rt, rt->loss_sum, &loss);
      if (rc == 0)
        rc = mr__rt_share_loss(rt, &loss);
      r->loss = loss;
    } else {
      rc = exec(rt, in, i, step, -1);
    }
    if (rc == 0 && rt->prof_op != NULL)
      rc = profile(rt, in, ti);
    if (rc == 0 && tracing)
      rc = trace_ins(rt, in, tt);
    if (rc == 0)
      mr__rt_done(rt, i);
  }
  rt->prof_steps++;
  if (rc < 0) { /* nothing may stay in flight on buffers about to be reused */
    mr__rt_wait_all(rt, rt->pass_req, &rt->n_pass_req);
    mr__rt_wait_all(rt, rt->step_req, &rt->n_step_req);
    return rc;
  }
  r->step_time_s = mr_clock_s() - t0;
  r->comm_wait_s = rt->comm_wait_s;
  r->tokens_per_s = (double)(rt->job->train.global_batch * rt->job->train.seq_len) /
                    r->step_time_s;
  r->peak_memory_bytes = (uint64_t)rt->allocated; /* measured by the allocator */
  return 0;
}

int mr_runtime_eval(struct mr_runtime *rt, double *loss) {
  const struct mr_rank_program *p = &rt->p;
  int64_t nb = rt->job->train.eval_batches > 0 ? rt->job->train.eval_batches : 1;
  double sum = 0;
  int rc = 0;
  int64_t t0 = mr_trace_now();
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
    int r2 = mr__rt_wait_all(rt, rt->step_req, &rt->n_step_req);
    if (rc == 0)
      rc = r2;
    float l = rt->loss_n > 0 ? (float)(rt->loss_sum / rt->loss_n) : 0.0f;
    if (rc == 0)
      rc = mr__rt_step_loss(rt, rt->loss_sum, &l);
    if (rc == 0)
      rc = mr__rt_share_loss(rt, &l);
    sum += l;
  }
  *loss = sum / (double)nb;
  if (rc == 0 && mr_trace_recording(rt->trace)) {
    rc = rt->be->ops->synchronize(rt->be, NULL);
    char args[48];
    snprintf(args, sizeof args, "\"batches\": %lld", (long long)nb);
    mr_trace_slice(rt->trace, MR_TRACE_COMPUTE, "eval", "eval", t0, mr_trace_now(), args);
  }
  return rc;
}

int mr_runtime_agree(struct mr_runtime *rt, int flag, int *any) {
  float v = flag ? 1.0f : 0.0f;
  MR_TRY(mr__rt_allreduce_all(rt, &v, MR_RED_MAX));
  *any = v > 0.0f;
  return 0;
}

