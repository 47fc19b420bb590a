/* discovery.h - which devices this machine has.
 *
 * CUDA GPUs where a driver reports any: libcuda is loaded with dlopen, so
 * the same binary runs where there is no driver; otherwise the CPU cores
 * this process may run on (its affinity mask). */
#ifndef MR_DISCOVERY_H
#define MR_DISCOVERY_H

#include <stdint.h>

struct mr_device {
  char kind[8];            // "cuda" or "cpu"
  int index;
  char name[96];
  uint64_t memory_bytes;   // device memory; for CPU, this machine's RAM
};

struct mr_devices {
  struct mr_device *dev;   // owned
  int n;
  int gpus;                // number of CUDA devices (0: CPU machine)
  int cpu_cores;           // cores in our affinity mask
};

/* Fills out (caller-allocated).  Never fails for lack of CUDA: a machine
 * without it reports its cores.  Honours CUDA_VISIBLE_DEVICES through the
 * driver.  Returns 0 or MR_ENOMEM. */
int mr_discover_devices(struct mr_devices *out);

/* Releases out's array. */
void mr_devices_close(struct mr_devices *out);

/* Default number of ranks: one per GPU, else cores / threads_per_rank
 * (at least 1). */
int mr_devices_default_nproc(const struct mr_devices *d, int threads_per_rank);

#endif
