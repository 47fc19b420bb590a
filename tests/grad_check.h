/* grad_check.h - shared by the graph and model tests: run a graph through
 * the executor and compare its autodiff gradients with central finite
 * differences of L = sum(out * R), L accumulated in double.
 *
 * Why float finite differences are trustworthy here: the forward runs in
 * float, so each output carries a rounding error below 2^-24 of its size;
 * over the n outputs L is off by at most ~n * 6e-8 * max|out * R| (a few
 * 1e-6 at these sizes), which a step of h turns into an error of that over
 * 2h in the difference quotient; the truncation error is h^2/6 * f''', about
 * 1e-5 for h = 1e-2 with O(1) derivatives.  The tolerances used (1e-3
 * absolute plus 1% relative for single ops) sit an order of magnitude above
 * both, and well below the size of any real mistake (a missing term, a sign,
 * a transpose), which shows up as O(|gradient|). */
#ifndef MR_TEST_GRAD_CHECK_H
#define MR_TEST_GRAD_CHECK_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "compiler/graph.h"
#include "worker/exec.h"

static uint64_t gc_state = 88172645463325252ull;

static inline double gc_uniform(void) { /* xorshift64*, in [-1, 1) */
  gc_state ^= gc_state >> 12;
  gc_state ^= gc_state << 25;
  gc_state ^= gc_state >> 27;
  return (double)((gc_state * 2685821657736338717ull) >> 11) * 0x1p-52 - 1.0;
}

static inline void gc_fill(float *p, int64_t n, double scale) {
  for (int64_t i = 0; i < n; i++)
    p[i] = (float)(scale * gc_uniform());
}

/* L = sum out * r over out's elements, in double. */
static inline double gc_objective(struct mr_exec *x, int out, const float *r) {
  const float *o = mr_exec_buf(x, out);
  int64_t n = mr_tensor_numel(&x->g->tensors[out]);
  double s = 0;
  for (int64_t i = 0; i < n; i++)
    s += (double)o[i] * (r ? r[i] : 1.0);
  return s;
}

/* Checks up to `samples` elements of every parameter of x's graph.
 * Returns the number of elements outside tolerance; prints each. */
static inline int gc_check_params(struct mr_exec *x, int out, const float *r,
                           double h, double atol, double rtol, int samples,
                           double *max_err) {
  const struct mr_graph *g = x->g;
  int bad = 0;
  *max_err = 0;
  if (mr_exec_run(x, 0, g->n_ops) < 0)
    return -1000;
  for (int p = 0; p < g->n_tensors; p++) {
    const struct mr_tensor *t = &g->tensors[p];
    if (t->role != MR_ROLE_PARAM || t->grad < 0)
      continue;
    int64_t n = mr_tensor_numel(t);
    float *w = mr_exec_buf(x, p);
    const float *gr = mr_exec_buf(x, t->grad);
    /* gradients are overwritten by the FD forwards' reruns?  No: the
     * forward range never writes a gradient; copy anyway for clarity */
    int k = samples < n ? samples : (int)n;
    for (int s = 0; s < k; s++) {
      int64_t i = k == n ? s : (int64_t)((gc_uniform() + 1) / 2 * (double)n) % n;
      float keep = w[i];
      double an = gr[i];
      w[i] = (float)(keep + h);
      double hp = (double)w[i] - keep;
      mr_exec_run(x, 0, g->n_forward_ops);
      double lp = gc_objective(x, out, r);
      w[i] = (float)(keep - h);
      double hm = keep - (double)w[i];
      mr_exec_run(x, 0, g->n_forward_ops);
      double lm = gc_objective(x, out, r);
      w[i] = keep;
      double fd = (lp - lm) / (hp + hm);
      double err = fabs(fd - an);
      if (err > *max_err)
        *max_err = err;
      if (err > atol + rtol * fabs(fd)) {
        if (bad < 5)
          fprintf(stderr, "%s[%lld]: autodiff %.6g, finite difference %.6g\n",
                  t->name, (long long)i, an, fd);
        bad++;
      }
    }
  }
  mr_exec_run(x, 0, g->n_forward_ops); /* leave the unperturbed outputs */
  return bad;
}

#endif
