/* optim.c - AdamW, clipping, schedules, loss scaling. */
#include "worker/optim.h"

#include <math.h>

#include "common/tunable.h"

double mr_clip_factor(double norm, double max_norm) {
  if (max_norm <= 0)
    return 1.0;
  double c = max_norm / (norm + 1e-6);
  return c < 1.0 ? c : 1.0;
}

double mr_lr_at(const struct mr_train_config *tc, int64_t s) {
  if (tc->warmup_steps > 0 && s < tc->warmup_steps)
    return tc->lr * (double)(s + 1) / (double)tc->warmup_steps;
  if (tc->schedule != MR_SCHEDULE_COSINE)
    return tc->lr;
  int64_t span = tc->steps - tc->warmup_steps - 1;
  double progress = span > 0 ? (double)(s - tc->warmup_steps) / (double)span : 1;
  if (progress > 1)
    progress = 1;
  return tc->min_lr + 0.5 * (tc->lr - tc->min_lr) * (1 + cos(M_PI * progress));
}

void mr_loss_scaler_init(struct mr_loss_scaler *s, int enabled,
                         double init_scale, int64_t growth_interval) {
  s->enabled = enabled;
  s->scale = enabled ? init_scale : 1.0;
  s->growth_interval = growth_interval > 0 ? growth_interval : 2000;
  s->clean_steps = 0;
  s->skipped = 0;
}

int mr_loss_scaler_update(struct mr_loss_scaler *s, int found_overflow) {
  if (!s->enabled) {
    s->skipped += found_overflow; /* fp32/bf16: a non-finite step is skipped */
    return found_overflow;
  }
  if (found_overflow) {
    s->scale *= 0.5;
    s->clean_steps = 0;
    s->skipped++;
    return 1;
  }
  if (++s->clean_steps >= s->growth_interval) {
    s->scale *= 2.0;
    s->clean_steps = 0;
  }
  return 0;
}

struct mr_adamw mr_adamw_of_job(const struct mr_train_config *tc) {
  struct mr_adamw h = mr_adamw_defaults();
  h.beta1 = (float)tc->beta1;
  h.beta2 = (float)tc->beta2;
  h.eps = (float)tc->eps;
  h.weight_decay = (float)tc->weight_decay;
  return h;
}

void mr_loss_scaler_of_job(struct mr_loss_scaler *s, const struct mr_job *job, int fp16) {
  double init = job->strategy.init_loss_scaling > 0 ? job->strategy.init_loss_scaling : 1024.0;
  mr_loss_scaler_init(s, fp16, init, mr_tunable_int(MR_TUNABLE_LOSS_SCALE_GROWTH));
}
