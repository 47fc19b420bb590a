/* loader.h - finds and loads the CUDA module (module.h) on first use.
 *
 * Linked into every program that may drive a GPU (meshrun-worker, meshrun,
 * the GPU tests and benchmarks); it needs no CUDA itself.  The module is
 * looked for beside the running executable, then where `meson install`
 * puts it, then in the build tree it was built in. */
#ifndef MR_CUDA_LOADER_H
#define MR_CUDA_LOADER_H

#include "worker/backend/cuda/module.h"

/* Loads the module once per process (thread-safe) and gives its table,
 * borrowed for the life of the process.  Returns 0; MR_ENOTSUP when this
 * build has no CUDA module; MR_ENOENT when it cannot be loaded, the message
 * naming the library, the paths tried and dlerror()'s text; MR_EVERSION on
 * a module of another version. */
int mr_cuda_module_load(const struct mr_cuda_module **out);

/* 1 when this build includes the CUDA module, else 0. */
int mr_cuda_module_built(void);

#endif
