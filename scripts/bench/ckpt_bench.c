/* ckpt_bench.c - checkpoint writing against the disk, and what an
 * asynchronous save costs a training step, in one run.
 *
 *   ckpt_bench DIR [--hidden 1024] [--layers 8] [--heads 16] [--inter 2752]
 *     [--vocab 256] [--seq 256] [--batch 1] [--threads 2] [--reps 5]
 *     [--saves 5] [--base-steps 3]
 *
 * The state is a real one: a LLaMA trained a few steps by the runtime a
 * rank runs (parameters and AdamW moments), saved through the same path a
 * rank takes (mr_ckpt_save: snapshot to host memory, the writer thread:
 * rank-0.safetensors and index.json, each fsynced and hashed), then the
 * coordinator's part (mr_ckpt_write_marker: COMPLETE with the checksums,
 * fsync, rename, fsync of the folder).  All under DIR.
 *
 * 1. Write speed, --reps trials, the order rotating in each: the checkpoint
 *    (from the save call to COMPLETE on disk); the peer, the same number of
 *    bytes written from memory to DIR/peer.bin by 8 MiB write(2) calls and
 *    one fsync; and `dd bs=8M conv=fsync` of as many bytes.  Files are
 *    removed and synced between trials, untimed.
 * 2. Step delay, --saves times: --base-steps steps with no save in flight,
 *    a save after the last of them, then steps until its COMPLETE is
 *    written; --base-steps more steps close the run.  A save's delay is the
 *    time mr_ckpt_save took (the snapshot is synchronous) plus what the
 *    steps run while it was in flight took beyond the baseline: the median
 *    of the steps without a save just before and just after it, so a drift
 *    in the machine's load cancels.  --reps 0 or --saves 0 skips a part.
 *
 * Prints every trial, then one `summary` line of medians. */
#include <fcntl.h>
#include <dirent.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/ckpt.h"
#include "common/clock.h"
#include "common/error.h"
#include "common/job.h"
#include "common/checksum.h"
#include "compiler/spmd/lower.h"
#include "worker/backend/backend.h"
#include "worker/checkpoint.h"
#include "worker/device.h"
#include "worker/runtime.h"

#define MAX_TRIALS 64

static double cpu_now(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec +
         (double)ru.ru_stime.tv_sec + 1e-6 * (double)ru.ru_stime.tv_usec;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(const double *v, int n) {
  double s[(MAX_TRIALS + 1) * 16];
  if (n <= 0)
    return NAN;
  memcpy(s, v, (size_t)n * sizeof *v);
  qsort(s, (size_t)n, sizeof *s, cmp_double);
  return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

/* The coordinator's part, done where the rank reports its files: the
 * completion marker.  Runs on the writer thread, off the training one, as
 * the coordinator is another process. */
struct coordinator {
  const char *root;
  atomic_int done;   // COMPLETE written (or failed) for the save in flight
  int rc;
};

static void on_written(void *ctx, int64_t step, const char *const *files,
                       const char *const *checksum, int n) {
  struct coordinator *co = ctx;
  char dir[4096];
  mr_ckpt_step_dir(co->root, step, dir, sizeof dir);
  co->rc = mr_ckpt_write_marker(dir, step, files, checksum, n);
  if (co->rc < 0)
    fprintf(stderr, "ckpt_bench: marker of step %lld: %s\n", (long long)step,
            mr_error_message());
  atomic_store(&co->done, 1);
}

static void remove_dir(const char *dir) {
  DIR *d = opendir(dir);
  struct dirent *e;
  while (d != NULL && (e = readdir(d)) != NULL) {
    char p[4400];
    if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) {
      snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
      unlink(p);
    }
  }
  if (d != NULL)
    closedir(d);
  rmdir(dir);
}

static long long file_bytes(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 ? (long long)st.st_size : -1;
}

/* One save of step `step`, timed from the call to COMPLETE on disk.
 * *bytes gets the size of the files written, *snap the time of the
 * synchronous part, *cpu the process CPU time spent. */
static int time_save(struct mr_ckpt_saver *sv, struct mr_runtime *tr, struct coordinator *co,
                     const struct mr_reporter *rep, int64_t step, double *dt, double *snap,
                     double *cpu, long long *bytes) {
  atomic_store(&co->done, 0);
  double c0 = cpu_now(), t0 = mr_clock_s();
  if (mr_ckpt_save(sv, tr, step, rep) < 0)
    return -1;
  double t1 = mr_clock_s();
  if (mr_ckpt_saver_wait(sv) < 0 || co->rc < 0 || !atomic_load(&co->done))
    return -1;
  *dt = mr_clock_s() - t0;
  *snap = t1 - t0;
  *cpu = cpu_now() - c0;
  char dir[4096], p[4200];
  mr_ckpt_step_dir(co->root, step, dir, sizeof dir);
  snprintf(p, sizeof p, "%s/rank-0.safetensors", dir);
  long long a = file_bytes(p);
  snprintf(p, sizeof p, "%s/%s", dir, MR_CKPT_INDEX);
  long long b = file_bytes(p);
  *bytes = a + b;
  return a > 0 && b > 0 ? 0 : -1;
}

/* The peer: bytes from memory to path by 8 MiB write(2) calls, one fsync;
 * direct: with O_DIRECT (buf and bytes aligned to 4 KiB). */
static double time_write_loop(const char *path, const char *buf, size_t bytes, int direct) {
  double t0 = mr_clock_s();
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | (direct ? O_DIRECT : 0), 0644);
  if (fd < 0)
    return -1;
  const size_t chunk = 8u << 20;
  for (size_t off = 0; off < bytes; off += chunk) {
    size_t n = bytes - off < chunk ? bytes - off : chunk;
    if (write(fd, buf + off, n) != (ssize_t)n) {
      close(fd);
      return -1;
    }
  }
  int rc = fsync(fd);
  close(fd);
  return rc == 0 ? mr_clock_s() - t0 : -1;
}

static double time_dd(const char *path, long long blocks) {
  char cmd[4400];
  snprintf(cmd, sizeof cmd, "dd if=/dev/zero of='%s' bs=8M count=%lld conv=fsync status=none",
           path, blocks);
  double t0 = mr_clock_s();
  if (system(cmd) != 0)
    return -1;
  return mr_clock_s() - t0;
}

static int write_tokens(const char *path, int n) {
  FILE *f = fopen(path, "wb");
  if (f == NULL)
    return -1;
  uint32_t x = 12345;
  for (int i = 0; i < n; i++) {
    x = x * 1103515245u + 12345u;
    uint16_t t = (uint16_t)((x >> 16) & 255);
    fwrite(&t, 2, 1, f);
  }
  return fclose(f);
}

int main(int argc, char **argv) {
  if (argc < 2 || argv[1][0] == '-') {
    fprintf(stderr, "usage: ckpt_bench DIR [--hidden N] [--layers N] [--heads N] [--inter N] "
                    "[--vocab N] [--seq N] [--batch N] [--threads N] [--reps N] [--saves N] "
                    "[--base-steps N]\n");
    return 2;
  }
  const char *root = argv[1];
  struct mr_job job;
  memset(&job, 0, sizeof job);
  struct mr_model_config *c = &job.model;
  c->family = MR_MODEL_LLAMA;
  c->vocab_size = 256, c->hidden_size = 1024, c->intermediate_size = 2752;
  c->num_hidden_layers = 8, c->num_attention_heads = 16;
  c->max_position_embeddings = 1024, c->rms_norm_eps = 1e-6;
  c->rope_theta = 10000, c->initializer_range = 0.02;
  struct mr_train_config *t = &job.train;
  t->steps = 1 << 30, t->global_batch = 1, t->seq_len = 256, t->lr = 1e-3;
  t->weight_decay = 0.01, t->beta1 = 0.9, t->beta2 = 0.999, t->eps = 1e-8;
  t->grad_clip = 1.0;
  int threads = 2, reps = 5, saves = 5, base_steps = 3;
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define ARG(name) (strcmp(a, name) == 0 && v && ++i)
    if (ARG("--hidden")) c->hidden_size = atoll(v);
    else if (ARG("--layers")) c->num_hidden_layers = atoll(v);
    else if (ARG("--heads")) c->num_attention_heads = atoll(v);
    else if (ARG("--inter")) c->intermediate_size = atoll(v);
    else if (ARG("--vocab")) c->vocab_size = atoll(v);
    else if (ARG("--seq")) t->seq_len = atoll(v);
    else if (ARG("--batch")) t->global_batch = atoll(v);
    else if (ARG("--threads")) threads = atoi(v);
    else if (ARG("--reps")) reps = atoi(v);
    else if (ARG("--saves")) saves = atoi(v);
    else if (ARG("--base-steps")) base_steps = atoi(v);
    else {
      fprintf(stderr, "ckpt_bench: unknown or incomplete flag %s\n", a);
      return 2;
    }
  }
  if (reps < 0 || reps > MAX_TRIALS || saves < 0 || saves > MAX_TRIALS || base_steps < 1 ||
      base_steps > 16) {
    fprintf(stderr, "ckpt_bench: --reps 0..%d, --saves 0..%d, --base-steps 1..16\n", MAX_TRIALS,
            MAX_TRIALS);
    return 2;
  }
  c->num_key_value_heads = c->num_attention_heads;
  char tokens[4200], ckroot[4200], peer[4200], ddf[4200];
  snprintf(tokens, sizeof tokens, "%s/tokens.u16", root);
  snprintf(ckroot, sizeof ckroot, "%s/ckpt", root);
  snprintf(peer, sizeof peer, "%s/peer.bin", root);
  snprintf(ddf, sizeof ddf, "%s/dd.bin", root);
  mkdir(root, 0755); /* may exist */
  if (write_tokens(tokens, 1 << 20) != 0) {
    fprintf(stderr, "ckpt_bench: cannot write %s\n", tokens);
    return 1;
  }
  job.data_train = tokens;
  job.checkpoint.dir = ckroot;

  struct mr_lowered L;
  struct mr_backend *be;
  struct mr_runtime *tr;
  struct mr_ckpt_saver *sv;
  if (mr_lower_graph(&job, 1, &L) < 0 || mr_device_open("cpu", 0, threads, 0, &be) < 0 ||
      mr_runtime_new(&job, &L, 0, be, NULL, &tr) < 0 || mr_ckpt_saver_new(0, 1, &job, &sv) < 0) {
    fprintf(stderr, "ckpt_bench: %s\n", mr_error_message());
    return 1;
  }
  struct coordinator co = {.root = ckroot};
  struct mr_reporter rep = {.ctx = &co, .checkpoint_written = on_written};
  int64_t step = 0;
  struct mr_step_report r;
  for (int i = 0; i < 2; i++) /* moments and parameters of a trained model */
    if (mr_runtime_step(tr, ++step, &r) < 0) {
      fprintf(stderr, "ckpt_bench: %s\n", mr_error_message());
      return 1;
    }
  const struct mr_rt_param *slots;
  double state_bytes = 0;
  for (int i = 0, n = mr_runtime_params(tr, &slots); i < n; i++)
    state_bytes += 4.0 * (double)(slots[i].plen + 2 * slots[i].len);
  printf("model: LLaMA hidden %lld, %lld layers, intermediate %lld, vocab %lld; state %.0f MiB "
         "(parameters and AdamW moments); batch %lld x seq %lld; %d threads; checksum %s\n",
         (long long)c->hidden_size, (long long)c->num_hidden_layers,
         (long long)c->intermediate_size, (long long)c->vocab_size, state_bytes / 1048576,
         (long long)t->global_batch, (long long)t->seq_len, threads,
         MR_CHECKSUM_NAME);

  /* ---- 1. write speed ---- */
  enum { OURS, LOOP, DIRECT, DD, PROGRAMS };
  static const char *const names[PROGRAMS] = {"checkpoint", "write loop", "O_DIRECT loop", "dd"};
  double gbps[PROGRAMS][MAX_TRIALS], ratio[MAX_TRIALS], ratio_direct[MAX_TRIALS],
      ratio_dd[MAX_TRIALS], snaps[MAX_TRIALS], cpus[MAX_TRIALS];
  long long bytes = 0, dd_blocks = 0;
  char *buf = NULL;
  for (int k = 0; k < reps; k++) {
    double dt[PROGRAMS] = {0}, snap = 0, cpu = 0;
    /* each program runs first, second, ... in turn; the checkpoint runs
     * first in the first trial, which gives the peers its size */
    for (int j = 0; j < PROGRAMS; j++) {
      int which = (j + k) % PROGRAMS;
      if (which == OURS) {
        int64_t s = 1000000 + k;
        long long b;
        if (time_save(sv, tr, &co, &rep, s, &dt[OURS], &snap, &cpu, &b) < 0) {
          fprintf(stderr, "ckpt_bench: save: %s\n", mr_error_message());
          return 1;
        }
        char dir[4096];
        mr_ckpt_step_dir(ckroot, s, dir, sizeof dir);
        if (k == 0 && mr_ckpt_verify(dir, NULL) != 0) { /* untimed: the checksums hold */
          fprintf(stderr, "ckpt_bench: %s\n", mr_error_message());
          return 1;
        }
        remove_dir(dir);
        if (bytes == 0) {
          bytes = b;
          dd_blocks = (bytes + (8 << 20) - 1) / (8 << 20);
          if (posix_memalign((void **)&buf, 1 << 21, (size_t)dd_blocks << 23) != 0)
            return 1;
          for (long long i = 0; i < dd_blocks << 23; i++) /* touched: no page faults timed */
            buf[i] = (char)(i * 7 + 1);
        }
      } else if (which == LOOP || which == DIRECT) {
        /* O_DIRECT writes whole 4 KiB blocks: the size rounded up */
        size_t n = which == LOOP ? (size_t)bytes : ((size_t)bytes + 4095) & ~(size_t)4095;
        dt[which] = time_write_loop(peer, buf, n, which == DIRECT);
        unlink(peer);
      } else {
        dt[DD] = time_dd(ddf, dd_blocks);
        unlink(ddf);
      }
      sync(); /* untimed: each trial starts with nothing left to write */
    }
    for (int i = 0; i < PROGRAMS; i++)
      if (dt[i] <= 0) {
        fprintf(stderr, "ckpt_bench: %s failed\n", names[i]);
        return 1;
      }
    for (int i = 0; i < DD; i++)
      gbps[i][k] = (double)bytes / 1e9 / dt[i];
    gbps[DD][k] = (double)(dd_blocks << 23) / 1e9 / dt[DD];
    ratio[k] = gbps[OURS][k] / gbps[LOOP][k];
    ratio_direct[k] = gbps[OURS][k] / gbps[DIRECT][k];
    ratio_dd[k] = gbps[OURS][k] / gbps[DD][k];
    snaps[k] = snap, cpus[k] = cpu;
    printf("write %d: %.0f MiB, save %.2f s (snapshot %.3f s, CPU %.2f s)", k,
           (double)bytes / 1048576, dt[OURS], snap, cpu);
    for (int i = 0; i < PROGRAMS; i++)
      printf(" | %s %.2f GB/s", names[i], gbps[i][k]);
    printf(" | ratio %.2f (to O_DIRECT %.2f, to dd %.2f)\n", ratio[k], ratio_direct[k],
           ratio_dd[k]);
    fflush(stdout);
  }
  free(buf);

  /* ---- 2. step delay ---- */
  double delay[MAX_TRIALS], per_step[MAX_TRIALS], durable[MAX_TRIALS], save_snap[MAX_TRIALS],
      inflight[MAX_TRIALS], inflight_s[MAX_TRIALS], base_all[(MAX_TRIALS + 1) * 16];
  double runs[MAX_TRIALS + 1][16]; /* baseline steps before save k: runs[k] */
  int n_base_all = 0;
  double base_cpu = 0, base_wall = 0;
  for (int k = 0; k <= saves; k++) {
    for (int i = 0; i < base_steps; i++) {
      double c0 = cpu_now(), t0 = mr_clock_s();
      if (mr_runtime_step(tr, ++step, &r) < 0)
        goto step_failed;
      runs[k][i] = base_all[n_base_all++] = mr_clock_s() - t0;
      base_wall += mr_clock_s() - t0;
      base_cpu += cpu_now() - c0;
    }
    if (k == saves)
      break;
    atomic_store(&co.done, 0);
    double t0 = mr_clock_s();
    if (mr_ckpt_save(sv, tr, step, &rep) < 0) {
      fprintf(stderr, "ckpt_bench: save: %s\n", mr_error_message());
      return 1;
    }
    save_snap[k] = mr_clock_s() - t0;
    int n = 0;
    double sum = 0;
    while (!atomic_load(&co.done)) {
      double s0 = mr_clock_s();
      if (mr_runtime_step(tr, ++step, &r) < 0)
        goto step_failed;
      sum += mr_clock_s() - s0;
      n++;
    }
    durable[k] = mr_clock_s() - t0;
    inflight[k] = n;
    if (mr_ckpt_saver_wait(sv) < 0 || co.rc < 0) {
      fprintf(stderr, "ckpt_bench: save: %s\n", mr_error_message());
      return 1;
    }
    char dir[4096];
    mr_ckpt_step_dir(ckroot, step - n, dir, sizeof dir);
    remove_dir(dir);
    inflight_s[k] = sum;
  }
  /* save k's baseline: the median of the baseline steps just before and
   * just after it, so a drift in the machine's load cancels */
  for (int k = 0; k < saves; k++) {
    double around[32];
    memcpy(around, runs[k], (size_t)base_steps * sizeof(double));
    memcpy(around + base_steps, runs[k + 1], (size_t)base_steps * sizeof(double));
    double b = median(around, 2 * base_steps);
    double extra = inflight_s[k] - inflight[k] * b;
    delay[k] = (save_snap[k] + extra) / b;
    per_step[k] = inflight[k] > 0 ? extra / inflight[k] / b : 0;
    printf("save %d: baseline step %.3f s (median of %d around it) | snapshot %.3f s | %d steps "
           "in flight, %+.3f s beyond baseline | durable after %.2f s | delay %.1f%% of a step\n",
           k, b, 2 * base_steps, save_snap[k], (int)inflight[k], extra, durable[k],
           100 * delay[k]);
  }
  mr_ckpt_saver_free(sv);
  mr_runtime_free(tr);
  mr_backend_free(be);
  mr_lowered_close(&L);
  rmdir(ckroot);
  unlink(tokens);
  printf("summary state_bytes=%.0f", state_bytes);
  if (reps > 0)
    printf(" bytes=%lld ckpt_gbps=%.3f loop_gbps=%.3f direct_gbps=%.3f dd_gbps=%.3f ratio=%.3f "
           "ratio_direct=%.3f ratio_dd=%.3f snapshot_s=%.3f save_cpu_s=%.2f",
           bytes, median(gbps[OURS], reps), median(gbps[LOOP], reps),
           median(gbps[DIRECT], reps), median(gbps[DD], reps), median(ratio, reps),
           median(ratio_direct, reps), median(ratio_dd, reps), median(snaps, reps),
           median(cpus, reps));
  if (saves > 0)
    printf(" step_s=%.3f train_cpu_use=%.2f delay_pct=%.1f inflight_step_pct=%.1f "
           "inflight_steps=%.1f save_snapshot_s=%.3f durable_s=%.2f",
           median(base_all, n_base_all), base_cpu / base_wall / threads,
           100 * median(delay, saves), 100 * median(per_step, saves),
           median(inflight, saves), median(save_snap, saves), median(durable, saves));
  printf("\n");
  return 0;
step_failed:
  fprintf(stderr, "ckpt_bench: step %lld: %s\n", (long long)step, mr_error_message());
  return 1;
}
