/* discovery.c - devices: CUDA through a dlopen'ed driver, else CPU cores. */
#include "common/discovery.h"

#include <dlfcn.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"
#include "common/log.h"

/* The few driver entry points we need, by their documented C signatures;
 * CUresult is an int-sized enum, 0 for success. */
typedef int (*cu_init_fn)(unsigned);
typedef int (*cu_count_fn)(int *);
typedef int (*cu_get_fn)(int *, int);
typedef int (*cu_name_fn)(char *, int, int);
typedef int (*cu_mem_fn)(size_t *, int);

static int discover_cuda(struct mr_devices *out) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL)
    return 0;
  /* POSIX's sanctioned way to turn dlsym's void * into a function pointer */
  cu_init_fn cu_init;
  cu_count_fn cu_count;
  cu_get_fn cu_get;
  cu_name_fn cu_name;
  cu_mem_fn cu_mem;
  *(void **)&cu_init = dlsym(lib, "cuInit");
  *(void **)&cu_count = dlsym(lib, "cuDeviceGetCount");
  *(void **)&cu_get = dlsym(lib, "cuDeviceGet");
  *(void **)&cu_name = dlsym(lib, "cuDeviceGetName");
  *(void **)&cu_mem = dlsym(lib, "cuDeviceTotalMem_v2");
  int n = 0;
  if (cu_init == NULL || cu_count == NULL || cu_get == NULL || cu_init(0) != 0 ||
      cu_count(&n) != 0 || n <= 0) {
    dlclose(lib);
    return 0;
  }
  out->dev = calloc((size_t)n, sizeof *out->dev);
  if (out->dev == NULL) {
    dlclose(lib);
    return MR_ENOMEM;
  }
  for (int i = 0; i < n; i++) {
    struct mr_device *d = &out->dev[i];
    int handle = 0;
    snprintf(d->kind, sizeof d->kind, "cuda");
    d->index = i;
    snprintf(d->name, sizeof d->name, "cuda:%d", i);
    if (cu_get(&handle, i) == 0) {
      if (cu_name != NULL)
        cu_name(d->name, (int)sizeof d->name, handle);
      size_t mem = 0;
      if (cu_mem != NULL && cu_mem(&mem, handle) == 0)
        d->memory_bytes = mem;
    }
  }
  out->n = out->gpus = n;
  dlclose(lib);
  return 0;
}

int mr_discover_devices(struct mr_devices *out) {
  memset(out, 0, sizeof *out);
  cpu_set_t set;
  CPU_ZERO(&set);
  out->cpu_cores = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set)
                                                               : (int)sysconf(_SC_NPROCESSORS_ONLN);
  if (out->cpu_cores < 1)
    out->cpu_cores = 1;
  MR_TRY(discover_cuda(out));
  if (out->n > 0)
    return 0;
  out->dev = calloc((size_t)out->cpu_cores, sizeof *out->dev);
  if (out->dev == NULL)
    return MR_ENOMEM;
  uint64_t ram = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
  int k = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE && k < out->cpu_cores; cpu++) {
    if (!CPU_ISSET(cpu, &set) && k < out->cpu_cores && CPU_COUNT(&set) > 0)
      continue;
    struct mr_device *d = &out->dev[k++];
    snprintf(d->kind, sizeof d->kind, "cpu");
    d->index = cpu;
    snprintf(d->name, sizeof d->name, "cpu core %d", cpu);
    d->memory_bytes = ram;
  }
  out->n = k;
  return 0;
}

void mr_devices_close(struct mr_devices *out) {
  free(out->dev);
  memset(out, 0, sizeof *out);
}

int mr_devices_default_nproc(const struct mr_devices *d, int threads_per_rank) {
  if (d->gpus > 0)
    return d->gpus;
  int t = threads_per_rank > 0 ? threads_per_rank : 1;
  int n = d->cpu_cores / t;
  return n > 0 ? n : 1;
}
