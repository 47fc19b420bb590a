/* cluster.h - what the planner knows about the machines it plans for.
 *
 * A cluster spec is nodes of identical devices: per-dtype peak rate, memory
 * size and bandwidth, the link inside a node and the network between nodes
 * (α–β: a latency and a bandwidth each), and the host link used by offload.
 * Specs are JSON files (configs/clusters/NAME.json) where every number carries
 * its source; mr_cluster_parse() reads one, naming the file and field of
 * each missing or wrong value. */
#ifndef MR_CLUSTER_H
#define MR_CLUSTER_H

#include <stdint.h>

#include "common/job.h"

struct cJSON;

struct mr_cluster {
  char name[64];
  int nodes;
  int devices_per_node;
  double peak_flops[3];        // FLOP/s per device, indexed by enum mr_amp_dtype
  double matmul_efficiency;    // best fraction of peak a large GEMM reaches
  double gemm_half_dim;        // elements; see mr_cost_gemm_efficiency
  double memory_bytes;         // per device
  double memory_bandwidth;     // bytes/s per device
  double reserved_bytes;       // per device: runtime context, library workspace
  double intra_bus_bandwidth;  // bytes/s, ring bus bandwidth inside a node
  double intra_latency;        // s, per ring step inside a node
  double inter_bandwidth;      // bytes/s per node, all network adapters together
  double inter_latency;        // s, per ring step across nodes
  double host_link_bandwidth;  // bytes/s per device, device <-> host (offload)
  double host_memory_bandwidth;// bytes/s per device share of host memory
  int host_is_device;          // 1: the device's memory is the host's (CPU
                               // ranks): offloading frees none of it
};

/* Parses a cluster spec object; `file` names it in messages.  Every
 * problem is reported at once (one line each, "FILE: FIELD: expected ...").
 * Returns 0 or MR_EFORMAT with mr_error_message() set. */
int mr_cluster_parse(const struct cJSON *obj, const char *file, struct mr_cluster *out);


/* Total devices. */
int64_t mr_cluster_devices(const struct mr_cluster *c);

/* A spec of one CPU host (one node, host.is_device: cpu-local, or a
 * machine measured) run with more ranks than its cores (world): the ranks
 * share the cores, each getting its fraction of their compute, of the
 * memory and of the memory bandwidth — the host's too, which is the same
 * memory (else offloading the optimizer would look faster than running it
 * in place); devices_per_node becomes world.  Returns 1 when c is such a
 * host spec (shared or not), else 0 and c unchanged. */
int mr_cluster_share_host(struct mr_cluster *c, int world);

#endif
