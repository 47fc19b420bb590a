/* gpu_probe.h - the start-up measurement of a GPU machine, written as a
 * cluster spec (launcher/planner/cluster.h) for the planner and cached per
 * machine under ~/.cache/meshrun/.
 *
 * The measuring runs in its own process, meshrun-gpu-probe (built with the
 * CUDA module; launcher/gpu_probe_main.c), so the launcher never holds a
 * CUDA context on a GPU its ranks need.  On a machine without GPUs nothing
 * is measured. */
#ifndef MR_GPU_PROBE_H
#define MR_GPU_PROBE_H

#include <stddef.h>

#include "common/discovery.h"

struct mr_gpu_probe;

/* The spec for this machine's visible GPUs: the cached one when the same
 * GPUs were measured before, else measured now (a few seconds) and cached.
 * Writes its path into path (len bytes).  Returns 0; 1 when skipped (no
 * GPU: path is ""); MR_ENOENT (no meshrun-gpu-probe), MR_EIO (the probe
 * failed or took over 3 minutes) or MR_EFORMAT with a message. */
int mr_gpu_cluster_spec(const struct mr_devices *d, char *path, size_t len);

/* Writes a spec for p's machine to out: the shipped spec nearest to the
 * device (H200, H100, A100; else H100's) with every measured field
 * replaced and each group's source saying so.  Returns 0 or an error
 * naming the file. */
int mr_gpu_spec_write(const struct mr_gpu_probe *p, const char *out);

#endif
