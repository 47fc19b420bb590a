/* train.h - single-rank training: the model's graph and its backward run
 * by the executor, AdamW, the job's schedule, mixed precision, evaluation,
 * metrics and the final weights.
 *
 * The executor-based trainer of one process: the reference the distributed
 * runtime (worker/runtime.h) is tested against, and what the benchmarks and
 * single-process tools drive step by step.
 *
 * Mixed precision on the CPU: parameters, gradients and optimizer state
 * stay float32 (the master weights); the operands of every matmul and of
 * attention are rounded to bf16 or fp16 (round to nearest even) where a GPU
 * would store them in 16 bits, and products accumulate in float32.  fp16
 * multiplies the loss by a dynamic scale (strategy.amp.init_loss_scaling,
 * default 1024), unscales the gradients before clipping, skips any step
 * whose gradients are not finite and halves the scale, and doubles it after
 * MESHRUN_LOSS_SCALE_GROWTH_INTERVAL clean steps. */
#ifndef MR_TRAIN_H
#define MR_TRAIN_H

#include <stdint.h>
#include <stdio.h>

#include "common/job.h"
#include "worker/reporter.h"

struct mr_trainer;

/* Builds the model of job->model for global_batch x seq_len, plans its
 * memory, initializes or loads the weights (train.init), opens the token
 * files.  threads: compute threads.  *out is freed by mr_trainer_free.
 * Returns 0 or a negative code with a message naming what failed. */
int mr_trainer_new(const struct mr_job *job, int threads,
                   struct mr_trainer **out);

/* Runs optimizer step `step` (1-based): reads its rows, forward, backward,
 * loss scaling, clipping, AdamW.  Fills r (val_loss NaN).  Returns 0 or a
 * kernel's error. */
int mr_trainer_step(struct mr_trainer *t, int64_t step,
                    struct mr_step_report *r);

/* Mean loss over train.eval_batches batches of the validation file (the
 * training file when there is none) into *loss. */
int mr_trainer_eval(struct mr_trainer *t, double *loss);

/* Writes the weights (safetensors, HF names, config in the metadata). */
int mr_trainer_save(const struct mr_trainer *t, const char *path);

/* Model FLOPs of one step (forward and backward as executed). */
double mr_trainer_step_flops(const struct mr_trainer *t);

/* The executor, for profiling (borrowed). */
struct mr_exec *mr_trainer_exec(struct mr_trainer *t);

void mr_trainer_free(struct mr_trainer *t);

/* The loss scaler (fp16).  Borrowed. */
struct mr_loss_scaler *mr_trainer_scaler(struct mr_trainer *t);

/* Trains job in this process for train.steps steps: reports each step to
 * env->reporter (stopping early when it asks), evaluates every
 * eval_interval_steps, appends one JSON object per step to
 * env->metrics_path and writes env->weights_out at the end.  Returns 0 or
 * a negative code with a message.  (`meshrun launch` workers run
 * worker/dist_train.h instead.) */
int mr_train_run(const struct mr_job *job, const struct mr_run_env *env);

/* What every training loop opens first: env->metrics_path for appending
 * into *out (NULL when there is none).  Returns 0 or an error naming the
 * file. */
int mr_train_open_metrics(const struct mr_run_env *env, FILE **out);

/* What every training loop does after a step: appends r to metrics (a JSON
 * line; NULL: none), hands it to env->reporter and, when log is nonzero
 * and the step is on train.log_interval_steps, logs one line. */
void mr_train_report_step(const struct mr_job *job, const struct mr_run_env *env,
                          FILE *metrics, const struct mr_step_report *r, int log);

#endif
