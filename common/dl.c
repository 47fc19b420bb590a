/* dl.c - dlopen and dlsym behind one call. */
#include "common/dl.h"

#include <dlfcn.h>
#include <string.h>

#include "common/error.h"

int mr_dl_function(const char *path, const char *symbol, void (**fn)(void)) {
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h)
    return mr_error_set(MR_ENOENT, "plugin %s: cannot load: %s", path, dlerror());
  void *sym = dlsym(h, symbol);
  if (!sym) {
    dlclose(h);
    return mr_error_set(MR_EINVAL, "plugin %s: no %s function", path, symbol);
  }
  /* ISO C forbids converting void * to a function pointer; POSIX allows
   * it through this copy */
  memcpy(fn, &sym, sizeof *fn);
  return 0;
}
