/* xent_vocab.c - the vocabulary-parallel cross-entropy steps: row maxima,
 * sums of exponentials with the targets' logits, the finishing step, and
 * the backward that rebuilds each row's softmax from m and s. */
#include "worker/backend/cpu/xent_vocab.h"

#include <math.h>

#include "common/error.h"
#include "worker/backend/cpu/par.h"
#include "worker/backend/cpu/simd.h"

struct step_job {
  float *m, *s, *tl, *d;
  const float *logits, *mx, *ds, *dtl;
  const int32_t *targets;
  int V;
  int64_t lo;
};

/* 8 running maxima (lane l takes columns l, l+8, ...) and a NaN check */
MR_CPU_BODY float row_max_body(const float *x, int V) {
  float mx[8];
  int bad[8] = {0};
  for (int l = 0; l < 8; l++)
    mx[l] = -INFINITY;
  int j0 = 0;
  for (; j0 + 8 <= V; j0 += 8)
    for (int l = 0; l < 8; l++) {
      float v = x[j0 + l];
      mx[l] = v > mx[l] ? v : mx[l];
      bad[l] |= v != v;
    }
  float m = -INFINITY;
  int nan = 0;
  for (int l = 0; l < 8; l++) {
    m = mx[l] > m ? mx[l] : m;
    nan |= bad[l];
  }
  for (int j = j0; j < V; j++) {
    m = x[j] > m ? x[j] : m;
    nan |= x[j] != x[j];
  }
  return nan ? NAN : m;
}
__attribute__((target("avx2,fma"))) static float row_max_avx2(const float *x,
                                                              int V) {
  return row_max_body(x, V);
}
static float row_max_base(const float *x, int V) { return row_max_body(x, V); }

MR_CPU_BODY float row_sumexp_body(const float *x, float m, int V) {
  float acc[8] = {0};
  int j0 = 0;
  for (; j0 + 8 <= V; j0 += 8)
    for (int l = 0; l < 8; l++)
      acc[l] += mr__expf(x[j0 + l] - m);
  float s = mr__hsum8(acc);
  for (int j = j0; j < V; j++)
    s += mr__expf(x[j] - m);
  return s;
}
__attribute__((target("avx2,fma"))) static float
row_sumexp_avx2(const float *x, float m, int V) {
  return row_sumexp_body(x, m, V);
}
static float row_sumexp_base(const float *x, float m, int V) {
  return row_sumexp_body(x, m, V);
}

MR_CPU_BODY void row_softmax_body(float *d, const float *x, float m, float g,
                                  int V) {
  for (int j = 0; j < V; j++)
    d[j] = g * mr__expf(x[j] - m);
}
MR_CPU_DISPATCH(row_softmax, (float *d, const float *x, float m, float g, int V),
                (d, x, m, g, V))

static int check(const char *what, int N, int V, int64_t lo, int64_t vocab,
                 const int32_t *targets) {
  if (N < 0 || V < 0 || lo < 0 || vocab < lo + V)
    return mr_error_set(MR_EINVAL, "%s: bad shape N=%d V=%d for columns from "
                        "%lld of a vocabulary of %lld", what, N, V,
                        (long long)lo, (long long)vocab);
  for (int i = 0; targets && i < N; i++)
    if (targets[i] >= vocab)
      return mr_error_set(MR_ERANGE, "%s: target %d at row %d is outside "
                          "[0, %lld)", what, (int)targets[i], i,
                          (long long)vocab);
  return 0;
}

/* Rows per task: about MR__STREAM_CHUNK logits. */
static size_t rows_per_task(int V) {
  return (MR__STREAM_CHUNK + (size_t)V) / ((size_t)V + 1);
}

static int max_range(void *arg, size_t lo, size_t hi, int thread) {
  (void)thread;
  const struct step_job *j = arg;
  int avx2 = mr__cpu_has_avx2();
  for (size_t r = lo; r < hi; r++) {
    const float *x = j->logits + r * (size_t)j->V;
    j->m[r] = avx2 ? row_max_avx2(x, j->V) : row_max_base(x, j->V);
  }
  return 0;
}

int mr_cpu_xent_rowmax(struct mr_pool *pool, float *m, const float *logits,
                       int N, int V) {
  MR_TRY(check("xent_rowmax", N, V, 0, V, NULL));
  struct step_job j = {.m = m, .logits = logits, .V = V};
  return mr__par_range(pool, (size_t)N, rows_per_task(V), max_range, &j);
}

/* the target's column in the shard, or -1 */
static int64_t column(const struct step_job *j, size_t r) {
  int64_t c = (int64_t)j->targets[r] - j->lo;
  return j->targets[r] >= 0 && c >= 0 && c < j->V ? c : -1;
}

static int sumexp_range(void *arg, size_t lo, size_t hi, int thread) {
  (void)thread;
  const struct step_job *j = arg;
  int avx2 = mr__cpu_has_avx2();
  for (size_t r = lo; r < hi; r++) {
    const float *x = j->logits + r * (size_t)j->V;
    float m = j->mx[r];
    /* every logit of the row is -inf (or there are none): no mass */
    if (m == -INFINITY)
      j->s[r] = 0.0f;
    else
      j->s[r] = avx2 ? row_sumexp_avx2(x, m, j->V) : row_sumexp_base(x, m, j->V);
    int64_t c = column(j, r);
    j->tl[r] = c >= 0 ? x[c] : 0.0f;
  }
  return 0;
}

int mr_cpu_xent_sumexp(struct mr_pool *pool, float *s, float *tl,
                       const float *logits, const int32_t *targets,
                       const float *m, int N, int V, int64_t lo, int64_t vocab) {
  MR_TRY(check("xent_sumexp", N, V, lo, vocab, targets));
  struct step_job j = {.s = s, .tl = tl, .logits = logits, .mx = m,
                       .targets = targets, .V = V, .lo = lo};
  return mr__par_range(pool, (size_t)N, rows_per_task(V), sumexp_range, &j);
}

static int bwd_range(void *arg, size_t lo, size_t hi, int thread) {
  (void)thread;
  const struct step_job *j = arg;
  size_t V = (size_t)j->V;
  for (size_t r = lo; r < hi; r++) {
    float *d = j->d + r * V;
    float g = j->ds ? j->ds[r] : 0.0f, m = j->mx[r];
    int64_t c = column(j, r);
    if (g == 0.0f || m == -INFINITY) {
      for (size_t k = 0; k < V; k++)
        d[k] = 0.0f;
    } else {
      row_softmax(d, j->logits + r * V, m, g, j->V);
    }
    if (c >= 0 && j->dtl)
      d[c] += j->dtl[r];
  }
  return 0;
}

int mr_cpu_xent_sumexp_bwd(struct mr_pool *pool, float *dlogits,
                           const float *logits, const int32_t *targets,
                           const float *m, const float *ds, const float *dtl,
                           int N, int V, int64_t lo, int64_t vocab) {
  MR_TRY(check("xent_sumexp_bwd", N, V, lo, vocab, targets));
  struct step_job j = {.d = dlogits, .logits = logits, .mx = m, .ds = ds,
                       .dtl = dtl, .targets = targets, .V = V, .lo = lo};
  return mr__par_range(pool, (size_t)N, rows_per_task(V), bwd_range, &j);
}

static double divisor(const int32_t *targets, int N, double rows) {
  if (rows > 0)
    return rows;
  int valid = 0;
  for (int i = 0; i < N; i++)
    valid += targets[i] >= 0;
  return valid;
}

int mr_cpu_xent_finish(float *loss, float *lse, const float *s,
                       const float *tl, const float *m, const int32_t *targets,
                       int N, double rows) {
  if (N < 0 || rows < 0)
    return mr_error_set(MR_EINVAL, "xent_finish: bad shape N=%d rows=%g", N,
                        rows);
  double sum = 0, denom = divisor(targets, N, rows);
  for (int i = 0; i < N; i++) {
    lse[i] = m[i] + logf(s[i]);
    if (targets[i] >= 0)
      sum += (double)(lse[i] - tl[i]);
  }
  *loss = denom > 0 ? (float)(sum / denom) : 0.0f;
  return 0;
}

int mr_cpu_xent_finish_bwd(float *ds, float *dtl, float dloss,
                           const float *dlse, const float *s,
                           const int32_t *targets, int N, double rows) {
  if (N < 0 || rows < 0)
    return mr_error_set(MR_EINVAL, "xent_finish_bwd: bad shape N=%d rows=%g",
                        N, rows);
  double denom = divisor(targets, N, rows);
  float g = denom > 0 ? (float)(dloss / denom) : 0.0f;
  for (int i = 0; i < N; i++) {
    float w = targets[i] >= 0 ? g : 0.0f;
    float num = w + (dlse ? dlse[i] : 0.0f);
    ds[i] = num == 0.0f ? 0.0f : num / s[i]; /* an ignored row may have s 0 */
    dtl[i] = -w;
  }
  return 0;
}
