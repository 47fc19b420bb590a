/* optim.c - AdamW (torch.optim.AdamW), the sum of squares behind the global
 * gradient norm, the fp16/bf16 conversions and the overflow check of dynamic
 * loss scaling. */
#include <math.h>
#include <stdlib.h>

#include "common/dtype.h"
#include "common/error.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/backend/cpu/par.h"
#include "worker/backend/cpu/simd.h"

struct mr_adamw mr_adamw_defaults(void) {
  return (struct mr_adamw){.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f,
                           .eps = 1e-8f, .weight_decay = 0.01f,
                           .grad_scale = 1.0f};
}

struct adamw_job {
  float *p, *m, *v;
  const float *g;
  float decay, b1, b2, step_size, bc2_sqrt, eps, gs;
};

/* Same operation order as torch 1.13's _single_tensor_adamw. */
MR_CPU_BODY void adamw_k_body(float *p, const float *grad, float *m, float *v,
                            size_t n, float decay, float b1, float b2,
                            float step_size, float bc2_sqrt, float eps,
                            float gs) {
  for (size_t i = 0; i < n; i++) {
    float g = grad[i] * gs;
    float pi = p[i] * decay;
    float mi = m[i] * b1 + g * (1.0f - b1);
    float vi = v[i] * b2 + (1.0f - b2) * g * g;
    float denom = sqrtf(vi) / bc2_sqrt + eps;
    p[i] = pi - step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
  }
}
MR_CPU_DISPATCH(adamw_k,
                (float *p, const float *grad, float *m, float *v, size_t n,
                 float decay, float b1, float b2, float step_size,
                 float bc2_sqrt, float eps, float gs),
                (p, grad, m, v, n, decay, b1, b2, step_size, bc2_sqrt, eps, gs))

static int adamw_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct adamw_job *j = arg;
  adamw_k(j->p + lo, j->g + lo, j->m + lo, j->v + lo, hi - lo, j->decay, j->b1,
          j->b2, j->step_size, j->bc2_sqrt, j->eps, j->gs);
  return 0;
}

int mr_cpu_adamw_step(struct mr_pool *pool, float *p, const float *grad,
                      float *m, float *v, size_t n, const struct mr_adamw *h,
                      int64_t t) {
  if (t < 1)
    return mr_error_set(MR_EINVAL, "adamw: step must be >= 1, got %lld", (long long)t);
  if (!(h->beta1 >= 0 && h->beta1 < 1 && h->beta2 >= 0 && h->beta2 < 1))
    return mr_error_set(MR_EINVAL, "adamw: betas must lie in [0, 1), got (%g, %g)",
                        (double)h->beta1, (double)h->beta2);
  /* torch computes the bias corrections in Python floats (double) */
  double bc1 = 1.0 - pow((double)h->beta1, (double)t);
  double bc2 = 1.0 - pow((double)h->beta2, (double)t);
  struct adamw_job j = {
      .p = p, .m = m, .v = v, .g = grad,
      .decay = 1.0f - h->lr * h->weight_decay,
      .b1 = h->beta1, .b2 = h->beta2,
      .step_size = (float)(h->lr / bc1), .bc2_sqrt = (float)sqrt(bc2),
      .eps = h->eps, .gs = h->grad_scale};
  return mr__par_range(pool, n, MR__STREAM_CHUNK, adamw_range, &j);
}

/* ---- sum of squares ---- */

#define SUMSQ_CHUNK 4096

MR_CPU_BODY double sumsq_body(const float *x, size_t n) {
  /* 8 float lanes over 256 elements, widened to double after each: exact
   * enough for a norm, and vectorizable */
  double total = 0;
  for (size_t i0 = 0; i0 < n; i0 += 256) {
    size_t e = i0 + 256 < n ? i0 + 256 : n;
    float acc[8] = {0};
    size_t i = i0;
    for (; i + 8 <= e; i += 8)
      for (int l = 0; l < 8; l++)
        acc[l] += x[i + l] * x[i + l];
    float s = mr__hsum8(acc);
    for (; i < e; i++)
      s += x[i] * x[i];
    total += s;
  }
  return total;
}
__attribute__((target("avx2,fma"))) static double sumsq_avx2(const float *x, size_t n) {
  return sumsq_body(x, n);
}
static double sumsq_base(const float *x, size_t n) { return sumsq_body(x, n); }

struct sumsq_job {
  const float *x;
  double *part;
};

static int sumsq_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct sumsq_job *j = arg;
  j->part[lo / SUMSQ_CHUNK] = mr__cpu_has_avx2() ? sumsq_avx2(j->x + lo, hi - lo)
                                                 : sumsq_base(j->x + lo, hi - lo);
  return 0;
}

int mr_cpu_sumsq(struct mr_pool *pool, double *out, const float *x, size_t n) {
  size_t nchunks = (n + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK;
  double *part = mr__pool_shared_scratch(pool, (nchunks + 1) * sizeof(double));
  if (!part)
    return mr_error_set(MR_ENOMEM, "sumsq: no memory for %zu partial sums", nchunks);
  struct sumsq_job j = {x, part};
  MR_TRY(mr__par_range(pool, n, SUMSQ_CHUNK, sumsq_range, &j));
  double s = 0;
  for (size_t i = 0; i < nchunks; i++)
    s += part[i];
  *out = s;
  return 0;
}

/* ---- conversions ---- */

struct conv_job {
  void *dst;
  const void *src;
};

static int to_bf16_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct conv_job *j = arg;
  mr_f32_to_bf16_n((uint16_t *)j->dst + lo, (const float *)j->src + lo, hi - lo);
  return 0;
}
static int from_bf16_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct conv_job *j = arg;
  mr_bf16_to_f32_n((float *)j->dst + lo, (const uint16_t *)j->src + lo, hi - lo);
  return 0;
}
static int to_f16_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct conv_job *j = arg;
  mr_f32_to_f16_n((uint16_t *)j->dst + lo, (const float *)j->src + lo, hi - lo);
  return 0;
}
static int from_f16_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct conv_job *j = arg;
  mr_f16_to_f32_n((float *)j->dst + lo, (const uint16_t *)j->src + lo, hi - lo);
  return 0;
}

MR_CPU_BODY void round_bf16_body(float *dst, const float *src, size_t n) {
  for (size_t i = 0; i < n; i++)
    dst[i] = mr_bf16_to_f32(mr_f32_to_bf16(src[i]));
}
static int round_bf16_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct conv_job *j = arg;
  round_bf16_body((float *)j->dst + lo, (const float *)j->src + lo, hi - lo);
  return 0;
}

int mr_cpu_round_bf16(struct mr_pool *pool, float *dst, const float *src, size_t n) {
  struct conv_job j = {dst, src};
  return mr__par_range(pool, n, MR__STREAM_CHUNK, round_bf16_range, &j);
}

int mr_cpu_to_bf16(struct mr_pool *pool, uint16_t *dst, const float *src, size_t n) {
  struct conv_job j = {dst, src};
  return mr__par_range(pool, n, MR__STREAM_CHUNK, to_bf16_range, &j);
}
int mr_cpu_from_bf16(struct mr_pool *pool, float *dst, const uint16_t *src, size_t n) {
  struct conv_job j = {dst, src};
  return mr__par_range(pool, n, MR__STREAM_CHUNK, from_bf16_range, &j);
}
int mr_cpu_to_f16(struct mr_pool *pool, uint16_t *dst, const float *src, size_t n) {
  struct conv_job j = {dst, src};
  return mr__par_range(pool, n, MR__STREAM_CHUNK, to_f16_range, &j);
}
int mr_cpu_from_f16(struct mr_pool *pool, float *dst, const uint16_t *src, size_t n) {
  struct conv_job j = {dst, src};
  return mr__par_range(pool, n, MR__STREAM_CHUNK, from_f16_range, &j);
}

/* ---- overflow check ---- */

struct finite_job {
  const void *x;
  uint32_t mask, expo; // exponent field: all ones means inf or NaN
  int h16;
  int bad;             // written only when a task finds one (benign race
                       // avoided: atomic store)
};

MR_CPU_BODY int bad32_body(const uint32_t *x, size_t n) {
  uint32_t any = 0;
  for (size_t i = 0; i < n; i++)
    any |= (x[i] & 0x7f800000u) == 0x7f800000u;
  return (int)any;
}
MR_CPU_BODY int bad16_body(const uint16_t *x, size_t n, uint16_t expo) {
  uint32_t any = 0;
  for (size_t i = 0; i < n; i++)
    any |= (uint16_t)(x[i] & expo) == expo;
  return (int)any;
}
__attribute__((target("avx2"))) static int bad32_avx2(const uint32_t *x, size_t n) {
  return bad32_body(x, n);
}
static int bad32_base(const uint32_t *x, size_t n) { return bad32_body(x, n); }
__attribute__((target("avx2"))) static int bad16_avx2(const uint16_t *x, size_t n,
                                                      uint16_t e) {
  return bad16_body(x, n, e);
}
static int bad16_base(const uint16_t *x, size_t n, uint16_t e) {
  return bad16_body(x, n, e);
}

static int finite_range(void *arg, size_t lo, size_t hi, int thread) {
  struct finite_job *j = arg;
  int avx2 = mr__cpu_has_avx2(), bad;
  if (j->h16) {
    const uint16_t *x = (const uint16_t *)j->x + lo;
    uint16_t e = (uint16_t)j->expo;
    bad = avx2 ? bad16_avx2(x, hi - lo, e) : bad16_base(x, hi - lo, e);
  } else {
    const uint32_t *x = (const uint32_t *)j->x + lo;
    bad = avx2 ? bad32_avx2(x, hi - lo) : bad32_base(x, hi - lo);
  }
  if (bad)
    __atomic_store_n(&j->bad, 1, __ATOMIC_RELAXED);
  return 0;
}

int mr_cpu_all_finite(struct mr_pool *pool, bool *finite, const float *x, size_t n) {
  struct finite_job j = {.x = x};
  MR_TRY(mr__par_range(pool, n, MR__STREAM_CHUNK, finite_range, &j));
  *finite = !j.bad;
  return 0;
}

int mr_cpu_all_finite_h16(struct mr_pool *pool, bool *finite, const uint16_t *x,
                          size_t n, int dtype) {
  struct finite_job j = {.x = x, .h16 = 1};
  if (dtype == MR_F16)
    j.expo = 0x7c00;
  else if (dtype == MR_BF16)
    j.expo = 0x7f80;
  else
    return mr_error_set(MR_EINVAL, "all_finite_h16: dtype must be fp16 or bf16, got %d",
                        dtype);
  MR_TRY(mr__par_range(pool, n, MR__STREAM_CHUNK, finite_range, &j));
  *finite = !j.bad;
  return 0;
}
