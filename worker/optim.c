/* optim.c - AdamW, clipping, schedules, loss scaling. */
#include "worker/optim.h"

#include <math.h>

void mr_adamw_update(const struct mr_adamw *o, int64_t step, double lr,
                     float *p, const float *g, float *m, float *v, size_t n) {
  float b1 = (float)o->beta1, b2 = (float)o->beta2;
  double bc1 = 1.0 - pow(o->beta1, (double)step);
  double bc2 = 1.0 - pow(o->beta2, (double)step);
  float decay = (float)(1.0 - lr * o->weight_decay);
  float step_size = (float)(lr / bc1), rbc2 = (float)(1.0 / sqrt(bc2));
  float eps = (float)o->eps;
  for (size_t i = 0; i < n; i++) {
    float gi = g[i];
    m[i] = b1 * m[i] + (1.0f - b1) * gi;
    v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
    float denom = sqrtf(v[i]) * rbc2 + eps;
    p[i] = p[i] * decay - step_size * m[i] / denom;
  }
}

double mr_sum_squares(const float *x, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; i++)
    s += (double)x[i] * x[i];
  return s;
}

void mr_scale_n(float *x, size_t n, float s) {
  for (size_t i = 0; i < n; i++)
    x[i] *= s;
}

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
