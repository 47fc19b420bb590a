/* rng.c - Philox4x32-10 and the draws built on it (see rng.h). */
#include "common/rng.h"

#include <math.h>
#include <pthread.h>

#include "common/box.h"

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u /* golden ratio */
#define PHILOX_W1 0xBB67AE85u /* sqrt(3) - 1 */

void mr_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2],
                      uint32_t out[4]) {
  uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; round++) {
    uint64_t p0 = (uint64_t)PHILOX_M0 * c0;
    uint64_t p1 = (uint64_t)PHILOX_M1 * c2;
    uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += PHILOX_W0;
    k1 += PHILOX_W1;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

uint64_t mr_hash_str(const char *s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    h ^= *p;
    h *= 0x100000001b3ull;
  }
  return h;
}

static void block(uint64_t seed, uint64_t stream, uint64_t c, uint32_t out[4]) {
  const uint32_t ctr[4] = {(uint32_t)c, (uint32_t)(c >> 32), (uint32_t)stream,
                           (uint32_t)(stream >> 32)};
  const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
  mr_philox4x32_10(ctr, key, out);
}

uint64_t mr_rng_u64(uint64_t seed, uint64_t stream, uint64_t index) {
  uint32_t w[4];
  block(seed, stream, index, w);
  return (uint64_t)w[0] | (uint64_t)w[1] << 32;
}

double mr_rng_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return (double)(mr_rng_u64(seed, stream, index) >> 11) * 0x1p-53;
}

/* Box-Muller on one block: the pair (r cos theta, r sin theta). */
static void normal_pair(const uint32_t w[4], double *z0, double *z1) {
  uint64_t a = (uint64_t)w[0] | (uint64_t)w[1] << 32;
  uint64_t b = (uint64_t)w[2] | (uint64_t)w[3] << 32;
  double u1 = (double)((a >> 11) + 1) * 0x1p-53; /* (0, 1]: log is finite */
  double u2 = (double)(b >> 11) * 0x1p-53;
  double r = sqrt(-2.0 * log(u1));
  double theta = 6.283185307179586476925286766559 * u2;
  *z0 = r * cos(theta);
  *z1 = r * sin(theta);
}

double mr_rng_normal(uint64_t seed, uint64_t stream, uint64_t index) {
  uint32_t w[4];
  double z0, z1;
  block(seed, stream, index >> 1, w);
  normal_pair(w, &z0, &z1);
  return (index & 1) ? z1 : z0;
}

void mr_rng_normal_fill(uint64_t seed, uint64_t stream, uint64_t first,
                        size_t n, float mean, float std, float *out) {
  size_t k = 0;
  while (k < n) {
    uint64_t i = first + k;
    uint32_t w[4];
    double z[2];
    block(seed, stream, i >> 1, w);
    normal_pair(w, &z[0], &z[1]);
    /* an odd start uses only the second half of its pair */
    for (unsigned j = (unsigned)(i & 1); j < 2 && k < n; j++, k++)
      out[k] = (float)((double)mean + (double)std * z[j]);
  }
}

/* Elements per task of a parallel draw: about 30 ms of Philox and
 * Box-Muller each */
#define FILL_CHUNK ((int64_t)1 << 20)

struct fill_job {
  uint64_t seed, stream, first;
  int64_t n;
  float mean, std;
  float *out;
  int threads, me;
};

/* Thread me's chunks: me, me + threads, ... */
static void *fill_main(void *arg) {
  const struct fill_job *j = arg;
  int64_t step = (int64_t)j->threads * FILL_CHUNK;
  for (int64_t at = (int64_t)j->me * FILL_CHUNK; at < j->n; at += step) {
    int64_t n = j->n - at < FILL_CHUNK ? j->n - at : FILL_CHUNK;
    mr_rng_normal_fill(j->seed, j->stream, j->first + (uint64_t)at, (size_t)n, j->mean, j->std,
                       j->out + at);
  }
  return NULL;
}

/* Runs up to `threads` copies of fn over jobs[0..threads), the caller one
 * of them; threads that fail to start are run here. */
static void run_threads(int threads, void *(*fn)(void *), void *jobs, size_t job_size) {
  pthread_t tid[64];
  int started = 1;
  for (int i = 1; i < threads; i++, started++)
    if (pthread_create(&tid[i], NULL, fn, (char *)jobs + (size_t)i * job_size) != 0)
      break;
  fn(jobs);
  for (int i = 1; i < started; i++)
    pthread_join(tid[i], NULL);
  for (int i = started; i < threads; i++)
    fn((char *)jobs + (size_t)i * job_size);
}

void mr_rng_normal_fill_threads(int threads, uint64_t seed, uint64_t stream, uint64_t first,
                                int64_t n, float mean, float std, float *out) {
  int64_t chunks = (n + FILL_CHUNK - 1) / FILL_CHUNK;
  if (threads > chunks)
    threads = (int)chunks;
  if (threads > 64)
    threads = 64;
  if (threads < 1)
    threads = 1;
  struct fill_job jobs[64];
  for (int i = 0; i < threads; i++)
    jobs[i] = (struct fill_job){seed, stream, first, n, mean, std, out, threads, i};
  run_threads(threads, fill_main, jobs, sizeof jobs[0]);
}

struct box_job {
  uint64_t seed, stream;
  int ndim;
  const int64_t *shape, *off, *len;
  float mean, std;
  float *out;
  int64_t r0, r1; /* its part: rows [r0, r1) of the box's first dimension */
};

static void box_run(void *ctx, int64_t at, int64_t in_box, int64_t n) {
  const struct box_job *j = ctx;
  mr_rng_normal_fill(j->seed, j->stream, (uint64_t)at, (size_t)n, j->mean, j->std,
                     j->out + in_box);
}

/* The job's part of the box, run by run (mr_box_runs). */
static void *box_main(void *arg) {
  const struct box_job *j = arg;
  int64_t off[MR_MAX_DIMS], len[MR_MAX_DIMS], row = 1;
  for (int d = 0; d < j->ndim; d++) {
    off[d] = j->off[d];
    len[d] = j->len[d];
    row *= d > 0 ? len[d] : 1;
  }
  off[0] += j->r0;
  len[0] = j->r1 - j->r0;
  struct box_job part = *j;
  part.out = j->out + j->r0 * row;
  mr_box_runs(j->ndim, j->shape, off, len, box_run, &part);
  return NULL;
}

void mr_rng_normal_fill_box(int threads, uint64_t seed, uint64_t stream, int ndim,
                            const int64_t *shape, const int64_t *off, const int64_t *len,
                            float mean, float std, float *out) {
  if (ndim <= 0) { /* a scalar */
    mr_rng_normal_fill(seed, stream, 0, 1, mean, std, out);
    return;
  }
  int64_t n = 1, row = 1;
  int whole_rows = 1;
  for (int d = 0; d < ndim; d++) {
    if (len[d] <= 0)
      return;
    n *= len[d];
    if (d > 0) {
      row *= shape[d];
      whole_rows = whole_rows && off[d] == 0 && len[d] == shape[d];
    }
  }
  if (whole_rows) {
    mr_rng_normal_fill_threads(threads, seed, stream, (uint64_t)(off[0] * row), n, mean, std,
                               out);
    return;
  }
  /* at least a chunk of elements a thread */
  int64_t most = (n + FILL_CHUNK - 1) / FILL_CHUNK;
  if (threads > most)
    threads = (int)most;
  if (threads > len[0])
    threads = (int)len[0];
  threads = threads > 64 ? 64 : threads < 1 ? 1 : threads;
  struct box_job jobs[64];
  for (int i = 0; i < threads; i++)
    jobs[i] = (struct box_job){seed, stream, ndim, shape, off, len, mean, std, out,
                               len[0] * i / threads, len[0] * (i + 1) / threads};
  run_threads(threads, box_main, jobs, sizeof jobs[0]);
}
