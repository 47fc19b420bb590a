/* test_gpu_discovery.c - discovery on a GPU machine: the driver's GPUs with
 * their memory, compute capability and PCI location; CUDA_VISIBLE_DEVICES
 * honoured; the links matrix; meshrun-gpu-probe writes a spec the planner
 * loads, and mr_gpu_cluster_spec caches it per machine.  Skips (77) where
 * there is no GPU. */
#include "check_main.h"
#include "test_gpu_common.h"
#include "testutil.h"

#include <string.h>
#include <time.h>

#include "common/discovery.h"
#include "common/error.h"
#include "launcher/measure.h"
#include "worker/gpu_spec.h"
#include "compiler/planner/cluster.h"
#include "launcher/cli.h"

START_TEST(test_gpu_discovery_reports_every_visible_gpu) {
  struct mr_devices d;
  ck_assert_int_eq(mr_discover_devices(&d), 0);
  ck_assert_int_eq(d.gpus, gpu_count());
  ck_assert_int_eq(d.n, d.gpus);
  for (int i = 0; i < d.gpus; i++) {
    const struct mr_device *g = &d.dev[i];
    fprintf(stderr, "cuda:%d %s, %.1f GiB, sm_%d%d x%d, pci %s, numa %d, nvlinks %d\n", i,
            g->name, (double)g->memory_bytes / (1 << 30), g->cc_major, g->cc_minor,
            g->sm_count, g->pci_bus_id, g->numa_node, g->nvlinks);
    ck_assert_str_eq(g->kind, "cuda");
    ck_assert(g->memory_bytes > ((uint64_t)1 << 30));
    ck_assert_int_ge(g->cc_major, 7);
    ck_assert_int_gt(g->sm_count, 0);
    ck_assert(strlen(g->pci_bus_id) >= 7);
    ck_assert_int_eq(mr_devices_link(&d, i, i), MR_GPU_LINK_SELF);
    for (int j = 0; j < d.gpus; j++)
      if (j != i)
        fprintf(stderr, "  cuda:%d <-> cuda:%d: %s\n", i, j,
                mr_gpu_link_name(mr_devices_link(&d, i, j)));
  }
  ck_assert_int_eq(mr_devices_default_nproc(&d, 1), d.gpus);
  mr_devices_close(&d);
}
END_TEST

START_TEST(test_gpu_discovery_honours_cuda_visible_devices) {
  /* this test's process has not initialized CUDA: the driver reads the
   * variable at cuInit */
  setenv("CUDA_VISIBLE_DEVICES", "0", 1);
  struct mr_devices d;
  ck_assert_int_eq(mr_discover_devices(&d), 0);
  ck_assert_int_eq(d.gpus, 1);
  mr_devices_close(&d);
}
END_TEST

START_TEST(test_gpu_probe_writes_a_spec_and_caches_it) {
  char src[4096], dir[256], home[512];
  snprintf(src, sizeof src, "%s/configs", getenv("MESHRUN_SOURCE_DIR"));
  setenv("MESHRUN_CONFIGS_DIR", src, 1);
  mr_t_tmpdir(dir, sizeof dir);
  snprintf(home, sizeof home, "%s/home", dir);
  setenv("HOME", home, 1);
  unsetenv("XDG_CACHE_HOME");
  struct mr_devices d;
  ck_assert_int_eq(mr_discover_devices(&d), 0);
  char path[4096], again[4096];
  time_t t0 = time(NULL);
  int rc = mr_gpu_cluster_spec(&d, path, sizeof path);
  ck_assert_msg(rc == 0, "probe: %s", mr_error_message());
  fprintf(stderr, "probe took %ld s: %s\n", (long)(time(NULL) - t0), path);
  ck_assert(strstr(path, "/home/.cache/meshrun/cluster-") != NULL);
  struct mr_cluster c;
  ck_assert_msg(mr_cluster_load(path, &c) == 0, "%s", mr_error_message());
  ck_assert_int_eq(c.devices_per_node, d.gpus);
  ck_assert(c.matmul_efficiency > 0.05 && c.matmul_efficiency <= 1.0);
  ck_assert(c.memory_bandwidth > 1e11);
  char *text = mr_t_slurp(path);
  fprintf(stderr, "%s\n", text);
  free(text);
  t0 = time(NULL);
  ck_assert_int_eq(mr_gpu_cluster_spec(&d, again, sizeof again), 0);
  ck_assert_str_eq(again, path);
  ck_assert_int_le(time(NULL) - t0, 2); /* from the cache */
  mr_devices_close(&d);
}
END_TEST

static Suite *gpu_discovery_suite(void) {
  Suite *s = suite_create("gpu_discovery");
  TCase *tc = mr_t_tcase("discovery");
  tcase_set_timeout(tc, 400);
  tcase_add_test(tc, test_gpu_discovery_reports_every_visible_gpu);
  tcase_add_test(tc, test_gpu_discovery_honours_cuda_visible_devices);
  tcase_add_test(tc, test_gpu_probe_writes_a_spec_and_caches_it);
  suite_add_tcase(s, tc);
  return s;
}

MR_GPU_TEST_MAIN(gpu_discovery_suite)
