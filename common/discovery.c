/* discovery.c - devices: CUDA through a dlopen'ed driver, else CPU cores. */
#include "common/discovery.h"

#include <ctype.h>
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
typedef int (*cu_bus_fn)(char *, int, int);
typedef int (*cu_attr_fn)(int *, int, int);

#define CU_ATTR_SM_COUNT 16
#define CU_ATTR_CC_MAJOR 75
#define CU_ATTR_CC_MINOR 76

/* NVML, equally by its documented signatures: nvmlReturn_t is an int enum
 * (0 success), nvmlDevice_t an opaque pointer. */
typedef int (*nvml_init_fn)(void);
typedef int (*nvml_by_bus_fn)(const char *, void **);
typedef int (*nvml_link_state_fn)(void *, unsigned, int *);
typedef int (*nvml_p2p_fn)(void *, void *, int, int *);
typedef int (*nvml_ancestor_fn)(void *, void *, int *);

#define NVML_NVLINK_MAX_LINKS 18
#define NVML_P2P_CAPS_INDEX_NVLINK 2
#define NVML_P2P_STATUS_OK 0
#define NVML_TOPOLOGY_HOSTBRIDGE 30 /* and below: one PCIe tree */

static void *sym(void *lib, const char *name) { return dlsym(lib, name); }

static int numa_of(const char *bus_id) {
  char path[128], lower[32];
  size_t i = 0;
  for (; bus_id[i] && i < sizeof lower - 1; i++)
    lower[i] = (char)tolower((unsigned char)bus_id[i]);
  lower[i] = '\0';
  snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/numa_node", lower);
  FILE *f = fopen(path, "r");
  int node = -1;
  if (f != NULL) {
    if (fscanf(f, "%d", &node) != 1)
      node = -1;
    fclose(f);
  }
  return node;
}

/* Links between the GPUs, where NVML is present. */
static void discover_links(struct mr_devices *out) {
  int n = out->gpus;
  out->links = calloc((size_t)n * (size_t)n, 1);
  if (out->links == NULL)
    return;
  for (int i = 0; i < n; i++)
    out->links[i * n + i] = MR_GPU_LINK_SELF;
  void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL)
    return;
  nvml_init_fn init;
  nvml_init_fn shutdown;
  nvml_by_bus_fn by_bus;
  nvml_link_state_fn link_state;
  nvml_p2p_fn p2p;
  nvml_ancestor_fn ancestor;
  *(void **)&init = sym(lib, "nvmlInit_v2");
  *(void **)&shutdown = sym(lib, "nvmlShutdown");
  *(void **)&by_bus = sym(lib, "nvmlDeviceGetHandleByPciBusId_v2");
  *(void **)&link_state = sym(lib, "nvmlDeviceGetNvLinkState");
  *(void **)&p2p = sym(lib, "nvmlDeviceGetP2PStatus");
  *(void **)&ancestor = sym(lib, "nvmlDeviceGetTopologyCommonAncestor");
  if (init == NULL || by_bus == NULL || init() != 0) {
    dlclose(lib);
    return;
  }
  void **h = calloc((size_t)n, sizeof *h);
  for (int i = 0; h != NULL && i < n; i++) {
    struct mr_device *d = &out->dev[i];
    if (d->pci_bus_id[0] == '\0' || by_bus(d->pci_bus_id, &h[i]) != 0) {
      h[i] = NULL;
      continue;
    }
    for (unsigned l = 0; link_state != NULL && l < NVML_NVLINK_MAX_LINKS; l++) {
      int active = 0;
      if (link_state(h[i], l, &active) == 0 && active)
        d->nvlinks++;
    }
  }
  for (int i = 0; h != NULL && i < n; i++)
    for (int j = 0; j < n; j++) {
      if (i == j || h[i] == NULL || h[j] == NULL)
        continue;
      int st = -1, level = -1;
      enum mr_gpu_link l = MR_GPU_LINK_UNKNOWN;
      if (p2p != NULL && p2p(h[i], h[j], NVML_P2P_CAPS_INDEX_NVLINK, &st) == 0 &&
          st == NVML_P2P_STATUS_OK)
        l = MR_GPU_LINK_NVLINK;
      else if (ancestor != NULL && ancestor(h[i], h[j], &level) == 0)
        l = level <= NVML_TOPOLOGY_HOSTBRIDGE ? MR_GPU_LINK_PCIE : MR_GPU_LINK_SYSTEM;
      out->links[i * n + j] = (unsigned char)l;
    }
  free(h);
  if (shutdown != NULL)
    shutdown();
  dlclose(lib);
}

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
  cu_bus_fn cu_bus;
  cu_attr_fn cu_attr;
  *(void **)&cu_init = sym(lib, "cuInit");
  *(void **)&cu_count = sym(lib, "cuDeviceGetCount");
  *(void **)&cu_get = sym(lib, "cuDeviceGet");
  *(void **)&cu_name = sym(lib, "cuDeviceGetName");
  *(void **)&cu_mem = sym(lib, "cuDeviceTotalMem_v2");
  *(void **)&cu_bus = sym(lib, "cuDeviceGetPCIBusId");
  *(void **)&cu_attr = sym(lib, "cuDeviceGetAttribute");
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
    d->numa_node = -1;
    snprintf(d->name, sizeof d->name, "cuda:%d", i);
    if (cu_get(&handle, i) == 0) {
      if (cu_name != NULL)
        cu_name(d->name, (int)sizeof d->name, handle);
      size_t mem = 0;
      if (cu_mem != NULL && cu_mem(&mem, handle) == 0)
        d->memory_bytes = mem;
      if (cu_bus != NULL && cu_bus(d->pci_bus_id, (int)sizeof d->pci_bus_id, handle) == 0)
        d->numa_node = numa_of(d->pci_bus_id);
      else
        d->pci_bus_id[0] = '\0';
      if (cu_attr != NULL) {
        cu_attr(&d->sm_count, CU_ATTR_SM_COUNT, handle);
        cu_attr(&d->cc_major, CU_ATTR_CC_MAJOR, handle);
        cu_attr(&d->cc_minor, CU_ATTR_CC_MINOR, handle);
      }
    }
  }
  out->n = out->gpus = n;
  dlclose(lib);
  discover_links(out);
  return 0;
}

/* Reads the first line of root + path into buf; 0 or -1. */
static int read_line(const char *root, const char *path, char *buf, size_t n) {
  char full[8400];
  snprintf(full, sizeof full, "%s%s", root, path);
  FILE *f = fopen(full, "r");
  if (f == NULL)
    return -1;
  int ok = fgets(buf, (int)n, f) != NULL;
  fclose(f);
  return ok ? 0 : -1;
}

/* The CPU quota in folder dir (under root) of a cgroup v2 (cpu.max "Q P"
 * or "max P") or v1 (cfs quota and period) hierarchy; 0 when none. */
static double cpu_at(const char *root, const char *dir, int v2) {
  char path[4200], qp[4200], line[128], line2[64];
  double q, p;
  if (v2) {
    snprintf(path, sizeof path, "%s/cpu.max", dir);
    if (read_line(root, path, line, sizeof line) == 0 && sscanf(line, "%lf %lf", &q, &p) == 2 &&
        q > 0 && p > 0)
      return q / p;
    return 0;
  }
  snprintf(path, sizeof path, "%s/cpu.cfs_quota_us", dir);
  snprintf(qp, sizeof qp, "%s/cpu.cfs_period_us", dir);
  if (read_line(root, path, line, sizeof line) == 0 && read_line(root, qp, line2, sizeof line2) == 0 &&
      sscanf(line, "%lf", &q) == 1 && sscanf(line2, "%lf", &p) == 1 && q > 0 && p > 0)
    return q / p;
  return 0;
}

/* The memory limit in bytes in folder dir: v2 memory.max (a number or
 * "max"), v1 memory.limit_in_bytes (no limit reads as ~2^63); 0 when none. */
static double memory_at(const char *root, const char *dir, int v2) {
  char path[4200], line[128];
  snprintf(path, sizeof path, "%s/%s", dir, v2 ? "memory.max" : "memory.limit_in_bytes");
  char *end;
  if (read_line(root, path, line, sizeof line) != 0)
    return 0;
  double v = strtod(line, &end);
  return end != line && v > 0 && v < 0x1p60 ? v : 0;
}

/* The least limit `at` reads in this process's cgroup and its ancestors,
 * for controller ctrl ("cpu", "memory"): cgroup v2 unless a v1 hierarchy
 * holds ctrl; under a container's cgroup namespace the path /proc/self/
 * cgroup names may not exist under the mount, whose own folder is then
 * ours.  0 when there is none. */
static double cgroup_least(const char *root, const char *want,
                           double (*at)(const char *root, const char *dir, int v2)) {
  char full[4096];
  snprintf(full, sizeof full, "%s/proc/self/cgroup", root);
  FILE *f = fopen(full, "r");
  if (f == NULL)
    return 0;
  char line[4096], mount[64] = "", rel[3072] = "";
  int v2 = 0;
  size_t wn = strlen(want);
  while (fgets(line, sizeof line, f) != NULL) {
    line[strcspn(line, "\n")] = '\0';
    char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    if (c2 == NULL)
      continue;
    *c2 = '\0';
    const char *ctrl = c1 + 1, *path = c2 + 1;
    if (strncmp(line, "0:", 2) == 0 && ctrl[0] == '\0' && mount[0] == '\0') {
      snprintf(mount, sizeof mount, "/sys/fs/cgroup");
      snprintf(rel, sizeof rel, "%s", path);
      v2 = 1;
    }
    for (const char *t = ctrl; *t != '\0';) { /* v1: a hierarchy holding it */
      size_t len = strcspn(t, ",");
      if (len == wn && strncmp(t, want, wn) == 0) {
        snprintf(mount, sizeof mount, "/sys/fs/cgroup/%s", ctrl);
        snprintf(rel, sizeof rel, "%s", path);
        v2 = 0;
      }
      t += len + (t[len] == ',');
    }
  }
  fclose(f);
  if (mount[0] == '\0')
    return 0;
  char dir[4096], probe[4096];
  snprintf(dir, sizeof dir, "%s%s", mount, strcmp(rel, "/") == 0 ? "" : rel);
  snprintf(probe, sizeof probe, "%s%s", root, dir);
  if (access(probe, F_OK) != 0)
    snprintf(dir, sizeof dir, "%s", mount);
  double least = 0;
  size_t base = strlen(mount);
  for (;;) {
    double q = at(root, dir, v2);
    if (q > 0 && (least == 0 || q < least))
      least = q;
    char *slash = strrchr(dir, '/');
    if (strlen(dir) <= base || slash == NULL || (size_t)(slash - dir) < base)
      break;
    *slash = '\0';
  }
  return least;
}

double mr_cgroup_cpu_limit(const char *root) { return cgroup_least(root, "cpu", cpu_at); }

double mr_cgroup_memory_limit(const char *root) {
  return cgroup_least(root, "memory", memory_at);
}

uint64_t mr_host_memory_bytes(void) {
  double ram = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
  double lim = mr_cgroup_memory_limit("");
  return (uint64_t)(lim > 0 && lim < ram ? lim : ram);
}

/* The affinity mask into set; the cores in it within the cgroup's quota. */
static int cpu_cores(cpu_set_t *set) {
  CPU_ZERO(set);
  int n = sched_getaffinity(0, sizeof *set, set) == 0 ? CPU_COUNT(set)
                                                      : (int)sysconf(_SC_NPROCESSORS_ONLN);
  double quota = mr_cgroup_cpu_limit("");
  if (quota > 0 && quota < n) /* a container's --cpus: whole CPUs */
    n = (int)quota;
  return n < 1 ? 1 : n;
}

int mr_cpu_cores(void) {
  cpu_set_t set;
  return cpu_cores(&set);
}

int mr_discover_devices(struct mr_devices *out) {
  memset(out, 0, sizeof *out);
  cpu_set_t set;
  out->cpu_cores = cpu_cores(&set);
  MR_TRY(discover_cuda(out));
  if (out->n > 0)
    return 0;
  out->dev = calloc((size_t)out->cpu_cores, sizeof *out->dev);
  if (out->dev == NULL)
    return MR_ENOMEM;
  uint64_t ram = mr_host_memory_bytes();
  int k = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE && k < out->cpu_cores; cpu++) {
    if (!CPU_ISSET(cpu, &set) && k < out->cpu_cores && CPU_COUNT(&set) > 0)
      continue;
    struct mr_device *d = &out->dev[k++];
    snprintf(d->kind, sizeof d->kind, "cpu");
    d->index = cpu;
    snprintf(d->name, sizeof d->name, "cpu core %d", cpu);
    d->memory_bytes = ram;
    d->numa_node = -1;
  }
  out->n = k;
  return 0;
}

void mr_devices_close(struct mr_devices *out) {
  free(out->dev);
  free(out->links);
  memset(out, 0, sizeof *out);
}

int mr_devices_default_nproc(const struct mr_devices *d, int threads_per_rank) {
  if (d->gpus > 0)
    return d->gpus;
  int t = threads_per_rank > 0 ? threads_per_rank : 1;
  int n = d->cpu_cores / t;
  return n > 0 ? n : 1;
}

enum mr_gpu_link mr_devices_link(const struct mr_devices *d, int i, int j) {
  if (d->links == NULL || i < 0 || j < 0 || i >= d->gpus || j >= d->gpus)
    return MR_GPU_LINK_UNKNOWN;
  return (enum mr_gpu_link)d->links[i * d->gpus + j];
}

const char *mr_gpu_link_name(enum mr_gpu_link l) {
  switch (l) {
  case MR_GPU_LINK_SELF: return "self";
  case MR_GPU_LINK_NVLINK: return "nvlink";
  case MR_GPU_LINK_PCIE: return "pcie";
  case MR_GPU_LINK_SYSTEM: return "system";
  default: return "unknown";
  }
}

int mr_devices_parse_list(const char *flag, const char *spec, int gpus, int *idx,
                          int max, int *n) {
  *n = 0;
  const char *p = spec != NULL ? spec : "";
  /* the syntax first, so a typo is named as such on any machine */
  int count = 0;
  do {
    char *end = NULL;
    if (!isdigit((unsigned char)*p) || strtol(p, &end, 10) > 1000000 ||
        (*end != ',' && *end != '\0') || (*end == ',' && end[1] == '\0'))
      return mr_error_set(MR_EINVAL, "%s \"%s\": expected GPU indices separated by "
                          "commas, such as 0,1,3", flag, spec != NULL ? spec : "");
    count++;
    p = *end == ',' ? end + 1 : end;
  } while (*p != '\0');
  if (gpus <= 0)
    return mr_error_set(MR_EINVAL, "%s %s: this machine has no CUDA device "
                        "(CUDA_VISIBLE_DEVICES applies)", flag, spec);
  if (count > max)
    return mr_error_set(MR_EINVAL, "%s %s: more than %d GPUs", flag, spec, max);
  for (p = spec; *p != '\0';) {
    char *end = NULL;
    long v = strtol(p, &end, 10);
    if (v >= gpus)
      return mr_error_set(MR_EINVAL, "%s %s: GPU %ld does not exist; %d visible "
                          "(0..%d)", flag, spec, v, gpus, gpus - 1);
    for (int i = 0; i < *n; i++)
      if (idx[i] == (int)v)
        return mr_error_set(MR_EINVAL, "%s %s: GPU %ld listed twice", flag, spec, v);
    idx[(*n)++] = (int)v;
    p = *end == ',' ? end + 1 : end;
  }
  return 0;
}

int mr_devices_select(struct mr_devices *d, const int *idx, int n, char *env,
                      size_t len) {
  for (int i = 0; i < n; i++)
    if (idx[i] < 0 || idx[i] >= d->gpus)
      return mr_error_set(MR_EINVAL, "device %d: %d GPUs", idx[i], d->gpus);
  /* entries of the current CUDA_VISIBLE_DEVICES, if any, by position */
  const char *cur = getenv("CUDA_VISIBLE_DEVICES");
  char *copy = cur != NULL && cur[0] ? strdup(cur) : NULL;
  char *entries[1024];
  int ne = 0;
  if (copy != NULL) {
    char *save = NULL;
    for (char *t = strtok_r(copy, ",", &save); t != NULL && ne < 1024;
         t = strtok_r(NULL, ",", &save))
      entries[ne++] = t;
  }
  size_t off = 0;
  env[0] = '\0';
  for (int i = 0; i < n && off < len; i++) {
    if (idx[i] < ne)
      off += (size_t)snprintf(env + off, len - off, "%s%s", i ? "," : "", entries[idx[i]]);
    else
      off += (size_t)snprintf(env + off, len - off, "%s%d", i ? "," : "", idx[i]);
  }
  free(copy);
  struct mr_device *dev = calloc((size_t)(n > 0 ? n : 1), sizeof *dev);
  unsigned char *links = d->links != NULL ? calloc((size_t)n * (size_t)n + 1, 1) : NULL;
  if (dev == NULL || (d->links != NULL && links == NULL)) {
    free(dev);
    free(links);
    return mr_error_set(MR_ENOMEM, "devices: out of memory");
  }
  for (int i = 0; i < n; i++) {
    dev[i] = d->dev[idx[i]];
    dev[i].index = i;
    for (int j = 0; links != NULL && j < n; j++)
      links[i * n + j] = d->links[idx[i] * d->gpus + idx[j]];
  }
  free(d->dev);
  free(d->links);
  d->dev = dev;
  d->links = links;
  d->n = d->gpus = n;
  return 0;
}

/* The first processor's block of /proc/cpuinfo (every core's reads the
 * same model) into buf; "" where there is none. */
void mr_cpuinfo_block(char *buf, size_t n) {
  size_t used = 0;
  buf[0] = '\0';
  FILE *f = fopen("/proc/cpuinfo", "r");
  char line[4096];
  while (f != NULL && fgets(line, sizeof line, f) != NULL && line[0] != '\n' && used < n)
    used += (size_t)snprintf(buf + used, n - used, "%s", line);
  if (f != NULL)
    fclose(f);
}

/* The value of `key` in a cpuinfo block ("key<blanks>: value"); "" if absent. */
void mr_cpuinfo_value(const char *block, const char *key, char *out, size_t n) {
  size_t k = strlen(key);
  out[0] = '\0';
  for (const char *l = block; *l != '\0'; l += strcspn(l, "\n") + (l[strcspn(l, "\n")] != '\0'))
    if (strncmp(l, key, k) == 0 && l[k + strspn(l + k, " \t")] == ':') {
      const char *v = l + k + strspn(l + k, " \t") + 1;
      v += strspn(v, " \t");
      snprintf(out, n, "%.*s", (int)strcspn(v, "\n"), v);
      return;
    }
}
