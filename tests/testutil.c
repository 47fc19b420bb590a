/* testutil.c - driving real binaries from tests. */
#include "testutil.h"

#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdint.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

double mr_t_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static char made[32][64]; /* this test's directories (one process a test) */
static int n_made;

void mr_t_tmpdir(char *buf, size_t n) {
  snprintf(buf, n, "/tmp/mr-test-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(buf));
  if (n_made < 32)
    snprintf(made[n_made++], sizeof made[0], "%s", buf);
}

static int remove_one(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st, (void)flag, (void)ftw;
  remove(path);
  return 0;
}

static void cleanup(void) {
  const char *keep = getenv("MESHRUN_KEEP_TEST_DIRS");
  for (int i = 0; i < n_made && (keep == NULL || keep[0] == '\0' || keep[0] == '0'); i++)
    nftw(made[i], remove_one, 16, FTW_DEPTH | FTW_PHYS);
  n_made = 0;
}

TCase *mr_t_tcase(const char *name) {
  TCase *tc = tcase_create(name);
  tcase_add_checked_fixture(tc, NULL, cleanup);
  return tc;
}

void mr_t_spawn(struct mr_tproc *p, const char *dir, char *const argv[],
                char *const extra_env[]) {
  static int seq;
  memset(p, 0, sizeof *p);
  seq++;
  snprintf(p->out_path, sizeof p->out_path, "%s/proc%d.out", dir, seq);
  snprintf(p->err_path, sizeof p->err_path, "%s/proc%d.err", dir, seq);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    int o = open(p->out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int e = open(p->err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(o, 1);
    dup2(e, 2);
    for (int i = 0; extra_env != NULL && extra_env[i] != NULL; i++)
      putenv(extra_env[i]);
    execv(argv[0], argv);
    _exit(127);
  }
  p->pid = pid;
}

int mr_t_wait(struct mr_tproc *p, double timeout_s) {
  double end = mr_t_now() + timeout_s;
  while (!p->reaped) {
    pid_t r = waitpid(p->pid, &p->status, WNOHANG);
    if (r == p->pid) {
      p->reaped = 1;
      break;
    }
    if (mr_t_now() > end)
      return -1;
    usleep(2000);
  }
  if (WIFEXITED(p->status))
    return WEXITSTATUS(p->status);
  return 128 + WTERMSIG(p->status);
}

void mr_t_kill(struct mr_tproc *p) {
  if (p->pid > 0 && !p->reaped) {
    kill(p->pid, SIGKILL);
    waitpid(p->pid, &p->status, 0);
    p->reaped = 1;
  }
}

char *mr_t_slurp(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f == NULL)
    return strdup("");
  size_t cap = 4096, n = 0;
  char *buf = malloc(cap);
  size_t r;
  while ((r = fread(buf + n, 1, cap - n - 1, f)) > 0) {
    n += r;
    if (cap - n - 1 == 0)
      buf = realloc(buf, cap *= 2);
  }
  fclose(f);
  buf[n] = '\0';
  return buf;
}

double mr_t_wait_for_text(const char *path, const char *needle, double timeout_s) {
  double start = mr_t_now();
  for (;;) {
    char *s = mr_t_slurp(path);
    int found = strstr(s, needle) != NULL;
    free(s);
    double t = mr_t_now() - start;
    if (found)
      return t;
    if (t > timeout_s)
      return -1;
    usleep(2000);
  }
}

int mr_t_children(pid_t pid, pid_t *pids, int max) {
  /* scan /proc for processes whose parent is pid */
  DIR *d = opendir("/proc");
  int n = 0;
  struct dirent *e;
  while (d != NULL && (e = readdir(d)) != NULL && n < max) {
    char *end;
    long p = strtol(e->d_name, &end, 10);
    if (*end != '\0' || p <= 0)
      continue;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%ld/stat", p);
    FILE *f = fopen(path, "r");
    if (f == NULL)
      continue;
    size_t r = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[r] = '\0';
    char *rp = strrchr(buf, ')');
    char state;
    int ppid;
    if (rp != NULL && sscanf(rp + 1, " %c %d", &state, &ppid) == 2 && ppid == pid &&
        state != 'Z')
      pids[n++] = (pid_t)p;
  }
  if (d != NULL)
    closedir(d);
  return n;
}

int mr_t_gone(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH)
    return 1;
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return 1;
  size_t r = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[r] = '\0';
  char *rp = strrchr(buf, ')');
  char state = 0;
  if (rp != NULL)
    sscanf(rp + 1, " %c", &state);
  return state == 'Z' || state == 'X';
}

const char *mr_t_meshrun(void) {
  const char *p = getenv("MESHRUN_BIN");
  return p != NULL ? p : "build/launcher/meshrun";
}

const char *mr_t_worker(void) {
  const char *p = getenv("MESHRUN_WORKER_BIN");
  return p != NULL ? p : "build/worker/meshrun-worker";
}

void mr_t_write_tokens(const char *path, int n) {
  FILE *f = fopen(path, "wb");
  ck_assert_ptr_nonnull(f);
  int32_t header[256] = {20240520, 1, n};
  fwrite(header, sizeof header, 1, f);
  uint32_t x = 1;
  for (int i = 0; i < n; i++) {
    x = x * 1103515245u + 12345u;
    uint16_t tok = (uint16_t)((i % 7 == 0) ? 10 : 97 + (x >> 16) % 20);
    fwrite(&tok, 2, 1, f);
  }
  fclose(f);
}

int mr_t_read_losses(const char *metrics_path, double *loss, int max) {
  char *s = mr_t_slurp(metrics_path);
  int n = 0;
  char *save = NULL;
  for (char *line = strtok_r(s, "\n", &save); line != NULL && n < max;
       line = strtok_r(NULL, "\n", &save)) {
    char *l = strstr(line, "\"loss\": ");
    if (l != NULL)
      loss[n++] = atof(l + 8);
  }
  free(s);
  return n;
}

void mr_t_write_llama8_job(const char *dir, const char *name, int steps, const char *ckpt_dir,
                           const char *strategy) {
  char path[400];
  snprintf(path, sizeof path, "%s/train.bin", dir);
  if (access(path, F_OK) != 0)
    mr_t_write_tokens(path, 40000);
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fprintf(f,
          "{\"model\": {\"model_type\": \"llama\", \"vocab_size\": 128, \"hidden_size\": 64,"
          " \"intermediate_size\": 128, \"num_hidden_layers\": 8, \"num_attention_heads\": 4,"
          " \"max_position_embeddings\": 32},"
          " \"data\": {\"train\": \"train.bin\"},"
          " \"train\": {\"steps\": %d, \"global_batch\": 8, \"seq_len\": 32, \"lr\": 0.003,"
          " \"seed\": 11}%s%s%s,"
          " \"strategy\": {\"auto_mode\": \"manual\", %s}}\n",
          steps, ckpt_dir ? ", \"checkpoint\": {\"dir\": \"" : "", ckpt_dir ? ckpt_dir : "",
          ckpt_dir ? "\", \"save_interval_steps\": 10}" : "", strategy);
  fclose(f);
}

int mr_t_count_files(const char *dir) {
  DIR *d = opendir(dir);
  if (d == NULL)
    return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

int mr_t_same_file(const char *a, const char *b) {
  FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
  int same = fa != NULL && fb != NULL;
  while (same) {
    int ca = fgetc(fa), cb = fgetc(fb);
    if (ca != cb)
      same = 0;
    if (ca == EOF || cb == EOF)
      break;
  }
  if (fa != NULL)
    fclose(fa);
  if (fb != NULL)
    fclose(fb);
  return same;
}
