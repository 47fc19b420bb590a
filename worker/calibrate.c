/* calibrate.c - `meshrun calibrate`: measures this machine and writes a
 * cluster spec.  Matmul rate with the worker's CPU kernels (one rank per
 * core, one thread each), the FMA peak, memory bandwidth, and AllReduce
 * latency and bus bandwidth with the CPU comm backend between forked
 * ranks.  What it cannot measure here (the network to other nodes) comes
 * from the cpu-local spec it starts from. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common/configs.h"
#include "common/clock.h"
#include "common/discovery.h"
#include "common/error.h"
#include "common/file.h"
#include "common/jsonv.h"
#include "common/log.h"
#include "common/rng.h"
#include "common/tunable.h"
#include "common/shm_name.h"
#include "worker/calibrate.h"
#include "compiler/planner/cluster.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/comm/comm.h"

static int parse_ranks(const char *value, long *out) {
  char *end;
  errno = 0;
  long v = strtol(value, &end, 10);
  if (errno != 0 || end == value || *end != '\0' || v < 1 || v > 1024) {
    fprintf(stderr, "meshrun calibrate: --ranks: expected an integer in [1, 1024], got "
            "\"%s\"\n", value);
    return -1;
  }
  *out = v;
  return 0;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: meshrun calibrate [options]\n"
          "\n"
          "Measures this machine and writes a cluster spec for `meshrun plan`.\n"
          "\n"
          "  --out FILE    write the spec here (default: standard output)\n"
          "  --ranks N     ranks (devices) per node (default: online CPUs)\n"
          "  --base SPEC   spec whose unmeasured fields are kept (default cpu-local)\n"
          "  --quiet       no progress lines\n");
}

#if defined(__x86_64__)
/* FMA peak of one core: 12 independent FMA chains of `width` floats,
 * enough to cover two pipes' latency. */
#define FMA_PEAK(name, isa, vec, set1, fmadd, width)                                \
  __attribute__((target(isa))) static double name(void) {                         \
    vec c0 = set1(0.0f), c1 = set1(0.1f), c2 = set1(0.2f), c3 = set1(0.3f);        \
    vec c4 = set1(0.4f), c5 = set1(0.5f), c6 = set1(0.6f), c7 = set1(0.7f);        \
    vec c8 = set1(0.8f), c9 = set1(0.9f), ca = set1(1.0f), cb = set1(1.1f);        \
    const vec a = set1(0.999999f), b = set1(1e-7f);                                \
    const long iters = 10000000;                                                   \
    double best = 0;                                                               \
    for (int rep = 0; rep < 5; rep++) {                                            \
      double t0 = mr_clock_s();                                                         \
      for (long k = 0; k < iters; k++) {                                           \
        c0 = fmadd(c0, a, b), c1 = fmadd(c1, a, b), c2 = fmadd(c2, a, b);           \
        c3 = fmadd(c3, a, b), c4 = fmadd(c4, a, b), c5 = fmadd(c5, a, b);           \
        c6 = fmadd(c6, a, b), c7 = fmadd(c7, a, b), c8 = fmadd(c8, a, b);           \
        c9 = fmadd(c9, a, b), ca = fmadd(ca, a, b), cb = fmadd(cb, a, b);           \
        __asm__ volatile("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4),     \
                         "+v"(c5), "+v"(c6), "+v"(c7), "+v"(c8), "+v"(c9), "+v"(ca), \
                         "+v"(cb));                                                \
      }                                                                            \
      double r = (double)iters * 12 * (width) * 2 / (mr_clock_s() - t0);                \
      best = r > best ? r : best;                                                  \
    }                                                                              \
    return best;                                                                   \
  }
FMA_PEAK(fma_peak, "avx2,fma", __m256, _mm256_set1_ps, _mm256_fmadd_ps, 8)
FMA_PEAK(fma_peak_512, "avx512f", __m512, _mm512_set1_ps, _mm512_fmadd_ps, 16)
#else
static double fma_peak(void) { return 0; }
static double fma_peak_512(void) { return 0; }
#endif

/* Best FLOP/s of one-thread mr_cpu_gemm at M×N×K. */
static int gemm_rate(struct mr_pool *pool, bool bf16, int m, int n, int k, double *out) {
  float *a = malloc(sizeof(float) * (size_t)m * k), *b = malloc(sizeof(float) * (size_t)k * n);
  float *c = malloc(sizeof(float) * (size_t)m * n);
  if (a == NULL || b == NULL || c == NULL) {
    free(a), free(b), free(c);
    return mr_error_set(MR_ENOMEM, "calibrate: out of memory for a %dx%dx%d matmul", m, n, k);
  }
  for (size_t i = 0; i < (size_t)m * k; i++)
    a[i] = (float)(i % 7) * 0.1f;
  for (size_t i = 0; i < (size_t)k * n; i++)
    b[i] = (float)(i % 5) * 0.1f;
  double flops = 2.0 * m * n * k, best = 0;
  int rc = 0;
  for (int rep = 0; rep < 8 && rc == 0; rep++) {
    double t0 = mr_clock_s();
    rc = (bf16 ? mr_cpu_gemm_bf16 : mr_cpu_gemm)(pool, false, false, m, n, k, 1.0f, a, k, b,
                                                 n, 0.0f, c, n);
    double dt = mr_clock_s() - t0;
    if (rep > 0 && flops / dt > best)
      best = flops / dt;
  }
  free(a), free(b), free(c);
  *out = best;
  return rc;
}

static double memcpy_bandwidth(void) {
  size_t bytes = (size_t)128 << 20;
  char *src = malloc(bytes), *dst = malloc(bytes);
  if (src == NULL || dst == NULL) {
    free(src), free(dst);
    return 0;
  }
  memset(src, 1, bytes);
  memset(dst, 2, bytes);
  double best = 0;
  for (int rep = 0; rep < 4; rep++) {
    double t0 = mr_clock_s();
    memcpy(dst, src, bytes);
    double dt = mr_clock_s() - t0;
    if (rep > 0 && bytes / dt > best)
      best = bytes / dt;
  }
  if (dst[bytes / 2] != 1)
    best = 0;
  free(src), free(dst);
  return best;
}

struct comm_result {
  double small_s;   // one 4 KiB AllReduce
  double large_s;   // one 16 MiB AllReduce
  int ok;
};

/* One forked rank of the measurement; returns its exit status. */
static int comm_rank(int rank, int world, struct mr_bootstrap_local *bl, const char *job,
                      struct comm_result *res) {
  struct mr_bootstrap bs;
  mr_bootstrap_local_rank(bl, rank, "calibrate-host", job, 30000, &bs);
  const struct mr_comm_ops *ops = mr_comm_cpu_ops();
  struct mr_comm *comm = NULL;
  if (ops->open(&bs, &comm) != 0)
    return 1;
  int *ranks = malloc(sizeof(int) * (size_t)world);
  for (int i = 0; i < world; i++)
    ranks[i] = i;
  struct mr_comm_group *g = NULL;
  if (ranks == NULL || ops->group_new(comm, "calibrate", ranks, world, &g) != 0)
    return 1;
  size_t big = (size_t)4 << 20; // floats: 16 MiB
  float *buf = calloc(big, sizeof(float));
  if (buf == NULL)
    return 1;
  struct mr_comm_req *req;
  double t_small = 1e30, t_large = 1e30;
  for (int rep = 0; rep < 5; rep++) {
    int iters = 200;
    double t0 = mr_clock_s();
    for (int i = 0; i < iters; i++) {
      if (mr_comm_all_reduce(g, buf, buf, 1024, MR_F32, MR_RED_SUM, &req) != 0 ||
          mr_comm_wait(req) != 0)
        return 1;
    }
    double dt = (mr_clock_s() - t0) / iters;
    t_small = dt < t_small ? dt : t_small;
  }
  for (int rep = 0; rep < 4; rep++) {
    double t0 = mr_clock_s();
    if (mr_comm_all_reduce(g, buf, buf, big, MR_F32, MR_RED_SUM, &req) != 0 ||
        mr_comm_wait(req) != 0)
      return 1;
    double dt = mr_clock_s() - t0;
    if (rep > 0)
      t_large = dt < t_large ? dt : t_large;
  }
  if (rank == 0) {
    res->small_s = t_small;
    res->large_s = t_large;
    res->ok = 1;
  }
  ops->group_free(g);
  ops->close(comm);
  free(buf);
  free(ranks);
  return 0;
}

static int measure_comm(int world, struct comm_result *out) {
  struct comm_result *res = mmap(NULL, sizeof *res, PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  struct mr_bootstrap_local *bl = mr_bootstrap_local_new(world, 512);
  if (res == MAP_FAILED || bl == NULL)
    return mr_error_set(MR_ENOMEM, "calibrate: out of memory for the comm ranks");
  memset(res, 0, sizeof *res);
  char job[64];
  snprintf(job, sizeof job, "calib%d", (int)getpid());
  pid_t *pids = calloc((size_t)world, sizeof *pids);
  fflush(stdout);
  fflush(stderr);
  for (int r = 0; r < world; r++) {
    pids[r] = fork();
    if (pids[r] == 0) /* a forked child ends without the parent's atexit */
      _exit(comm_rank(r, world, bl, job, res));
  }
  int bad = 0;
  for (int r = 0; r < world; r++) {
    int st = 0;
    if (pids[r] < 0 || waitpid(pids[r], &st, 0) != pids[r] || !WIFEXITED(st) ||
        WEXITSTATUS(st) != 0)
      bad++;
  }
  free(pids);
  mr_shm_sweep(job);
  mr_bootstrap_local_free(bl);
  *out = *res;
  munmap(res, sizeof *res);
  if (bad || !out->ok)
    return mr_error_set(MR_EPEER, "calibrate: %d of %d comm ranks failed", bad, world);
  return 0;
}

static cJSON *num_obj(cJSON *parent, const char *key) {
  cJSON *o = cJSON_GetObjectItemCaseSensitive(parent, key);
  return o;
}

static void set_num(cJSON *o, const char *key, double v) {
  cJSON_DeleteItemFromObjectCaseSensitive(o, key);
  cJSON_AddNumberToObject(o, key, v);
}

static void set_str(cJSON *o, const char *key, const char *v) {
  cJSON_DeleteItemFromObjectCaseSensitive(o, key);
  cJSON_AddStringToObject(o, key, v);
}

/* What one core computes and moves. */
struct core_rates {
  double peak;            // FMA loop, FLOP/s
  double big, small;      // fp32 GEMM at 1024^3 and 2048x128x128
  double big_bf16, small_bf16; // the same in bf16 (0: no AVX512_BF16)
  double e, g;            // the matmul efficiency model: e / (1 + g·S)
  double bw;              // memcpy, bytes/s
};

/* Measures one core; check is the base spec (its peak where the FMA loop
 * cannot run). */
static int measure_core(const struct mr_cluster *check, int quiet, struct core_rates *r) {
  memset(r, 0, sizeof *r);
  if (!quiet)
    fprintf(stderr, "meshrun calibrate: FMA peak, matmul, memcpy (one core)...\n");
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) /* the kernels' own sgemm uses it */
    r->peak = fma_peak_512();
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    r->peak = fma_peak();
#endif
  struct mr_pool *pool = NULL;
  int rc = mr_pool_new(1, &pool);
  if (rc == 0)
    rc = gemm_rate(pool, false, 1024, 1024, 1024, &r->big);
  if (rc == 0)
    rc = gemm_rate(pool, false, 2048, 128, 128, &r->small);
  if (rc == 0 && mr_cpu_has_bf16_gemm()) {
    rc = gemm_rate(pool, true, 1024, 1024, 1024, &r->big_bf16);
    if (rc == 0)
      rc = gemm_rate(pool, true, 2048, 128, 128, &r->small_bf16);
  }
  mr_pool_free(pool);
  MR_TRY(rc);
  if (!(r->peak > r->big))
    r->peak = check->peak_flops[MR_AMP_FP32];
  /* eff = e / (1 + g·S), S = 1/M + 1/N + 1/K, from the two shapes. */
  double s_big = 3.0 / 1024, s_small = 1.0 / 2048 + 2.0 / 128;
  r->g = (r->big - r->small) / (r->small * s_small - r->big * s_big);
  if (!(r->g > 0) || r->g > 1e5)
    r->g = 0;
  r->e = r->big * (1 + r->g * s_big) / r->peak;
  if (r->e > 1)
    r->e = 1;
  r->bw = memcpy_bandwidth();
  return 0;
}

/* The spec's device: its name, peaks, matmul model, memory. */
static void write_device(cJSON *spec, const struct core_rates *r, long ranks) {
  char src[4096 + 512];
  cJSON *dev = num_obj(spec, "device");
  char block[16384], model[240], cpu[256];
  mr_cpuinfo_block(block, sizeof block);
  mr_cpuinfo_value(block, "model name", model, sizeof model);
  snprintf(cpu, sizeof cpu, "%s core", model[0] ? model : "CPU"); /* "AMD EPYC core" */
  set_str(dev, "name", cpu);
  cJSON *pf = num_obj(dev, "peak_flops");
  /* one matmul efficiency for every type: bf16's peak is fp32's scaled
   * by the two kernels' measured rates */
  double ratio = r->big_bf16 > r->big && r->small_bf16 > 0
                     ? sqrt(r->big_bf16 / r->big * r->small_bf16 / r->small)
                     : 1;
  set_num(pf, "fp32", r->peak);
  set_num(pf, "bf16", r->peak * (ratio > 1 ? ratio : 1));
  set_num(pf, "fp16", r->peak);
  if (ratio > 1)
    snprintf(src, sizeof src, "FMA loop, 12 chains of 16-wide (AVX-512) fused multiply-adds, "
             "one core; bf16: that times the AVX512_BF16 matmul's rate over fp32's, the "
             "geometric mean of 1024^3 (%.1f / %.1f GFLOP/s) and 2048x128x128 (%.1f / %.1f); "
             "fp16 computes in fp32", r->big_bf16 / 1e9, r->big / 1e9, r->small_bf16 / 1e9,
             r->small / 1e9);
  else
    snprintf(src, sizeof src, "FMA loop, 12 chains of 16-wide (AVX-512) or 8-wide (AVX2) "
             "fused multiply-adds, one core; 16-bit types compute in fp32");
  set_str(pf, "source", src);
  long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
  set_num(dev, "matmul_efficiency", r->e);
  set_num(dev, "gemm_half_dim", r->g);
  set_num(dev, "memory_bytes", (double)pages * (double)psz / (double)ranks);
  set_num(dev, "memory_bandwidth", r->bw);
  snprintf(src, sizeof src, "mr_cpu_gemm (%s) one thread: %.1f GFLOP/s at 1024^3, %.1f at "
           "2048x128x128; memcpy 128 MiB %.2f GB/s; physical memory / ranks",
           mr_cpu_gemm_kernel(), r->big / 1e9, r->small / 1e9, r->bw / 1e9);
  set_str(dev, "source", src);
}

/* The spec's links: the ranks' AllReduce fitted to α–β (small ≈ 2(n−1)α;
 * large = 2(n−1)α + 2(n−1)/n·S/β), and the host, which is the device. */
static void write_links(cJSON *spec, const struct comm_result *cr, int world, double bw) {
  double n = world, S = 16.0 * 1048576;
  double alpha = cr->small_s / (2 * (n - 1));
  double beta = 2 * (n - 1) / n * S / (cr->large_s - 2 * (n - 1) * alpha);
  if (!(beta > 0))
    beta = 2 * (n - 1) / n * S / cr->large_s;
  char src[512];
  cJSON *in = num_obj(spec, "intra_node");
  set_num(in, "bus_bandwidth", beta);
  set_num(in, "latency", alpha);
  snprintf(src, sizeof src, "CPU comm backend AllReduce, %d ranks: 4 KiB in %.2f us, "
           "16 MiB in %.2f ms", world, cr->small_s * 1e6, cr->large_s * 1e3);
  set_str(in, "source", src);
  cJSON *host = num_obj(spec, "host");
  set_num(host, "link_bandwidth", bw);
  set_num(host, "memory_bandwidth", bw);
  cJSON_DeleteItemFromObjectCaseSensitive(host, "is_device");
  cJSON_AddBoolToObject(host, "is_device", 1);
  set_str(host, "source", "the host is the device: memcpy bandwidth; offload frees no memory");
}

/* The base spec (a shipped name or a file) with this machine's
 * measurements in place: one core's compute and copies, `ranks` ranks'
 * AllReduce; checked by the spec parser before it is returned. */
int mr_calibrate_spec(long ranks, const char *base, int quiet, char **text) {
  *text = NULL;
  if (ranks < 1)
    ranks = 1;
  char base_path[4096];
  if (mr_configs_cluster_path(base, base_path, sizeof base_path) < 0)
    return mr_error_set(MR_ENOENT, "calibrate: no cluster spec \"%s\" to start from", base);
  cJSON *spec = NULL;
  MR_TRY(mr_json_load(base_path, &spec));
  struct mr_cluster check;
  struct core_rates r;
  struct comm_result cr = {0, 0, 0};
  int world = ranks < 2 ? 2 : (int)ranks;
  int rc = mr_cluster_parse(spec, base_path, &check);
  if (rc == 0)
    rc = measure_core(&check, quiet, &r);
  if (rc == 0 && !quiet)
    fprintf(stderr, "meshrun calibrate: AllReduce over %ld ranks (CPU comm backend)...\n",
            ranks);
  if (rc == 0)
    rc = measure_comm(world, &cr);
  if (rc < 0) {
    cJSON_Delete(spec);
    return rc;
  }
  char when[64], src[4096 + 512];
  time_t now = time(NULL);
  strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", gmtime(&now));
  set_str(spec, "name", "calibrated");
  set_num(spec, "nodes", 1);
  set_num(spec, "devices_per_node", (double)ranks);
  snprintf(src, sizeof src, "measured by meshrun calibrate on %s, %ld ranks; inter_node "
           "and reserved_bytes from %s", when, ranks, base_path);
  set_str(spec, "source", src);
  write_device(spec, &r, ranks);
  write_links(spec, &cr, world, r.bw);
  struct mr_cluster parsed;
  rc = mr_cluster_parse(spec, "calibrated spec", &parsed);
  if (rc < 0) {
    cJSON_Delete(spec);
    return mr_error_set(MR_EIO, "calibrate: a measurement is out of range: %s",
                        mr_error_message());
  }
  *text = cJSON_Print(spec);
  cJSON_Delete(spec);
  return *text != NULL ? 0 : mr_error_set(MR_ENOMEM, "calibrate: out of memory");
}

int mr_calibrate_main(int argc, char **argv) {
  static const struct option opts[] = {{"out", required_argument, NULL, 'o'},
                                       {"ranks", required_argument, NULL, 'r'},
                                       {"base", required_argument, NULL, 'b'},
                                       {"quiet", no_argument, NULL, 'q'},
                                       {"help", no_argument, NULL, 'h'},
                                       {NULL, 0, NULL, 0}};
  const char *out_path = NULL, *base = "cpu-local";
  long ranks = mr_cpu_cores(); /* as launch counts them */
  int quiet = 0;
  int c;
  optind = 1;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (c) {
    case 'o': out_path = optarg; break;
    case 'r':
      if (parse_ranks(optarg, &ranks) < 0)
        return 2;
      break;
    case 'b': base = optarg; break;
    case 'q': quiet = 1; break;
    case 'h': usage(stdout); return 0;
    default: usage(stderr); return 2;
    }
  }
  if (optind != argc) {
    usage(stderr);
    return 2;
  }
  char *text = NULL;
  int rc = mr_calibrate_spec(ranks, base, quiet, &text);
  if (rc < 0) {
    fprintf(stderr, "meshrun calibrate: %s\n", mr_error_message());
    /* a base spec that is missing or malformed is bad input */
    return rc == MR_ENOENT || rc == MR_EFORMAT ? 2 : 1;
  }
  int status = 0;
  if (out_path == NULL) {
    printf("%s\n", text);
  } else {
    if (mr_file_write_text(out_path, text, MR_FILE_ATOMIC | MR_FILE_NEWLINE) < 0) {
      fprintf(stderr, "meshrun calibrate: %s\n", mr_error_message());
      status = 1;
    } else {
      if (!quiet)
        fprintf(stderr, "meshrun calibrate: wrote %s\n", out_path);
    }
  }
  free(text);
  return status;
}
