/* loader.c - dlopen of libmeshrun-cuda.so. */
#include "worker/backend/cuda/loader.h"

#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"

#ifndef MR_HAVE_CUDA_MODULE
#define MR_HAVE_CUDA_MODULE 0
#endif
#ifndef MR_CUDA_MODULE_INSTALL
#define MR_CUDA_MODULE_INSTALL ""
#endif
#ifndef MR_CUDA_MODULE_BUILD
#define MR_CUDA_MODULE_BUILD ""
#endif

static pthread_once_t once = PTHREAD_ONCE_INIT;
static struct mr_cuda_module table;
static int load_rc;
static char load_msg[1536];

int mr_cuda_module_built(void) { return MR_HAVE_CUDA_MODULE; }

static void exe_dir(char *buf, size_t n) {
  buf[0] = '\0';
  char path[PATH_MAX];
  ssize_t len = readlink("/proc/self/exe", path, sizeof path - 1);
  if (len <= 0)
    return;
  path[len] = '\0';
  char *slash = strrchr(path, '/');
  if (slash != NULL)
    *slash = '\0';
  snprintf(buf, n, "%s", path);
}

static void load_once(void) {
  if (!MR_HAVE_CUDA_MODULE) {
    load_rc = MR_ENOTSUP;
    snprintf(load_msg, sizeof load_msg,
             "this meshrun was built without the CUDA module (%s): nvcc was "
             "not found, -Dcuda=disabled was given, or it is a sanitizer build",
             MR_CUDA_MODULE_FILE);
    return;
  }
  char dir[PATH_MAX], beside[PATH_MAX + 64];
  exe_dir(dir, sizeof dir);
  snprintf(beside, sizeof beside, "%s/%s", dir, MR_CUDA_MODULE_FILE);
  const char *paths[] = {beside, MR_CUDA_MODULE_INSTALL, MR_CUDA_MODULE_BUILD};
  char tried[1024] = "", err[512] = "";
  size_t off = 0;
  void *h = NULL;
  for (size_t i = 0; i < MR_ARRAY_LEN(paths) && h == NULL; i++) {
    if (paths[i][0] == '\0' || (i > 0 && strcmp(paths[i], paths[0]) == 0))
      continue;
    if (off < sizeof tried)
      off += (size_t)snprintf(tried + off, sizeof tried - off, "%s%s",
                              off ? ", " : "", paths[i]);
    if (access(paths[i], F_OK) != 0)
      continue;
    /* RTLD_NOW: a host symbol the module needs and the executable lacks
     * fails here, naming it, instead of at the first call */
    h = dlopen(paths[i], RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
      const char *e = dlerror();
      snprintf(err, sizeof err, "%s", e != NULL ? e : "unknown error");
    }
  }
  if (h == NULL) {
    load_rc = MR_ENOENT;
    snprintf(load_msg, sizeof load_msg, "cannot load the CUDA module %s (tried %s): %s",
             MR_CUDA_MODULE_FILE, tried, err[0] ? err : "no such file");
    return;
  }
  mr_cuda_module_fn fill;
  void *sym = dlsym(h, MR_CUDA_MODULE_SYMBOL);
  if (sym == NULL) {
    load_rc = MR_ENOENT;
    snprintf(load_msg, sizeof load_msg, "%s: no symbol %s", MR_CUDA_MODULE_FILE,
             MR_CUDA_MODULE_SYMBOL);
    return;
  }
  /* POSIX allows converting dlsym's void * to a function pointer this way */
  memcpy(&fill, &sym, sizeof fill);
  load_rc = fill(MR_CUDA_MODULE_VERSION, &table);
  if (load_rc < 0)
    snprintf(load_msg, sizeof load_msg, "%s: %s", MR_CUDA_MODULE_FILE,
             mr_error_message());
}

int mr_cuda_module_load(const struct mr_cuda_module **out) {
  *out = NULL;
  pthread_once(&once, load_once);
  if (load_rc < 0)
    return mr_error_set(load_rc, "%s", load_msg);
  *out = &table;
  return 0;
}
