/* seed_cluster.c - writes valid cluster specs into DIR, the starting
 * corpus for fuzz_cluster. */
#include <stdio.h>

static const char *const specs[] = {
    "{\"name\": \"n\", \"nodes\": 2, \"devices_per_node\": 4, \"device\": {\"peak_flops\": "
    "{\"fp32\": 19.5e12, \"bf16\": 312e12, \"fp16\": 312e12}, \"matmul_efficiency\": 0.87, "
    "\"gemm_half_dim\": 295, \"memory_bytes\": 85899345920, \"memory_bandwidth\": 2.039e12, "
    "\"reserved_bytes\": 3221225472}, \"intra_node\": {\"bus_bandwidth\": 235e9, "
    "\"latency\": 3.1e-6}, \"inter_node\": {\"bandwidth\": 200e9, \"latency\": 5e-6}, "
    "\"host\": {\"link_bandwidth\": 25e9, \"memory_bandwidth\": 51.2e9}}",
    "{\"name\": \"cpu\", \"devices_per_node\": 2, \"device\": {\"peak_flops\": {\"fp32\": 94e9, "
    "\"bf16\": 94e9, \"fp16\": 94e9}, \"matmul_efficiency\": 0.8, \"gemm_half_dim\": 6, "
    "\"memory_bytes\": 12884901888, \"memory_bandwidth\": 9.6e9, \"reserved_bytes\": 0}, "
    "\"intra_node\": {\"bus_bandwidth\": 4.3e9, \"latency\": 0.9e-6}, \"inter_node\": "
    "{\"bandwidth\": 1.25e9, \"latency\": 6.5e-6}, \"host\": {\"link_bandwidth\": 9.6e9, "
    "\"memory_bandwidth\": 9.6e9}}",
};

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: seed_cluster DIR\n");
    return 2;
  }
  for (unsigned i = 0; i < sizeof specs / sizeof specs[0]; i++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/spec%u.json", argv[1], i);
    FILE *f = fopen(path, "w");
    if (f == NULL)
      return 1;
    fputs(specs[i], f);
    fclose(f);
  }
  return 0;
}
