/* xent.c - cross-entropy fused with softmax: the forward keeps only the
 * per-row loss and log-sum-exp, the backward rebuilds each row's softmax from
 * the log-sum-exp and writes the gradient over the logits. */
#include <math.h>

#include "common/error.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/backend/cpu/par.h"
#include "worker/backend/cpu/simd.h"

struct xent_job {
  float *loss, *lse, *dlogits;
  const float *logits, *dloss;
  const int32_t *targets;
  float scale;
  int N, V;
};

MR_CPU_BODY float row_lse_body(const float *x, int V) {
  float m = -INFINITY;
  for (int j = 0; j < V; j++)
    m = x[j] > m ? x[j] : m;
  if (m == -INFINITY || m != m)
    return m;
  float s = 0;
  for (int j = 0; j < V; j++)
    s += mr__expf(x[j] - m);
  return m + logf(s);
}
__attribute__((target("avx2,fma"))) static float row_lse_avx2(const float *x, int V) {
  return row_lse_body(x, V);
}
static float row_lse_base(const float *x, int V) { return row_lse_body(x, V); }

static int xent_fwd_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct xent_job *j = arg;
  int avx2 = mr__cpu_has_avx2();
  for (size_t r = lo; r < hi; r++) {
    const float *x = j->logits + r * (size_t)j->V;
    float l = avx2 ? row_lse_avx2(x, j->V) : row_lse_base(x, j->V);
    j->lse[r] = l;
    int t = j->targets[r];
    j->loss[r] = t < 0 ? 0.0f : l - x[t];
  }
  return 0;
}

static int check_targets(const char *what, const int32_t *t, int N, int V) {
  for (int i = 0; i < N; i++)
    if (t[i] >= V)
      return mr_error_set(MR_ERANGE, "%s: target %d at row %d is outside [0, %d)",
                          what, (int)t[i], i, V);
  return 0;
}

int mr_cpu_xent_fwd(struct mr_pool *pool, float *loss, float *lse,
                    const float *logits, const int32_t *targets, int N, int V,
                    int *n_valid) {
  if (N < 0 || V <= 0)
    return mr_error_set(MR_EINVAL, "xent_fwd: bad shape N=%d V=%d", N, V);
  MR_TRY(check_targets("xent_fwd", targets, N, V));
  struct xent_job j = {.loss = loss, .lse = lse, .logits = logits,
                       .targets = targets, .N = N, .V = V};
  size_t rows = (MR__STREAM_CHUNK + (size_t)V - 1) / (size_t)V;
  MR_TRY(mr__par_range(pool, (size_t)N, rows, xent_fwd_range, &j));
  if (n_valid) {
    int c = 0;
    for (int i = 0; i < N; i++)
      c += targets[i] >= 0;
    *n_valid = c;
  }
  return 0;
}

MR_CPU_BODY void xent_bwd_k_body(float *d, const float *x, float lse, float g,
                               int V) {
  for (int j = 0; j < V; j++)
    d[j] = g * mr__expf(x[j] - lse);
}
MR_CPU_DISPATCH(xent_bwd_k, (float *d, const float *x, float lse, float g, int V),
                (d, x, lse, g, V))

static int xent_bwd_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct xent_job *j = arg;
  size_t V = (size_t)j->V;
  for (size_t r = lo; r < hi; r++) {
    int t = j->targets[r];
    float *d = j->dlogits + r * V;
    float g = t < 0 ? 0.0f : j->scale * (j->dloss ? j->dloss[r] : 1.0f);
    xent_bwd_k(d, j->logits + r * V, j->lse[r], g, j->V);
    if (t >= 0)
      d[t] -= g;
  }
  return 0;
}

int mr_cpu_xent_bwd(struct mr_pool *pool, float *dlogits, const float *logits,
                    const float *lse, const int32_t *targets,
                    const float *dloss, float scale, int N, int V) {
  if (N < 0 || V <= 0)
    return mr_error_set(MR_EINVAL, "xent_bwd: bad shape N=%d V=%d", N, V);
  MR_TRY(check_targets("xent_bwd", targets, N, V));
  struct xent_job j = {.dlogits = dlogits, .logits = logits, .lse = (float *)lse,
                       .dloss = dloss, .targets = targets, .scale = scale,
                       .N = N, .V = V};
  size_t rows = (MR__STREAM_CHUNK + (size_t)V - 1) / (size_t)V;
  return mr__par_range(pool, (size_t)N, rows, xent_bwd_range, &j);
}
