/* elementwise.c - residual adds, bias, scaling, SwiGLU and tanh-GELU forward
 * and backward: streaming kernels, one pass over their operands. */
#include <math.h>

#include "common/error.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/backend/cpu/par.h"
#include "worker/backend/cpu/simd.h"

struct ew {
  float *out, *out2;
  const float *a, *b, *c;
  float s;
  bool accum;
};

/* ---- add, scale ---- */

MR_CPU_BODY void add_k_body(float *out, const float *a, const float *b,
                          size_t n) {
  for (size_t i = 0; i < n; i++)
    out[i] = a[i] + b[i];
}
MR_CPU_DISPATCH(add_k, (float *out, const float *a, const float *b, size_t n),
                (out, a, b, n))

static int add_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct ew *e = arg;
  add_k(e->out + lo, e->a + lo, e->b + lo, hi - lo);
  return 0;
}

int mr_cpu_add(struct mr_pool *pool, float *out, const float *a, const float *b,
               size_t n) {
  struct ew e = {.out = out, .a = a, .b = b};
  return mr__par_range(pool, n, MR__STREAM_CHUNK, add_range, &e);
}

MR_CPU_BODY void scale_k_body(float *x, size_t n, float s) {
  for (size_t i = 0; i < n; i++)
    x[i] *= s;
}
MR_CPU_DISPATCH(scale_k, (float *x, size_t n, float s), (x, n, s))

static int scale_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct ew *e = arg;
  scale_k(e->out + lo, hi - lo, e->s);
  return 0;
}

int mr_cpu_scale(struct mr_pool *pool, float *x, size_t n, float s) {
  struct ew e = {.out = x, .s = s};
  return mr__par_range(pool, n, MR__STREAM_CHUNK, scale_range, &e);
}

/* ---- bias ---- */

struct bias_job {
  float *y;
  const float *b;
  int N, C;
};

static int bias_add_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct bias_job *j = arg;
  for (size_t r = lo; r < hi; r++)
    add_k(j->y + r * (size_t)j->C, j->y + r * (size_t)j->C, j->b, (size_t)j->C);
  return 0;
}

int mr_cpu_bias_add(struct mr_pool *pool, float *y, const float *b, int N, int C) {
  if (N < 0 || C < 0)
    return mr_error_set(MR_EINVAL, "bias_add: negative size N=%d C=%d", N, C);
  struct bias_job j = {y, b, N, C};
  size_t rows = C > 0 ? (MR__STREAM_CHUNK + (size_t)C - 1) / (size_t)C : 1;
  return mr__par_range(pool, (size_t)N, rows, bias_add_range, &j);
}

/* Column block [c0, c0 + w) of db += column sums, rows in order. */
MR_CPU_BODY void colsum_k_body(float *restrict db, const float *dy, int N, int ld,
                             int w) {
  float acc[64];
  for (int c = 0; c < w; c++)
    acc[c] = 0;
  for (int r = 0; r < N; r++) {
    const float *row = dy + (size_t)r * (size_t)ld;
    for (int c = 0; c < w; c++)
      acc[c] += row[c];
  }
  for (int c = 0; c < w; c++)
    db[c] += acc[c];
}
MR_CPU_DISPATCH(colsum_k, (float *db, const float *dy, int N, int ld, int w),
                (db, dy, N, ld, w))

struct bias_grad_job {
  float *db;
  const float *dy;
  int N, C;
};

static int bias_grad_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct bias_grad_job *j = arg;
  colsum_k(j->db + lo, j->dy + lo, j->N, j->C, (int)(hi - lo));
  return 0;
}

int mr_cpu_bias_grad(struct mr_pool *pool, float *db, const float *dy, int N,
                     int C) {
  if (N < 0 || C < 0)
    return mr_error_set(MR_EINVAL, "bias_grad: negative size N=%d C=%d", N, C);
  struct bias_grad_job j = {db, dy, N, C};
  return mr__par_range(pool, (size_t)C, 64, bias_grad_range, &j);
}

/* ---- SwiGLU ---- */

MR_CPU_BODY void swiglu_fwd_k_body(float *restrict out, const float *g,
                                 const float *u, size_t n) {
  for (size_t i = 0; i < n; i++)
    out[i] = g[i] / (1.0f + mr__expf(-g[i])) * u[i];
}
MR_CPU_DISPATCH(swiglu_fwd_k,
                (float *out, const float *g, const float *u, size_t n),
                (out, g, u, n))

static int swiglu_fwd_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct ew *e = arg;
  swiglu_fwd_k(e->out + lo, e->a + lo, e->b + lo, hi - lo);
  return 0;
}

int mr_cpu_swiglu_fwd(struct mr_pool *pool, float *out, const float *gate,
                      const float *up, size_t n) {
  struct ew e = {.out = out, .a = gate, .b = up};
  return mr__par_range(pool, n, MR__STREAM_CHUNK, swiglu_fwd_range, &e);
}

/* d silu(g)/dg = sig(g) (1 + g (1 - sig(g))) */
MR_CPU_BODY void swiglu_bwd_k_body(float *restrict dg, float *restrict du,
                                 const float *d, const float *g, const float *u,
                                 size_t n, int accum) {
  for (size_t i = 0; i < n; i++) {
    float sg = 1.0f / (1.0f + mr__expf(-g[i]));
    float silu = g[i] * sg;
    float vg = d[i] * u[i] * sg * (1.0f + g[i] * (1.0f - sg));
    float vu = d[i] * silu;
    dg[i] = accum ? dg[i] + vg : vg;
    du[i] = accum ? du[i] + vu : vu;
  }
}
MR_CPU_DISPATCH(swiglu_bwd_k,
                (float *dg, float *du, const float *d, const float *g,
                 const float *u, size_t n, int accum),
                (dg, du, d, g, u, n, accum))

static int swiglu_bwd_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct ew *e = arg;
  swiglu_bwd_k(e->out + lo, e->out2 + lo, e->c + lo, e->a + lo, e->b + lo,
               hi - lo, e->accum);
  return 0;
}

int mr_cpu_swiglu_bwd(struct mr_pool *pool, float *dgate, float *dup,
                      const float *dout, const float *gate, const float *up,
                      size_t n, bool accum) {
  struct ew e = {.out = dgate, .out2 = dup, .a = gate, .b = up, .c = dout,
                 .accum = accum};
  return mr__par_range(pool, n, MR__STREAM_CHUNK, swiglu_bwd_range, &e);
}

/* ---- tanh-GELU (gelu_new) ---- */

#define GELU_K 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_A 0.044715f

/* tanh(u) = 1 - 2 / (e^(2u) + 1), exact at both ends of the range */
MR_CPU_BODY float tanh_fast(float u) {
  return 1.0f - 2.0f / (mr__expf(2.0f * u) + 1.0f);
}

MR_CPU_BODY void gelu_fwd_k_body(float *out, const float *x, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float v = x[i];
    out[i] = 0.5f * v * (1.0f + tanh_fast(GELU_K * (v + GELU_A * v * v * v)));
  }
}
MR_CPU_DISPATCH(gelu_fwd_k, (float *out, const float *x, size_t n), (out, x, n))

static int gelu_fwd_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct ew *e = arg;
  gelu_fwd_k(e->out + lo, e->a + lo, hi - lo);
  return 0;
}

int mr_cpu_gelu_fwd(struct mr_pool *pool, float *out, const float *x, size_t n) {
  struct ew e = {.out = out, .a = x};
  return mr__par_range(pool, n, MR__STREAM_CHUNK, gelu_fwd_range, &e);
}

MR_CPU_BODY void gelu_bwd_k_body(float *dx, const float *d, const float *x,
                               size_t n, int accum) {
  for (size_t i = 0; i < n; i++) {
    float v = x[i];
    float t = tanh_fast(GELU_K * (v + GELU_A * v * v * v));
    float dt = GELU_K * (1.0f + 3.0f * GELU_A * v * v) * (1.0f - t * t);
    float g = d[i] * (0.5f * (1.0f + t) + 0.5f * v * dt);
    dx[i] = accum ? dx[i] + g : g;
  }
}
MR_CPU_DISPATCH(gelu_bwd_k,
                (float *dx, const float *d, const float *x, size_t n, int accum),
                (dx, d, x, n, accum))

static int gelu_bwd_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct ew *e = arg;
  gelu_bwd_k(e->out + lo, e->c + lo, e->a + lo, hi - lo, e->accum);
  return 0;
}

int mr_cpu_gelu_bwd(struct mr_pool *pool, float *dx, const float *dout,
                    const float *x, size_t n, bool accum) {
  struct ew e = {.out = dx, .c = dout, .a = x, .accum = accum};
  return mr__par_range(pool, n, MR__STREAM_CHUNK, gelu_bwd_range, &e);
}
