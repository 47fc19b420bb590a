/* pool.c - the persistent thread pool: workers spin briefly, then sleep on a
 * condition variable until the next job's generation number appears. */
#include "worker/backend/cpu/pool.h"

#include <cblas.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/tunable.h"
#include "worker/backend/cpu/simd.h"

/* Spin this many polls before sleeping: a job follows the last one within a
 * few microseconds in a training step, and a futex wake costs more. */
#define POOL_SPIN 4000

struct scratch {
  void *ptr;
  size_t cap; // bytes
};

struct mr_pool {
  int n;                  // threads, the caller included
  pthread_t *threads;     // [n - 1]
  pthread_mutex_t mu;
  pthread_cond_t wake;    // a new job (or stop)
  pthread_cond_t done;    // the last worker left the job
  atomic_uint_fast64_t gen;
  atomic_int stop;
  mr_pool_task_fn fn;     // the current job
  void *arg;
  int ntasks;
  atomic_int next;        // next task index to hand out
  atomic_int active;      // workers not yet finished with the job
  atomic_int rc;          // first failure
  struct scratch *scratch; // [n]
  struct scratch shared;
  struct scratch keyed;
  unsigned char key[64];  // the keyed buffer's key, key_bytes long
  size_t key_bytes;       // 0: no key held
  size_t keyed_bytes;     // size asked with the key
};

struct worker_arg {
  struct mr_pool *pool;
  int thread;
};

static void run_tasks(struct mr_pool *pool, int thread) {
  for (;;) {
    int t = atomic_fetch_add_explicit(&pool->next, 1, memory_order_relaxed);
    if (t >= pool->ntasks)
      return;
    int rc = pool->fn(pool->arg, t, thread);
    if (rc < 0) {
      int zero = 0;
      atomic_compare_exchange_strong(&pool->rc, &zero, rc);
    }
  }
}

static void *worker_main(void *p) {
  struct worker_arg wa = *(struct worker_arg *)p;
  free(p);
  struct mr_pool *pool = wa.pool;
  uint_fast64_t seen = 0;
  for (;;) {
    uint_fast64_t g = 0;
    for (int i = 0; i < POOL_SPIN; i++) {
      g = atomic_load_explicit(&pool->gen, memory_order_acquire);
      if (g != seen || atomic_load(&pool->stop))
        break;
      __builtin_ia32_pause();
    }
    if (g == seen && !atomic_load(&pool->stop)) {
      pthread_mutex_lock(&pool->mu);
      while ((g = atomic_load(&pool->gen)) == seen && !atomic_load(&pool->stop))
        pthread_cond_wait(&pool->wake, &pool->mu);
      pthread_mutex_unlock(&pool->mu);
    }
    if (atomic_load(&pool->stop))
      return NULL;
    seen = g;
    run_tasks(pool, wa.thread);
    if (atomic_fetch_sub(&pool->active, 1) == 1) {
      pthread_mutex_lock(&pool->mu);
      pthread_cond_signal(&pool->done);
      pthread_mutex_unlock(&pool->mu);
    }
  }
}

int mr_pool_new(int nthreads, struct mr_pool **out) {
  *out = NULL;
  if (nthreads <= 0)
    nthreads = (int)mr_tunable_int(MR_TUNABLE_THREADS);
  if (nthreads <= 0 || nthreads > 1024)
    return mr_error_set(MR_EINVAL, "MESHRUN_THREADS: expected 1..1024, got %d",
                        nthreads);
  /* Our pool splits every matmul itself; OpenBLAS's threads would fight it. */
  openblas_set_num_threads(1);
  struct mr_pool *pool = calloc(1, sizeof(*pool));
  if (!pool)
    return MR_ENOMEM;
  pool->n = nthreads;
  pool->scratch = calloc((size_t)nthreads, sizeof(*pool->scratch));
  pool->threads = calloc((size_t)nthreads, sizeof(*pool->threads));
  if (!pool->scratch || !pool->threads) {
    free(pool->scratch);
    free(pool->threads);
    free(pool);
    return MR_ENOMEM;
  }
  pthread_mutex_init(&pool->mu, NULL);
  pthread_cond_init(&pool->wake, NULL);
  pthread_cond_init(&pool->done, NULL);
  for (int i = 1; i < nthreads; i++) {
    struct worker_arg *wa = malloc(sizeof(*wa));
    int err = ENOMEM;
    if (wa) {
      wa->pool = pool;
      wa->thread = i;
      err = pthread_create(&pool->threads[i - 1], NULL, worker_main, wa);
    }
    if (err) {
      free(wa);
      pool->n = i; /* join only those started */
      mr_pool_free(pool);
      return mr_error_set(MR_ESYS, "thread pool: pthread_create: %s",
                          strerror(err));
    }
  }
  *out = pool;
  return 0;
}

void mr_pool_free(struct mr_pool *pool) {
  if (!pool)
    return;
  pthread_mutex_lock(&pool->mu);
  atomic_store(&pool->stop, 1);
  pthread_cond_broadcast(&pool->wake);
  pthread_mutex_unlock(&pool->mu);
  for (int i = 1; i < pool->n; i++)
    pthread_join(pool->threads[i - 1], NULL);
  for (int i = 0; i < pool->n; i++)
    free(pool->scratch[i].ptr);
  free(pool->shared.ptr);
  free(pool->keyed.ptr);
  pthread_cond_destroy(&pool->done);
  pthread_cond_destroy(&pool->wake);
  pthread_mutex_destroy(&pool->mu);
  free(pool->scratch);
  free(pool->threads);
  free(pool);
}

int mr_pool_threads(const struct mr_pool *pool) { return pool->n; }

int mr_pool_run(struct mr_pool *pool, int ntasks, mr_pool_task_fn fn, void *arg) {
  if (ntasks <= 0)
    return 0;
  if (ntasks == 1 || pool->n == 1) {
    int rc = 0;
    for (int t = 0; t < ntasks; t++) {
      int r = fn(arg, t, 0);
      if (r < 0 && rc == 0)
        rc = r;
    }
    return rc;
  }
  pool->fn = fn;
  pool->arg = arg;
  pool->ntasks = ntasks;
  atomic_store(&pool->rc, 0);
  atomic_store(&pool->next, 0);
  atomic_store(&pool->active, pool->n - 1);
  pthread_mutex_lock(&pool->mu);
  atomic_fetch_add_explicit(&pool->gen, 1, memory_order_release);
  pthread_cond_broadcast(&pool->wake);
  pthread_mutex_unlock(&pool->mu);
  run_tasks(pool, 0);
  /* The workers finish their last task soon after ours: poll first. */
  for (int i = 0; i < POOL_SPIN && atomic_load(&pool->active) > 0; i++)
    __builtin_ia32_pause();
  if (atomic_load(&pool->active) > 0) {
    pthread_mutex_lock(&pool->mu);
    while (atomic_load(&pool->active) > 0)
      pthread_cond_wait(&pool->done, &pool->mu);
    pthread_mutex_unlock(&pool->mu);
  }
  return atomic_load(&pool->rc);
}

static void *grow(struct scratch *s, size_t bytes) {
  if (bytes <= s->cap && s->ptr)
    return s->ptr;
  size_t cap = s->cap ? s->cap : 4096;
  while (cap < bytes)
    cap *= 2;
  void *p = aligned_alloc(64, cap);
  if (!p)
    return NULL;
  free(s->ptr);
  s->ptr = p;
  s->cap = cap;
  return p;
}

void *mr_pool_scratch(struct mr_pool *pool, int thread, size_t bytes) {
  return grow(&pool->scratch[thread], bytes);
}

void *mr__pool_shared_scratch(struct mr_pool *pool, size_t bytes) {
  return grow(&pool->shared, bytes);
}

void *mr__pool_keyed_scratch(struct mr_pool *pool, const void *key,
                             size_t key_bytes, size_t bytes, int *fresh) {
  if (!key || key_bytes == 0 || key_bytes > sizeof pool->key) {
    pool->key_bytes = 0;
    return NULL;
  }
  int same = pool->key_bytes == key_bytes && pool->keyed_bytes == bytes &&
             memcmp(pool->key, key, key_bytes) == 0;
  void *p = grow(&pool->keyed, bytes);
  if (!p) {
    pool->key_bytes = 0;
    return NULL;
  }
  if (!same) {
    memcpy(pool->key, key, key_bytes);
    pool->key_bytes = key_bytes;
    pool->keyed_bytes = bytes;
  }
  *fresh = !same;
  return p;
}

int mr__cpu_has_avx2(void) {
  static int cached = -1;
  int c = __atomic_load_n(&cached, __ATOMIC_RELAXED);
  if (c < 0) {
    c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        strcmp(mr_tunable_str(MR_TUNABLE_CPU_SIMD), "portable") != 0;
    __atomic_store_n(&cached, c, __ATOMIC_RELAXED);
  }
  return c;
}
