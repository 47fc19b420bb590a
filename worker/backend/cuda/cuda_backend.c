/* cuda_backend.c - the device backend table on one CUDA GPU: pooled device
 * memory, a compute stream (non-blocking, where kernels go), more streams
 * on request, events, page-locked host buffers, the runtime's vector
 * entries, and the module's one exported function.
 *
 * Copies between device memory and host memory from host_alloc are
 * asynchronous on their stream; with any other host memory they return
 * when done, as on the CPU backend, so code written against the CPU
 * backend stays correct.  Kernel errors found on the device (an id out of
 * range) surface at the next synchronize, event_synchronize, sumsq or
 * device-to-host copy of pageable memory. */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#include "compiler/ops.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/backend/cuda/cuda_internal.h"
#include "worker/backend/cuda/module.h"
#include "worker/comm/comm.h"

#define EXPORT __attribute__((visibility("default")))

/* the module's one entry point (module.h); exported, so declared here */
EXPORT int meshrun_cuda_module(int version, struct mr_cuda_module *out);

int mr__cuda_check(cudaError_t e, const char *call) {
  if (e == cudaSuccess)
    return 0;
  cudaGetLastError(); /* clear a non-sticky error */
  int code = MR_EIO;
  if (e == cudaErrorMemoryAllocation)
    code = MR_ENOMEM;
  else if (e == cudaErrorNoDevice || e == cudaErrorInvalidDevice)
    code = MR_ENOENT;
  return mr_error_set(code, "cuda: %s: %s (%s)", call, cudaGetErrorName(e),
                      cudaGetErrorString(e));
}

int mr__cuda_set_device(int device) {
  int cur = -1;
  if (cudaGetDevice(&cur) == cudaSuccess && cur == device)
    return 0;
  return mr__cuda_check(cudaSetDevice(device), "cudaSetDevice");
}

/* ---- which compute stream the NCCL backend orders after ---- */

#define MAX_DEVICES 64
static pthread_mutex_t streams_lock = PTHREAD_MUTEX_INITIALIZER;
static cudaStream_t compute_streams[MAX_DEVICES];

cudaStream_t mr__cuda_compute_stream(int device) {
  if (device < 0 || device >= MAX_DEVICES)
    return NULL;
  pthread_mutex_lock(&streams_lock);
  cudaStream_t s = compute_streams[device];
  pthread_mutex_unlock(&streams_lock);
  return s;
}

static int last_device = -1;

int mr__cuda_backend_device(void) {
  pthread_mutex_lock(&streams_lock);
  int d = last_device;
  pthread_mutex_unlock(&streams_lock);
  return d;
}

static void set_compute_stream(int device, cudaStream_t s, cudaStream_t expect) {
  if (device < 0 || device >= MAX_DEVICES)
    return;
  pthread_mutex_lock(&streams_lock);
  if (expect == NULL || compute_streams[device] == expect)
    compute_streams[device] = s;
  if (s != NULL)
    last_device = device;
  pthread_mutex_unlock(&streams_lock);
}

/* ---- status word, scratch ---- */

int mr__cuda_status_check(struct mr__cuda_ctx *c) {
  struct mr__cuda_status st;
  MR_CUDA_TRY(cudaMemcpy(&st, c->status, sizeof st, cudaMemcpyDeviceToHost));
  if (st.code == MR__KERR_NONE)
    return 0;
  MR_CUDA_TRY(cudaMemset(c->status, 0, sizeof st));
  switch (st.code) {
  case MR__KERR_EMBED_ID:
    return mr_error_set(MR_ERANGE, "embedding: id %lld at row %lld is outside "
                        "[0, %lld)", st.a, st.b, st.c);
  case MR__KERR_XENT_TARGET:
    return mr_error_set(MR_ERANGE, "cross_entropy: target %lld at row %lld is "
                        "outside [0, %lld)", st.a, st.b, st.c);
  default:
    return mr_error_set(MR_EIO, "cuda kernel reported error %d", st.code);
  }
}

int mr__cuda_scratch(struct mr__cuda_ctx *c, size_t bytes, void **out) {
  struct mr_stream *s = c->cur;
  if (bytes == 0)
    bytes = 256;
  if (s->scratch_bytes < bytes) {
    /* kernels queued on this stream may still read the old scratch */
    MR_CUDA_TRY(cudaStreamSynchronize(s->s));
    mr__cuda_pool_free(&c->be->pool, s->scratch);
    s->scratch = NULL;
    s->scratch_bytes = 0;
    size_t want = bytes + bytes / 2;
    MR_TRY(mr__cuda_pool_alloc(&c->be->pool, want, &s->scratch));
    s->scratch_bytes = want;
  }
  *out = s->scratch;
  return 0;
}

/* ---- the table ---- */

#define IMPL(be) ((struct mr__cuda *)(be))

static struct mr_stream *stream_or_compute(struct mr_backend *be,
                                           struct mr_stream *s) {
  return s != NULL ? s : &IMPL(be)->compute;
}

static int cu_alloc(struct mr_backend *be, size_t bytes, void **out) {
  MR_TRY(mr__cuda_set_device(IMPL(be)->device));
  return mr__cuda_pool_alloc(&IMPL(be)->pool, bytes, out);
}

static void cu_free(struct mr_backend *be, void *ptr) {
  mr__cuda_pool_free(&IMPL(be)->pool, ptr);
}

static int is_pinned(const void *p) {
  struct cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return a.type == cudaMemoryTypeHost;
}

static int cu_copy(struct mr_backend *be, struct mr_stream *s, void *dst,
                   const void *src, size_t bytes, enum mr_copy_kind kind) {
  struct mr__cuda *c = IMPL(be);
  if (bytes == 0)
    return 0;
  MR_TRY(mr__cuda_set_device(c->device));
  cudaStream_t st = stream_or_compute(be, s)->s;
  MR_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, st));
  const void *host = kind == MR_COPY_HOST_TO_DEVICE ? src
                     : kind == MR_COPY_DEVICE_TO_HOST ? dst : NULL;
  if (host != NULL && !is_pinned(host)) {
    MR_CUDA_TRY(cudaStreamSynchronize(st));
    if (kind == MR_COPY_DEVICE_TO_HOST)
      MR_TRY(mr__cuda_status_check(&c->ctx));
  }
  return 0;
}

static int cu_memset(struct mr_backend *be, struct mr_stream *s, void *dst,
                     int byte, size_t bytes) {
  if (bytes == 0)
    return 0;
  MR_TRY(mr__cuda_set_device(IMPL(be)->device));
  MR_CUDA_TRY(cudaMemsetAsync(dst, byte, bytes, stream_or_compute(be, s)->s));
  return 0;
}

static int cu_stream_new(struct mr_backend *be, struct mr_stream **out) {
  *out = NULL;
  MR_TRY(mr__cuda_set_device(IMPL(be)->device));
  struct mr_stream *s = calloc(1, sizeof *s);
  if (s == NULL)
    return mr_error_set(MR_ENOMEM, "cuda: out of host memory");
  int rc = mr__cuda_check(cudaStreamCreateWithFlags(&s->s, cudaStreamNonBlocking),
                          "cudaStreamCreateWithFlags");
  if (rc < 0) {
    free(s);
    return rc;
  }
  *out = s;
  return 0;
}

static void cu_stream_free(struct mr_backend *be, struct mr_stream *s) {
  struct mr__cuda *c = IMPL(be);
  if (s == NULL || s == &c->compute)
    return;
  mr__cuda_set_device(c->device);
  cudaStreamSynchronize(s->s);
  mr__cuda_pool_free(&c->pool, s->scratch);
  cudaStreamDestroy(s->s);
  free(s);
}

static int cu_launch(struct mr_backend *be, struct mr_stream *s, mr_launch_fn fn,
                     const void *args) {
  struct mr__cuda *c = IMPL(be);
  MR_TRY(mr__cuda_set_device(c->device));
  pthread_mutex_lock(&c->ctx_lock);
  struct mr_stream *saved = c->ctx.cur;
  c->ctx.cur = stream_or_compute(be, s);
  int rc = fn(&c->ctx, args);
  c->ctx.cur = saved;
  pthread_mutex_unlock(&c->ctx_lock);
  return rc;
}

static int cu_event_new(struct mr_backend *be, struct mr_event **out) {
  *out = NULL;
  MR_TRY(mr__cuda_set_device(IMPL(be)->device));
  struct mr_event *ev = calloc(1, sizeof *ev);
  if (ev == NULL)
    return mr_error_set(MR_ENOMEM, "cuda: out of host memory");
  int rc = mr__cuda_check(cudaEventCreateWithFlags(&ev->e, cudaEventDisableTiming),
                          "cudaEventCreateWithFlags");
  if (rc < 0) {
    free(ev);
    return rc;
  }
  *out = ev;
  return 0;
}

static void cu_event_free(struct mr_backend *be, struct mr_event *ev) {
  if (ev == NULL)
    return;
  mr__cuda_set_device(IMPL(be)->device);
  cudaEventDestroy(ev->e);
  free(ev);
}

static int cu_event_record(struct mr_backend *be, struct mr_event *ev,
                           struct mr_stream *s) {
  MR_TRY(mr__cuda_set_device(IMPL(be)->device));
  MR_CUDA_TRY(cudaEventRecord(ev->e, stream_or_compute(be, s)->s));
  return 0;
}

static int cu_stream_wait(struct mr_backend *be, struct mr_stream *s,
                          struct mr_event *ev) {
  MR_TRY(mr__cuda_set_device(IMPL(be)->device));
  MR_CUDA_TRY(cudaStreamWaitEvent(stream_or_compute(be, s)->s, ev->e, 0));
  return 0;
}

static int cu_event_synchronize(struct mr_backend *be, struct mr_event *ev) {
  MR_TRY(mr__cuda_set_device(IMPL(be)->device));
  MR_CUDA_TRY(cudaEventSynchronize(ev->e));
  return mr__cuda_status_check(&IMPL(be)->ctx);
}

static int cu_event_query(struct mr_backend *be, struct mr_event *ev) {
  MR_TRY(mr__cuda_set_device(IMPL(be)->device));
  cudaError_t e = cudaEventQuery(ev->e);
  if (e == cudaSuccess)
    return 1;
  if (e == cudaErrorNotReady) {
    cudaGetLastError();
    return 0;
  }
  return mr__cuda_check(e, "cudaEventQuery");
}

static int cu_synchronize(struct mr_backend *be, struct mr_stream *s) {
  MR_TRY(mr__cuda_set_device(IMPL(be)->device));
  if (s == NULL)
    MR_CUDA_TRY(cudaDeviceSynchronize());
  else
    MR_CUDA_TRY(cudaStreamSynchronize(s->s));
  return mr__cuda_status_check(&IMPL(be)->ctx);
}

static void *cu_kernel_ctx(struct mr_backend *be) { return &IMPL(be)->ctx; }

static int cu_axpby(struct mr_backend *be, float *y, const float *x, float a,
                    float b, size_t n) {
  struct mr__cuda *c = IMPL(be);
  MR_TRY(mr__cuda_set_device(c->device));
  MR_CUDA_TRY(mr__k_axpby(c->compute.s, y, x, a, b, (int64_t)n));
  return 0;
}

static int cu_sumsq(struct mr_backend *be, const float *x, size_t n, double *out) {
  struct mr__cuda *c = IMPL(be);
  MR_TRY(mr__cuda_set_device(c->device));
  size_t chunks = (n + 4095) / 4096;
  *out = 0;
  if (chunks == 0)
    return 0;
  double *part = NULL, *host = NULL;
  MR_TRY(mr__cuda_pool_alloc(&c->pool, chunks * sizeof(double), (void **)&part));
  int rc = mr__cuda_check(mr__k_sumsq_chunks(c->compute.s, part, x, (int64_t)n),
                          "sumsq kernel");
  if (rc == 0 && c->sumsq_cap < chunks) {
    cudaFreeHost(c->sumsq_host);
    c->sumsq_host = NULL;
    c->sumsq_cap = 0;
    rc = mr__cuda_check(cudaMallocHost((void **)&c->sumsq_host,
                                       chunks * sizeof(double)), "cudaMallocHost");
    if (rc == 0)
      c->sumsq_cap = chunks;
  }
  host = c->sumsq_host;
  if (rc == 0)
    rc = mr__cuda_check(cudaMemcpyAsync(host, part, chunks * sizeof(double),
                                        cudaMemcpyDeviceToHost, c->compute.s),
                        "cudaMemcpyAsync");
  if (rc == 0)
    rc = mr__cuda_check(cudaStreamSynchronize(c->compute.s), "cudaStreamSynchronize");
  if (rc == 0) {
    /* the chunks in order, as the CPU backend sums them */
    double s = 0;
    for (size_t i = 0; i < chunks; i++)
      s += host[i];
    *out = s;
  }
  mr__cuda_pool_free(&c->pool, part);
  if (rc == 0)
    rc = mr__cuda_status_check(&c->ctx);
  return rc;
}

static int cu_adamw(struct mr_backend *be, float *p, const float *grad, float *m,
                    float *v, size_t n, const struct mr_adamw *h, int64_t t) {
  struct mr__cuda *c = IMPL(be);
  if (t < 1)
    return mr_error_set(MR_EINVAL, "adamw: step must be >= 1, got %lld", (long long)t);
  if (!(h->beta1 >= 0 && h->beta1 < 1 && h->beta2 >= 0 && h->beta2 < 1))
    return mr_error_set(MR_EINVAL, "adamw: betas must lie in [0, 1), got (%g, %g)",
                        (double)h->beta1, (double)h->beta2);
  MR_TRY(mr__cuda_set_device(c->device));
  /* the bias corrections in double, as torch (and the CPU backend) */
  double bc1 = 1.0 - pow((double)h->beta1, (double)t);
  double bc2 = 1.0 - pow((double)h->beta2, (double)t);
  MR_CUDA_TRY(mr__k_adamw(c->compute.s, p, grad, m, v, (int64_t)n,
                          1.0f - h->lr * h->weight_decay, h->beta1, h->beta2,
                          (float)(h->lr / bc1), (float)sqrt(bc2), h->eps,
                          h->grad_scale));
  return 0;
}

static int cu_copy2d(struct mr_backend *be, void *dst, size_t dpitch,
                     const void *src, size_t spitch, size_t width, size_t rows) {
  struct mr__cuda *c = IMPL(be);
  if (width == 0 || rows == 0)
    return 0;
  MR_TRY(mr__cuda_set_device(c->device));
  MR_CUDA_TRY(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows,
                                cudaMemcpyDefault, c->compute.s));
  return 0;
}

static int cu_host_alloc(struct mr_backend *be, size_t bytes, void **out) {
  *out = NULL;
  MR_TRY(mr__cuda_set_device(IMPL(be)->device));
  MR_CUDA_TRY(cudaHostAlloc(out, bytes ? bytes : 64, cudaHostAllocPortable));
  return 0;
}

static void cu_host_free(struct mr_backend *be, void *ptr) {
  if (ptr != NULL)
    cudaFreeHost(ptr);
}

static void cu_destroy(struct mr_backend *be) {
  struct mr__cuda *c = IMPL(be);
  mr__cuda_set_device(c->device);
  cudaDeviceSynchronize();
  set_compute_stream(c->device, NULL, c->compute.s);
  mr__cuda_lt_free(&c->ctx, c->ctx.lt);
  for (size_t i = 0; i < MR_ARRAY_LEN(c->ctx.rope); i++)
    mr__cuda_pool_free(&c->pool, c->ctx.rope[i].cs);
  mr__cuda_pool_free(&c->pool, c->compute.scratch);
  if (c->ctx.status != NULL)
    cudaFree(c->ctx.status);
  cudaFreeHost(c->sumsq_host);
  mr__cuda_pool_close(&c->pool);
  if (c->compute.s != NULL)
    cudaStreamDestroy(c->compute.s);
  pthread_mutex_destroy(&c->ctx_lock);
  free(c);
}

static const struct mr_backend_ops cuda_ops = {
    .name = "cuda",
    .alloc = cu_alloc,
    .free = cu_free,
    .copy = cu_copy,
    .memset = cu_memset,
    .stream_new = cu_stream_new,
    .stream_free = cu_stream_free,
    .launch = cu_launch,
    .event_new = cu_event_new,
    .event_free = cu_event_free,
    .event_record = cu_event_record,
    .stream_wait = cu_stream_wait,
    .event_synchronize = cu_event_synchronize,
    .event_query = cu_event_query,
    .synchronize = cu_synchronize,
    .kernel_ctx = cu_kernel_ctx,
    .destroy = cu_destroy,
    .registry = MR_BACKEND_CUDA,
    .axpby = cu_axpby,
    .sumsq = cu_sumsq,
    .adamw = cu_adamw,
    .copy2d = cu_copy2d,
    .host_alloc = cu_host_alloc,
    .host_free = cu_host_free,
};

/* why the last count found no device ("" when it found some) */
static char count_reason[160];

static int device_count(int *n) {
  *n = 0;
  int k = 0;
  cudaError_t e = cudaGetDeviceCount(&k);
  if (e != cudaSuccess) {
    cudaGetLastError();
    void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (driver != NULL)
      dlclose(driver);
    snprintf(count_reason, sizeof count_reason, "cudaGetDeviceCount: %s (%s)",
             cudaGetErrorName(e), cudaGetErrorString(e));
    if (driver == NULL)
      snprintf(count_reason, sizeof count_reason, "no CUDA driver (libcuda.so.1)");
    /* no driver or no device is a CPU machine; anything else (a driver
     * too old for this CUDA, a broken install) deserves a word */
    else if (e != cudaErrorNoDevice)
      MR_WARN("cuda", "%s", count_reason);
    return 0;
  }
  count_reason[0] = '\0';
  *n = k;
  return 0;
}

static pthread_once_t register_once = PTHREAD_ONCE_INIT;

int mr__cuda_backend_make(int device, int amp, struct mr__cuda **out) {
  *out = NULL;
  if (amp < 0 || amp > 2)
    return mr_error_set(MR_EINVAL, "cuda backend: amp mode %d: expected 0 (fp32), "
                        "1 (bf16) or 2 (fp16)", amp);
  int n = 0;
  device_count(&n);
  if (device < 0 || device >= n)
    return mr_error_set(MR_ENOENT, "cuda backend: no device %d (%d visible%s%s)",
                        device, n, n == 0 ? "; " : "",
                        n == 0 ? (count_reason[0] ? count_reason : "no CUDA device")
                               : "");
  pthread_once(&register_once, mr__cuda_kernels_register);
  struct mr__cuda *c = calloc(1, sizeof *c);
  if (c == NULL)
    return mr_error_set(MR_ENOMEM, "cuda backend: out of host memory");
  c->base.ops = &cuda_ops;
  c->base.impl = c;
  c->device = device;
  pthread_mutex_init(&c->ctx_lock, NULL);
  int rc = 0;
  MR_TRY_GOTO(rc, mr__cuda_set_device(device), err);
  MR_TRY_GOTO(rc, mr__cuda_pool_init(&c->pool, device), err);
  MR_TRY_GOTO(rc, mr__cuda_check(cudaStreamCreateWithFlags(&c->compute.s,
                                                           cudaStreamNonBlocking),
                                 "cudaStreamCreateWithFlags"), err);
  c->ctx.be = c;
  c->ctx.device = device;
  c->ctx.amp = amp;
  c->ctx.cur = &c->compute;
  MR_TRY_GOTO(rc, mr__cuda_check(cudaMalloc((void **)&c->ctx.status,
                                            sizeof(struct mr__cuda_status)),
                                 "cudaMalloc"), err);
  MR_TRY_GOTO(rc, mr__cuda_check(cudaMemset(c->ctx.status, 0,
                                            sizeof(struct mr__cuda_status)),
                                 "cudaMemset"), err);
  MR_TRY_GOTO(rc, mr__cuda_lt_new(&c->ctx, &c->ctx.lt), err);
  set_compute_stream(device, c->compute.s, NULL);
  *out = c;
  return 0;
err:
  cu_destroy(&c->base);
  return rc;
}

EXPORT int mr_cuda_backend_new(int device, int amp, struct mr_backend **out) {
  *out = NULL;
  struct mr__cuda *c = NULL;
  MR_TRY(mr__cuda_backend_make(device, amp, &c));
  struct cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) == cudaSuccess)
    MR_INFO("cuda", "device %d: %s, %.1f GiB, compute capability %d.%d, amp %s",
            device, prop.name, (double)prop.totalGlobalMem / (1 << 30), prop.major,
            prop.minor, amp == 1 ? "bf16" : amp == 2 ? "fp16" : "off (fp32)");
  *out = &c->base;
  return 0;
}

EXPORT int meshrun_cuda_module(int version, struct mr_cuda_module *out) {
  if (version != MR_CUDA_MODULE_VERSION)
    return mr_error_set(MR_EVERSION, "module version %d, the program expects %d",
                        MR_CUDA_MODULE_VERSION, version);
  memset(out, 0, sizeof *out);
  out->version = MR_CUDA_MODULE_VERSION;
  out->device_count = device_count;
  out->backend_new = mr_cuda_backend_new;
  out->nccl_ops = mr__comm_nccl_ops;
  out->probe = mr__cuda_probe;
  out->matmul_rate = mr__cuda_matmul_rate;
  return 0;
}
