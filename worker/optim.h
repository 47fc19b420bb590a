/* optim.h - around the optimizer step (AdamW itself is the backend's
 * mr_cpu_adamw_step, torch.optim.AdamW's semantics): global-norm gradient clipping as torch.nn.utils.clip_grad_norm_, the
 * learning-rate schedules of the job file, and dynamic loss scaling for
 * fp16 as torch.cuda.amp.GradScaler does it. */
#ifndef MR_OPTIM_H
#define MR_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "common/job.h"
#include "worker/backend/cpu/kernels.h"

/* The clip factor for a total gradient norm (torch: max_norm / (norm +
 * 1e-6), capped at 1); 1 when max_norm <= 0 (clipping off). */
double mr_clip_factor(double norm, double max_norm);

/* Learning rate at 0-based step s: linear warmup from lr/warmup to lr over
 * warmup_steps, then constant, or cosine from lr down to min_lr at the last
 * step. */
double mr_lr_at(const struct mr_train_config *tc, int64_t s);

/* Dynamic loss scaling: multiply the loss by `scale`; on a step whose
 * gradients overflowed skip the update and halve the scale; after
 * growth_interval clean steps in a row double it. */
struct mr_loss_scaler {
  double scale;           // 1 and never changed when disabled
  int enabled;
  int64_t growth_interval;
  int64_t clean_steps;    // since the last change
  int64_t skipped;        // steps skipped so far
};

void mr_loss_scaler_init(struct mr_loss_scaler *s, int enabled,
                         double init_scale, int64_t growth_interval);

/* Records one step's outcome; returns 1 when the step must be skipped. */
int mr_loss_scaler_update(struct mr_loss_scaler *s, int found_overflow);

/* The job's AdamW settings: its betas, eps and weight decay over torch's
 * defaults (the learning rate is set step by step). */
struct mr_adamw mr_adamw_of_job(const struct mr_train_config *tc);

/* The job's loss scaler: on for fp16, starting at
 * strategy.amp.init_loss_scaling (1024 when unset), growing after the
 * MESHRUN_LOSS_SCALE_GROWTH tunable's clean steps. */
void mr_loss_scaler_of_job(struct mr_loss_scaler *s, const struct mr_job *job, int fp16);

#endif
