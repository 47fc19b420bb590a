/* cpu_backend.c - the device backend table for host memory.  Streams are
 * in order and run their work at launch on the calling thread and the
 * rank's pool, so events complete when recorded. */
#include "worker/backend/cpu/cpu_backend.h"

#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "compiler/ops.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/backend/cpu/pool.h"

struct mr_stream {
  int unused;
};
struct mr_event {
  int recorded;
};

struct cpu_impl {
  struct mr_pool *pool;
  void *kernel_ctx;              // what kernels get: the pool, or the caller's
  int owns_pool;
  struct mr_stream default_stream;
};

static int cpu_alloc(struct mr_backend *be, size_t bytes, void **out) {
  size_t n = (bytes + 63) / 64 * 64;
  void *p = aligned_alloc(64, n ? n : 64);
  if (!p) {
    *out = NULL;
    return mr_error_set(MR_ENOMEM, "cpu backend: cannot allocate %zu bytes", bytes);
  }
  *out = p;
  return 0;
}

static void cpu_free(struct mr_backend *be, void *ptr) { free(ptr); }

static int cpu_copy(struct mr_backend *be, struct mr_stream *s, void *dst,
                    const void *src, size_t bytes, enum mr_copy_kind kind) {
  if (bytes)
    memmove(dst, src, bytes);
  return 0;
}

static int cpu_memset(struct mr_backend *be, struct mr_stream *s, void *dst,
                      int byte, size_t bytes) {
  if (bytes)
    memset(dst, byte, bytes);
  return 0;
}

static int cpu_stream_new(struct mr_backend *be, struct mr_stream **out) {
  *out = calloc(1, sizeof(**out));
  return *out ? 0 : MR_ENOMEM;
}

static void cpu_stream_free(struct mr_backend *be, struct mr_stream *s) {
  struct cpu_impl *impl = be->impl;
  if (s != &impl->default_stream)
    free(s);
}

static int cpu_launch(struct mr_backend *be, struct mr_stream *s,
                      mr_launch_fn fn, const void *args) {
  struct cpu_impl *impl = be->impl;
  return fn(impl->pool, args);
}

static int cpu_event_new(struct mr_backend *be, struct mr_event **out) {
  *out = calloc(1, sizeof(**out));
  return *out ? 0 : MR_ENOMEM;
}

static void cpu_event_free(struct mr_backend *be, struct mr_event *ev) { free(ev); }

static int cpu_event_record(struct mr_backend *be, struct mr_event *ev,
                            struct mr_stream *s) {
  ev->recorded = 1;
  return 0;
}

static int cpu_stream_wait(struct mr_backend *be, struct mr_stream *s,
                           struct mr_event *ev) {
  return 0; /* everything recorded before is already done */
}

static int cpu_event_synchronize(struct mr_backend *be, struct mr_event *ev) {
  return 0;
}

static int cpu_event_query(struct mr_backend *be, struct mr_event *ev) {
  return 1;
}

static int cpu_synchronize(struct mr_backend *be, struct mr_stream *s) { return 0; }

static void *cpu_kernel_ctx(struct mr_backend *be) {
  return ((struct cpu_impl *)be->impl)->kernel_ctx;
}

struct axpby_job {
  float *y;
  const float *x;
  float a, b;
  size_t n;
};

#define AXPBY_BLOCK 16384

static int axpby_part(void *arg, int task, int thread) {
  struct axpby_job *j = arg;
  size_t lo = (size_t)task * AXPBY_BLOCK, hi = lo + AXPBY_BLOCK < j->n ? lo + AXPBY_BLOCK : j->n;
  float *y = j->y;
  const float *x = j->x;
  float a = j->a, b = j->b;
  if (a == 1.0f)
    for (size_t i = lo; i < hi; i++)
      y[i] += b * x[i];
  else if (a == 0.0f)
    for (size_t i = lo; i < hi; i++)
      y[i] = b * x[i];
  else
    for (size_t i = lo; i < hi; i++)
      y[i] = a * y[i] + b * x[i];
  return 0;
}

static int cpu_axpby(struct mr_backend *be, float *y, const float *x, float a, float b,
                     size_t n) {
  struct cpu_impl *impl = be->impl;
  struct axpby_job j = {y, x, a, b, n};
  return mr_pool_run(impl->pool, (int)((n + AXPBY_BLOCK - 1) / AXPBY_BLOCK), axpby_part, &j);
}

static int cpu_sumsq(struct mr_backend *be, const float *x, size_t n, double *out) {
  return mr_cpu_sumsq(((struct cpu_impl *)be->impl)->pool, out, x, n);
}

static int cpu_adamw(struct mr_backend *be, float *p, const float *grad, float *m, float *v,
                     size_t n, const struct mr_adamw *h, int64_t t) {
  return mr_cpu_adamw_step(((struct cpu_impl *)be->impl)->pool, p, grad, m, v, n, h, t);
}

static int cpu_copy2d(struct mr_backend *be, void *dst, size_t dpitch, const void *src,
                      size_t spitch, size_t width, size_t rows) {
  if (width == dpitch && width == spitch) {
    memmove(dst, src, width * rows);
    return 0;
  }
  for (size_t r = 0; r < rows; r++)
    memcpy((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
  return 0;
}

static void cpu_destroy(struct mr_backend *be) {
  struct cpu_impl *impl = be->impl;
  if (impl->owns_pool)
    mr_pool_free(impl->pool);
  free(impl);
  free(be);
}

static const struct mr_backend_ops cpu_ops = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy = cpu_copy,
    .memset = cpu_memset,
    .stream_new = cpu_stream_new,
    .stream_free = cpu_stream_free,
    .launch = cpu_launch,
    .event_new = cpu_event_new,
    .event_free = cpu_event_free,
    .event_record = cpu_event_record,
    .stream_wait = cpu_stream_wait,
    .event_synchronize = cpu_event_synchronize,
    .event_query = cpu_event_query,
    .synchronize = cpu_synchronize,
    .kernel_ctx = cpu_kernel_ctx,
    .destroy = cpu_destroy,
    .registry = MR_BACKEND_CPU,
    .axpby = cpu_axpby,
    .sumsq = cpu_sumsq,
    .adamw = cpu_adamw,
    .copy2d = cpu_copy2d,
};

int mr_cpu_backend_wrap(struct mr_pool *pool, void *kernel_ctx, struct mr_backend **out) {
  *out = NULL;
  struct mr_backend *be = calloc(1, sizeof(*be));
  struct cpu_impl *impl = calloc(1, sizeof(*impl));
  if (!be || !impl) {
    free(be);
    free(impl);
    return MR_ENOMEM;
  }
  impl->pool = pool;
  impl->kernel_ctx = kernel_ctx != NULL ? kernel_ctx : (void *)pool;
  be->ops = &cpu_ops;
  be->impl = impl;
  *out = be;
  return 0;
}

int mr_cpu_backend_new(int nthreads, struct mr_backend **out) {
  *out = NULL;
  struct mr_backend *be = calloc(1, sizeof(*be));
  struct cpu_impl *impl = calloc(1, sizeof(*impl));
  if (!be || !impl) {
    free(be);
    free(impl);
    return MR_ENOMEM;
  }
  int rc = mr_pool_new(nthreads, &impl->pool);
  if (rc < 0) {
    free(be);
    free(impl);
    return rc;
  }
  impl->kernel_ctx = impl->pool;
  impl->owns_pool = 1;
  be->ops = &cpu_ops;
  be->impl = impl;
  *out = be;
  return 0;
}

struct mr_pool *mr_cpu_backend_pool(struct mr_backend *be) {
  return ((struct cpu_impl *)be->impl)->pool;
}
