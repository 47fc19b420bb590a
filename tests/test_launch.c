/* test_launch.c - `meshrun launch` end to end: the real launcher and real
 * workers on the self-check job, with failures injected from outside. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "check_main.h"
#include "common/auth.h"
#include "common/discovery.h"
#include "common/error.h"
#include "common/frame.h"
#include "common/rpc.h"
#include "compiler/planner/cluster.h"
#include "launcher/cli.h"
#include "launcher/ranks.h"
#include "launcher/sockdir.h"
#include "launcher/strategy_choice.h"
#include "testutil.h"

/* Starts `meshrun launch --selfcheck` with nproc ranks and extra flags. */
static void launch(struct mr_tproc *p, const char *dir, int nproc, const char *steps,
                   char *const flags[]) {
  static char steps_env[64], nproc_s[16], logdir[300];
  snprintf(steps_env, sizeof steps_env, "MESHRUN_SELFCHECK_STEPS=%s", steps);
  snprintf(nproc_s, sizeof nproc_s, "%d", nproc);
  snprintf(logdir, sizeof logdir, "%s/logs", dir);
  char *argv[32] = {(char *)mr_t_meshrun(), "launch", "--selfcheck", "--nproc", nproc_s,
                    "--log-dir", logdir};
  int n = 7;
  for (int i = 0; flags != NULL && flags[i] != NULL && n < 30; i++)
    argv[n++] = flags[i];
  argv[n] = NULL;
  char *env[] = {steps_env, NULL};
  mr_t_spawn(p, dir, argv, env);
}

/* A one-layer LLaMA training job dir/name of `steps` steps of `batch`
 * sequences (tokens beside it), with `strategy` (", " and JSON members, or
 * ""); its path into path[n]. */
static void tiny_job_with(const char *dir, const char *name, int steps, int batch,
                          const char *strategy, char *path, size_t n) {
  snprintf(path, n, "%s/train.bin", dir);
  mr_t_write_tokens(path, 4000);
  snprintf(path, n, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fprintf(f, "{\"model\": {\"model_type\": \"llama\", \"vocab_size\": 128, \"hidden_size\": 16,"
             " \"intermediate_size\": 24, \"num_hidden_layers\": 1, \"num_attention_heads\": 2,"
             " \"max_position_embeddings\": 16},"
             " \"data\": {\"train\": \"train.bin\"},"
             " \"train\": {\"steps\": %d, \"global_batch\": %d, \"seq_len\": 8}%s}\n",
          steps, batch, strategy);
  fclose(f);
}

static void tiny_job(const char *dir, int steps, char *path, size_t n) {
  tiny_job_with(dir, "job.json", steps, 2, "", path, n);
}

/* Waits until every rank has registered (its log shows the job started). */
static void wait_registered(const char *dir, int nproc) {
  for (int i = 0; i < nproc; i++) {
    char path[320];
    snprintf(path, sizeof path, "%s/logs/rank-%d.log", dir, i);
    ck_assert_msg(mr_t_wait_for_text(path, "steps of", 10) >= 0, "rank %d never started", i);
  }
}

START_TEST(test_launch_selfcheck_four_ranks_fast) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  /* a wrapper records each worker's environment, then becomes the worker */
  char wrapper[128], script[1024];
  snprintf(wrapper, sizeof wrapper, "%s/worker.sh", dir);
  snprintf(script, sizeof script,
           "#!/bin/sh\nenv > \"$MESHRUN_LOG_DIR/env-$RANK\"\nexec %s\n", mr_t_worker());
  FILE *f = fopen(wrapper, "w");
  fputs(script, f);
  fclose(f);
  chmod(wrapper, 0755);
  static char wenv[160];
  snprintf(wenv, sizeof wenv, "MESHRUN_WORKER=%s", wrapper);
  putenv(wenv);
  struct mr_tproc p;
  double t0 = mr_t_now();
  launch(&p, dir, 4, "3", NULL);
  int code = mr_t_wait(&p, 20);
  double took = mr_t_now() - t0;
  ck_assert_int_eq(code, 0);
  ck_assert_msg(took < 2.0, "self-check took %.2f s", took);
  char *out = mr_t_slurp(p.out_path);
  ck_assert_ptr_nonnull(strstr(out, "self-check passed: 4 ranks"));
  for (int i = 0; i < 4; i++) {
    char want[64], path[160];
    snprintf(want, sizeof want, "[rank %d] self-check ok: rank %d of 4", i, i);
    ck_assert_msg(strstr(out, want) != NULL, "console lacks \"%s\"", want);
    snprintf(path, sizeof path, "%s/logs/rank-%d.log", dir, i);
    char *log = mr_t_slurp(path);
    snprintf(want, sizeof want, "self-check ok: rank %d of 4", i);
    ck_assert_msg(strstr(log, want) != NULL, "rank %d log lacks its line", i);
    free(log);
    snprintf(path, sizeof path, "%s/logs/env-%d", dir, i);
    char *env = mr_t_slurp(path);
    char line[64];
    snprintf(line, sizeof line, "\nRANK=%d\n", i);
    ck_assert_msg(strstr(env, line) != NULL, "rank %d: RANK missing", i);
    snprintf(line, sizeof line, "\nLOCAL_RANK=%d\n", i);
    ck_assert(strstr(env, line) != NULL);
    ck_assert(strstr(env, "\nWORLD_SIZE=4\n") != NULL);
    ck_assert(strstr(env, "\nLOCAL_WORLD_SIZE=4\n") != NULL);
    ck_assert(strstr(env, "\nMASTER_ADDR=127.0.0.1\n") != NULL);
    ck_assert(strstr(env, "\nMASTER_PORT=") != NULL);
    /* the token travels on a descriptor, never in the environment */
    ck_assert(strstr(env, "MESHRUN_TOKEN_FD=3") != NULL);
    ck_assert(strstr(env, "TOKEN=") == NULL || strstr(env, "TOKEN_FD=3") != NULL);
    free(env);
  }
  free(out);
}
END_TEST

START_TEST(test_launch_sigkill_detected_fast_and_group_restarts) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  struct mr_tproc p;
  char *flags[] = {"--max-restarts", "1", NULL};
  launch(&p, dir, 3, "40", flags);
  wait_registered(dir, 3);
  pid_t kids[16];
  int n = mr_t_children(p.pid, kids, 16);
  ck_assert_int_eq(n, 3);
  double t_kill = mr_t_now();
  kill(kids[1], SIGKILL);
  double seen = mr_t_wait_for_text(p.err_path, "was killed by signal 9", 5);
  ck_assert_msg(seen >= 0, "the kill was never reported");
  double detect = mr_t_now() - t_kill;
  ck_assert_msg(detect < 1.0, "detected after %.3f s", detect);
  int code = mr_t_wait(&p, 30);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(code == 0, "exit %d, stderr:\n%s", code, err);
  ck_assert_ptr_nonnull(strstr(err, "restarting the group (restart 1 of 1;"));
  free(err);
  char *out = mr_t_slurp(p.out_path);
  ck_assert_ptr_nonnull(strstr(out, "self-check passed: 3 ranks"));
  free(out);
}
END_TEST

START_TEST(test_launch_no_restarts_left_names_rank_and_signal) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  struct mr_tproc p;
  char *flags[] = {"--max-restarts", "0", NULL};
  launch(&p, dir, 2, "200", flags);
  wait_registered(dir, 2);
  pid_t kids[16];
  ck_assert_int_eq(mr_t_children(p.pid, kids, 16), 2);
  /* which rank is it?  its environment says */
  char path[64], *env;
  snprintf(path, sizeof path, "/proc/%d/environ", (int)kids[0]);
  int fd = open(path, O_RDONLY);
  char buf[16384];
  ssize_t r = read(fd, buf, sizeof buf - 1);
  close(fd);
  ck_assert_int_gt(r, 0);
  buf[r] = '\0';
  int rank = -1;
  for (char *s = buf; s < buf + r; s += strlen(s) + 1)
    if (strncmp(s, "RANK=", 5) == 0)
      rank = atoi(s + 5);
  ck_assert_int_ge(rank, 0);
  /* a SIGKILL not the launcher's, nor the out-of-memory killer's (the
   * kernel's count of its kills does not move): the message says so and
   * gives the resident size the heartbeats reported */
  usleep(400000);
  snprintf(path, sizeof path, "/proc/%d/status", (int)kids[0]);
  char *status = mr_t_slurp(path);
  const char *vm = strstr(status, "VmRSS:");
  ck_assert_ptr_nonnull(vm);
  double rss_mib = atof(vm + 6) / 1024.0;
  free(status);
  kill(kids[0], SIGKILL);
  int code = mr_t_wait(&p, 20);
  ck_assert_int_ne(code, 0);
  ck_assert_int_lt(code, 128); /* an orderly failure exit, not a crash */
  env = mr_t_slurp(p.err_path);
  char want[96];
  snprintf(want, sizeof want, "job failed after 0 restarts: rank %d (pid %d) was killed by signal 9",
           rank, (int)kids[0]);
  ck_assert_msg(strstr(env, want) != NULL, "stderr lacks \"%s\":\n%s", want, env);
  const char *oom = strstr(env, "nor the out-of-memory killer, which killed nothing since the "
                                "rank started: another process, an operator or a scheduler; "
                                "the rank's resident size had reached ");
  ck_assert_msg(oom != NULL, "%s", env);
  double said = atof(strstr(oom, "reached ") + 8);
  ck_assert_msg(said > 0.5 * rss_mib && said < 2.0 * rss_mib, "said %.0f MiB, VmRSS %.1f MiB",
                said, rss_mib);
  snprintf(want, sizeof want, "last 1 line of rank %d's log", rank);
  ck_assert_msg(strstr(env, want) != NULL, "stderr lacks the log tail:\n%s", env);
  free(env);
}
END_TEST

START_TEST(test_launch_sigstopped_worker_caught_by_heartbeat_timeout) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  struct mr_tproc p;
  char *flags[] = {"--heartbeat-timeout", "0.5", NULL};
  launch(&p, dir, 2, "500", flags);
  wait_registered(dir, 2);
  pid_t kids[16];
  ck_assert_int_eq(mr_t_children(p.pid, kids, 16), 2);
  double t0 = mr_t_now();
  kill(kids[1], SIGSTOP);
  int code = mr_t_wait(&p, 20);
  double took = mr_t_now() - t0;
  ck_assert_int_eq(code, 1);
  ck_assert_msg(took < 3.0, "took %.2f s to give up", took);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(strstr(err, "sent no heartbeat") != NULL, "stderr:\n%s", err);
  free(err);
  ck_assert(mr_t_gone(kids[1]));
}
END_TEST

/* A stopped rank caught by the hang timeout (before its heartbeat
 * timeout) is named in the headline: its last position may be a wait like
 * the others', but it alone went silent. */
START_TEST(test_launch_sigstopped_worker_named_by_hang_timeout) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  struct mr_tproc p;
  char *flags[] = {"--heartbeat-timeout", "60", "--hang-timeout", "1.5", NULL};
  launch(&p, dir, 3, "500", flags);
  wait_registered(dir, 3);
  pid_t kids[16];
  ck_assert_int_eq(mr_t_children(p.pid, kids, 16), 3);
  kill(kids[1], SIGSTOP);
  int code = mr_t_wait(&p, 30);
  ck_assert_int_eq(code, 1);
  char *err = mr_t_slurp(p.err_path);
  char want[96];
  snprintf(want, sizeof want, "(pid %d) has sent nothing for ", (int)kids[1]);
  const char *headline = strstr(err, "hang: no rank made progress");
  ck_assert_msg(headline != NULL && strstr(headline, want) != NULL &&
                    strstr(headline, want) < strchr(headline, '\n'),
                "the headline does not name pid %d:\n%s", (int)kids[1], err);
  free(err);
  ck_assert(mr_t_gone(kids[1]));
}
END_TEST

/* Where a thousand ranks are reads in a few lines: the ranks at one place
 * listed as ranges, against the positions set by hand. */
START_TEST(test_launch_positions_of_a_thousand_ranks) {
  struct mr_ranks s;
  memset(&s, 0, sizeof s);
  s.n = 1000;
  s.r = calloc(1000, sizeof *s.r);
  for (int i = 0; i < s.n; i++) {
    struct mr_rank *r = &s.r[i];
    r->rank = i;
    r->step = 21;
    r->last_done = 1;
    r->waiting_on = i == 3 || i == 700 ? -1 : 2;
    snprintf(r->waiting_detail, sizeof r->waiting_detail, "AllReduce of 4.0 MiB");
  }
  s.r[999].exited = 1;
  char buf[4096];
  mr_ranks_describe_positions(&s, buf, sizeof buf);
  const char *want[] = {
      "\n  ranks 0-2,4-699,701-998: step 21, completed #1, waits on #2: AllReduce of 4.0 MiB",
      "\n  ranks 3,700: step 21, completed #1, waits on nothing: busy or stuck in its own work "
      "(instruction #2)",
      "\n  rank 999: exited"};
  char all[1024];
  snprintf(all, sizeof all, "%s%s%s", want[0], want[1], want[2]);
  ck_assert_str_eq(buf, all);
  mr_ranks_describe_positions(&s, buf, 40); /* cut short: says so */
  ck_assert_int_eq(strlen(buf), 39);
  ck_assert_str_eq(buf + 36, "...");
  free(s.r);
}
END_TEST

/* A launcher that does not run for longer than the heartbeat timeout (sent
 * SIGSTOP here; a slow disk or a paused machine alike) finds the ranks'
 * heartbeats waiting in its sockets: it blames none of them. */
START_TEST(test_launch_paused_launcher_blames_no_rank) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  struct mr_tproc p;
  char *flags[] = {"--heartbeat-timeout", "1", "--max-restarts", "0", NULL};
  launch(&p, dir, 2, "300", flags);
  wait_registered(dir, 2);
  kill(p.pid, SIGSTOP);
  usleep(3500000);
  kill(p.pid, SIGCONT);
  int code = mr_t_wait(&p, 60);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(code == 0, "exit %d; stderr:\n%s", code, err);
  ck_assert_msg(strstr(err, "sent no heartbeat") == NULL, "stderr:\n%s", err);
  ck_assert_msg(strstr(err, "the launcher did not run for") != NULL, "stderr:\n%s", err);
  free(err);
}
END_TEST

/* A 500-step job of nproc ranks launched in a new folder dir[64] and
 * running: every rank registered; its workers' pids into kids[16]. */
static void launch_running(struct mr_tproc *p, char dir[64], int nproc, pid_t kids[16]) {
  mr_t_tmpdir(dir, 64);
  launch(p, dir, nproc, "500", NULL);
  wait_registered(dir, nproc);
  ck_assert_int_eq(mr_t_children(p->pid, kids, 16), nproc);
}

START_TEST(test_launch_no_orphans_after_launcher_sigkill) {
  char dir[64];
  struct mr_tproc p;
  pid_t kids[16];
  const int n = 3;
  launch_running(&p, dir, n, kids);
  kill(p.pid, SIGKILL);
  mr_t_wait(&p, 5);
  double end = mr_t_now() + 2.0;
  int alive = n;
  while (alive > 0 && mr_t_now() < end) {
    alive = 0;
    for (int i = 0; i < n; i++)
      alive += !mr_t_gone(kids[i]);
    usleep(5000);
  }
  ck_assert_msg(alive == 0, "%d workers outlived the launcher", alive);
  /* a killed launcher cannot remove its socket's folder; the next
   * launcher on the host does */
  char path[300];
  snprintf(path, sizeof path, "%s/logs/coordinator.json", dir);
  char *c = mr_t_slurp(path), *at = strstr(c, "\"unix:");
  ck_assert_ptr_nonnull(at);
  char sock[200];
  ck_assert_int_eq(sscanf(at + 6, "%199[^\"]", sock), 1);
  free(c);
  *strrchr(sock, '/') = '\0';
  struct stat st;
  ck_assert_int_eq(stat(sock, &st), 0);
  char dir2[64];
  mr_t_tmpdir(dir2, sizeof dir2);
  launch(&p, dir2, 1, "2", NULL);
  ck_assert_int_eq(mr_t_wait(&p, 30), 0);
  ck_assert_msg(stat(sock, &st) != 0 && errno == ENOENT, "%s outlived its launcher", sock);
}
END_TEST

static void write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fputs(text, f);
  fclose(f);
}

/* A folder named as a launcher's socket folder, made in root by hand. */
static void fake_folder(const char *root, char *dir, size_t n) {
  snprintf(dir, n, "%s/meshrun-XXXXXX", root);
  ck_assert_ptr_nonnull(mkdtemp(dir));
}

START_TEST(test_launch_sockdir_sweep_takes_only_dead_folders) {
  char root[64], live[200], dead[200], bare[200], busy[200], path[300];
  mr_t_tmpdir(root, sizeof root);
  int live_fd, dead_fd, busy_fd;
  ck_assert_int_eq(mr_sockdir_make(root, live, sizeof live, &live_fd), 0);
  ck_assert_int_eq(mr_sockdir_make(root, dead, sizeof dead, &dead_fd), 0);
  ck_assert_int_eq(mr_sockdir_make(root, busy, sizeof busy, &busy_fd), 0);
  fake_folder(root, bare, sizeof bare); /* no lock: not (yet) a launcher's */
  snprintf(path, sizeof path, "%s/" MR_SOCKDIR_SOCKET, dead);
  write_file(path, "");
  snprintf(path, sizeof path, "%s/other", busy);
  write_file(path, "not ours");
  /* the lock is close-on-exec: a started program does not hold it */
  ck_assert_int_eq(fcntl(live_fd, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  close(dead_fd), close(busy_fd); /* their launchers died */
  ck_assert_int_eq(mr_sockdir_sweep(root), 1);
  struct stat st;
  ck_assert_int_eq(stat(live, &st), 0);
  ck_assert_int_ne(stat(dead, &st), 0);
  ck_assert_int_eq(stat(bare, &st), 0);
  ck_assert_int_eq(stat(path, &st), 0); /* a folder holding more is left */
  ck_assert_int_eq(mr_sockdir_sweep(root), 0);
  mr_sockdir_remove(live, live_fd);
  ck_assert_int_ne(stat(live, &st), 0);
  ck_assert_int_eq(unlink(path), 0);
  ck_assert_int_eq(rmdir(busy), 0);
  ck_assert_int_eq(rmdir(bare), 0);
}
END_TEST

START_TEST(test_launch_sigterm_stops_every_worker) {
  char dir[64];
  struct mr_tproc p;
  pid_t kids[16];
  const int n = 2;
  launch_running(&p, dir, n, kids);
  kill(p.pid, SIGTERM);
  int code = mr_t_wait(&p, 10);
  ck_assert_int_eq(code, 128 + SIGTERM);
  for (int i = 0; i < n; i++)
    ck_assert(mr_t_gone(kids[i]));
}
END_TEST

/* A scheduler signals every process of its step (Slurm's scancel): a
 * worker leaves a SIGTERM that is not its launcher's to the launcher, which
 * got its own, so the job is not cut short under it; here none comes to
 * the launcher, and the job trains to its end. */
START_TEST(test_launch_worker_ignores_a_sigterm_not_from_its_launcher) {
  char dir[64];
  struct mr_tproc p;
  pid_t kids[16];
  const int n = 2;
  launch_running(&p, dir, n, kids);
  for (int i = 0; i < n; i++)
    kill(kids[i], SIGTERM);
  int code = mr_t_wait(&p, 120);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(code == 0, "exit %d:\n%s", code, err);
  free(err);
}
END_TEST

/* Reads coordinator.json's "unix" address. */
static void coordinator_address(const char *dir, char *addr, size_t n) {
  char path[160];
  snprintf(path, sizeof path, "%s/logs/coordinator.json", dir);
  ck_assert(mr_t_wait_for_text(path, "\"tcp\"", 10) >= 0);
  char *s = mr_t_slurp(path);
  char *u = strstr(s, "\"unix\": \"unix:");
  ck_assert_ptr_nonnull(u);
  u += strlen("\"unix\": \"unix:");
  char *q = strchr(u, '"');
  snprintf(addr, n, "%.*s", (int)(q - u), u);
  free(s);
}

static int connect_unix(const char *path) {
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
  ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  return fd;
}

/* True when the peer closes fd within timeout (reading and dropping). */
static int closed_within(int fd, double timeout_s) {
  double end = mr_t_now() + timeout_s;
  struct timeval tv = {.tv_sec = 0, .tv_usec = 50000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  while (mr_t_now() < end) {
    char buf[4096];
    ssize_t r = recv(fd, buf, sizeof buf, 0);
    if (r == 0)
      return 1;
  }
  return 0;
}

/* The launcher's resident size, KiB. */
static long vm_rss_kib(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  char *s = mr_t_slurp(path);
  const char *vm = strstr(s, "VmRSS:");
  long kib = vm != NULL ? atol(vm + 6) : -1;
  free(s);
  return kib;
}

static int connect_tcp(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  return fd;
}

/* Strangers on the TCP listener: 50 that each send 1 MiB of a frame
 * declared before authenticating (held whole before, 50 MiB), and 200
 * that each hold a partial handshake open.  The launcher's memory grows
 * by less than 16 MiB, the oldest waiting connections are dropped past
 * 64 more than the job's own ranks and nodes, and the job finishes. */
START_TEST(test_launch_strangers_cannot_grow_the_launcher) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  struct mr_tproc p;
  launch(&p, dir, 2, "400", NULL);
  char path[160];
  snprintf(path, sizeof path, "%s/logs/coordinator.json", dir);
  ck_assert(mr_t_wait_for_text(path, "\"tcp\"", 10) >= 0);
  char *cj = mr_t_slurp(path);
  const char *t = strstr(cj, "\"tcp:");
  ck_assert_ptr_nonnull(t);
  char addr[64];
  snprintf(addr, sizeof addr, "%.*s", (int)strcspn(t + 5, "\""), t + 5); /* 127.0.0.1:PORT */
  int port = atoi(strrchr(addr, ':') + 1);
  free(cj);
  wait_registered(dir, 2);
  long rss0 = vm_rss_kib(p.pid);
  static char mib[1 << 20];
  int big[50]; /* kept open until measured: a closed one frees what it sent */
  for (int i = 0; i < 50; i++) {
    big[i] = connect_tcp(port);
    struct timeval tv = {.tv_sec = 2};
    setsockopt(big[i], SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    uint8_t h[4];
    mr_frame_put_header(h, 1u << 20);
    (void)!send(big[i], h, 4, MSG_NOSIGNAL);
    (void)!send(big[i], mib, sizeof mib, MSG_NOSIGNAL);
  }
  usleep(200000);
  long rss1 = vm_rss_kib(p.pid);
  ck_assert_msg(rss1 - rss0 < 16 * 1024, "the launcher grew by %ld KiB", rss1 - rss0);
  for (int i = 0; i < 50; i++)
    close(big[i]);
  int fds[200];
  for (int i = 0; i < 200; i++) {
    fds[i] = connect_tcp(port);
    uint8_t part[4 + 300] = {0};
    mr_frame_put_header(part, 500); /* a frame under the limit, never finished */
    ck_assert_int_eq(send(fds[i], part, sizeof part, MSG_NOSIGNAL), (ssize_t)sizeof part);
  }
  long rss2 = vm_rss_kib(p.pid);
  ck_assert_msg(rss2 - rss0 < 16 * 1024, "the launcher grew by %ld KiB", rss2 - rss0);
  fprintf(stderr, "# the launcher's resident size: %ld KiB, %+ld KiB after the 1 MiB frames, "
          "%+ld KiB with 200 half handshakes\n", rss0, rss1 - rss0, rss2 - rss0);
  int room = 64 + 2 + 1; /* the strangers' 64, and the job's 2 ranks and 1 node */
  for (int i = 0; i < 200 - room; i++)
    ck_assert_msg(closed_within(fds[i], 3), "waiting connection %d was kept", i);
  ck_assert_msg(!closed_within(fds[199], 0.2), "the newest waiting connection was dropped");
  for (int i = 0; i < 200; i++)
    close(fds[i]);
  int code = mr_t_wait(&p, 60);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(code == 0, "exit %d\n%s", code, err);
  ck_assert_msg(strstr(err, "exceeds the 512-byte limit") != NULL, "%s", err);
  ck_assert_msg(strstr(err, "too many connections waiting to authenticate") != NULL, "%s", err);
  free(err);
}
END_TEST

START_TEST(test_launch_bad_clients_refused_job_still_finishes) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  struct mr_tproc p;
  launch(&p, dir, 2, "60", NULL);
  char addr[128];
  coordinator_address(dir, addr, sizeof addr);

  /* 1. skips the handshake: sends a Hello straight away */
  int fd = connect_unix(addr);
  Meshrun__Hello hello = MESHRUN__HELLO__INIT;
  hello.protocol_version = MR_PROTOCOL_VERSION;
  hello.requested_rank = 0;
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_HELLO;
  env.hello = &hello;
  ck_assert_int_eq(mr_rpc_send_fd(fd, &env), 0);
  ck_assert_msg(closed_within(fd, 3), "a client without a handshake was not dropped");
  close(fd);

  /* 2. an oversized frame header */
  fd = connect_unix(addr);
  uint8_t h[4];
  mr_frame_put_header(h, 0xfffffff0u);
  ck_assert_int_eq(send(fd, h, 4, MSG_NOSIGNAL), 4);
  ck_assert(closed_within(fd, 3));
  close(fd);

  /* 3. garbage bytes */
  fd = connect_unix(addr);
  uint8_t junk[] = {5, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff};
  ck_assert_int_eq(send(fd, junk, sizeof junk, MSG_NOSIGNAL), (ssize_t)sizeof junk);
  ck_assert(closed_within(fd, 3));
  close(fd);

  /* 4. a real worker with the wrong token, from a 0600 file */
  char tok_path[128];
  snprintf(tok_path, sizeof tok_path, "%s/wrong.token", dir);
  uint8_t wrong[32];
  mr_auth_random(wrong, sizeof wrong);
  ck_assert_int_eq(mr_auth_token_write_file(tok_path, wrong), 0);
  static char e_coord[200], e_tok[200];
  snprintf(e_coord, sizeof e_coord, "MESHRUN_COORD=unix:%s", addr);
  snprintf(e_tok, sizeof e_tok, "MESHRUN_TOKEN_FILE=%s", tok_path);
  char *wenv[] = {e_coord, e_tok, "RANK=0", NULL};
  char *wargv[] = {(char *)mr_t_worker(), NULL};
  struct mr_tproc w;
  mr_t_spawn(&w, dir, wargv, wenv);
  int wcode = mr_t_wait(&w, 10);
  ck_assert_int_eq(wcode, 1);
  char *werr = mr_t_slurp(w.err_path);
  ck_assert_msg(strstr(werr, "refused our job token") != NULL, "worker said:\n%s", werr);
  free(werr);

  int code = mr_t_wait(&p, 20);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(code == 0, "the job did not survive the bad clients: %d\n%s", code, err);
  ck_assert_ptr_nonnull(strstr(err, "sent a message before authenticating"));
  ck_assert_ptr_nonnull(strstr(err, "bad frame"));
  ck_assert_ptr_nonnull(strstr(err, "bad message"));
  ck_assert_ptr_nonnull(strstr(err, "wrong job token"));
  free(err);
}
END_TEST

START_TEST(test_launch_hang_diagnosed_naming_rank_and_operation) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  struct mr_tproc p;
  static char stall[] = "MESHRUN_TEST_STALL=2:3";
  putenv(stall);
  char *flags[] = {"--hang-timeout", "0.5", NULL};
  launch(&p, dir, 3, "20", flags);
  int code = mr_t_wait(&p, 20);
  ck_assert_int_eq(code, 1);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(strstr(err, "hang: no rank made progress") != NULL, "%s", err);
  ck_assert_msg(strstr(err, "rank 2 is stuck outside communication") != NULL, "%s", err);
  /* ranks at one place share a line */
  const char *both = strstr(err, "ranks 0-1: step 3, completed #5, waits on #6: rendezvous "
                                 "\"selfcheck/step-3\"");
  ck_assert_msg(both != NULL || (strstr(err, "rank 0: step 3, completed #5, waits on #6: "
                                              "rendezvous \"selfcheck/step-3\"") != NULL &&
                                 strstr(err, "rank 1: step 3") != NULL), "%s", err);
  ck_assert(strstr(err, "rendezvous \"selfcheck/step-3\": 2 of 3 arrived; missing: rank 2") != NULL);
  free(err);
}
END_TEST

/* A rank killed while its group is being created (before every member has
 * mapped the segment, after which it is unlinked) leaves the segment
 * behind; the launcher removes every segment of its job once the group
 * stopped.  The left-over segment is made here, named as the comm names
 * them, while a real training job runs; then a rank is killed. */
START_TEST(test_launch_killed_rank_leaves_no_shared_memory) {
  char dir[64], path[160];
  mr_t_tmpdir(dir, sizeof dir);
  tiny_job(dir, 50, path, sizeof path);
  static char stall[] = "MESHRUN_TEST_STALL=1:3";
  char logdir[160];
  snprintf(logdir, sizeof logdir, "%s/logs", dir);
  char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", "2", "--max-restarts", "0",
                  "--log-dir", logdir, path, NULL};
  char *env[] = {stall, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, env);
  ck_assert_msg(mr_t_wait_for_text(p.err_path, "info launch: job ", 20) >= 0,
                "launcher never started");
  char *err = mr_t_slurp(p.err_path);
  char id[17] = {0};
  ck_assert(sscanf(strstr(err, "info launch: job "), "info launch: job %16[0-9a-f]:", id) == 1);
  free(err);
  char name[96];
  snprintf(name, sizeof name, "/meshrun-%s-00000000deadbeef-0123456789abcdef-0", id);
  int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  ck_assert_int_ge(fd, 0);
  close(fd);
  char rlog[200];
  snprintf(rlog, sizeof rlog, "%s/rank-0.log", logdir);
  ck_assert_msg(mr_t_wait_for_text(rlog, "parameters", 20) >= 0, "training never started");
  pid_t kids[8];
  ck_assert_int_eq(mr_t_children(p.pid, kids, 8), 2);
  kill(kids[0], SIGKILL);
  ck_assert_int_eq(mr_t_wait(&p, 20), 1);
  fd = shm_open(name, O_RDWR, 0600);
  if (fd >= 0) {
    close(fd);
    shm_unlink(name);
  }
  ck_assert_msg(fd < 0, "left behind: /dev/shm%s", name);
}
END_TEST

START_TEST(test_launch_bind_and_metrics_flags) {
  /* a malformed --bind is bad usage (exit 2, the value named); a good one
   * is where the coordinator listens; --metrics is where the steps go */
  char dir[64], path[200];
  mr_t_tmpdir(dir, sizeof dir);
  static const char *const bad[] = {"nonsense", "127.0.0.1:99999", "300.1.1.1:5", ":80"};
  for (int i = 0; i < 4; i++) {
    char *flags[] = {"--bind", (char *)bad[i], NULL};
    struct mr_tproc p;
    launch(&p, dir, 1, "2", flags);
    int code = mr_t_wait(&p, 20);
    char *err = mr_t_slurp(p.err_path);
    char want[64];
    snprintf(want, sizeof want, "--bind %s:", bad[i]);
    ck_assert_msg(code == 2 && strstr(err, want) != NULL, "%s: exit %d: %s", bad[i], code, err);
    free(err);
  }
  char *good[] = {"--bind", "127.0.0.1:0", NULL};
  struct mr_tproc p;
  launch(&p, dir, 2, "2", good);
  ck_assert_int_eq(mr_t_wait(&p, 30), 0);
  snprintf(path, sizeof path, "%s/logs/coordinator.json", dir);
  char *c = mr_t_slurp(path);
  ck_assert_msg(strstr(c, "\"tcp\": \"tcp:127.0.0.1:") != NULL, "%s", c);
  free(c);
  /* a training job's metrics where --metrics says, a line per step */
  tiny_job(dir, 3, path, sizeof path);
  char logdir[160], metrics[160];
  snprintf(logdir, sizeof logdir, "%s/run", dir);
  snprintf(metrics, sizeof metrics, "%s/elsewhere.jsonl", dir);
  char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", "2", "--log-dir", logdir,
                  "--metrics", metrics, path, NULL};
  mr_t_spawn(&p, dir, argv, NULL);
  ck_assert_int_eq(mr_t_wait(&p, 60), 0);
  double loss[4];
  ck_assert_int_eq(mr_t_read_losses(metrics, loss, 4), 3);
  for (int s = 0; s < 3; s++)
    ck_assert(loss[s] > 0 && loss[s] < 10);
  char deflt[200];
  snprintf(deflt, sizeof deflt, "%s/metrics.jsonl", logdir);
  ck_assert_int_ne(access(deflt, F_OK), 0);
}
END_TEST

/* A rank made 40 ms slower every step (a throttled device) is named, and
 * only it: its work per step stays above its stage's others (which wait
 * for it).  The same job without the slow rank names nobody. */
START_TEST(test_launch_persistently_slow_rank_named) {
  char dir[64], path[300], logdir[300];
  mr_t_tmpdir(dir, sizeof dir);
  tiny_job(dir, 40, path, sizeof path);
  for (int slow = 0; slow < 2; slow++) {
    snprintf(logdir, sizeof logdir, "%s/logs%d", dir, slow);
    char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", "2", "--log-dir", logdir,
                    path, NULL};
    static char hook[] = "MESHRUN_TEST_SLOW=1:40";
    char *env[] = {hook, NULL};
    struct mr_tproc p;
    mr_t_spawn(&p, dir, argv, slow ? env : NULL);
    int code = mr_t_wait(&p, 120);
    char *err = mr_t_slurp(p.err_path);
    ck_assert_msg(code == 0, "exit %d:\n%s", code, err);
    char *named = strstr(err, "is persistently slow");
    if (slow) {
      ck_assert_msg(strstr(err, "rank 1 (node 0, here) is persistently slow") != NULL, "%s", err);
      ck_assert_msg(strstr(err, "rank 0 (node 0, here) is persistently slow") == NULL, "%s", err);
    } else {
      ck_assert_msg(named == NULL, "a rank named slow with none slowed:\n%s", err);
    }
    free(err);
  }
}
END_TEST

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The step time (ms) `meshrun plan JOB --nproc nproc --json` predicts, on
 * the cluster spec file `spec` when not NULL. */
static double plan_step_ms(const char *dir, const char *job, const char *nproc,
                           const char *spec) {
  char *argv[] = {(char *)mr_t_meshrun(), "plan", (char *)job, "--nproc", (char *)nproc,
                  "--json", spec != NULL ? "--cluster" : NULL, (char *)spec, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, NULL);
  ck_assert_int_eq(mr_t_wait(&p, 60), 0);
  char *plan = mr_t_slurp(p.out_path);
  const char *st = strstr(plan, "\"step_time_s\":");
  ck_assert_msg(st != NULL, "%s", plan);
  double ms = 1e3 * atof(st + strlen("\"step_time_s\":"));
  free(plan);
  return ms;
}

/* The closing summary sets the median step time measured (rank 0's steps
 * past the first two, as metrics.jsonl has them) beside the step time
 * `meshrun plan` predicts for the same job and ranks. */
START_TEST(test_launch_summary_measured_beside_predicted) {
  char dir[64], path[300], logdir[300];
  mr_t_tmpdir(dir, sizeof dir);
  tiny_job(dir, 9, path, sizeof path);
  snprintf(logdir, sizeof logdir, "%s/logs", dir);
  char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", "2", "--log-dir", logdir,
                  path, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, NULL);
  ck_assert_int_eq(mr_t_wait(&p, 60), 0);
  char *out = mr_t_slurp(p.out_path);
  const char *line = strstr(out, "meshrun: step time: median ");
  ck_assert_msg(line != NULL, "%s", out);
  double median, predicted, ratio;
  int n;
  ck_assert_int_eq(sscanf(line, "meshrun: step time: median %lf ms over %d steps, predicted %lf ms "
                                "(measured / predicted %lf)", &median, &n, &predicted, &ratio), 4);
  free(out);

  char mpath[340];
  snprintf(mpath, sizeof mpath, "%s/metrics.jsonl", logdir);
  char *m = mr_t_slurp(mpath);
  double steps[16];
  int k = 0;
  for (char *at = strstr(m, "\"step_time_s\": "); at != NULL && k < 16;
       at = strstr(at + 1, "\"step_time_s\": "))
    steps[k++] = 1e3 * atof(at + strlen("\"step_time_s\": "));
  free(m);
  ck_assert_int_eq(k, 9);
  qsort(steps + 2, 7, sizeof *steps, cmp_double);
  ck_assert_int_eq(n, 7);
  ck_assert_msg(fabs(median - steps[5]) <= 1e-3 * steps[5], "median %g, metrics say %g", median,
                steps[5]);

  double want = plan_step_ms(dir, path, "2", NULL);
  ck_assert_msg(fabs(predicted - want) <= 1e-3 * want, "predicted %g ms, plan says %g", predicted,
                want);
  /* both printed to 4 digits, the ratio to 2 decimals */
  ck_assert_msg(fabs(ratio - median / predicted) <= 0.006 + 2e-3 * ratio, "ratio %g of %g / %g",
                ratio, median, predicted);
}
END_TEST

/* The tiny job's plan on `world` ranks of this host (no cluster named:
 * the built-in spec) with `sharding` (JSON members) and dp fixed at world;
 * its chosen candidate into out. */
static void plan_tiny(const char *dir, int world, const char *sharding,
                      struct mr_plan_candidate *out) {
  char path[300], strategy[300];
  snprintf(strategy, sizeof strategy,
           ", \"strategy\": {\"auto_mode\": \"semi\", \"data_parallel\": {\"degree\": %d}%s}",
           world, sharding);
  tiny_job_with(dir, "plan.json", 2, world, strategy, path, sizeof path);
  struct mr_job job;
  ck_assert_msg(mr_job_load(path, &job) == 0, "%s", mr_error_message());
  struct mr_strategy_choice c;
  ck_assert_msg(mr_strategy_choose(&job, world, &c) == 0, "%s", mr_error_message());
  *out = c.chosen;
  mr_strategy_choice_close(&c);
  mr_job_close(&job);
}

/* More CPU ranks than the built-in spec's cores share them: each plans at
 * its share (2 cores, 4 ranks: half) of the compute and of the memory
 * bandwidth, the host's included, which is the same memory.  The
 * optimizer step by hand: ZeRO-1 over 4 ranks owns a quarter of the
 * 6 320 parameters (embedding and head 128 x 16 each, the layer's
 * 4 x 16 x 16 attention and 3 x 16 x 24 MLP weights, 3 norms of 16); in
 * place it moves 28 bytes a parameter at the halved memory bandwidth;
 * offloaded, 2 x 4 bytes across the halved host link besides, so the
 * search, free to offload, does not (it took offload when the host's
 * bandwidth was left whole: twice as fast an optimizer step, from the
 * same memory). */
START_TEST(test_launch_oversubscribed_cpu_ranks_plan_at_their_share) {
  char dir[64], path[400];
  mr_t_tmpdir(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/configs/clusters/cpu-local.json", getenv("MESHRUN_SOURCE_DIR"));
  struct mr_cluster spec;
  ck_assert_msg(mr_cluster_load(path, &spec) == 0, "%s", mr_error_message());
  int devices = spec.nodes * spec.devices_per_node, world = 2 * devices;
  double share = (double)devices / world, owned = 6320.0 / world;
  struct mr_plan_candidate in_place, offloaded, open;
  plan_tiny(dir, world, ", \"sharding\": {\"stage\": 1, \"offload\": false}", &in_place);
  plan_tiny(dir, world, ", \"sharding\": {\"stage\": 1, \"offload\": true}", &offloaded);
  plan_tiny(dir, world, "", &open);
  double want = owned * 28.0 / (spec.memory_bandwidth * share);
  ck_assert_msg(fabs(in_place.cost.optimizer_s - want) <= 1e-6 * want, "%g s, by hand %g s",
                in_place.cost.optimizer_s, want);
  want = owned * 8.0 / (spec.host_link_bandwidth * share) +
         owned * 28.0 / (spec.host_memory_bandwidth * share);
  ck_assert_msg(fabs(offloaded.cost.optimizer_s - want) <= 1e-6 * want, "%g s, by hand %g s",
                offloaded.cost.optimizer_s, want);
  ck_assert_int_eq(open.strategy.offload, 0);
  /* and `meshrun plan --nproc` plans those ranks the same way (not as a
   * second node of the spec) */
  char job[300], nproc[16];
  snprintf(job, sizeof job, "%s/plan.json", dir);
  snprintf(nproc, sizeof nproc, "%d", world);
  double plan_ms = plan_step_ms(dir, job, nproc, NULL);
  ck_assert_msg(fabs(plan_ms - 1e3 * open.cost.step_time_s) <= 1e-3 * plan_ms,
                "plan %g ms, launch %g ms", plan_ms, 1e3 * open.cost.step_time_s);
}
END_TEST

/* Launches the tiny job on nproc ranks with MESHRUN_CLUSTER cleared and
 * the cache under dir/cache: returns the spec the launcher says it planned
 * for (path into spec) and the step time it predicted (ms); its stdout and
 * stderr into *out and *err (the caller frees them). */
static double launch_measured(const char *dir, const char *job, const char *nproc, char *spec,
                              size_t n, char **out, char **err) {
  static char cache_env[200], cluster_env[] = "MESHRUN_CLUSTER=";
  char logdir[300];
  snprintf(cache_env, sizeof cache_env, "XDG_CACHE_HOME=%s/cache", dir);
  snprintf(logdir, sizeof logdir, "%s/logs", dir);
  char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", (char *)nproc, "--log-dir",
                  logdir, (char *)job, NULL};
  char *env[] = {cache_env, cluster_env, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, env);
  int code = mr_t_wait(&p, 60);
  *out = mr_t_slurp(p.out_path);
  *err = mr_t_slurp(p.err_path);
  ck_assert_msg(code == 0, "exit %d:\n%s\n%s", code, *out, *err);
  const char *at = strstr(*out, "meshrun: measured this machine: ");
  ck_assert_msg(at != NULL, "%s", *out);
  at += strlen("meshrun: measured this machine: ");
  snprintf(spec, n, "%.*s", (int)strcspn(at, "\n"), at);
  const char *line = strstr(*out, "meshrun: step time: median ");
  ck_assert_msg(line != NULL, "%s", *out);
  double median, predicted;
  int steps;
  ck_assert_int_eq(sscanf(line, "meshrun: step time: median %lf ms over %d steps, predicted "
                                "%lf ms", &median, &steps, &predicted), 3);
  return predicted;
}

/* A job that names no cluster spec is planned for this machine, measured
 * the first time (as `meshrun calibrate` measures it: one rank a core) and
 * cached under $XDG_CACHE_HOME/meshrun: the spec describes this host's
 * cores and memory, and the step the launcher predicts is the one `meshrun
 * plan --cluster` predicts on that file.  A second launch reads the cache
 * (the file as it was: measuring again would write other numbers and
 * another time); a cache file that does not load is measured again. */
START_TEST(test_launch_plans_for_this_machine_measured_once) {
  char dir[64], job[300], spec[600], again[600];
  mr_t_tmpdir(dir, sizeof dir);
  tiny_job(dir, 6, job, sizeof job);
  const char *nproc = mr_cpu_cores() >= 2 ? "2" : "1";
  char *out, *err;
  double predicted = launch_measured(dir, job, nproc, spec, sizeof spec, &out, &err);
  char prefix[200];
  snprintf(prefix, sizeof prefix, "%s/cache/meshrun/cluster-cpu-", dir);
  ck_assert_msg(strncmp(spec, prefix, strlen(prefix)) == 0, "%s", spec);
  ck_assert_msg(strstr(err, "measuring this machine's") != NULL, "%s", err);
  free(out), free(err);
  struct mr_cluster c;
  ck_assert_msg(mr_cluster_load(spec, &c) == 0, "%s", mr_error_message());
  ck_assert_int_eq(c.nodes, 1);
  ck_assert_int_eq(c.devices_per_node, mr_cpu_cores());
  ck_assert(c.host_is_device);
  ck_assert(c.peak_flops[MR_AMP_FP32] > 1e8);
  ck_assert(c.memory_bytes <= (double)mr_host_memory_bytes() / c.devices_per_node * 1.0001);
  double want = plan_step_ms(dir, job, nproc, spec);
  ck_assert_msg(fabs(predicted - want) <= 1e-3 * want, "predicted %g ms, plan on %s says %g",
                predicted, spec, want);

  char *before = mr_t_slurp(spec);
  launch_measured(dir, job, nproc, again, sizeof again, &out, &err);
  ck_assert_str_eq(again, spec);
  ck_assert_msg(strstr(err, "measuring this machine's") == NULL, "measured again:\n%s", err);
  char *after = mr_t_slurp(spec);
  ck_assert_str_eq(after, before);
  free(out), free(err), free(after), free(before);

  FILE *f = fopen(spec, "w");
  fputs("{\"name\": ", f);
  fclose(f);
  launch_measured(dir, job, nproc, again, sizeof again, &out, &err);
  ck_assert_str_eq(again, spec);
  ck_assert_msg(strstr(err, spec) != NULL && strstr(err, "measuring this machine again") != NULL,
                "%s", err);
  free(out), free(err);
  ck_assert_msg(mr_cluster_load(spec, &c) == 0, "%s", mr_error_message());
}
END_TEST

static Suite *launch_suite(void) {
  Suite *s = suite_create("launch");
  TCase *tc = mr_t_tcase("e2e");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_launch_selfcheck_four_ranks_fast);
  tcase_add_test(tc, test_launch_sigkill_detected_fast_and_group_restarts);
  tcase_add_test(tc, test_launch_no_restarts_left_names_rank_and_signal);
  tcase_add_test(tc, test_launch_sigstopped_worker_caught_by_heartbeat_timeout);
  tcase_add_test(tc, test_launch_paused_launcher_blames_no_rank);
  tcase_add_test(tc, test_launch_sigstopped_worker_named_by_hang_timeout);
  tcase_add_test(tc, test_launch_positions_of_a_thousand_ranks);
  tcase_add_test(tc, test_launch_no_orphans_after_launcher_sigkill);
  tcase_add_test(tc, test_launch_sockdir_sweep_takes_only_dead_folders);
  tcase_add_test(tc, test_launch_sigterm_stops_every_worker);
  tcase_add_test(tc, test_launch_worker_ignores_a_sigterm_not_from_its_launcher);
  tcase_add_test(tc, test_launch_bad_clients_refused_job_still_finishes);
  tcase_add_test(tc, test_launch_strangers_cannot_grow_the_launcher);
  tcase_add_test(tc, test_launch_hang_diagnosed_naming_rank_and_operation);
  tcase_add_test(tc, test_launch_killed_rank_leaves_no_shared_memory);
  tcase_add_test(tc, test_launch_bind_and_metrics_flags);
  tcase_add_test(tc, test_launch_persistently_slow_rank_named);
  tcase_add_test(tc, test_launch_summary_measured_beside_predicted);
  tcase_add_test(tc, test_launch_oversubscribed_cpu_ranks_plan_at_their_share);
  tcase_add_test(tc, test_launch_plans_for_this_machine_measured_once);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(launch_suite)
