/* kernels_ref.h - shared by the kernel suites: a seeded generator, double
 * precision helpers, and the central finite-difference check.
 *
 * References in the suites are written out in double from the textbook
 * formulas; they share no code with worker/backend/cpu. */
#ifndef MR_TEST_KERNELS_REF_H
#define MR_TEST_KERNELS_REF_H

#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/backend/cpu/kernels.h"

static inline double ref_uniform(uint64_t *s) { /* splitmix64 -> [-1, 1) */
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (double)(z >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

static inline float *ref_randf(size_t n, uint64_t *s, double scale) {
  float *x = malloc((n ? n : 1) * sizeof(float));
  ck_assert_ptr_nonnull(x);
  for (size_t i = 0; i < n; i++)
    x[i] = (float)(ref_uniform(s) * scale);
  return x;
}

static inline double *ref_tod(const float *x, size_t n) {
  double *d = malloc((n ? n : 1) * sizeof(double));
  ck_assert_ptr_nonnull(d);
  for (size_t i = 0; i < n; i++)
    d[i] = x[i];
  return d;
}

static inline float *ref_copyf(const float *x, size_t n) {
  float *y = malloc((n ? n : 1) * sizeof(float));
  ck_assert_ptr_nonnull(y);
  memcpy(y, x, n * sizeof(float));
  return y;
}

static inline struct mr_pool *ref_pool(int n) {
  struct mr_pool *p = NULL;
  ck_assert_int_eq(mr_pool_new(n, &p), 0);
  return p;
}

/* Fails unless |got - want| <= atol + rtol |want| everywhere. */
static inline void ref_close(const char *what, const float *got,
                             const double *want, size_t n, double atol,
                             double rtol) {
  for (size_t i = 0; i < n; i++) {
    double e = fabs((double)got[i] - want[i]);
    ck_assert_msg(e <= atol + rtol * fabs(want[i]),
                  "%s[%zu]: got %.9g want %.9g (err %.3g)", what, i,
                  (double)got[i], want[i], e);
  }
}

/* L(ctx) is a scalar loss computed in double; x is one of its inputs, inside
 * ctx.  Checks analytic[i] against (L(x + h) - L(x - h)) / 2h for `count`
 * indices spread over [0, n) (all of them when count >= n). */
typedef double (*ref_loss_fn)(void *ctx);

static inline void ref_fd_check(const char *what, ref_loss_fn L, void *ctx,
                                double *x, size_t n, const float *analytic,
                                size_t count, double atol, double rtol) {
  const double h = 1e-5;
  size_t step = count >= n ? 1 : n / count;
  for (size_t i = 0; i < n; i += step) {
    double x0 = x[i];
    x[i] = x0 + h;
    double lp = L(ctx);
    x[i] = x0 - h;
    double lm = L(ctx);
    x[i] = x0;
    double fd = (lp - lm) / (2 * h);
    double e = fabs((double)analytic[i] - fd);
    ck_assert_msg(e <= atol + rtol * fabs(fd),
                  "%s[%zu]: analytic %.9g finite difference %.9g (err %.3g)",
                  what, i, (double)analytic[i], fd, e);
  }
}

static inline double ref_dot(const double *a, const float *g, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; i++)
    s += a[i] * g[i];
  return s;
}

#endif
