/* gpu_probe_main.c - meshrun-gpu-probe: measures the visible GPUs and
 * writes a cluster spec (worker/gpu_spec.h; launcher/measure.h caches it).  `meshrun launch` runs it
 * once per machine; it can also be run by hand. */
#include <stdio.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#include "worker/backend/cuda/loader.h"
#include "worker/gpu_spec.h"

int main(int argc, char **argv) {
  const char *out = NULL;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--out") == 0 && i + 1 < argc)
      out = argv[++i];
    else {
      fprintf(stderr, "usage: meshrun-gpu-probe --out FILE.json\n");
      return 2;
    }
  }
  if (out == NULL) {
    fprintf(stderr, "usage: meshrun-gpu-probe --out FILE.json\n");
    return 2;
  }
  mr_log_set_prefix("gpu-probe");
  const struct mr_cuda_module *m = NULL;
  struct mr_gpu_probe p;
  if (mr_cuda_module_load(&m) < 0 || m->probe(0, &p) < 0 ||
      mr_gpu_spec_write(&p, out) < 0) {
    fprintf(stderr, "meshrun-gpu-probe: %s\n", mr_error_message());
    return 1;
  }
  printf("%d x %s: bf16 GEMM %.0f TFLOP/s, device copy %.0f GB/s, host link %.1f / "
         "%.1f GB/s, AllReduce busbw %.0f GB/s -> %s\n", p.devices, p.name,
         p.matmul_flops_bf16 / 1e12, p.d2d_bandwidth / 1e9, p.h2d_bandwidth / 1e9,
         p.d2h_bandwidth / 1e9, p.allreduce_bus_bw / 1e9, out);
  return 0;
}
