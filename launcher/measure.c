/* measure.c - this machine measured for the planner: the programs that
 * measure, their cached specs, and `meshrun calibrate`. */
#include "launcher/measure.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/discovery.h"
#include "common/rng.h"
#include "common/error.h"
#include "common/file.h"
#include "common/log.h"
#include "launcher/cli.h"
#include "compiler/planner/cluster.h"

extern char **environ;

#define MEASURE_TIMEOUT_S 180

static uint64_t fnv(uint64_t h, const char *s) {
  for (; *s; s++)
    h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
  return h;
}

/* Runs argv[0] (a measuring program found beside meshrun) to completion:
 * 0 when it exits 0, else MR_EIO naming it (killed after
 * MEASURE_TIMEOUT_S). */
static int run_measure(char *const argv[]) {
  const char *exe = argv[0];
  pid_t pid;
  int e = posix_spawn(&pid, exe, NULL, NULL, argv, environ);
  if (e != 0)
    return mr_error_set(MR_ESYS, "measure: cannot start %s: %s", exe, strerror(e));
  time_t t0 = time(NULL);
  for (;;) {
    int st = 0;
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid) {
      if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
        return 0;
      return mr_error_set(MR_EIO, "measure: %s failed (%s %d; its messages are above)",
                          exe, WIFEXITED(st) ? "exit" : "signal",
                          WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
    }
    if (r < 0 && errno != EINTR)
      return mr_error_set(MR_ESYS, "measure: waitpid: %s", strerror(errno));
    if (time(NULL) - t0 > MEASURE_TIMEOUT_S) {
      kill(pid, SIGKILL);
      waitpid(pid, NULL, 0);
      return mr_error_set(MR_EIO, "measure: %s took over %d s; killed", exe,
                          MEASURE_TIMEOUT_S);
    }
    usleep(50000);
  }
}

static int run_probe(const char *out) {
  char exe[4096];
  if (mr_find_program("meshrun-gpu-probe", "worker", exe, sizeof exe) < 0)
    return mr_error_set(MR_ENOENT, "gpu probe: cannot find meshrun-gpu-probe beside "
                        "meshrun or on PATH");
  char *argv[] = {exe, "--out", (char *)out, NULL};
  return run_measure(argv);
}

int mr_gpu_cluster_spec(const struct mr_devices *d, char *path, size_t len) {
  if (len > 0)
    path[0] = '\0';
  if (d->gpus <= 0)
    return 1;
  char host[256] = "host";
  gethostname(host, sizeof host - 1);
  host[sizeof host - 1] = '\0';
  uint64_t h = fnv(0xcbf29ce484222325ull, host);
  for (int i = 0; i < d->gpus; i++) {
    char mem[32];
    snprintf(mem, sizeof mem, ":%llu:", (unsigned long long)d->dev[i].memory_bytes);
    h = fnv(fnv(fnv(h, d->dev[i].name), mem), d->dev[i].pci_bus_id);
  }
  for (char *p = host; *p; p++)
    if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
          (*p >= '0' && *p <= '9') || *p == '-'))
      *p = '_';
  char dir[3072];
  MR_TRY(mr_cli_cache_dir(dir, sizeof dir));
  snprintf(path, len, "%s/cluster-%s-%d-%016llx.json", dir, host, d->gpus,
           (unsigned long long)h);
  struct mr_cluster c;
  if (access(path, R_OK) == 0 && mr_cluster_load(path, &c) == 0)
    return 0;
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
  MR_INFO("launch", "measuring this machine's %d GPU%s for the planner (cached in %s)",
          d->gpus, d->gpus > 1 ? "s" : "", path);
  int rc = run_probe(tmp);
  if (rc == 0)
    rc = mr_cluster_load(tmp, &c);
  if (rc == 0 && rename(tmp, path) != 0)
    rc = mr_error_set(MR_EIO, "gpu probe: rename %s: %s", path, strerror(errno));
  if (rc < 0) {
    unlink(tmp);
    path[0] = '\0';
  }
  return rc;
}

/* This CPU as the cache tells machines apart: what /proc/cpuinfo says of
 * the model and its instruction sets, the cores meshrun counts and the
 * physical memory. */
static uint64_t cpu_identity(void) {
  static const char *const keys[] = {"vendor_id", "cpu family", "model", "model name",
                                     "stepping", "flags", "CPU implementer",
                                     "CPU architecture", "CPU variant", "CPU part",
                                     "Features", NULL};
  char block[16384], value[4096], id[8192];
  mr_cpuinfo_block(block, sizeof block);
  /* v2: the spec holds the bf16 matmul's own rate */
  size_t off = (size_t)snprintf(id, sizeof id, "v2 cores %d memory %llu", mr_cpu_cores(),
                                (unsigned long long)mr_host_memory_bytes());
  for (int i = 0; keys[i] != NULL && off < sizeof id; i++) {
    mr_cpuinfo_value(block, keys[i], value, sizeof value);
    off += (size_t)snprintf(id + off, sizeof id - off, "|%s=%s", keys[i], value);
  }
  return mr_hash_str(id);
}

static int find_worker(char *exe, size_t n) {
  if (mr_find_program("meshrun-worker", "worker", exe, n) < 0)
    return mr_error_set(MR_ENOENT, "calibrate: cannot find meshrun-worker beside meshrun "
                        "or on PATH");
  return 0;
}

int mr_cpu_cluster_spec(char *path, size_t len) {
  if (len > 0)
    path[0] = '\0';
  char dir[3072];
  MR_TRY(mr_cli_cache_dir(dir, sizeof dir));
  snprintf(path, len, "%s/cluster-cpu-%d-%016llx.json", dir, mr_cpu_cores(),
           (unsigned long long)cpu_identity());
  struct mr_cluster c;
  if (access(path, R_OK) == 0) {
    if (mr_cluster_load(path, &c) == 0)
      return 0;
    MR_WARN("launch", "%s; measuring this machine again", mr_error_message());
  }
  MR_INFO("launch", "measuring this machine's %d cores for the planner (cached in %s)",
          mr_cpu_cores(), path);
  char exe[4096], ranks[32];
  int rc = find_worker(exe, sizeof exe);
  snprintf(ranks, sizeof ranks, "%d", mr_cpu_cores());
  char *argv[] = {exe, "--calibrate", "--quiet", "--ranks", ranks, "--base", "cpu-local",
                  "--out", path, NULL};
  if (rc == 0)
    rc = run_measure(argv);
  if (rc == 0)
    rc = mr_cluster_load(path, &c);
  if (rc < 0)
    path[0] = '\0';
  return rc;
}

int mr_cmd_calibrate(int argc, char **argv) {
  char exe[4096];
  if (find_worker(exe, sizeof exe) < 0) {
    fprintf(stderr, "meshrun calibrate: %s\n", mr_error_message());
    return 1;
  }
  /* the worker measures (the launcher runs no kernel): the same flags,
   * output and exit status */
  char **args = calloc((size_t)argc + 2, sizeof *args);
  if (args == NULL) {
    fprintf(stderr, "meshrun calibrate: out of memory\n");
    return 1;
  }
  args[0] = exe;
  args[1] = "--calibrate";
  for (int i = 1; i < argc; i++)
    args[i + 1] = argv[i];
  fflush(stdout);
  fflush(stderr);
  execv(exe, args);
  fprintf(stderr, "meshrun calibrate: cannot run %s: %s\n", exe, strerror(errno));
  free(args);
  return 1;
}
