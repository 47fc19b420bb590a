/* discovery.h - which devices this machine has.
 *
 * CUDA GPUs where a driver reports any: libcuda is loaded with dlopen, so
 * the same binary runs where there is no driver, and NVML (also dlopen'ed,
 * optional) tells how the GPUs are linked (NVLink, or PCIe within or
 * across CPU sockets); each GPU's NUMA node comes from sysfs.  Otherwise
 * the CPU cores this process may run on (its affinity mask, bounded by its
 * cgroup's CPU quota). */
#ifndef MR_DISCOVERY_H
#define MR_DISCOVERY_H

#include <stddef.h>
#include <stdint.h>

struct mr_device {
  char kind[8];            // "cuda" or "cpu"
  int index;               // CUDA: among the visible GPUs; CPU: the core
  char name[96];
  uint64_t memory_bytes;   // device memory; for CPU, this machine's RAM (no
                           // more than the cgroup's memory limit)
  char pci_bus_id[32];     // CUDA: "0000:3b:00.0", else ""
  int numa_node;           // -1 when unknown
  int cc_major, cc_minor;  // CUDA compute capability, else 0
  int sm_count;            // CUDA multiprocessors, else 0
  int nvlinks;             // active NVLink links (NVML), else 0
};

/* How two GPUs reach each other, best first. */
enum mr_gpu_link {
  MR_GPU_LINK_UNKNOWN = 0,     // no NVML, or a CPU machine
  MR_GPU_LINK_SELF = 1,
  MR_GPU_LINK_NVLINK = 2,      // NVLink, directly or through NVSwitch
  MR_GPU_LINK_PCIE = 3,        // PCIe switches or one host bridge
  MR_GPU_LINK_SYSTEM = 4,      // across CPU sockets (NUMA nodes)
};

struct mr_devices {
  struct mr_device *dev;   // owned
  int n;
  int gpus;                // number of CUDA devices (0: CPU machine)
  int cpu_cores;           // cores in our affinity mask, at most our cgroup's
                           // CPU quota (a container's --cpus, a pod's limit)
  unsigned char *links;    // owned, [gpus * gpus] enum mr_gpu_link, NULL if none
};

/* Fills out (caller-allocated).  Never fails for lack of CUDA: a machine
 * without it reports its cores.  Honours CUDA_VISIBLE_DEVICES through the
 * driver.  Returns 0 or MR_ENOMEM. */
int mr_discover_devices(struct mr_devices *out);

/* Releases out's arrays. */
void mr_devices_close(struct mr_devices *out);

/* The CPU cores this process may use, as mr_discover_devices counts them
 * (without loading any GPU driver). */
int mr_cpu_cores(void);

/* The CPU quota of this process's cgroup, in CPUs (quota / period; the
 * least of it and its ancestors'), read under `root` ("" for this system,
 * a folder standing in for / in tests): cgroup v2's cpu.max, else v1's
 * cpu.cfs_quota_us / cpu.cfs_period_us, at the path /proc/self/cgroup
 * names (or the mount's own folder, inside a container's namespace).
 * 0 when there is none or it cannot be read. */
double mr_cgroup_cpu_limit(const char *root);

/* The same for memory: v2 memory.max, v1 memory.limit_in_bytes; bytes, 0
 * when none. */
double mr_cgroup_memory_limit(const char *root);

/* This host's memory as this process may use it: RAM, no more than the
 * cgroup's limit. */
uint64_t mr_host_memory_bytes(void);

/* Default number of ranks: one per GPU, else cores / threads_per_rank
 * (at least 1). */
int mr_devices_default_nproc(const struct mr_devices *d, int threads_per_rank);

/* The link between GPUs i and j (MR_GPU_LINK_UNKNOWN when out of range). */
enum mr_gpu_link mr_devices_link(const struct mr_devices *d, int i, int j);

/* "nvlink", "pcie", ... */
const char *mr_gpu_link_name(enum mr_gpu_link l);

/* Parses a --devices list, "0,1,3": GPU indices among the visible ones,
 * each < gpus, none twice, at most max.  Writes them into idx and their
 * count into *n.  Returns 0, or MR_EINVAL with a message naming `flag` and
 * what was expected (not a list of indices, a duplicate, an index out of
 * range, no GPU at all). */
int mr_devices_parse_list(const char *flag, const char *spec, int gpus, int *idx,
                          int max, int *n);

/* Keeps only GPUs idx[0..n) of d, in that order, renumbered 0..n-1, and
 * writes into env (len bytes) the CUDA_VISIBLE_DEVICES value that shows
 * the ranks exactly those GPUs (entries of the current CUDA_VISIBLE_DEVICES
 * where one is set, else the indices).  Returns 0, MR_EINVAL (an index out
 * of range) or MR_ENOMEM. */
int mr_devices_select(struct mr_devices *d, const int *idx, int n, char *env,
                      size_t len);

/* The first processor's block of /proc/cpuinfo (every core's reads the
 * same model) into buf (n bytes); "" where there is none. */
void mr_cpuinfo_block(char *buf, size_t n);

/* The value of key in a cpuinfo block ("key<blanks>: value") into out (n
 * bytes); "" where absent. */
void mr_cpuinfo_value(const char *block, const char *key, char *out, size_t n);

#endif
