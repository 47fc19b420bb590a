/* measure.h - this machine measured for the planner, as a cluster spec
 * (compiler/planner/cluster.h) cached per machine under ~/.cache/meshrun/.
 *
 * The launcher runs no kernel: the measuring runs in processes of its
 * own, `meshrun-worker --calibrate` for CPU ranks (worker/calibrate.h)
 * and meshrun-gpu-probe for GPUs (worker/gpu_probe_main.c, built with the
 * CUDA module), so the launcher never holds a CUDA context on a GPU its
 * ranks need. */
#ifndef MR_MEASURE_H
#define MR_MEASURE_H

#include <stddef.h>

#include "common/discovery.h"

/* The spec for this machine's visible GPUs: the cached one when the same
 * GPUs were measured before, else measured now (a few seconds) and cached.
 * Writes its path into path (len bytes).  Returns 0; 1 when skipped (no
 * GPU: path is ""); MR_ENOENT (no meshrun-gpu-probe), MR_EIO (the probe
 * failed or took over 3 minutes) or MR_EFORMAT with a message. */
int mr_gpu_cluster_spec(const struct mr_devices *d, char *path, size_t len);

/* The spec for CPU ranks on this machine: the cached one when this CPU
 * (model, instruction sets, cores, memory) was measured before, else
 * measured now by `meshrun-worker --calibrate` for one rank a core and
 * cached as ~/.cache/meshrun/cluster-cpu-CORES-ID.json (a cached file that
 * does not load is measured again).  Writes its path into path (len
 * bytes).  Returns 0 or an MR_E code with a message (path is then ""). */
int mr_cpu_cluster_spec(char *path, size_t len);

#endif
