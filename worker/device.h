/* device.h - opens the device a rank computes on and names the comm
 * backend that goes with it, so the distributed runtime needs nothing but
 * the struct mr_backend table, the op registry and struct mr_comm_ops.
 *
 * "cpu": the rank's thread pool and the CPU kernels, with the shared-memory
 * and TCP comm backend.  "cuda": the CUDA module (libmeshrun-cuda.so,
 * loaded on first use) on one GPU, with the NCCL comm backend.  Open the
 * device before the communicator: the NCCL communicator uses the device
 * of the CUDA backend opened before it. */
#ifndef MR_DEVICE_H
#define MR_DEVICE_H

struct mr_backend;
struct mr_comm_ops;

/* Opens device kind ("cpu" or "cuda").  device_index: the GPU among the
 * visible ones (CUDA_VISIBLE_DEVICES applied; ignored for cpu); threads:
 * compute threads of a CPU rank (<= 0: 1; ignored for cuda); amp: enum
 * mr_amp_mode (worker/exec_extra.h).  The backend's kernel context is what
 * the registry's kernels for be->ops->registry expect.  *out is the
 * caller's: mr_backend_free().  Returns 0; MR_EINVAL for an unknown kind;
 * for cuda MR_ENOTSUP (built without CUDA), MR_ENOENT (the module cannot
 * be loaded: the message names the library and dlerror()'s text; or no
 * such GPU), MR_ENOMEM or MR_EIO naming the CUDA call that failed. */
int mr_device_open(const char *kind, int device_index, int threads, int amp,
                   struct mr_backend **out);

/* The comm backend for device kind: the CPU one for "cpu", NCCL for
 * "cuda" (loading the module).  *out is borrowed for the process life.
 * Returns 0 or the errors of mr_device_open. */
int mr_device_comm_ops(const char *kind, const struct mr_comm_ops **out);

#endif
