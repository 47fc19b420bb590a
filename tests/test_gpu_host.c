/* test_gpu_host.c - the host side of the GPU path, which runs on every
 * machine: the CUDA module loads (or says why not), mr_device_open gives a
 * CPU backend or a clean error for cuda without a GPU, --devices parses and
 * selects, the measured cluster spec is written from a probe's numbers,
 * and nothing is probed on a machine without GPUs; and discovery's CPU
 * count, bounded by the cgroup's quota. */
#include "check_main.h"
#include "test_gpu_common.h"
#include "testutil.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "common/discovery.h"
#include "common/error.h"
#include "compiler/graph.h"
#include "compiler/ops.h"
#include "launcher/measure.h"
#include "worker/gpu_spec.h"
#include "compiler/planner/cluster.h"
#include "launcher/cli.h"
#include "worker/backend/backend.h"
#include "worker/comm/comm.h"
#include "worker/device.h"
#include "worker/exec_extra.h"

START_TEST(test_gpu_module_loads_or_says_why) {
  const struct mr_cuda_module *m = NULL;
  int rc = mr_cuda_module_load(&m);
  if (mr_cuda_module_built()) {
    ck_assert_msg(rc == 0, "load: %s", mr_error_message());
    ck_assert_int_eq(m->version, MR_CUDA_MODULE_VERSION);
    ck_assert_str_eq(m->nccl_ops()->name, "nccl");
    int n = -1;
    ck_assert_int_eq(m->device_count(&n), 0);
    ck_assert_int_ge(n, 0);
  } else {
    ck_assert_int_eq(rc, MR_ENOTSUP);
    ck_assert(strstr(mr_error_message(), "without the CUDA module") != NULL);
  }
}
END_TEST

START_TEST(test_gpu_device_open_cpu_runs_registry_kernels) {
  struct mr_backend *be = NULL;
  ck_assert_int_eq(mr_device_open("cpu", 0, 2, MR_AMP_ROUND_BF16, &be), 0);
  ck_assert_str_eq(be->ops->name, "cpu");
  ck_assert_int_eq(be->ops->registry, MR_BACKEND_CPU);
  struct mr_cpu_ctx *ctx = be->ops->kernel_ctx(be);
  ck_assert_int_eq(ctx->amp, MR_AMP_ROUND_BF16);
  struct mr_graph g;
  mr_graph_init(&g);
  int64_t shape[1] = {5};
  int x = mr_graph_tensor(&g, "x", MR_F32, MR_ROLE_INPUT, 1, shape);
  int in[2] = {x, x};
  int id = mr_graph_op(&g, MR_OP_ADD, "y", in, 2, NULL, NULL);
  float *a = NULL, *y = NULL;
  ck_assert_int_eq(be->ops->alloc(be, 20, (void **)&a), 0);
  ck_assert_int_eq(be->ops->alloc(be, 20, (void **)&y), 0);
  for (int i = 0; i < 5; i++)
    a[i] = (float)i;
  void *bufs[3] = {a, a, y};
  ck_assert_int_eq(mr_op_kernel(MR_OP_ADD, be->ops->registry)(ctx, &g, &g.ops[id], bufs), 0);
  ck_assert(y[4] == 8.0f);
  double s = 0;
  ck_assert_int_eq(be->ops->sumsq(be, a, 5, &s), 0);
  ck_assert(s == 30.0);
  be->ops->free(be, a);
  be->ops->free(be, y);
  mr_graph_close(&g);
  mr_backend_free(be);
  ck_assert_int_eq(mr_device_open("tpu", 0, 1, 0, &be), MR_EINVAL);
  ck_assert(strstr(mr_error_message(), "tpu") != NULL);
  const struct mr_comm_ops *ops = NULL;
  ck_assert_int_eq(mr_device_comm_ops("cpu", &ops), 0);
  ck_assert_ptr_eq(ops, mr_comm_cpu_ops());
  ck_assert_int_eq(mr_device_comm_ops(NULL, &ops), MR_EINVAL);
}
END_TEST

START_TEST(test_gpu_device_open_cuda_without_a_gpu_is_a_clean_error) {
  struct mr_backend *be = NULL;
  int rc = mr_device_open("cuda", 0, 0, 0, &be);
  if (!mr_cuda_module_built()) {
    ck_assert_int_eq(rc, MR_ENOTSUP);
    return;
  }
  if (gpu_count() > 0) {
    ck_assert_msg(rc == 0, "%s", mr_error_message());
    ck_assert_str_eq(be->ops->name, "cuda");
    ck_assert_int_eq(be->ops->registry, MR_BACKEND_CUDA);
    mr_backend_free(be);
    return;
  }
  ck_assert_int_eq(rc, MR_ENOENT);
  ck_assert_ptr_null(be);
  ck_assert_msg(strstr(mr_error_message(), "no device 0") != NULL, "%s",
                mr_error_message());
  const struct mr_comm_ops *ops = NULL;
  ck_assert_int_eq(mr_device_comm_ops("cuda", &ops), 0);
  ck_assert_str_eq(ops->name, "nccl");
}
END_TEST

START_TEST(test_gpu_devices_list_parsing) {
  int idx[8], n = 0;
  ck_assert_int_eq(mr_devices_parse_list("--devices", "0,1,3", 4, idx, 8, &n), 0);
  ck_assert_int_eq(n, 3);
  ck_assert(idx[0] == 0 && idx[1] == 1 && idx[2] == 3);
  ck_assert_int_eq(mr_devices_parse_list("--devices", "2", 4, idx, 8, &n), 0);
  ck_assert(n == 1 && idx[0] == 2);
  const char *bad[] = {"", "a", "0,,1", "0,", ",0", "1;2", "-1", "0, 1"};
  for (size_t i = 0; i < MR_ARRAY_LEN(bad); i++) {
    ck_assert_msg(mr_devices_parse_list("--devices", bad[i], 4, idx, 8, &n) == MR_EINVAL,
                  "\"%s\" accepted", bad[i]);
    ck_assert(strstr(mr_error_message(), "--devices") != NULL);
    ck_assert(strstr(mr_error_message(), "0,1,3") != NULL);
  }
  ck_assert_int_eq(mr_devices_parse_list("--devices", "1,1", 4, idx, 8, &n), MR_EINVAL);
  ck_assert(strstr(mr_error_message(), "twice") != NULL);
  ck_assert_int_eq(mr_devices_parse_list("--devices", "0,4", 4, idx, 8, &n), MR_EINVAL);
  ck_assert(strstr(mr_error_message(), "GPU 4 does not exist") != NULL);
  ck_assert_int_eq(mr_devices_parse_list("--devices", "0", 0, idx, 8, &n), MR_EINVAL);
  ck_assert(strstr(mr_error_message(), "no CUDA device") != NULL);
}
END_TEST

START_TEST(test_gpu_devices_select_sets_visible_devices) {
  for (int pass = 0; pass < 2; pass++) {
    if (pass == 0)
      unsetenv("CUDA_VISIBLE_DEVICES");
    else
      setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b,GPU-c,GPU-d", 1);
    struct mr_devices d;
    memset(&d, 0, sizeof d);
    d.n = d.gpus = 4;
    d.dev = calloc(4, sizeof *d.dev);
    d.links = calloc(16, 1);
    for (int i = 0; i < 4; i++) {
      snprintf(d.dev[i].kind, sizeof d.dev[i].kind, "cuda");
      snprintf(d.dev[i].name, sizeof d.dev[i].name, "gpu%d", i);
      d.dev[i].index = i;
      for (int j = 0; j < 4; j++)
        d.links[i * 4 + j] = (unsigned char)(i == j ? MR_GPU_LINK_SELF
                                            : (i / 2 == j / 2) ? MR_GPU_LINK_NVLINK
                                                               : MR_GPU_LINK_SYSTEM);
    }
    int idx[2] = {3, 1};
    char env[64];
    ck_assert_int_eq(mr_devices_select(&d, idx, 2, env, sizeof env), 0);
    ck_assert_str_eq(env, pass == 0 ? "3,1" : "GPU-d,GPU-b");
    ck_assert_int_eq(d.gpus, 2);
    ck_assert_str_eq(d.dev[0].name, "gpu3");
    ck_assert_int_eq(d.dev[1].index, 1);
    ck_assert_int_eq(mr_devices_link(&d, 0, 1), MR_GPU_LINK_SYSTEM);
    ck_assert_int_eq(mr_devices_link(&d, 1, 1), MR_GPU_LINK_SELF);
    ck_assert_str_eq(mr_gpu_link_name(mr_devices_link(&d, 0, 1)), "system");
    mr_devices_close(&d);
  }
  unsetenv("CUDA_VISIBLE_DEVICES");
}
END_TEST

static int launch_rc(const char *const *args, char **err) {
  char dir[256];
  mr_t_tmpdir(dir, sizeof dir);
  char *argv[16];
  int n = 0;
  argv[n++] = (char *)mr_t_meshrun();
  for (; args[n - 1] != NULL; n++)
    argv[n] = (char *)args[n - 1];
  argv[n] = NULL;
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, NULL);
  int rc = mr_t_wait(&p, 60);
  *err = mr_t_slurp(p.err_path);
  return rc;
}

START_TEST(test_gpu_launch_devices_flag_errors_exit_2) {
  char *err = NULL;
  const char *bad[] = {"launch", "--selfcheck", "--devices", "0,x", NULL};
  ck_assert_int_eq(launch_rc(bad, &err), 2);
  ck_assert_msg(strstr(err, "--devices") != NULL && strstr(err, "0,1,3") != NULL, "%s", err);
  free(err);
  const char *missing[] = {"launch", "--selfcheck", "--devices", "97", NULL};
  ck_assert_int_eq(launch_rc(missing, &err), 2);
  ck_assert_msg(strstr(err, "--devices 97") != NULL, "%s", err);
  free(err);
}
END_TEST

START_TEST(test_gpu_probe_skipped_without_gpus) {
  struct mr_devices d;
  memset(&d, 0, sizeof d);
  d.cpu_cores = 2;
  char path[256] = "x";
  ck_assert_int_eq(mr_gpu_cluster_spec(&d, path, sizeof path), 1);
  ck_assert_str_eq(path, "");
}
END_TEST

START_TEST(test_gpu_spec_written_from_measurements) {
  char env[4096];
  snprintf(env, sizeof env, "%s/configs", getenv("MESHRUN_SOURCE_DIR"));
  setenv("MESHRUN_CONFIGS_DIR", env, 1);
  struct mr_gpu_probe p;
  memset(&p, 0, sizeof p);
  p.devices = 8;
  snprintf(p.name, sizeof p.name, "NVIDIA H200");
  p.memory_bytes = 150e9;
  p.h2d_bandwidth = 55e9;
  p.d2h_bandwidth = 50e9;
  p.d2d_bandwidth = 4.0e12;
  p.matmul_flops_bf16 = 700e12;
  p.matmul_flops_fp32 = 50e12;
  p.allreduce_bus_bw = 350e9;
  p.allreduce_latency = 4e-6;
  char dir[256], out[512];
  mr_t_tmpdir(dir, sizeof dir);
  snprintf(out, sizeof out, "%s/spec.json", dir);
  ck_assert_msg(mr_gpu_spec_write(&p, out) == 0, "%s", mr_error_message());
  struct mr_cluster c;
  ck_assert_msg(mr_cluster_load(out, &c) == 0, "%s", mr_error_message());
  ck_assert_int_eq(c.nodes, 1);
  ck_assert_int_eq(c.devices_per_node, 8);
  ck_assert_double_eq_tol(c.memory_bandwidth, 4.0e12, 1);
  ck_assert_double_eq_tol(c.intra_bus_bandwidth, 350e9, 1);
  ck_assert_double_eq_tol(c.host_link_bandwidth, 50e9, 1);
  ck_assert_double_eq_tol(c.matmul_efficiency, 700.0 / 989.0, 1e-9);
  ck_assert_double_eq_tol(c.peak_flops[1], 989e12, 1);
  char *text = mr_t_slurp(out);
  ck_assert(strstr(text, "measured") != NULL);
  free(text);
}
END_TEST

/* root/REL (its folders made) holds text. */
static void put(const char *root, const char *rel, const char *text) {
  char path[512];
  snprintf(path, sizeof path, "%s%s", root, rel);
  for (char *s = strchr(path + strlen(root) + 1, '/'); s != NULL; s = strchr(s + 1, '/')) {
    *s = '\0';
    mkdir(path, 0755);
    *s = '/';
  }
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fputs(text, f);
  fclose(f);
}

/* A cgroup's CPU quota and memory limit, from stand-in /proc and /sys
 * trees: v2 (the least of the folder and its parents), v1 (cpu,cpuacct;
 * memory), a container's namespace (the path not under the mount: the
 * mount's own), none. */
START_TEST(test_gpu_host_cgroup_limits) {
  char a[64], b[64], c[64], d[64];
  mr_t_tmpdir(a, sizeof a);
  put(a, "/proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
  put(a, "/sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "max 100000\n");
  put(a, "/sys/fs/cgroup/kubepods/pod1/cpu.max", "350000 100000\n");
  put(a, "/sys/fs/cgroup/kubepods/cpu.max", "800000 100000\n");
  ck_assert_double_eq_tol(mr_cgroup_cpu_limit(a), 3.5, 1e-12);
  mr_t_tmpdir(b, sizeof b);
  put(b, "/proc/self/cgroup", "12:memory:/docker/x\n4:cpu,cpuacct:/docker/x\n0::/\n");
  put(b, "/sys/fs/cgroup/cpu,cpuacct/docker/x/cpu.cfs_quota_us", "150000\n");
  put(b, "/sys/fs/cgroup/cpu,cpuacct/docker/x/cpu.cfs_period_us", "100000\n");
  put(b, "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  put(b, "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  ck_assert_double_eq_tol(mr_cgroup_cpu_limit(b), 1.5, 1e-12);
  mr_t_tmpdir(c, sizeof c);
  put(c, "/proc/self/cgroup", "0::/system.slice/docker-1.scope\n");
  put(c, "/sys/fs/cgroup/cpu.max", "200000 100000\n");
  ck_assert_double_eq_tol(mr_cgroup_cpu_limit(c), 2.0, 1e-12);
  mr_t_tmpdir(d, sizeof d);
  put(d, "/proc/self/cgroup", "0::/user.slice\n");
  put(d, "/sys/fs/cgroup/user.slice/cpu.max", "max 100000\n");
  ck_assert_double_eq(mr_cgroup_cpu_limit(d), 0.0);
  put(d, "/sys/fs/cgroup/user.slice/cpu.max", "garbage\n");
  ck_assert_double_eq(mr_cgroup_cpu_limit(d), 0.0);
  ck_assert_double_eq(mr_cgroup_cpu_limit("/nonexistent-root"), 0.0);
  /* memory: v2 max (the least up the tree), v1 limit, v1 unlimited */
  put(a, "/sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "max\n");
  put(a, "/sys/fs/cgroup/kubepods/pod1/memory.max", "8589934592\n");
  put(a, "/sys/fs/cgroup/kubepods/memory.max", "17179869184\n");
  ck_assert_double_eq(mr_cgroup_memory_limit(a), 8589934592.0);
  put(b, "/proc/self/cgroup", "12:memory:/docker/x\n4:cpu,cpuacct:/docker/x\n0::/\n");
  put(b, "/sys/fs/cgroup/memory/docker/x/memory.limit_in_bytes", "2147483648\n");
  put(b, "/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  ck_assert_double_eq(mr_cgroup_memory_limit(b), 2147483648.0);
  put(b, "/sys/fs/cgroup/memory/docker/x/memory.limit_in_bytes", "9223372036854771712\n");
  ck_assert_double_eq(mr_cgroup_memory_limit(b), 0.0);
  ck_assert_double_eq(mr_cgroup_memory_limit(c), 0.0);
  /* this machine: the cores discovery counts are no more than the quota */
  struct mr_devices dev;
  ck_assert_int_eq(mr_discover_devices(&dev), 0);
  double q = mr_cgroup_cpu_limit("");
  ck_assert(dev.cpu_cores >= 1 && (q == 0 || dev.cpu_cores <= (q < 1 ? 1 : q)));
  /* and the host memory it reports is no more than the cgroup's limit;
   * on a GPU machine dev[0] is a GPU, whose memory is its own */
  double m = mr_cgroup_memory_limit("");
  ck_assert(m == 0 || mr_host_memory_bytes() <= m);
  if (dev.gpus == 0)
    ck_assert_uint_eq(dev.dev[0].memory_bytes, mr_host_memory_bytes());
  mr_devices_close(&dev);
}
END_TEST

static Suite *gpu_host_suite(void) {
  Suite *s = suite_create("gpu_host");
  TCase *tc = mr_t_tcase("host");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_gpu_module_loads_or_says_why);
  tcase_add_test(tc, test_gpu_device_open_cpu_runs_registry_kernels);
  tcase_add_test(tc, test_gpu_device_open_cuda_without_a_gpu_is_a_clean_error);
  tcase_add_test(tc, test_gpu_devices_list_parsing);
  tcase_add_test(tc, test_gpu_devices_select_sets_visible_devices);
  tcase_add_test(tc, test_gpu_launch_devices_flag_errors_exit_2);
  tcase_add_test(tc, test_gpu_probe_skipped_without_gpus);
  tcase_add_test(tc, test_gpu_spec_written_from_measurements);
  tcase_add_test(tc, test_gpu_host_cgroup_limits);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(gpu_host_suite)
