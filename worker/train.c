/* train.c - the single-rank training loop. */
#include "worker/train.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "compiler/autodiff.h"
#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "compiler/ops.h"
#include "compiler/model.h"
#include "common/tokens.h"
#include "common/tunable.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/exec.h"
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
  /* gradient accumulation: `accum` micro-batches of `model.batch` rows per
   * step; acc[i] sums parameter i's gradient over the micro-batches */
  int accum;
  float **acc;
};

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
  free(t->m);
  free(t->v);
  free(t->params);
  mr_exec_close(&t->exec);
  mr_model_close(&t->model);
  mr_tokens_close(&t->train);
  mr_tokens_close(&t->val);
  free(t);
}

int mr_trainer_new(const struct mr_job *job, int threads,
                   struct mr_trainer **out) {
  const struct mr_train_config *tc = &job->train;
  int accum = job->strategy.grad_accum_steps > 1 ? job->strategy.grad_accum_steps : 1;
  if (tc->global_batch % accum != 0)
    return mr_error_set(MR_EINVAL,
                        "train.global_batch (%lld) must be a multiple of "
                        "strategy.gradient_accumulation_steps (%d)",
                        (long long)tc->global_batch, accum);
  struct mr_trainer *t = calloc(1, sizeof *t);
  if (!t)
    return MR_ENOMEM;
  int rc;
  t->job = job;
  t->accum = accum;
  MR_TRY_GOTO(rc, mr_model_build(&job->model, tc->global_batch / accum, tc->seq_len, &t->model),
              fail);
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
  if (!t->m || !t->v || !t->acc)
    goto fail;
  for (int i = 0; i < t->n_params; i++) {
    int64_t numel = mr_tensor_numel(&g->tensors[t->params[i]]);
    size_t n = (size_t)numel;
    t->m[i] = calloc(n > 0 ? n : 1, sizeof(float));
    t->v[i] = calloc(n > 0 ? n : 1, sizeof(float));
    if (!t->m[i] || !t->v[i])
      goto fail;
    if (accum > 1 && !(t->acc[i] = calloc((size_t)numel, sizeof(float))))
      goto fail;
  }
  if (!tc->init || strcmp(tc->init, "random") == 0)
    mr_weights_init(&t->model, &t->exec, tc->seed);
  else
    MR_TRY_GOTO(rc, mr_weights_load(&t->model, &t->exec, tc->init), fail);
  t->adamw = mr_adamw_of_job(tc);
  mr_loss_scaler_of_job(&t->scaler, job, amp == MR_AMP_ROUND_F16);
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
 * rows of step `step` (0-based).  Micro-batch `micro` holds global rows
 * micro * batch onwards, so the global batch is the same whatever the
 * accumulation. */
static int load_batch(struct mr_trainer *t, int64_t step, int64_t eval_batch, int micro) {
  const struct mr_model *m = &t->model;
  int32_t *ids = mr_exec_buf(&t->exec, m->input_ids);
  int32_t *lab = mr_exec_buf(&t->exec, m->labels);
  int64_t T = m->seq;
  int64_t first = (int64_t)micro * m->batch;
  for (int64_t r = 0; r < m->batch; r++) {
    if (eval_batch < 0)
      MR_TRY(mr_tokens_batch_row(&t->train, t->job->train.seed, step, first + r, T,
                                 ids + r * T, lab + r * T));
    else
      MR_TRY(mr_tokens_eval_row(t->have_val ? &t->val : &t->train, eval_batch,
                                first + r, m->batch * t->accum, T, ids + r * T,
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
    opt += 2 * (uint64_t)mr_tensor_bytes(&t->model.graph.tensors[t->params[i]]);
    if (t->accum > 1)
      opt += (uint64_t)mr_tensor_bytes(&t->model.graph.tensors[t->params[i]]);
  }
  return mr_exec_peak_bytes(&t->exec) + opt;
}

/* The last micro-batch's gradient of parameter i becomes the mean over the
 * step's micro-batches. */
static void finish_accumulation(struct mr_trainer *t, int i) {
  if (t->accum <= 1)
    return;
  const struct mr_tensor *p = &t->model.graph.tensors[t->params[i]];
  float *gr = mr_exec_buf(&t->exec, p->grad);
  const float *acc = t->acc[i];
  float inv = 1.0f / (float)t->accum;
  for (int64_t e = 0, n = mr_tensor_numel(p); e < n; e++)
    gr[e] = (gr[e] + acc[e]) * inv;
}

int mr_trainer_step(struct mr_trainer *t, int64_t step,
                    struct mr_step_report *r) {
  const struct mr_train_config *tc = &t->job->train;
  struct mr_graph *g = &t->model.graph;
  double t0 = mr_clock_s();
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
    MR_TRY(mr_exec_run(&t->exec, g->n_forward_ops, g->n_ops));
    if (!last) { /* accumulate locally: no communication before the last */
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
    } else {
      for (int i = 0; i < t->n_params; i++)
        finish_accumulation(t, i);
    }
  }
  r->loss = (float)(loss_sum / t->accum);
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
      MR_TRY(mr_cpu_adamw_step(t->exec.cpu.pool, (float *)mr_exec_buf(&t->exec, t->params[i]),
                               (float *)mr_exec_buf(&t->exec, p->grad), t->m[i], t->v[i],
                               (size_t)mr_tensor_numel(p), &h, opt_step));
    }
  }
  r->step_time_s = mr_clock_s() - t0;
  r->tokens_per_s =
      (double)(t->model.batch * t->accum * t->model.seq) / r->step_time_s;
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
    sum += batch_loss;
  }
  *loss = sum / (double)nb;
  return 0;
}

int mr_trainer_save(const struct mr_trainer *t, const char *path) {
  return mr_weights_save(&t->model, &t->exec, path);
}

struct mr_exec *mr_trainer_exec(struct mr_trainer *t) { return &t->exec; }

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

int mr_train_open_metrics(const struct mr_run_env *env, FILE **out) {
  *out = NULL;
  if (env->metrics_path != NULL && (*out = fopen(env->metrics_path, "a")) == NULL)
    return mr_error_set(mr_from_errno(errno), "%s: cannot open for metrics: %s",
                        env->metrics_path, strerror(errno));
  return 0;
}

void mr_train_report_step(const struct mr_job *job, const struct mr_run_env *env,
                          FILE *metrics, const struct mr_step_report *r, int log) {
  if (metrics)
    write_metrics(metrics, r);
  if (env->reporter->step)
    env->reporter->step(env->reporter->ctx, r);
  int64_t li = job->train.log_interval_steps > 0 ? job->train.log_interval_steps : 1;
  if (log && r->step % li == 0)
    MR_INFO("train", "step %lld loss %.4f lr %.3g norm %.3g %.0f tok/s%s", (long long)r->step,
            r->loss, r->lr, r->grad_norm, r->tokens_per_s, r->skipped ? " (skipped)" : "");
}

int mr_train_run(const struct mr_job *job, const struct mr_run_env *env) {
  struct mr_trainer *t;
  int threads = env->threads > 0 ? env->threads : 1;
  MR_TRY(mr_trainer_new(job, threads, &t));
  FILE *mf = NULL;
  int rc;
  MR_TRY_GOTO(rc, mr_train_open_metrics(env, &mf), out);
  for (int64_t s = 1; s <= job->train.steps; s++) {
    if (env->reporter->stop_requested &&
        env->reporter->stop_requested(env->reporter->ctx))
      break;
    struct mr_step_report r;
    MR_TRY_GOTO(rc, mr_trainer_step(t, s, &r), out);
    int64_t ev = job->train.eval_interval_steps;
    if (ev > 0 && (s % ev == 0 || s == job->train.steps))
      MR_TRY_GOTO(rc, mr_trainer_eval(t, &r.val_loss), out);
    mr_train_report_step(job, env, mf, &r, getenv("MESHRUN_LAUNCHER_PID") == NULL);
  }
  if (env->weights_out)
    MR_TRY_GOTO(rc, mr_trainer_save(t, env->weights_out), out);
out:
  if (mf)
    fclose(mf);
  mr_trainer_free(t);
  return rc;
}
