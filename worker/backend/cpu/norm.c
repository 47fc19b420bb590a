/* norm.c - RMSNorm (LLaMA) and LayerNorm (GPT-2), forward and backward.
 * Rows go to tasks for the forward and for dx; the weight and bias
 * gradients are summed per 64-column block over all rows in order, so they
 * do not depend on how rows were split. */
#include <math.h>

#include "common/error.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/backend/cpu/par.h"
#include "worker/backend/cpu/simd.h"

struct norm_job {
  float *y, *dx, *dw, *db, *mean, *rstd;
  const float *x, *dy, *w, *b, *cmean, *crstd;
  int N, C;
  float eps;
  bool accum;
};

static size_t rows_per_task(int C) {
  return C > 0 ? (MR__STREAM_CHUNK + (size_t)C - 1) / (size_t)C : 1;
}

static int check_nc(const char *what, int N, int C) {
  if (N < 0 || C <= 0)
    return mr_error_set(MR_EINVAL, "%s: expected N >= 0 and C > 0, got N=%d C=%d",
                        what, N, C);
  return 0;
}

/* ---- RMSNorm ---- */

MR_CPU_BODY void rms_fwd_k_body(float *y, float *rstd, const float *x,
                              const float *w, int C, float eps) {
  float ss = 0;
  for (int c = 0; c < C; c++)
    ss += x[c] * x[c];
  float r = 1.0f / sqrtf(ss / (float)C + eps);
  for (int c = 0; c < C; c++)
    y[c] = x[c] * r * w[c];
  if (rstd)
    *rstd = r;
}
MR_CPU_DISPATCH(rms_fwd_k,
                (float *y, float *rstd, const float *x, const float *w, int C,
                 float eps),
                (y, rstd, x, w, C, eps))

static int rms_fwd_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct norm_job *j = arg;
  for (size_t r = lo; r < hi; r++)
    rms_fwd_k(j->y + r * (size_t)j->C, j->rstd ? j->rstd + r : NULL,
              j->x + r * (size_t)j->C, j->w, j->C, j->eps);
  return 0;
}

int mr_cpu_rmsnorm_fwd(struct mr_pool *pool, float *y, float *rstd,
                       const float *x, const float *w, int N, int C, float eps) {
  MR_TRY(check_nc("rmsnorm_fwd", N, C));
  struct norm_job j = {.y = y, .rstd = rstd, .x = x, .w = w, .N = N, .C = C,
                       .eps = eps};
  return mr__par_range(pool, (size_t)N, rows_per_task(C), rms_fwd_range, &j);
}

/* dx = r w dy - r^3 / C * x * sum(dy w x) */
MR_CPU_BODY void rms_bwd_k_body(float *dx, const float *dy, const float *x,
                              const float *w, float r, int C, int accum) {
  float dot = 0;
  for (int c = 0; c < C; c++)
    dot += dy[c] * w[c] * x[c];
  float k = r * r * r * dot / (float)C;
  for (int c = 0; c < C; c++) {
    float g = r * w[c] * dy[c] - k * x[c];
    dx[c] = accum ? dx[c] + g : g;
  }
}
MR_CPU_DISPATCH(rms_bwd_k,
                (float *dx, const float *dy, const float *x, const float *w,
                 float r, int C, int accum),
                (dx, dy, x, w, r, C, accum))

static int rms_bwd_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct norm_job *j = arg;
  size_t C = (size_t)j->C;
  for (size_t r = lo; r < hi; r++)
    rms_bwd_k(j->dx + r * C, j->dy + r * C, j->x + r * C, j->w, j->crstd[r],
              j->C, j->accum);
  return 0;
}

/* Column block of width w <= 64 of the weight (and bias) gradient:
 * dw += sum_r dy[r] * (x[r] - mean[r]) * rstd[r]; db += sum_r dy[r]. */
MR_CPU_BODY void norm_dw_k_body(float *dw, float *db, const float *dy,
                              const float *x, const float *mean,
                              const float *rstd, int N, int ld, int w) {
  float aw[64], ab[64];
  for (int c = 0; c < w; c++)
    aw[c] = ab[c] = 0;
  for (int r = 0; r < N; r++) {
    const float *g = dy + (size_t)r * (size_t)ld, *xr = x + (size_t)r * (size_t)ld;
    float m = mean ? mean[r] : 0.0f, s = rstd[r];
    for (int c = 0; c < w; c++) {
      aw[c] += g[c] * ((xr[c] - m) * s);
      ab[c] += g[c];
    }
  }
  for (int c = 0; c < w; c++)
    dw[c] += aw[c];
  if (db)
    for (int c = 0; c < w; c++)
      db[c] += ab[c];
}
MR_CPU_DISPATCH(norm_dw_k,
                (float *dw, float *db, const float *dy, const float *x,
                 const float *mean, const float *rstd, int N, int ld, int w),
                (dw, db, dy, x, mean, rstd, N, ld, w))

static int norm_dw_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct norm_job *j = arg;
  norm_dw_k(j->dw + lo, j->db ? j->db + lo : NULL, j->dy + lo, j->x + lo,
            j->cmean, j->crstd, j->N, j->C, (int)(hi - lo));
  return 0;
}

int mr_cpu_rmsnorm_bwd(struct mr_pool *pool, float *dx, float *dw,
                       const float *dy, const float *x, const float *w,
                       const float *rstd, int N, int C, bool accum) {
  MR_TRY(check_nc("rmsnorm_bwd", N, C));
  struct norm_job j = {.dx = dx, .dw = dw, .dy = dy, .x = x, .w = w,
                       .crstd = rstd, .N = N, .C = C, .accum = accum};
  MR_TRY(mr__par_range(pool, (size_t)N, rows_per_task(C), rms_bwd_range, &j));
  return mr__par_range(pool, (size_t)C, 64, norm_dw_range, &j);
}

/* ---- LayerNorm ---- */

MR_CPU_BODY void ln_fwd_k_body(float *y, float *mean, float *rstd, const float *x,
                             const float *w, const float *b, int C, float eps) {
  float s = 0;
  for (int c = 0; c < C; c++)
    s += x[c];
  float m = s / (float)C;
  float v = 0;
  for (int c = 0; c < C; c++)
    v += (x[c] - m) * (x[c] - m);
  float r = 1.0f / sqrtf(v / (float)C + eps);
  for (int c = 0; c < C; c++)
    y[c] = (x[c] - m) * r * w[c] + b[c];
  if (mean) {
    *mean = m;
    *rstd = r;
  }
}
MR_CPU_DISPATCH(ln_fwd_k,
                (float *y, float *mean, float *rstd, const float *x,
                 const float *w, const float *b, int C, float eps),
                (y, mean, rstd, x, w, b, C, eps))

static int ln_fwd_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct norm_job *j = arg;
  size_t C = (size_t)j->C;
  for (size_t r = lo; r < hi; r++)
    ln_fwd_k(j->y + r * C, j->mean ? j->mean + r : NULL,
             j->rstd ? j->rstd + r : NULL, j->x + r * C, j->w, j->b, j->C,
             j->eps);
  return 0;
}

int mr_cpu_layernorm_fwd(struct mr_pool *pool, float *y, float *mean,
                         float *rstd, const float *x, const float *w,
                         const float *b, int N, int C, float eps) {
  MR_TRY(check_nc("layernorm_fwd", N, C));
  if (!mean != !rstd)
    return mr_error_set(MR_EINVAL, "layernorm_fwd: mean and rstd must both be "
                                   "given or both be NULL");
  struct norm_job j = {.y = y, .mean = mean, .rstd = rstd, .x = x, .w = w,
                       .b = b, .N = N, .C = C, .eps = eps};
  return mr__par_range(pool, (size_t)N, rows_per_task(C), ln_fwd_range, &j);
}

/* dx = r (g - mean(g) - xhat mean(g xhat)), g = dy w, xhat = (x - m) r */
MR_CPU_BODY void ln_bwd_k_body(float *dx, const float *dy, const float *x,
                             const float *w, float m, float r, int C, int accum) {
  float sg = 0, sgx = 0;
  for (int c = 0; c < C; c++) {
    float g = dy[c] * w[c];
    sg += g;
    sgx += g * ((x[c] - m) * r);
  }
  sg /= (float)C;
  sgx /= (float)C;
  for (int c = 0; c < C; c++) {
    float xh = (x[c] - m) * r;
    float v = r * (dy[c] * w[c] - sg - xh * sgx);
    dx[c] = accum ? dx[c] + v : v;
  }
}
MR_CPU_DISPATCH(ln_bwd_k,
                (float *dx, const float *dy, const float *x, const float *w,
                 float m, float r, int C, int accum),
                (dx, dy, x, w, m, r, C, accum))

static int ln_bwd_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct norm_job *j = arg;
  size_t C = (size_t)j->C;
  for (size_t r = lo; r < hi; r++)
    ln_bwd_k(j->dx + r * C, j->dy + r * C, j->x + r * C, j->w, j->cmean[r],
             j->crstd[r], j->C, j->accum);
  return 0;
}

int mr_cpu_layernorm_bwd(struct mr_pool *pool, float *dx, float *dw, float *db,
                         const float *dy, const float *x, const float *w,
                         const float *mean, const float *rstd, int N, int C,
                         bool accum) {
  MR_TRY(check_nc("layernorm_bwd", N, C));
  struct norm_job j = {.dx = dx, .dw = dw, .db = db, .dy = dy, .x = x, .w = w,
                       .cmean = mean, .crstd = rstd, .N = N, .C = C,
                       .accum = accum};
  MR_TRY(mr__par_range(pool, (size_t)N, rows_per_task(C), ln_bwd_range, &j));
  return mr__par_range(pool, (size_t)C, 64, norm_dw_range, &j);
}
