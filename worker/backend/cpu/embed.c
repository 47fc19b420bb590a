/* embed.c - token embedding lookup and its gradient, and rotary position
 * embedding (Hugging Face LLaMA's rotate_half form). */
#include <math.h>
#include <string.h>

#include "common/error.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/backend/cpu/par.h"
#include "worker/backend/cpu/simd.h"

struct emb_job {
  float *out;
  const float *table;
  const int32_t *ids;
  int N, V, C;
};

static int check_ids(const char *what, const int32_t *ids, int n, int V) {
  for (int i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= V)
      return mr_error_set(MR_ERANGE, "%s: id %d at row %d is outside [0, %d)",
                          what, (int)ids[i], i, V);
  return 0;
}

static int emb_fwd_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct emb_job *j = arg;
  size_t C = (size_t)j->C;
  for (size_t r = lo; r < hi; r++)
    memcpy(j->out + r * C, j->table + (size_t)j->ids[r] * C, C * sizeof(float));
  return 0;
}

int mr_cpu_embedding_fwd(struct mr_pool *pool, float *out, const float *table,
                         const int32_t *ids, int N, int V, int C) {
  if (N < 0 || V <= 0 || C <= 0)
    return mr_error_set(MR_EINVAL, "embedding_fwd: bad shape N=%d V=%d C=%d", N, V, C);
  MR_TRY(check_ids("embedding_fwd", ids, N, V));
  struct emb_job j = {out, table, ids, N, V, C};
  size_t rows = (MR__STREAM_CHUNK + (size_t)C - 1) / (size_t)C;
  return mr__par_range(pool, (size_t)N, rows, emb_fwd_range, &j);
}

MR_CPU_BODY void emb_bwd_k_body(float *dt, const float *dout, const int32_t *ids,
                              int N, int C, int w) {
  for (int r = 0; r < N; r++) {
    float *row = dt + (size_t)ids[r] * (size_t)C;
    const float *g = dout + (size_t)r * (size_t)C;
    for (int c = 0; c < w; c++)
      row[c] += g[c];
  }
}
MR_CPU_DISPATCH(emb_bwd_k,
                (float *dt, const float *dout, const int32_t *ids, int N, int C,
                 int w),
                (dt, dout, ids, N, C, w))

static int emb_bwd_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct emb_job *j = arg;
  emb_bwd_k(j->out + lo, j->table + lo, j->ids, j->N, j->C, (int)(hi - lo));
  return 0;
}

int mr_cpu_embedding_bwd(struct mr_pool *pool, float *dtable, const float *dout,
                         const int32_t *ids, int N, int V, int C) {
  if (N < 0 || V <= 0 || C <= 0)
    return mr_error_set(MR_EINVAL, "embedding_bwd: bad shape N=%d V=%d C=%d", N, V, C);
  MR_TRY(check_ids("embedding_bwd", ids, N, V));
  struct emb_job j = {dtable, dout, ids, N, V, C};
  return mr__par_range(pool, (size_t)C, 64, emb_bwd_range, &j);
}

/* ---- RoPE ---- */

struct rope_job {
  float *x;
  const float *cos_t, *sin_t;
  const int32_t *pos;
  int B, T, H, D, P, ld;
  float dir; // +1 forward, -1 backward (rotation by -angle)
};

MR_CPU_BODY void rope_k_body(float *x, const float *cs, const float *sn, int H,
                           int D, float dir) {
  int half = D / 2;
  for (int h = 0; h < H; h++) {
    float *a = x + (size_t)h * D, *b = a + half;
    for (int i = 0; i < half; i++) {
      float s = dir * sn[i], u = a[i], v = b[i];
      a[i] = u * cs[i] - v * s;
      b[i] = v * cs[i] + u * s;
    }
  }
}
MR_CPU_DISPATCH(rope_k,
                (float *x, const float *cs, const float *sn, int H, int D,
                 float dir),
                (x, cs, sn, H, D, dir))

static int rope_range(void *arg, size_t lo, size_t hi, int thread) {
  const struct rope_job *j = arg;
  size_t half = (size_t)j->D / 2;
  for (size_t r = lo; r < hi; r++) {
    size_t p = j->pos ? (size_t)j->pos[r] : r % (size_t)j->T;
    rope_k(j->x + r * (size_t)j->ld, j->cos_t + p * half, j->sin_t + p * half,
           j->H, j->D, j->dir);
  }
  return 0;
}

static int rope_run(struct mr_pool *pool, float *x, const float *cos_t,
                    const float *sin_t, const int32_t *pos, int B, int T, int H,
                    int D, int P, int ld, float dir) {
  if (B < 0 || T < 0 || H <= 0 || D <= 0 || D % 2 || P < 0)
    return mr_error_set(MR_EINVAL, "rope: bad shape B=%d T=%d H=%d D=%d P=%d (D even)",
                        B, T, H, D, P);
  if (ld == 0)
    ld = H * D;
  if (ld < H * D)
    return mr_error_set(MR_EINVAL, "rope: ld=%d is less than H*D=%d", ld, H * D);
  size_t n = (size_t)B * (size_t)T;
  if (pos) {
    MR_TRY(check_ids("rope position", pos, (int)n, P));
  } else if (T > P) {
    return mr_error_set(MR_ERANGE, "rope: T=%d exceeds the table's %d positions", T, P);
  }
  struct rope_job j = {x, cos_t, sin_t, pos, B, T, H, D, P, ld, dir};
  size_t rows = (MR__STREAM_CHUNK + (size_t)(H * D) - 1) / (size_t)(H * D);
  return mr__par_range(pool, n, rows, rope_range, &j);
}

int mr_cpu_rope_fwd(struct mr_pool *pool, float *x, const float *cos_t,
                    const float *sin_t, const int32_t *pos, int B, int T,
                    int H, int D, int P, int ld) {
  return rope_run(pool, x, cos_t, sin_t, pos, B, T, H, D, P, ld, 1.0f);
}

int mr_cpu_rope_bwd(struct mr_pool *pool, float *dx, const float *cos_t,
                    const float *sin_t, const int32_t *pos, int B, int T,
                    int H, int D, int P, int ld) {
  return rope_run(pool, dx, cos_t, sin_t, pos, B, T, H, D, P, ld, -1.0f);
}
