/* gpu_matmul.c - cuBLASLt GEMM rates through the CUDA backend's matmul
 * (scripts/gpu-check): bf16 operands with fp32 accumulation at a few large
 * shapes, and one fp32 (true fp32, no TF32) shape, against the device's
 * peak.
 *
 *   gpu_matmul_bench [--peak-tflops 989] [--device 0] [--iters 10]
 *
 * Prints `matmul MxNxK dtype tflops=.. of_peak=..` per shape and
 * `best tflops=.. of_peak=..` for bf16. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "worker/backend/cuda/loader.h"

int main(int argc, char **argv) {
  double peak = 989;
  int device = 0, iters = 10;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--peak-tflops") == 0 && i + 1 < argc)
      peak = atof(argv[++i]);
    else if (strcmp(argv[i], "--device") == 0 && i + 1 < argc)
      device = atoi(argv[++i]);
    else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
      iters = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: gpu_matmul_bench [--peak-tflops T] [--device D] [--iters N]\n");
      return 2;
    }
  }
  const struct mr_cuda_module *m = NULL;
  if (mr_cuda_module_load(&m) < 0) {
    fprintf(stderr, "gpu_matmul_bench: %s\n", mr_error_message());
    return 1;
  }
  static const int shapes[][4] = {
      {4096, 4096, 4096, 1}, {8192, 8192, 8192, 1}, {16384, 8192, 4096, 1},
      {8192, 5632, 2048, 1}, {8192, 32000, 2048, 1}, {4096, 4096, 4096, 0},
  };
  double best = 0;
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
    double f = 0;
    if (m->matmul_rate(device, shapes[i][0], shapes[i][1], shapes[i][2], shapes[i][3],
                       iters, &f) < 0) {
      fprintf(stderr, "gpu_matmul_bench: %dx%dx%d: %s\n", shapes[i][0], shapes[i][1],
              shapes[i][2], mr_error_message());
      return 1;
    }
    double p = shapes[i][3] ? peak : peak / 14.76; /* fp32 peak: 67 of 989 on H100/H200 */
    printf("matmul %dx%dx%d %s tflops=%.1f of_peak=%.1f%%\n", shapes[i][0], shapes[i][1],
           shapes[i][2], shapes[i][3] ? "bf16" : "fp32", f / 1e12, 100 * f / 1e12 / p);
    if (shapes[i][3] && f > best)
      best = f;
  }
  printf("best tflops=%.1f of_peak=%.1f%%\n", best / 1e12, 100 * best / 1e12 / peak);
  return 0;
}
