/* device.c - "cpu" or "cuda": a backend table and its comm backend. */
#include "worker/device.h"

#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "worker/backend/cpu/cpu_backend.h"
#include "worker/backend/cuda/loader.h"
#include "worker/comm/comm.h"
#include "worker/exec_extra.h"

/* A CPU backend that owns its kernel context: the wrapped backend's table
 * with destroy replaced. */
struct cpu_device {
  struct mr_backend be;          // what the caller holds
  struct mr_backend_ops ops;
  struct mr_backend *inner;      // mr_cpu_backend_wrap over ctx
  struct mr_cpu_ctx ctx;
};

static void cpu_device_destroy(struct mr_backend *be) {
  struct cpu_device *d = (struct cpu_device *)be;
  mr_backend_free(d->inner);
  mr_cpu_ctx_close(&d->ctx);
  free(d);
}

static int open_cpu(int threads, int amp, struct mr_backend **out) {
  struct cpu_device *d = calloc(1, sizeof *d);
  if (d == NULL)
    return mr_error_set(MR_ENOMEM, "cpu device: out of memory");
  int rc = mr_cpu_ctx_init(&d->ctx, threads > 0 ? threads : 1, (enum mr_amp_mode)amp);
  if (rc == 0)
    rc = mr_cpu_backend_wrap(d->ctx.pool, &d->ctx, &d->inner);
  if (rc < 0) {
    mr_cpu_ctx_close(&d->ctx);
    free(d);
    return rc;
  }
  mr_cpu_kernels_register();
  d->ops = *d->inner->ops;
  d->ops.destroy = cpu_device_destroy;
  d->be.ops = &d->ops;
  d->be.impl = d->inner->impl; /* the CPU table's functions read impl */
  *out = &d->be;
  return 0;
}

int mr_device_open(const char *kind, int device_index, int threads, int amp,
                   struct mr_backend **out) {
  *out = NULL;
  if (amp < MR_AMP_NONE || amp > MR_AMP_ROUND_F16)
    return mr_error_set(MR_EINVAL, "device: amp mode %d: expected 0 (fp32), 1 (bf16) "
                        "or 2 (fp16)", amp);
  if (kind != NULL && strcmp(kind, "cpu") == 0)
    return open_cpu(threads, amp, out);
  if (kind != NULL && strcmp(kind, "cuda") == 0) {
    const struct mr_cuda_module *m = NULL;
    MR_TRY(mr_cuda_module_load(&m));
    return m->backend_new(device_index, amp, out);
  }
  return mr_error_set(MR_EINVAL, "device \"%s\": expected \"cpu\" or \"cuda\"",
                      kind != NULL ? kind : "(null)");
}

int mr_device_comm_ops(const char *kind, const struct mr_comm_ops **out) {
  *out = NULL;
  if (kind != NULL && strcmp(kind, "cpu") == 0) {
    *out = mr_comm_cpu_ops();
    return 0;
  }
  if (kind != NULL && strcmp(kind, "cuda") == 0) {
    const struct mr_cuda_module *m = NULL;
    MR_TRY(mr_cuda_module_load(&m));
    *out = m->nccl_ops();
    return 0;
  }
  return mr_error_set(MR_EINVAL, "device \"%s\": expected \"cpu\" or \"cuda\"",
                      kind != NULL ? kind : "(null)");
}
