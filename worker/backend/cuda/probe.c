/* probe.c - the start-up measurements behind a GPU machine's cluster spec:
 * host link and device memory bandwidth, GEMM rates through the backend's
 * own matmul, and an in-process NCCL AllReduce over the visible GPUs
 * (nccl-tests' bus bandwidth).  A few seconds in all. */
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "common/log.h"
#include "worker/backend/cuda/cuda_internal.h"
#include "worker/backend/cuda/module.h"

/* Seconds of the best of reps runs of fn on stream s, timed with events. */
typedef int (*timed_fn)(void *arg, cudaStream_t s);

static int best_time(timed_fn fn, void *arg, cudaStream_t s, int reps, double *out) {
  cudaEvent_t a = NULL, b = NULL;
  int rc = mr__cuda_check(cudaEventCreate(&a), "cudaEventCreate");
  if (rc == 0)
    rc = mr__cuda_check(cudaEventCreate(&b), "cudaEventCreate");
  double best = 0;
  for (int i = 0; i <= reps && rc == 0; i++) { /* run 0 warms up */
    rc = mr__cuda_check(cudaEventRecord(a, s), "cudaEventRecord");
    if (rc == 0)
      rc = fn(arg, s);
    if (rc == 0)
      rc = mr__cuda_check(cudaEventRecord(b, s), "cudaEventRecord");
    if (rc == 0)
      rc = mr__cuda_check(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    if (rc == 0)
      rc = mr__cuda_check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    if (rc == 0 && i > 0 && (best == 0 || ms * 1e-3 < best))
      best = ms * 1e-3;
  }
  if (a != NULL)
    cudaEventDestroy(a);
  if (b != NULL)
    cudaEventDestroy(b);
  *out = best;
  return rc;
}

struct copy_arg {
  void *dst;
  const void *src;
  size_t bytes;
};

static int do_copy(void *arg, cudaStream_t s) {
  struct copy_arg *c = arg;
  return mr__cuda_check(cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDefault, s),
                        "cudaMemcpyAsync");
}

struct mm_arg {
  struct mr__cuda_ctx *ctx;
  int m, n, k, dtype;
  void *a, *b;
  float *c;
};

static int do_matmul(void *arg, cudaStream_t s) {
  struct mm_arg *m = arg;
  return mr__cuda_matmul(m->ctx, 0, 0, m->m, m->n, m->k, m->a, m->k, m->b, m->n, m->c,
                         m->n, m->dtype, 0);
}

int mr__cuda_matmul_rate(int device, int m, int n, int k, int dtype, int iters,
                         double *flops) {
  *flops = 0;
  struct mr__cuda *be = NULL;
  MR_TRY(mr__cuda_backend_make(device, 0, &be));
  size_t es = dtype == 0 ? 4 : 2;
  struct mm_arg a = {&be->ctx, m, n, k, dtype, NULL, NULL, NULL};
  int rc = mr__cuda_pool_alloc(&be->pool, (size_t)m * k * es, &a.a);
  if (rc == 0)
    rc = mr__cuda_pool_alloc(&be->pool, (size_t)k * n * es, &a.b);
  if (rc == 0)
    rc = mr__cuda_pool_alloc(&be->pool, (size_t)m * n * 4, (void **)&a.c);
  /* a small nonzero pattern (0x3c3c: about 0.0115 in bf16, 1.06 in fp16) */
  if (rc == 0)
    rc = mr__cuda_check(cudaMemset(a.a, 0x3c, (size_t)m * k * es), "cudaMemset");
  if (rc == 0)
    rc = mr__cuda_check(cudaMemset(a.b, 0x3c, (size_t)k * n * es), "cudaMemset");
  double t = 0;
  if (rc == 0)
    rc = best_time(do_matmul, &a, be->compute.s, iters > 0 ? iters : 3, &t);
  if (rc == 0 && t > 0)
    *flops = 2.0 * m * (double)n * k / t;
  mr_backend_free(&be->base);
  return rc;
}

static int measure_allreduce(int ndev, double *busbw, double *lat) {
  *busbw = 0;
  *lat = 0;
  if (ndev < 2)
    return 0;
  ncclComm_t *comms = calloc((size_t)ndev, sizeof *comms);
  cudaStream_t *st = calloc((size_t)ndev, sizeof *st);
  float **buf = calloc((size_t)ndev, sizeof *buf);
  int *devs = calloc((size_t)ndev, sizeof *devs);
  int rc = comms && st && buf && devs ? 0 : mr_error_set(MR_ENOMEM, "probe: out of memory");
  size_t big = (size_t)64 << 20, small = 4096;
  for (int i = 0; i < ndev && rc == 0; i++) {
    devs[i] = i;
    rc = mr__cuda_set_device(i);
    if (rc == 0)
      rc = mr__cuda_check(cudaStreamCreateWithFlags(&st[i], cudaStreamNonBlocking),
                          "cudaStreamCreateWithFlags");
    if (rc == 0)
      rc = mr__cuda_check(cudaMalloc((void **)&buf[i], big), "cudaMalloc");
    if (rc == 0)
      rc = mr__cuda_check(cudaMemset(buf[i], 0, big), "cudaMemset");
  }
  if (rc == 0) {
    ncclResult_t r = ncclCommInitAll(comms, ndev, devs);
    if (r != ncclSuccess)
      rc = mr_error_set(MR_EIO, "probe: ncclCommInitAll over %d GPUs: %s", ndev,
                        ncclGetErrorString(r));
  }
  for (int pass = 0; pass < 2 && rc == 0; pass++) {
    size_t bytes = pass == 0 ? small : big;
    double best = 0;
    for (int rep = 0; rep < 6 && rc == 0; rep++) {
      struct timespec t0, t1;
      clock_gettime(CLOCK_MONOTONIC, &t0);
      ncclResult_t r = ncclGroupStart();
      for (int i = 0; i < ndev && r == ncclSuccess; i++)
        r = ncclAllReduce(buf[i], buf[i], bytes / 4, ncclFloat32, ncclSum, comms[i], st[i]);
      ncclResult_t e = ncclGroupEnd();
      if (r == ncclSuccess)
        r = e;
      if (r != ncclSuccess) {
        rc = mr_error_set(MR_EIO, "probe: ncclAllReduce: %s", ncclGetErrorString(r));
        break;
      }
      for (int i = 0; i < ndev && rc == 0; i++) {
        rc = mr__cuda_set_device(i);
        if (rc == 0)
          rc = mr__cuda_check(cudaStreamSynchronize(st[i]), "cudaStreamSynchronize");
      }
      clock_gettime(CLOCK_MONOTONIC, &t1);
      double t = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
      if (rep > 0 && (best == 0 || t < best))
        best = t;
    }
    if (rc == 0 && best > 0) {
      double steps = 2.0 * (ndev - 1);
      if (pass == 0)
        *lat = best / steps;
      else
        *busbw = (double)bytes / best * steps / ndev;
    }
  }
  for (int i = 0; i < ndev; i++) {
    if (comms && comms[i] != NULL)
      ncclCommDestroy(comms[i]);
    if (buf && buf[i] != NULL) {
      cudaSetDevice(i);
      cudaFree(buf[i]);
    }
    if (st && st[i] != NULL)
      cudaStreamDestroy(st[i]);
  }
  free(comms);
  free(st);
  free(buf);
  free(devs);
  return rc;
}

int mr__cuda_probe(int ndev, struct mr_gpu_probe *out) {
  memset(out, 0, sizeof *out);
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return mr_error_set(MR_ENOENT, "probe: no CUDA device");
  }
  if (ndev <= 0 || ndev > n)
    ndev = n;
  out->devices = ndev;
  struct cudaDeviceProp prop;
  MR_CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
  snprintf(out->name, sizeof out->name, "%.95s", prop.name);
  out->memory_bytes = (double)prop.totalGlobalMem;
  out->sm_count = prop.multiProcessorCount;
  out->cc_major = prop.major;
  out->cc_minor = prop.minor;

  struct mr__cuda *be = NULL;
  MR_TRY(mr__cuda_backend_make(0, 0, &be));
  size_t bytes = (size_t)256 << 20;
  void *host = NULL, *d0 = NULL, *d1 = NULL;
  int rc = mr__cuda_check(cudaMallocHost(&host, bytes), "cudaMallocHost");
  if (rc == 0)
    rc = mr__cuda_pool_alloc(&be->pool, bytes, &d0);
  if (rc == 0)
    rc = mr__cuda_pool_alloc(&be->pool, bytes, &d1);
  if (rc == 0) {
    memset(host, 1, bytes);
    rc = mr__cuda_check(cudaMemset(d0, 1, bytes), "cudaMemset");
  }
  double t = 0;
  struct copy_arg h2d = {d0, host, bytes}, d2h = {host, d0, bytes}, d2d = {d1, d0, bytes};
  if (rc == 0 && (rc = best_time(do_copy, &h2d, be->compute.s, 3, &t)) == 0 && t > 0)
    out->h2d_bandwidth = (double)bytes / t;
  if (rc == 0 && (rc = best_time(do_copy, &d2h, be->compute.s, 3, &t)) == 0 && t > 0)
    out->d2h_bandwidth = (double)bytes / t;
  /* a device copy reads and writes every byte */
  if (rc == 0 && (rc = best_time(do_copy, &d2d, be->compute.s, 3, &t)) == 0 && t > 0)
    out->d2d_bandwidth = 2.0 * (double)bytes / t;
  if (host != NULL)
    cudaFreeHost(host);
  mr_backend_free(&be->base);
  MR_TRY(rc);
  static const int shapes[][3] = {{8192, 8192, 8192}, {4096, 8192, 8192}, {8192, 4096, 8192}};
  for (size_t i = 0; i < MR_ARRAY_LEN(shapes); i++) {
    double f = 0;
    MR_TRY(mr__cuda_matmul_rate(0, shapes[i][0], shapes[i][1], shapes[i][2], 1, 3, &f));
    if (f > out->matmul_flops_bf16)
      out->matmul_flops_bf16 = f;
  }
  MR_TRY(mr__cuda_matmul_rate(0, 4096, 4096, 4096, 0, 2, &out->matmul_flops_fp32));
  rc = measure_allreduce(ndev, &out->allreduce_bus_bw, &out->allreduce_latency);
  if (rc < 0)
    MR_WARN("cuda", "probe: %s (AllReduce not measured)", mr_error_message());
  return 0;
}
