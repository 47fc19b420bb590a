/* train.c - the single-rank training loop. */
#include "worker/train.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/autodiff.h"
#include "common/error.h"
#include "common/log.h"
#include "common/ops.h"
#include "common/model.h"
#include "common/tokens.h"
#include "common/tunable.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/exec.h"
#include "worker/grad_sync.h"
#include "worker/optim.h"
#include "worker/weights.h"

struct mr_trainer {
  const struct mr_job *job;     // borrowed
  struct mr_model model;
  struct mr_exec exec;
  int seed_grad;                // gradient fed into the loss
  int *params;                  // [n_params] tensor ids
  int n_params;
  float **m, **v;               // AdamW moments per parameter
  struct mr_adamw adamw;
  struct mr_loss_scaler scaler;
  struct mr_tokens train, val;
  int have_val;
  int64_t inject_step;
  double step_flops;
  /* data parallelism: this rank computes rows [dp_rank * batch, +batch) of
   * every global batch; sync averages the gradients (NULL: one rank) */
  int dp_rank, dp_size;
  struct mr_grad_sync *sync;
  struct mr_train_slot *slots;  // [n_params], for checkpoints
  /* gradient accumulation: `accum` micro-batches of `model.batch` rows per
   * step; acc[i] sums parameter i's gradient over the micro-batches */
  int accum;
  float **acc;
  /* ZeRO-1: this rank keeps AdamW moments for, and updates, elements
   * [shard_begin[i], +shard_len[i]) of parameter i (blocks of
   * ceil(n / dp)); the updated blocks are all-gathered */
  int zero;
  int64_t *shard_begin, *shard_len;
  float *gather;                // scratch for the all-gather
  struct mr_comm_group *env_dp; // borrowed data-parallel group, or NULL
  size_t gather_floats;
};

static void finish_accumulation(void *ctx, int i);

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void mr_trainer_free(struct mr_trainer *t) {
  if (!t)
    return;
  for (int i = 0; i < t->n_params; i++) {
    if (t->m)
      free(t->m[i]);
    if (t->v)
      free(t->v[i]);
    if (t->acc)
      free(t->acc[i]);
  }
  free(t->acc);
  free(t->shard_begin);
  free(t->shard_len);
  free(t->gather);
  free(t->m);
  free(t->v);
  free(t->params);
  free(t->slots);
  mr_grad_sync_free(t->sync);
  mr_exec_close(&t->exec);
  mr_model_close(&t->model);
  mr_tokens_close(&t->train);
  mr_tokens_close(&t->val);
  free(t);
}

int mr_trainer_new(const struct mr_job *job, int threads,
                   struct mr_trainer **out) {
  return mr_trainer_new_dp(job, threads, NULL, out);
}

int mr_trainer_new_dp(const struct mr_job *job, int threads, struct mr_comm_group *dp,
                      struct mr_trainer **out) {
  const struct mr_train_config *tc = &job->train;
  int dp_size = dp != NULL ? dp->comm->ops->group_size(dp) : 1;
  int accum = job->strategy.grad_accum_steps > 1 ? job->strategy.grad_accum_steps : 1;
  if (tc->global_batch % ((int64_t)dp_size * accum) != 0)
    return mr_error_set(MR_EINVAL,
                        "train.global_batch (%lld) must be a multiple of the data-parallel "
                        "degree (%d) times strategy.gradient_accumulation_steps (%d)",
                        (long long)tc->global_batch, dp_size, accum);
  struct mr_trainer *t = calloc(1, sizeof *t);
  if (!t)
    return MR_ENOMEM;
  int rc;
  t->job = job;
  t->dp_size = dp_size;
  t->dp_rank = dp != NULL ? dp->comm->ops->group_rank(dp) : 0;
  t->accum = accum;
  t->zero = dp_size > 1 && job->strategy.zero_stage >= 1;
  MR_TRY_GOTO(rc, mr_model_build(&job->model, tc->global_batch / dp_size / accum, tc->seq_len,
                                 &t->model), fail);
  struct mr_graph *g = &t->model.graph;
  MR_TRY_GOTO(rc, mr_autodiff(g, t->model.loss, &t->seed_grad), fail);
  enum mr_amp_mode amp = job->strategy.amp_dtype == MR_AMP_BF16 ? MR_AMP_ROUND_BF16
                         : job->strategy.amp_dtype == MR_AMP_FP16 ? MR_AMP_ROUND_F16
                                                                   : MR_AMP_NONE;
  MR_TRY_GOTO(rc, mr_exec_init(&t->exec, g, threads, amp), fail);
  t->step_flops = mr_graph_flops(g);
  rc = MR_ENOMEM;
  t->params = malloc((size_t)g->n_tensors * sizeof *t->params);
  if (!t->params)
    goto fail;
  for (int i = 0; i < g->n_tensors; i++)
    if (g->tensors[i].role == MR_ROLE_PARAM && g->tensors[i].grad >= 0)
      t->params[t->n_params++] = i;
  t->m = calloc((size_t)t->n_params, sizeof *t->m);
  t->v = calloc((size_t)t->n_params, sizeof *t->v);
  t->acc = calloc((size_t)t->n_params, sizeof *t->acc);
  t->shard_begin = calloc((size_t)t->n_params, sizeof *t->shard_begin);
  t->shard_len = calloc((size_t)t->n_params, sizeof *t->shard_len);
  if (!t->m || !t->v || !t->acc || !t->shard_begin || !t->shard_len)
    goto fail;
  for (int i = 0; i < t->n_params; i++) {
    int64_t numel = mr_tensor_numel(&g->tensors[t->params[i]]);
    t->shard_begin[i] = 0;
    t->shard_len[i] = numel;
    if (t->zero) {
      int64_t block = (numel + dp_size - 1) / dp_size;
      int64_t b = block * t->dp_rank;
      t->shard_begin[i] = b < numel ? b : numel;
      t->shard_len[i] = b >= numel ? 0 : (numel - b < block ? numel - b : block);
      if ((size_t)(block * dp_size) > t->gather_floats)
        t->gather_floats = (size_t)(block * dp_size);
    }
    size_t n = (size_t)t->shard_len[i];
    t->m[i] = calloc(n > 0 ? n : 1, sizeof(float));
    t->v[i] = calloc(n > 0 ? n : 1, sizeof(float));
    if (!t->m[i] || !t->v[i])
      goto fail;
    if (accum > 1 && !(t->acc[i] = calloc((size_t)numel, sizeof(float))))
      goto fail;
  }
  if (t->zero &&
      !(t->gather = malloc((t->gather_floats + t->gather_floats / (size_t)dp_size + 1) *
                           sizeof(float))))
    goto fail;
  t->env_dp = dp;
  if (dp != NULL) {
    MR_TRY_GOTO(rc, mr_grad_sync_new(dp, &t->exec, t->params, t->n_params, &t->sync), fail);
    mr_grad_sync_set_prepare(t->sync, finish_accumulation, t);
  }
  if (!tc->init || strcmp(tc->init, "random") == 0)
    mr_weights_init(&t->model, &t->exec, tc->seed);
  else
    MR_TRY_GOTO(rc, mr_weights_load(&t->model, &t->exec, tc->init), fail);
  t->adamw = mr_adamw_defaults();
  t->adamw.beta1 = (float)tc->beta1;
  t->adamw.beta2 = (float)tc->beta2;
  t->adamw.eps = (float)tc->eps;
  t->adamw.weight_decay = (float)tc->weight_decay;
  double init_scale = job->strategy.init_loss_scaling > 0
                          ? job->strategy.init_loss_scaling : 1024.0;
  mr_loss_scaler_init(&t->scaler, amp == MR_AMP_ROUND_F16, init_scale,
                      mr_tunable_int(MR_TUNABLE_LOSS_SCALE_GROWTH));
  t->inject_step = mr_tunable_int(MR_TUNABLE_INJECT_OVERFLOW_STEP);
  MR_TRY_GOTO(rc, mr_tokens_open(&t->train, job->data_train,
                                 job->model.vocab_size), fail);
  if (job->data_val) {
    MR_TRY_GOTO(rc, mr_tokens_open(&t->val, job->data_val,
                                   job->model.vocab_size), fail);
    t->have_val = 1;
  }
  *out = t;
  return 0;
fail:
  mr_trainer_free(t);
  return rc;
}

/* Fills the graph's inputs with rows of a batch; eval_batch < 0: training
 * rows of step `step` (0-based).  This rank's micro-batch `micro` holds
 * global rows (dp_rank * accum + micro) * batch onwards, so the global
 * batch is the same whatever the data-parallel degree and accumulation. */
static int load_batch(struct mr_trainer *t, int64_t step, int64_t eval_batch, int micro) {
  const struct mr_model *m = &t->model;
  int32_t *ids = mr_exec_buf(&t->exec, m->input_ids);
  int32_t *lab = mr_exec_buf(&t->exec, m->labels);
  int64_t T = m->seq;
  /* global row numbers: the global batch is the same whatever dp is */
  int64_t first = ((int64_t)t->dp_rank * t->accum + micro) * m->batch;
  for (int64_t r = 0; r < m->batch; r++) {
    if (eval_batch < 0)
      MR_TRY(mr_tokens_batch_row(&t->train, t->job->train.seed, step, first + r, T,
                                 ids + r * T, lab + r * T));
    else
      MR_TRY(mr_tokens_eval_row(t->have_val ? &t->val : &t->train, eval_batch,
                                first + r, m->batch * t->accum * t->dp_size, T, ids + r * T,
                                lab + r * T));
  }
  if (m->position_ids >= 0) {
    int32_t *pos = mr_exec_buf(&t->exec, m->position_ids);
    for (int64_t i = 0; i < m->batch * T; i++)
      pos[i] = (int32_t)(i % T);
  }
  return 0;
}

static uint64_t peak_bytes(const struct mr_trainer *t) {
  uint64_t opt = 0;
  for (int i = 0; i < t->n_params; i++) {
    opt += 2 * (uint64_t)t->shard_len[i] * sizeof(float);
    if (t->accum > 1)
      opt += (uint64_t)mr_tensor_bytes(&t->model.graph.tensors[t->params[i]]);
  }
  return mr_exec_peak_bytes(&t->exec) + opt + t->gather_floats * sizeof(float);
}

/* The last micro-batch's gradient of parameter i becomes the mean over the
 * step's micro-batches (called just before it is synchronised). */
static void finish_accumulation(void *ctx, int i) {
  struct mr_trainer *t = ctx;
  if (t->accum <= 1)
    return;
  const struct mr_tensor *p = &t->model.graph.tensors[t->params[i]];
  float *gr = mr_exec_buf(&t->exec, p->grad);
  const float *acc = t->acc[i];
  float inv = 1.0f / (float)t->accum;
  for (int64_t e = 0, n = mr_tensor_numel(p); e < n; e++)
    gr[e] = (gr[e] + acc[e]) * inv;
}

/* ZeRO-1: every rank updated its block of each parameter; gather them. */
static int gather_params(struct mr_trainer *t) {
  const struct mr_graph *g = &t->model.graph;
  for (int i = 0; i < t->n_params; i++) {
    int64_t numel = mr_tensor_numel(&g->tensors[t->params[i]]);
    size_t block = (size_t)((numel + t->dp_size - 1) / t->dp_size);
    float *p = mr_exec_buf(&t->exec, t->params[i]);
    float *mine = t->gather + t->gather_floats; /* the send block, past the gathered */
    memset(mine, 0, block * sizeof(float));
    memcpy(mine, p + t->shard_begin[i], (size_t)t->shard_len[i] * sizeof(float));
    struct mr_comm_req *req;
    MR_TRY(mr_comm_all_gather(t->env_dp, mine, t->gather, block, NULL, MR_F32, &req));
    MR_TRY(mr_comm_wait(req));
    memcpy(p, t->gather, (size_t)numel * sizeof(float));
  }
  return 0;
}

int mr_trainer_step(struct mr_trainer *t, int64_t step,
                    struct mr_step_report *r) {
  const struct mr_train_config *tc = &t->job->train;
  struct mr_graph *g = &t->model.graph;
  double t0 = now();
  memset(r, 0, sizeof *r);
  r->step = step;
  r->val_loss = NAN;
  double loss_sum = 0;
  for (int micro = 0; micro < t->accum; micro++) {
    int last = micro == t->accum - 1;
    MR_TRY(load_batch(t, step - 1, -1, micro));
    float *seed = mr_exec_buf(&t->exec, t->seed_grad);
    seed[0] = (float)t->scaler.scale;
    MR_TRY(mr_exec_run(&t->exec, 0, g->n_forward_ops));
    loss_sum += ((float *)mr_exec_buf(&t->exec, t->model.loss))[0];
    if (!last) { /* accumulate locally: no communication before the last */
      MR_TRY(mr_exec_run(&t->exec, g->n_forward_ops, g->n_ops));
      for (int i = 0; i < t->n_params; i++) {
        const struct mr_tensor *p = &g->tensors[t->params[i]];
        const float *gr = mr_exec_buf(&t->exec, p->grad);
        float *acc = t->acc[i];
        int64_t n = mr_tensor_numel(p);
        if (micro == 0)
          memcpy(acc, gr, (size_t)n * sizeof(float));
        else
          for (int64_t e = 0; e < n; e++)
            acc[e] += gr[e];
      }
    } else if (t->sync == NULL) {
      MR_TRY(mr_exec_run(&t->exec, g->n_forward_ops, g->n_ops));
      for (int i = 0; i < t->n_params; i++)
        finish_accumulation(t, i);
    } else {
      MR_TRY(mr_grad_sync_run(t->sync, g->n_forward_ops, g->n_ops));
      MR_TRY(mr_grad_sync_wait(t->sync, &r->comm_wait_s));
    }
  }
  float loss = (float)(loss_sum / t->accum);
  if (t->sync != NULL)
    MR_TRY(mr_grad_sync_average(t->sync, &loss, 1));
  r->loss = loss;
  if (step == t->inject_step && t->n_params > 0)
    ((float *)mr_exec_buf(&t->exec, g->tensors[t->params[0]].grad))[0] = INFINITY;
  double ss = 0;
  for (int i = 0; i < t->n_params; i++) {
    const struct mr_tensor *p = &g->tensors[t->params[i]];
    double part;
    MR_TRY(mr_cpu_sumsq(t->exec.cpu.pool, &part, mr_exec_buf(&t->exec, p->grad),
                        (size_t)mr_tensor_numel(p)));
    ss += part;
  }
  double scale = t->scaler.scale;
  r->loss_scale = scale;
  r->lr = mr_lr_at(tc, step - 1);
  r->grad_norm = sqrt(ss) / scale;
  int overflow = !isfinite(ss);
  r->skipped = mr_loss_scaler_update(&t->scaler, overflow);
  if (r->skipped) {
    MR_WARN("train", "step %lld: gradients not finite at loss scale %g; "
            "update skipped (%lld so far), scale now %g", (long long)step,
            scale, (long long)t->scaler.skipped, t->scaler.scale);
  } else {
    struct mr_adamw h = t->adamw;
    h.lr = (float)r->lr;
    h.grad_scale = (float)(mr_clip_factor(r->grad_norm, tc->grad_clip) / scale);
    /* optimizer step counts only applied updates, as GradScaler's skip */
    int64_t opt_step = step - t->scaler.skipped;
    for (int i = 0; i < t->n_params; i++) {
      const struct mr_tensor *p = &g->tensors[t->params[i]];
      MR_TRY(mr_cpu_adamw_step(t->exec.cpu.pool,
                               (float *)mr_exec_buf(&t->exec, t->params[i]) + t->shard_begin[i],
                               (float *)mr_exec_buf(&t->exec, p->grad) + t->shard_begin[i],
                               t->m[i], t->v[i], (size_t)t->shard_len[i], &h, opt_step));
    }
    if (t->zero)
      MR_TRY(gather_params(t));
  }
  r->step_time_s = now() - t0;
  r->tokens_per_s =
      (double)(t->model.batch * t->accum * t->dp_size * t->model.seq) / r->step_time_s;
  r->peak_memory_bytes = peak_bytes(t);
  return 0;
}

int mr_trainer_eval(struct mr_trainer *t, double *loss) {
  int64_t nb = t->job->train.eval_batches > 0 ? t->job->train.eval_batches : 1;
  double sum = 0;
  for (int64_t b = 0; b < nb; b++) {
    float batch_loss = 0;
    for (int micro = 0; micro < t->accum; micro++) {
      MR_TRY(load_batch(t, 0, b, micro));
      MR_TRY(mr_exec_run(&t->exec, 0, t->model.graph.n_forward_ops));
      batch_loss += ((float *)mr_exec_buf(&t->exec, t->model.loss))[0] / (float)t->accum;
    }
    if (t->sync != NULL)
      MR_TRY(mr_grad_sync_average(t->sync, &batch_loss, 1));
    sum += batch_loss;
  }
  *loss = sum / (double)nb;
  return 0;
}

int mr_trainer_save(const struct mr_trainer *t, const char *path) {
  return mr_weights_save(&t->model, &t->exec, path);
}

struct mr_exec *mr_trainer_exec(struct mr_trainer *t) { return &t->exec; }

int mr_trainer_slots(struct mr_trainer *t, const struct mr_train_slot **slots) {
  if (t->slots == NULL) {
    t->slots = calloc((size_t)(t->n_params > 0 ? t->n_params : 1), sizeof *t->slots);
    if (t->slots == NULL)
      return MR_ENOMEM;
    const struct mr_graph *g = &t->model.graph;
    for (int i = 0; i < t->n_params; i++) {
      const struct mr_tensor *p = &g->tensors[t->params[i]];
      t->slots[i] = (struct mr_train_slot){
          .name = p->name, .param = mr_exec_buf(&t->exec, t->params[i]), .m = t->m[i],
          .v = t->v[i], .numel = mr_tensor_numel(p), .shard_begin = t->shard_begin[i],
          .shard_len = t->shard_len[i], .ndim = p->ndim, .shape = p->shape};
    }
  }
  *slots = t->slots;
  return t->n_params;
}

struct mr_loss_scaler *mr_trainer_scaler(struct mr_trainer *t) { return &t->scaler; }

double mr_trainer_step_flops(const struct mr_trainer *t) { return t->step_flops; }

static void write_metrics(FILE *f, const struct mr_step_report *r) {
  /* JSON has no infinity: a norm that overflowed is written as null */
  fprintf(f, "{\"step\":%lld,\"loss\":%.6f,\"lr\":%.6g,", (long long)r->step, r->loss, r->lr);
  if (isfinite(r->grad_norm))
    fprintf(f, "\"grad_norm\":%.6g,", r->grad_norm);
  else
    fprintf(f, "\"grad_norm\":null,");
  fprintf(f, "\"tokens_per_s\":%.1f,\"loss_scale\":%g,\"step_time_s\":%.4f,"
          "\"peak_memory_bytes\":%llu,\"skipped\":%d",
          r->tokens_per_s, r->loss_scale, r->step_time_s,
          (unsigned long long)r->peak_memory_bytes, r->skipped);
  if (!isnan(r->val_loss))
    fprintf(f, ",\"val_loss\":%.6f", r->val_loss);
  fputs("}\n", f);
  fflush(f);
}

int mr_train_run(const struct mr_job *job, const struct mr_run_env *env) {
  struct mr_trainer *t;
  int threads = env->threads > 0 ? env->threads : 1;
  MR_TRY(mr_trainer_new_dp(job, threads, env->dp_group, &t));
  FILE *mf = NULL;
  int rc = 0;
  if (env->metrics_path && !(mf = fopen(env->metrics_path, "a"))) {
    rc = mr_error_set(mr_from_errno(errno), "%s: cannot open for metrics: %s",
                      env->metrics_path, strerror(errno));
    goto out;
  }
  for (int64_t s = 1; s <= job->train.steps; s++) {
    if (env->reporter->stop_requested &&
        env->reporter->stop_requested(env->reporter->ctx))
      break;
    struct mr_step_report r;
    MR_TRY_GOTO(rc, mr_trainer_step(t, s, &r), out);
    int64_t ev = job->train.eval_interval_steps;
    if (ev > 0 && (s % ev == 0 || s == job->train.steps))
      MR_TRY_GOTO(rc, mr_trainer_eval(t, &r.val_loss), out);
    if (mf)
      write_metrics(mf, &r);
    if (env->reporter->step)
      env->reporter->step(env->reporter->ctx, &r);
    int64_t li = job->train.log_interval_steps > 0 ? job->train.log_interval_steps : 1;
    if (s % li == 0 && getenv("MESHRUN_LAUNCHER_PID") == NULL)
      MR_INFO("train", "step %lld loss %.4f lr %.3g norm %.3g %.0f tok/s%s",
              (long long)s, r.loss, r.lr, r.grad_norm, r.tokens_per_s,
              r.skipped ? " (skipped)" : "");
  }
  if (env->weights_out)
    MR_TRY_GOTO(rc, mr_trainer_save(t, env->weights_out), out);
out:
  if (mf)
    fclose(mf);
  mr_trainer_free(t);
  return rc;
}
