/* module.h - what the CUDA module (libmeshrun-cuda.so) offers the programs
 * that load it: one table of entry points, filled by its one exported
 * function.
 *
 * The module holds everything that links the CUDA runtime, cuBLASLt and
 * NCCL, so meshrun and meshrun-worker themselves run on machines without
 * them.  It links nothing of meshrun's: its references to the host's
 * functions (error, log, tunables, the op registry, the CPU comm backend)
 * resolve at load time against the executable, which is linked with
 * --export-dynamic and keeps those functions (host_symbols.c).  Only plain C
 * types cross this boundary; no CUDA or NCCL type appears here. */
#ifndef MR_CUDA_MODULE_H
#define MR_CUDA_MODULE_H

#include <stddef.h>
#include <stdint.h>

struct mr_backend;
struct mr_comm_ops;

#define MR_CUDA_MODULE_VERSION 1
#define MR_CUDA_MODULE_SYMBOL "meshrun_cuda_module"
#define MR_CUDA_MODULE_FILE "libmeshrun-cuda.so"

/* What the start-up probe measures on the visible GPUs (0 where a value
 * could not be measured). */
struct mr_gpu_probe {
  int devices;                 // visible GPUs measured
  char name[96];               // of device 0
  double memory_bytes;         // device 0 total memory
  double h2d_bandwidth;        // bytes/s, pinned host -> device 0
  double d2h_bandwidth;        // bytes/s, device 0 -> pinned host
  double d2d_bandwidth;        // bytes/s, copy within device 0 (read + write)
  double matmul_flops_bf16;    // FLOP/s, best of a few large bf16 GEMMs
  double matmul_flops_fp32;    // FLOP/s, one large fp32 GEMM
  double allreduce_bus_bw;     // bytes/s, nccl-tests busbw at 64 MiB over all GPUs
  double allreduce_latency;    // s per ring step, from a 4 KiB AllReduce
  int sm_count, cc_major, cc_minor;
};

struct mr_cuda_module {
  int version;                 // MR_CUDA_MODULE_VERSION
  /* GPUs the CUDA runtime sees (CUDA_VISIBLE_DEVICES applied): 0 where
   * there is no driver or no device.  Initializes CUDA in this process. */
  int (*device_count)(int *n);
  /* mr_cuda_backend_new below. */
  int (*backend_new)(int device, int amp, struct mr_backend **out);
  /* The NCCL comm backend (worker/comm/comm.h). */
  const struct mr_comm_ops *(*nccl_ops)(void);
  /* Measures bandwidths, GEMM rates and an in-process NCCL AllReduce over
   * the first ndev visible GPUs (<= 0: all), a few seconds. */
  int (*probe)(int ndev, struct mr_gpu_probe *out);
  /* FLOP/s of C[m,n] = A[m,k] B[k,n] through the backend's matmul (dtype
   * 0 fp32, 1 bf16 operands, 2 fp16), best of iters timed runs. */
  int (*matmul_rate)(int device, int m, int n, int k, int dtype, int iters,
                     double *flops);
};

/* The one exported function: fills *out (caller-allocated) when version is
 * MR_CUDA_MODULE_VERSION; else MR_EVERSION. */
typedef int (*mr_cuda_module_fn)(int version, struct mr_cuda_module *out);

/* A CUDA device backend on visible device `device` with amp one of enum
 * mr_amp_mode (worker/exec_extra.h): 0 fp32 (true fp32 GEMMs), 1 bf16 or
 * 2 fp16 operands for matmuls and attention with fp32 accumulation.
 * Registers the module's op kernels (MR_BACKEND_CUDA) on first use.  *out is
 * the caller's: mr_backend_free().  Returns 0, MR_ENOENT (no such device),
 * MR_ENOMEM or MR_EIO with a message naming the CUDA call that failed. */
int mr_cuda_backend_new(int device, int amp, struct mr_backend **out);

#endif
