/* test_gpu_common.h - shared by the GPU suites: how many GPUs this machine
 * has (asked in a forked child, so the test process itself has not touched
 * CUDA and may fork ranks), and the main() that skips with 77 where there
 * is none. */
#ifndef MR_TEST_GPU_COMMON_H
#define MR_TEST_GPU_COMMON_H

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "worker/backend/cuda/loader.h"

/* Visible GPUs (0 when none, or when this build has no CUDA module). */
static inline int gpu_count(void) {
  static int cached = -1;
  if (cached >= 0)
    return cached;
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    const struct mr_cuda_module *m = NULL;
    int n = 0;
    if (mr_cuda_module_load(&m) == 0)
      m->device_count(&n);
    _exit(n > 100 ? 100 : n);
  }
  int st = 0;
  if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st))
    return cached = 0;
  return cached = WEXITSTATUS(st);
}

#define MR_GPU_TEST_MAIN(suite_fn)                                           \
  int main(void) {                                                           \
    if (gpu_count() == 0) {                                                  \
      printf("1..0 # SKIP no CUDA device: skipped\n");                      \
      fprintf(stderr, "no CUDA device: skipped%s\n",                        \
              mr_cuda_module_built() ? "" : " (this build has no CUDA module)"); \
      return 77;                                                             \
    }                                                                        \
    SRunner *sr = srunner_create(suite_fn());                                \
    srunner_set_tap(sr, "-");                                                \
    srunner_run_all(sr, CK_NORMAL);                                          \
    int failed = srunner_ntests_failed(sr);                                  \
    srunner_free(sr);                                                        \
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;                        \
  }

#endif
