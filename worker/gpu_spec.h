/* gpu_spec.h - a GPU machine's measurements (the CUDA module's probe)
 * written as a cluster spec for the planner, by meshrun-gpu-probe. */
#ifndef MR_GPU_SPEC_H
#define MR_GPU_SPEC_H

#include "worker/backend/cuda/module.h"

/* Writes a spec for p's machine to out: the shipped spec nearest to the
 * device (H200, H100, A100; else H100's) with every measured field
 * replaced and each group's source saying so.  Returns 0 or an error
 * naming the file. */
int mr_gpu_spec_write(const struct mr_gpu_probe *p, const char *out);

#endif
