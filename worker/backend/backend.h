/* backend.h - the device backend interface: memory, streams, kernel
 * launches, events, synchronization.
 *
 * The runtime loop drives a device through this table only, so the CPU and
 * CUDA backends are interchangeable.  A stream is an in-order queue of work;
 * an event marks a point in a stream that another stream (or the host) can
 * wait for.  A kernel is a function taking the backend's kernel context (for
 * the CPU backend the rank's struct mr_pool, for CUDA its stream handle) and
 * a pointer to its own argument struct; the op registry holds one such
 * function per op and backend.
 *
 * On the CPU backend work runs at launch, on the calling thread and the
 * rank's pool, so a launch returns when the kernel is done, an event is
 * complete as soon as it is recorded and synchronize returns at once; the
 * overlap with communication comes from the comm backend's own threads. */
#ifndef MR_BACKEND_H
#define MR_BACKEND_H

#include <stddef.h>
#include <stdint.h>

struct mr_backend;
struct mr_stream;
struct mr_event;
/* AdamW's hyper-parameters, as every backend's adamw takes them. */
struct mr_adamw {
  float lr;            // 1e-3
  float beta1, beta2;  // 0.9, 0.999
  float eps;           // 1e-8
  float weight_decay;  // 0.01 (decoupled, torch.optim.AdamW)
  float grad_scale;    // multiplies g before use (1/loss_scale * clip); 1
};

enum mr_copy_kind {
  MR_COPY_HOST_TO_DEVICE = 0,
  MR_COPY_DEVICE_TO_HOST = 1,
  MR_COPY_DEVICE_TO_DEVICE = 2,
};

/* A kernel: kctx is the backend's context (see above), args its own struct,
 * borrowed for the duration of the call.  Returns 0 or a negative MR_E*. */
typedef int (*mr_launch_fn)(void *kctx, const void *args);

struct mr_backend_ops {
  const char *name; // "cpu", "cuda"
  /* Device memory, 64-byte aligned.  alloc of 0 bytes gives a valid pointer
   * that free accepts; free(NULL) is a no-op. */
  int (*alloc)(struct mr_backend *be, size_t bytes, void **out);
  void (*free)(struct mr_backend *be, void *ptr);
  /* Ordered on stream s (NULL: the default stream). */
  int (*copy)(struct mr_backend *be, struct mr_stream *s, void *dst,
              const void *src, size_t bytes, enum mr_copy_kind kind);
  int (*memset)(struct mr_backend *be, struct mr_stream *s, void *dst,
                int byte, size_t bytes);
  int (*stream_new)(struct mr_backend *be, struct mr_stream **out);
  void (*stream_free)(struct mr_backend *be, struct mr_stream *s);
  /* Queues fn(kctx, args) on s.  The caller keeps args alive until the
   * stream has passed it (on the CPU: until launch returns). */
  int (*launch)(struct mr_backend *be, struct mr_stream *s, mr_launch_fn fn,
                const void *args);
  int (*event_new)(struct mr_backend *be, struct mr_event **out);
  void (*event_free)(struct mr_backend *be, struct mr_event *ev);
  /* Marks the current end of s. */
  int (*event_record)(struct mr_backend *be, struct mr_event *ev,
                      struct mr_stream *s);
  /* Work queued on s after this waits for ev. */
  int (*stream_wait)(struct mr_backend *be, struct mr_stream *s,
                     struct mr_event *ev);
  /* Host waits for ev; query returns 1 when done, 0 when not yet. */
  int (*event_synchronize)(struct mr_backend *be, struct mr_event *ev);
  int (*event_query)(struct mr_backend *be, struct mr_event *ev);
  /* Host waits for everything queued on s (NULL: on every stream). */
  int (*synchronize)(struct mr_backend *be, struct mr_stream *s);
  /* The kernel context passed to kernels launched on this backend, and to
   * the op registry's kernels for this backend (compiler/ops.h mr_kernel_fn:
   * on the CPU a struct mr_cpu_ctx, on CUDA the backend's stream context). */
  void *(*kernel_ctx)(struct mr_backend *be);
  void (*destroy)(struct mr_backend *be);

  /* What the distributed runtime needs besides the op kernels, on the
   * compute stream, all on device memory (float32):
   * registry: which op registry kernels run here (enum mr_backend_kind). */
  int registry;
  /* y[i] = a * y[i] + b * x[i] for n elements (x may be y); a == 0: y is
   * only written (whatever it held, NaN included). */
  int (*axpby)(struct mr_backend *be, float *y, const float *x, float a, float b,
               size_t n);
  /* *out = sum of x[i]^2 in double over fixed 4096-element chunks summed in
   * order (the same for any thread or block count); returns when *out (host
   * memory) holds it. */
  int (*sumsq)(struct mr_backend *be, const float *x, size_t n, double *out);
  /* One AdamW step t (1-based) on n elements, torch.optim.AdamW's order
   * (worker/backend/cpu/kernels.h mr_cpu_adamw_step). */
  int (*adamw)(struct mr_backend *be, float *p, const float *grad, float *m,
               float *v, size_t n, const struct mr_adamw *h, int64_t t);
  /* rows of width bytes from src (rows spitch bytes apart) to dst (dpitch
   * apart): the packing of a tensor's block for a collective. */
  int (*copy2d)(struct mr_backend *be, void *dst, size_t dpitch, const void *src,
                size_t spitch, size_t width, size_t rows);
  /* Optional (NULL: use malloc/free): host memory the device reaches at full
   * link speed (page-locked on CUDA), for data loading and offload.  A copy
   * to or from it is asynchronous on its stream (wait with an event or
   * synchronize before touching it); a copy with other host memory returns
   * when done. */
  int (*host_alloc)(struct mr_backend *be, size_t bytes, void **out);
  void (*host_free)(struct mr_backend *be, void *ptr);
};

struct mr_backend {
  const struct mr_backend_ops *ops;
  void *impl;  // the backend's own state
};

/* Frees a backend made by a backend's constructor.  NULL is a no-op. */
static inline void mr_backend_free(struct mr_backend *be) {
  if (be)
    be->ops->destroy(be);
}

#endif
