/* test_nodes.c - `meshrun launch --nnodes N --node-rank K`: one job over
 * several launchers, as on several nodes.  Here both "nodes" are this
 * machine, on loopback; the ranks' traffic between them is forced onto
 * TCP (MESHRUN_COMM_TRANSPORT=tcp), as between hosts.  The reference is the
 * same job on one launcher with all the ranks. */
#include <arpa/inet.h>
#include <check.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check_main.h"
#include "common/error.h"
#include "launcher/slurm.h"
#include "testutil.h"

/* A free TCP port on loopback (bound, read, released). */
static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&sa, &len), 0);
  close(fd);
  return ntohs(sa.sin_port);
}

/* A LLaMA job of steps steps, global batch `batch`, under `strategy`,
 * checkpoints every 5 when ckpt; written to dir/NAME. */
static void job_s(const char *dir, const char *name, int steps, int ckpt, int batch,
                  const char *strategy) {
  char path[300];
  snprintf(path, sizeof path, "%s/train.bin", dir);
  if (access(path, F_OK) != 0)
    mr_t_write_tokens(path, 20000);
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fprintf(f,
          "{\"model\": {\"model_type\": \"llama\", \"vocab_size\": 128, \"hidden_size\": 32,"
          " \"intermediate_size\": 48, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
          " \"max_position_embeddings\": 16},"
          " \"data\": {\"train\": \"train.bin\"},"
          " \"train\": {\"steps\": %d, \"global_batch\": %d, \"seq_len\": 16, \"lr\": 0.003,"
          " \"seed\": 5}%s%s%s,"
          " \"strategy\": {%s}}\n",
          steps, batch, ckpt ? ", \"checkpoint\": {\"dir\": \"" : "", ckpt ? dir : "",
          ckpt ? "/ckpt\", \"save_interval_steps\": 5}" : "", strategy);
  fclose(f);
}

/* The job under data x tensor parallelism on 4 ranks. */
static void job(const char *dir, const char *name, int steps, int ckpt) {
  job_s(dir, name, steps, ckpt, 8,
        "\"auto_mode\": \"manual\", \"data_parallel\": {\"degree\": 2}, "
        "\"tensor_parallel\": {\"degree\": 2}");
}

/* "MESHRUN_WORKER=..." and "MESHRUN_TEST_SLOW=..." for the launchers
 * node() starts, or "". */
static char worker_env[400], slow_env[64];
/* their --nnodes and --nproc, and the re-planning threshold with slow_env */
static const char *nnodes_arg = "2", *nproc_arg = "2";
static const char *gain_env = "MESHRUN_REBALANCE_GAIN=0.15";

/* Starts the launcher of node `node` (of nnodes_arg, nproc_arg ranks each) for job file
 * `name`, its logs in dir/LOGS; extra flags after. */
static void node(struct mr_tproc *p, const char *dir, const char *name, int node, int port,
                 const char *token, const char *logs, char *const extra[]) {
  static char master[4][64], rank[4][8], logdir[4][300], tokf[4][300], jobf[4][300];
  snprintf(master[node], sizeof master[0], "127.0.0.1:%d", port);
  snprintf(rank[node], sizeof rank[0], "%d", node);
  snprintf(logdir[node], sizeof logdir[0], "%s/%s", dir, logs);
  snprintf(tokf[node], sizeof tokf[0], "%s/%s", dir, token);
  snprintf(jobf[node], sizeof jobf[0], "%s/%s", dir, name);
  char *argv[32] = {(char *)mr_t_meshrun(), "launch", "--nnodes", (char *)nnodes_arg,
                    "--node-rank", rank[node], "--nproc", (char *)nproc_arg, "--threads", "1",
                    "--master", master[node],
                    "--token-file", tokf[node], "--log-dir", logdir[node]};
  int n = 16;
  for (int i = 0; extra != NULL && extra[i] != NULL; i++)
    argv[n++] = extra[i];
  argv[n++] = jobf[node];
  argv[n] = NULL;
  char *env[5] = {"MESHRUN_COMM_TRANSPORT=tcp"};
  int e = 1;
  if (worker_env[0])
    env[e++] = worker_env;
  if (slow_env[0]) { /* and re-planning for it on */
    env[e++] = slow_env;
    env[e++] = (char *)gain_env;
  }
  env[e] = NULL;
  mr_t_spawn(p, dir, argv, env);
}

/* Runs job file `name` on one launcher with `nproc` ranks into dir/LOGS. */
static void one_node_n(const char *dir, const char *name, const char *logs, const char *nproc) {
  char logdir[300], jobf[300];
  snprintf(logdir, sizeof logdir, "%s/%s", dir, logs);
  snprintf(jobf, sizeof jobf, "%s/%s", dir, name);
  char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", (char *)nproc, "--threads", "1",
                  "--log-dir", logdir, jobf, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, NULL);
  int code = mr_t_wait(&p, 120);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(code == 0, "one node: exit %d\n%s", code, err);
  free(err);
}

static void one_node(const char *dir, const char *name, const char *logs) {
  one_node_n(dir, name, logs, "4");
}

static int losses(const char *dir, const char *logs, double *l, int max) {
  char path[300];
  snprintf(path, sizeof path, "%s/%s/metrics.jsonl", dir, logs);
  return mr_t_read_losses(path, l, max);
}

static void expect_exit(struct mr_tproc *p, int want, const char *who, double timeout) {
  int code = mr_t_wait(p, timeout);
  char *err = mr_t_slurp(p->err_path);
  ck_assert_msg(code == want, "%s: exit %d (expected %d)\n%s", who, code, want, err);
  free(err);
}

/* Waits for text in file; on timeout fails showing what node 0 (and `other`,
 * when not NULL) said. */
static void wait_text(const char *file, const char *text, struct mr_tproc *n0,
                      struct mr_tproc *other) {
  if (mr_t_wait_for_text(file, text, 60) >= 0)
    return;
  char *e0 = mr_t_slurp(n0->err_path), *e1 = mr_t_slurp(other ? other->err_path : "");
  ck_assert_msg(0, "no \"%s\" in %s within 60 s; node 0:\n%s\nthe other:\n%s", text, file, e0,
                e1);
}

static void stderr_has(struct mr_tproc *p, const char *text) {
  char *err = mr_t_slurp(p->err_path);
  ck_assert_msg(strstr(err, text) != NULL, "expected \"%s\" in:\n%s", text, err);
  free(err);
}

/* Two launchers of two ranks each train as one launcher of four: the same
 * loss at every step; node 0 wrote the token file for node 1 (mode 0600);
 * each node's ranks log on their own node and see torchrun's variables
 * for their place (a wrapper records each worker's environment). */
START_TEST(test_nodes_two_nodes_train_as_one) {
  char dir[64], path[300];
  mr_t_tmpdir(dir, sizeof dir);
  job(dir, "job.json", 8, 0);
  one_node(dir, "job.json", "one");
  snprintf(path, sizeof path, "%s/worker.sh", dir);
  FILE *f = fopen(path, "w");
  fprintf(f, "#!/bin/sh\nenv > \"$MESHRUN_LOG_DIR/env-$RANK\"\nexec %s\n", mr_t_worker());
  fclose(f);
  chmod(path, 0755);
  snprintf(worker_env, sizeof worker_env, "MESHRUN_WORKER=%s", path);
  int port = free_port();
  struct mr_tproc n0, n1;
  node(&n1, dir, "job.json", 1, port, "token", "n1", NULL); /* before node 0: it waits */
  node(&n0, dir, "job.json", 0, port, "token", "n0", NULL);
  worker_env[0] = '\0';
  expect_exit(&n0, 0, "node 0", 120);
  expect_exit(&n1, 0, "node 1", 30);
  for (int r = 0; r < 4; r++) {
    snprintf(path, sizeof path, "%s/n%d/env-%d", dir, r / 2, r);
    char *env = mr_t_slurp(path), want[64];
    snprintf(want, sizeof want, "\nRANK=%d\n", r);
    ck_assert_msg(strstr(env, want) != NULL, "%s: no %s", path, want + 1);
    snprintf(want, sizeof want, "\nLOCAL_RANK=%d\n", r % 2);
    ck_assert_msg(strstr(env, want) != NULL, "%s: no %s", path, want + 1);
    ck_assert(strstr(env, "\nWORLD_SIZE=4\n") != NULL);
    ck_assert(strstr(env, "\nLOCAL_WORLD_SIZE=2\n") != NULL);
    snprintf(want, sizeof want, "\nGROUP_RANK=%d\n", r / 2); /* torchrun's node index */
    ck_assert_msg(strstr(env, want) != NULL, "%s: no %s", path, want + 1);
    ck_assert(strstr(env, "\nGROUP_WORLD_SIZE=2\n") != NULL);
    ck_assert(strstr(env, "\nMASTER_ADDR=127.0.0.1\n") != NULL);
    snprintf(want, sizeof want, "\nMASTER_PORT=%d\n", port);
    ck_assert_msg(strstr(env, want) != NULL, "%s: no %s", path, want + 1);
    free(env);
  }
  double a[8], b[8];
  ck_assert_int_eq(losses(dir, "one", a, 8), 8);
  ck_assert_int_eq(losses(dir, "n0", b, 8), 8);
  for (int s = 0; s < 8; s++)
    ck_assert_msg(fabs(a[s] - b[s]) <= 1e-5 * fabs(a[s]), "step %d: one node %.7f, two %.7f",
                  s + 1, a[s], b[s]);
  struct stat st;
  snprintf(path, sizeof path, "%s/token", dir);
  ck_assert_int_eq(stat(path, &st), 0);
  ck_assert_int_eq(st.st_mode & 0777, 0600);
  const char *where[4] = {"n0", "n0", "n1", "n1"};
  for (int r = 0; r < 4; r++) {
    snprintf(path, sizeof path, "%s/%s/rank-%d.log", dir, where[r], r);
    ck_assert_msg(access(path, F_OK) == 0, "no %s", path);
    snprintf(path, sizeof path, "%s/%s/rank-%d.log", dir, where[r][1] == '0' ? "n1" : "n0", r);
    ck_assert_msg(access(path, F_OK) != 0, "%s: a rank logged on the other node", path);
  }
  stderr_has(&n0, "node 1 joined");
}
END_TEST

/* A rank of node 1 is killed mid-run: node 0 names it, both nodes restart
 * the group from the last checkpoint, and the run ends with the loss of a
 * run never interrupted. */
START_TEST(test_nodes_a_remote_rank_dies_and_both_nodes_restart) {
  enum { STEPS = 40 };
  char dir[64], metrics[300];
  mr_t_tmpdir(dir, sizeof dir);
  job(dir, "ref.json", STEPS, 0);
  one_node(dir, "ref.json", "one");
  job(dir, "job.json", STEPS, 1);
  int port = free_port();
  struct mr_tproc n0, n1;
  char *restarts[] = {"--max-restarts", "1", NULL};
  node(&n0, dir, "job.json", 0, port, "token", "n0", restarts);
  node(&n1, dir, "job.json", 1, port, "token", "n1", NULL);
  snprintf(metrics, sizeof metrics, "%s/n0/metrics.jsonl", dir);
  wait_text(metrics, "\"step\": 12,", &n0, &n1);
  pid_t kids[8];
  ck_assert_int_eq(mr_t_children(n1.pid, kids, 8), 2);
  kill(kids[1], SIGKILL);
  expect_exit(&n0, 0, "node 0", 120);
  expect_exit(&n1, 0, "node 1", 30);
  stderr_has(&n0, "(node 1, pid");
  stderr_has(&n0, "restarting the group (restart 1 of 1;");
  stderr_has(&n1, "starting ranks 2..3 of 4 (restart 1)");
  double a[STEPS], b[2 * STEPS];
  ck_assert_int_eq(losses(dir, "one", a, STEPS), STEPS);
  int n = losses(dir, "n0", b, 2 * STEPS);
  ck_assert_int_gt(n, STEPS); /* steps after the checkpoint ran twice */
  ck_assert_msg(fabs(a[STEPS - 1] - b[n - 1]) <= 1e-5 * fabs(a[STEPS - 1]),
                "final loss %.7f after the restart, %.7f uninterrupted", b[n - 1], a[STEPS - 1]);
}
END_TEST

/* Node 1 with another token is refused, and one whose token file never
 * appears says where it looked; node 0 waits for it no longer than the
 * join timeout and names the rank that never came. */
START_TEST(test_nodes_wrong_token_and_missing_node) {
  char dir[64], path[300];
  mr_t_tmpdir(dir, sizeof dir);
  job(dir, "job.json", 4, 0);
  snprintf(path, sizeof path, "%s/other", dir);
  FILE *f = fopen(path, "w");
  fputs("00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n", f);
  fclose(f);
  chmod(path, 0600);
  int port = free_port();
  struct mr_tproc n0, n1;
  char *join[] = {"--join-timeout", "3", NULL};
  node(&n0, dir, "job.json", 0, port, "token", "n0", join);
  node(&n1, dir, "job.json", 1, port, "other", "n1", join);
  expect_exit(&n1, 1, "node 1", 30);
  stderr_has(&n1, "refused our job token");
  /* a token file node 0 never writes (not the one it was given): named */
  char *soon[] = {"--join-timeout", "1", NULL};
  node(&n1, dir, "job.json", 1, port, "nowhere", "n1", soon);
  expect_exit(&n1, 1, "node 1", 30);
  stderr_has(&n1, "nowhere within 1 s: node 0 writes it there, so it must be on a file system "
                  "every node sees");
  expect_exit(&n0, 1, "node 0", 60);
  stderr_has(&n0, "node 1 never joined within 3.0 s, so its rank 2 did not register: no "
                  "launcher of node 1 reached this one");
}
END_TEST

/* A node with another rank count is refused, naming both counts. */
START_TEST(test_nodes_rank_count_mismatch) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  job(dir, "job.json", 4, 0);
  int port = free_port();
  struct mr_tproc n0, n1;
  char *join[] = {"--join-timeout", "3", NULL};
  char *one[] = {"--join-timeout", "3", "--nproc", "1", NULL};
  node(&n0, dir, "job.json", 0, port, "token", "n0", join);
  node(&n1, dir, "job.json", 1, port, "token", "n1", one);
  expect_exit(&n1, 1, "node 1", 30);
  stderr_has(&n1, "refused node 1");
  expect_exit(&n0, 1, "node 0", 60);
  stderr_has(&n0, "node 1 runs 1 ranks; every node runs 2");
}
END_TEST

/* Bad node flags are bad usage: exit 2 naming the flag; node 0's port
 * taken by another process is named with the way out. */
START_TEST(test_nodes_bad_flags) {
  char dir[64], jobf[300];
  mr_t_tmpdir(dir, sizeof dir);
  job(dir, "job.json", 4, 0);
  snprintf(jobf, sizeof jobf, "%s/job.json", dir);
  struct {
    char *argv[12];
    const char *says;
  } cases[] = {
      {{"--nnodes", "2", "--node-rank", "2", "--master", "127.0.0.1:1", "--token-file", "t"},
       "--node-rank 2: expected 0..1"},
      {{"--nnodes", "2", "--node-rank", "1"}, "expected --master HOST:PORT"},
      {{"--nnodes", "2", "--master", "127.0.0.1", "--token-file", "t"},
       "--master 127.0.0.1: expected HOST:PORT"},
      {{"--nnodes", "0"}, "--nnodes"},
      {{"--nnodes", "1000", "--nproc", "2000", "--master", "127.0.0.1:1", "--token-file", "t"},
       "2000000 ranks, expected at most 1000000"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char *argv[20] = {(char *)mr_t_meshrun(), "launch"};
    int n = 2;
    for (int k = 0; cases[i].argv[k] != NULL; k++)
      argv[n++] = cases[i].argv[k];
    argv[n++] = jobf;
    argv[n] = NULL;
    struct mr_tproc p;
    mr_t_spawn(&p, dir, argv, NULL);
    expect_exit(&p, 2, cases[i].says, 30);
    stderr_has(&p, cases[i].says);
  }
  /* node 0's port taken by another process: said, with the way out */
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET};
  socklen_t len = sizeof sa;
  ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  ck_assert_int_eq(listen(fd, 1), 0);
  ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&sa, &len), 0);
  struct mr_tproc n0;
  char *soon[] = {"--join-timeout", "1", NULL};
  node(&n0, dir, "job.json", 0, ntohs(sa.sin_port), "token", "n0", soon);
  expect_exit(&n0, 1, "node 0", 30);
  stderr_has(&n0, "address already in use (another process has the port: --master, or --bind, "
                  "can name another)");
  close(fd);
}
END_TEST

/* A scheduler's preemption signals every node: node 0 checkpoints and
 * stops the job, node 1 leaves it to node 0, and both exit 143 (stopped
 * by SIGTERM) with a checkpoint complete on disk. */
START_TEST(test_nodes_preemption_checkpoints_and_every_node_exits_143) {
  char dir[64], metrics[300];
  mr_t_tmpdir(dir, sizeof dir);
  job(dir, "job.json", 100000, 1);
  int port = free_port();
  struct mr_tproc n0, n1;
  node(&n0, dir, "job.json", 0, port, "token", "n0", NULL);
  node(&n1, dir, "job.json", 1, port, "token", "n1", NULL);
  snprintf(metrics, sizeof metrics, "%s/n0/metrics.jsonl", dir);
  wait_text(metrics, "\"step\": 7,", &n0, &n1);
  double t0 = mr_t_now();
  kill(n1.pid, SIGTERM);
  kill(n0.pid, SIGTERM);
  expect_exit(&n0, 128 + SIGTERM, "node 0", 30);
  expect_exit(&n1, 128 + SIGTERM, "node 1", 30);
  ck_assert_msg(mr_t_now() - t0 < 10.0, "took %.1f s", mr_t_now() - t0);
  stderr_has(&n0, "stopping for preemption");
  stderr_has(&n1, "node 0's launcher stops the job");
  /* the step it names is at least the one reached before the signal */
  char *err = mr_t_slurp(n0.err_path);
  const char *says = "the next launch resumes from step ";
  char *at = strstr(err, says);
  ck_assert_ptr_nonnull(at);
  int step = atoi(at + strlen(says));
  free(err);
  ck_assert_int_ge(step, 7);
  char marker[400];
  snprintf(marker, sizeof marker, "%s/ckpt/step-%08d/COMPLETE", dir, step);
  ck_assert_msg(access(marker, F_OK) == 0, "no complete checkpoint of step %d", step);
}
END_TEST

/* An elastic test's jobs in dir: the reference run on one launcher of 3
 * ranks (done here), and the job the nodes run (global batch 6, the
 * strategy left to the planner, checkpoints every 5). */
static void elastic_jobs(const char *dir, int steps) {
  job_s(dir, "ref.json", steps, 0, 6, "");
  one_node_n(dir, "ref.json", "one", "3");
  job_s(dir, "job.json", steps, 1, 6, "");
}

/* Starts node k of an elastic job of 2 to 3 one-rank nodes on dir/job.json;
 * node 0 gets `first`, the others wait up to 60 s for it. */
static void elastic_node(struct mr_tproc *p, const char *dir, int k, int port,
                         char *const first[]) {
  static char *others[] = {"--join-timeout", "60", NULL};
  static const char *logs[] = {"n0", "n1", "n2"};
  nnodes_arg = "2:3";
  nproc_arg = "1";
  node(p, dir, "job.json", k, port, "token", logs[k], k == 0 ? first : others);
  nnodes_arg = nproc_arg = "2";
}

/* Node 0's last loss is the reference run's last, within 1e-4. */
static void ends_as_uninterrupted(const char *dir, int steps, const char *what) {
  double a[128], b[256];
  ck_assert_int_le(steps, 128);
  ck_assert_int_eq(losses(dir, "one", a, steps), steps);
  int got = losses(dir, "n0", b, 2 * steps);
  ck_assert_int_gt(got, 0);
  ck_assert_msg(fabs(a[steps - 1] - b[got - 1]) <= 1e-4 * fabs(a[steps - 1]),
                "final loss %.7f %s, %.7f on three uninterrupted", b[got - 1], what,
                a[steps - 1]);
}

/* Elastic (--nnodes 2:3): node 2 is lost for good mid-run (its launcher
 * killed, its rank with it); node 0 waits the join timeout for it, then
 * plans again for the two nodes left, and both resume from the last
 * checkpoint to the loss of a run never interrupted. */
START_TEST(test_nodes_elastic_goes_on_without_a_lost_node) {
  enum { STEPS = 30 };
  char dir[64], metrics[300];
  mr_t_tmpdir(dir, sizeof dir);
  elastic_jobs(dir, STEPS);
  int port = free_port();
  struct mr_tproc n[3];
  char *first[] = {"--max-restarts", "1", "--join-timeout", "8", NULL};
  /* the others first: they wait for node 0, which waits for them */
  elastic_node(&n[1], dir, 1, port, NULL);
  elastic_node(&n[2], dir, 2, port, NULL);
  elastic_node(&n[0], dir, 0, port, first);
  wait_text(n[2].err_path, "starting ranks 2..2 of 3", &n[0], &n[2]);
  snprintf(metrics, sizeof metrics, "%s/n0/metrics.jsonl", dir);
  wait_text(metrics, "\"step\": 8,", &n[0], &n[2]);
  kill(n[2].pid, SIGKILL);
  expect_exit(&n[0], 0, "node 0", 120);
  expect_exit(&n[1], 0, "node 1", 30);
  stderr_has(&n[0], "the launcher of node 2 disconnected");
  stderr_has(&n[0], "2 of 3 nodes here: waiting up to 8 s for the others");
  stderr_has(&n[0], "re-planned for 2 ranks on 2 nodes");
  stderr_has(&n[1], "starting ranks 1..1 of 2 (restart 1)");
  ends_as_uninterrupted(dir, STEPS, "on two nodes after the loss");
}
END_TEST

/* Elastic, growing: the job starts on the two nodes there are (node 2 is
 * late: node 0 waits the join timeout for it, then plans for two); when
 * node 2 joins mid-run, a checkpoint is written and the group starts again
 * on all three, planned for three, without counting as a failure; the
 * loss at the end is that of a run on three never interrupted. */
START_TEST(test_nodes_elastic_takes_in_a_late_node) {
  enum { STEPS = 30 };
  char dir[64], metrics[300];
  mr_t_tmpdir(dir, sizeof dir);
  elastic_jobs(dir, STEPS);
  int port = free_port();
  struct mr_tproc n[3];
  char *first[] = {"--join-timeout", "6", NULL}; /* and no restarts allowed */
  elastic_node(&n[1], dir, 1, port, NULL); /* it waits for node 0 */
  elastic_node(&n[0], dir, 0, port, first);
  snprintf(metrics, sizeof metrics, "%s/n0/metrics.jsonl", dir);
  wait_text(metrics, "\"step\": 6,", &n[0], &n[1]);
  elastic_node(&n[2], dir, 2, port, NULL);
  expect_exit(&n[0], 0, "node 0", 120);
  expect_exit(&n[1], 0, "node 1", 30);
  expect_exit(&n[2], 0, "node 2", 30);
  stderr_has(&n[0], "re-planned for 2 ranks on 2 nodes");
  stderr_has(&n[0], "node 2 joined: writing a checkpoint");
  stderr_has(&n[0], "starting the group again with the nodes that have joined");
  stderr_has(&n[2], "starting ranks 2..2 of 3 (restart 1)");
  ends_as_uninterrupted(dir, STEPS, "after taking node 2 in");
}
END_TEST

/* The median step time node 0 logged for the steps group `restart` ran
 * from step `from` on. */
static double median_step(const char *dir, int restart, int from) {
  char path[300];
  snprintf(path, sizeof path, "%s/n0/metrics.jsonl", dir);
  char *text = mr_t_slurp(path), *save = NULL;
  double v[256];
  int n = 0;
  for (char *l = strtok_r(text, "\n", &save); l != NULL && n < 256; l = strtok_r(NULL, "\n", &save)) {
    char *st = strstr(l, "\"step\": "), *t = strstr(l, "\"step_time_s\": ");
    char *r = strstr(l, "\"restart\": ");
    if (st != NULL && t != NULL && r != NULL && atoi(r + 11) == restart && atoi(st + 8) >= from)
      v[n++] = atof(t + 15);
  }
  free(text);
  ck_assert_int_gt(n, 4);
  for (int a = 1; a < n; a++) /* insertion sort: a few dozen steps */
    for (int b = a; b > 0 && v[b - 1] > v[b]; b--) {
      double x = v[b];
      v[b] = v[b - 1], v[b - 1] = x;
    }
  return v[n / 2];
}

/* Elastic (--nnodes 2:3), node 2's rank 250 ms slower every step
 * (MESHRUN_TEST_SLOW=2:250): the three ranks wait for it at every step, so
 * node 0 leaves node 2 out — a checkpoint, then the group again on two
 * nodes, planned for them — and the steps run faster than before; node 2
 * idles until the job ends and exits with it; its launcher, started again,
 * is not taken back in (no regroup); the loss at the end is that of three
 * ranks never slowed.  Rank 0 is 30 ms slow a step as well (it stays the
 * fastest while node 2 is in), which leaves node 2 time to come back. */
START_TEST(test_nodes_elastic_leaves_out_a_slow_node) {
  enum { STEPS = 80 };
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  elastic_jobs(dir, STEPS);
  int port = free_port();
  struct mr_tproc n[3], again;
  snprintf(slow_env, sizeof slow_env, "MESHRUN_TEST_SLOW=2:250,0:30");
  char *first[] = {"--join-timeout", "30", NULL};
  elastic_node(&n[1], dir, 1, port, NULL);
  elastic_node(&n[2], dir, 2, port, NULL);
  elastic_node(&n[0], dir, 0, port, first);
  slow_env[0] = '\0';
  wait_text(n[0].err_path, "starting the group again without the slow node", &n[0], &n[2]);
  kill(n[2].pid, SIGKILL);
  expect_exit(&n[2], 128 + SIGKILL, "node 2", 30);
  elastic_node(&again, dir, 2, port, NULL);
  wait_text(n[0].err_path, "outside the running group (left out for running slow)", &n[0],
            &again);
  expect_exit(&n[0], 0, "node 0", 180);
  expect_exit(&n[1], 0, "node 1", 30);
  expect_exit(&again, 0, "node 2, started again", 30);
  stderr_has(&n[0], "node 2 runs slow");
  stderr_has(&n[0], "re-planned for 2 ranks on 2 nodes");
  char *err = mr_t_slurp(n[0].err_path);
  ck_assert_msg(strstr(err, "node 2 joined: writing a checkpoint") == NULL, "%s", err);
  free(err);
  err = mr_t_slurp(again.err_path);
  ck_assert_msg(strstr(err, "starting ranks") == NULL, "%s", err);
  free(err);
  ends_as_uninterrupted(dir, STEPS, "on two nodes after leaving the slow one out");
  double before = median_step(dir, 0, 3), after = median_step(dir, 1, 35);
  ck_assert_msg(after < 0.8 * before, "step %.2f ms without node 2, %.2f ms with it",
                after * 1e3, before * 1e3);
}
END_TEST

/* Elastic (--nnodes 1:2), node 1's rank 3x slower at its work
 * (MESHRUN_TEST_SLOW=1:x3): leaving node 1 out would save about a third of
 * the step, giving it fewer micro-batches about half (docs/PLANNER.md), so
 * node 0 re-balances the micro-batches and keeps the node; the loss at the
 * end is that of two ranks never slowed.  (A node slow by a fixed time a
 * step is left out: test_nodes_elastic_leaves_out_a_slow_node.)  The
 * threshold is 5%: a sanitized build slows the rest of the step too, so
 * the rank measures under 2x slow, where leaving it out saves nothing and
 * a smaller share saves under a fifth of the step. */
START_TEST(test_nodes_elastic_slow_node_keeps_a_smaller_share) {
  enum { STEPS = 60 };
  char dir[64], ckpt[300];
  mr_t_tmpdir(dir, sizeof dir);
  snprintf(ckpt, sizeof ckpt, "%s/ckpt", dir);
  static const char dp2[] = "\"data_parallel\": {\"degree\": 2}";
  mr_t_write_llama8_job(dir, "ref.json", STEPS, NULL, dp2);
  mr_t_write_llama8_job(dir, "job.json", STEPS, ckpt, dp2);
  one_node_n(dir, "ref.json", "one", "2");
  int port = free_port();
  struct mr_tproc n[2];
  char *others[] = {"--join-timeout", "60", NULL};
  snprintf(slow_env, sizeof slow_env, "MESHRUN_TEST_SLOW=1:x3");
  nnodes_arg = "1:2";
  nproc_arg = "1";
  gain_env = "MESHRUN_REBALANCE_GAIN=0.05";
  node(&n[1], dir, "job.json", 1, port, "token", "n1", others);
  node(&n[0], dir, "job.json", 0, port, "token", "n0", NULL);
  nnodes_arg = nproc_arg = "2";
  gain_env = "MESHRUN_REBALANCE_GAIN=0.15";
  slow_env[0] = '\0';
  expect_exit(&n[0], 0, "node 0", 180);
  expect_exit(&n[1], 0, "node 1", 30);
  stderr_has(&n[0], "the data-parallel ranks run unbalanced");
  stderr_has(&n[0], "starting the group again with the data-parallel ranks' micro-batches "
                    "re-balanced");
  char *err = mr_t_slurp(n[0].err_path);
  ck_assert_msg(strstr(err, "runs slow:") == NULL, "left the node out:\n%s", err);
  free(err);
  ends_as_uninterrupted(dir, STEPS, "with node 1's share re-balanced");
}
END_TEST

/* Slurm host lists: the first host, by hand; malformed ones refused. */
START_TEST(test_nodes_slurm_first_host) {
  static const char *const good[][2] = {
      {"gpu[07-09,12],cpu3", "gpu07"}, {"node1", "node1"},         {"a[1-2]b[03]", "a1b03"},
      {"rack1-[2-3]", "rack1-2"},      {"127.0.0.[1-2]", "127.0.0.1"}, {"n[5],m[1-9]", "n5"}};
  char host[64];
  for (int i = 0; i < 6; i++) {
    ck_assert_msg(mr_slurm_first_host(good[i][0], host, sizeof host) == 0, "%s: %s", good[i][0],
                  mr_error_message());
    ck_assert_str_eq(host, good[i][1]);
  }
  static const char *const bad[] = {"", ",x", "[", "n[", "n[]", "n[a-b]", "n[1-2", "n o", "n[1]]"};
  for (int i = 0; i < 9; i++) {
    ck_assert_msg(mr_slurm_first_host(bad[i], host, sizeof host) == MR_EINVAL, "%s accepted",
                  bad[i]);
    ck_assert_msg(strstr(mr_error_message(), "Slurm host list") != NULL ||
                      strstr(mr_error_message(), "host") != NULL,
                  "%s", mr_error_message());
  }
  ck_assert_int_eq(mr_slurm_first_host("averylonghostname", host, 8), MR_EINVAL);
}
END_TEST

/* A per-node count list read as Slurm writes it, node by node. */
START_TEST(test_nodes_slurm_per_node_counts) {
  static const struct {
    const char *list;
    long counts[6];
    int n;
  } good[] = {{"4", {4}, 1}, {"4(x3)", {4, 4, 4}, 3}, {"2(x2),1,8(x2)", {2, 2, 1, 8, 8}, 5},
              {"0,16", {0, 16}, 2}};
  for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
    for (int k = 0; k < good[i].n; k++) {
      long c = -1;
      ck_assert_msg(mr_slurm_per_node(good[i].list, k, &c) == 0, "%s node %d: %s",
                    good[i].list, k, mr_error_message());
      ck_assert_int_eq(c, good[i].counts[k]);
    }
    long c;
    ck_assert_int_eq(mr_slurm_per_node(good[i].list, good[i].n, &c), MR_EINVAL);
    ck_assert_msg(strstr(mr_error_message(), "no count for node") != NULL, "%s",
                  mr_error_message());
  }
  static const char *const bad[] = {"", "x", "4(2)", "4(x)", "4(x0)", "4(x2", "4,,2", "4;2",
                                    "-1", "4(x2)5"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    long c;
    ck_assert_msg(mr_slurm_per_node(bad[i], 3, &c) == MR_EINVAL, "\"%s\" accepted", bad[i]);
  }
}
END_TEST

/* Writes file dir/name with text and mode. */
static void put_file(const char *dir, const char *name, const char *text, mode_t mode) {
  char path[300];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fputs(text, f);
  fclose(f);
  chmod(path, mode);
}

static int exists(const char *dir, const char *name) {
  char path[300];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  return access(path, F_OK) == 0;
}

/* Node 0 of job 9's step 2 removes the token files of jobs squeue no longer
 * lists and of job 9's earlier steps, and nothing else: not live jobs',
 * not later steps', not another cluster's, not other files; where squeue
 * cannot say, only the earlier steps'. */
START_TEST(test_nodes_slurm_stale_tokens_removed) {
  char dir[64], bin[100], path[4200];
  mr_t_tmpdir(dir, sizeof dir);
  snprintf(bin, sizeof bin, "%s/bin", dir);
  mkdir(bin, 0700);
  /* squeue as Slurm's answers: this user's live jobs, one id a line */
  put_file(bin, "squeue", "#!/bin/sh\nprintf '5\\n  7 \\n9\\n'\n", 0700);
  snprintf(path, sizeof path, "%s:%s", bin, getenv("PATH"));
  setenv("PATH", path, 1);
  static const char *const names[] = {
      "slurm-c1-9.1.token", "slurm-c1-9.2.token", "slurm-c1-9.3.token", "slurm-c1-6.0.token",
      "slurm-c1-6.token",   "slurm-c1-5.0.token", "slurm-c1-7.4.token", "slurm-c2-6.0.token",
      "slurm-6.0.token",    "notes.txt"};
  static const int removed[] = {1, 0, 0, 1, 1, 0, 0, 0, 0, 0};
  for (int i = 0; i < 10; i++)
    put_file(dir, names[i], "x\n", 0600);
  struct mr_slurm_step s = {.job_id = 9, .step_id = 2};
  snprintf(s.token_file, sizeof s.token_file, "%s/slurm-c1-9.2.token", dir);
  setenv("SLURM_CLUSTER_NAME", "c1", 1);
  ck_assert_int_eq(mr_slurm_clean_tokens(&s), 3);
  for (int i = 0; i < 10; i++)
    ck_assert_msg(exists(dir, names[i]) == !removed[i], "%s %s", names[i],
                  removed[i] ? "kept" : "removed");
  /* a controller that cannot be reached: the live jobs unknown */
  put_file(bin, "squeue", "#!/bin/sh\necho 'slurm_load_jobs error' >&2\nexit 1\n", 0700);
  put_file(dir, "slurm-c1-6.0.token", "x\n", 0600);
  put_file(dir, "slurm-c1-9.0.token", "x\n", 0600);
  ck_assert_int_eq(mr_slurm_clean_tokens(&s), 1);
  ck_assert(exists(dir, "slurm-c1-6.0.token"));
  ck_assert(!exists(dir, "slurm-c1-9.0.token"));
  unsetenv("SLURM_CLUSTER_NAME");
}
END_TEST

static void slurm_env(const char *const *kv) {
  static const char *const all[] = {"SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_ID",
                                    "SLURM_STEPID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
                                    "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS",
                                    "SLURM_NTASKS", "SLURM_NODEID", "SLURM_STEP_NODELIST",
                                    "SLURM_JOB_NODELIST", "SLURM_NODELIST",
                                    "SLURM_CLUSTER_NAME", "SLURM_CPUS_PER_TASK",
                                    "SLURM_CPUS_ON_NODE", "SLURM_JOB_CPUS_PER_NODE",
                                    "SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++)
    unsetenv(all[i]);
  for (int i = 0; kv[i] != NULL; i += 2)
    setenv(kv[i], kv[i + 1], 1);
}

/* A step's environment read as the flags it stands for; a step that is
 * not one launcher a node refused naming why. */
START_TEST(test_nodes_slurm_step_environment) {
  struct mr_slurm_step s;
  setenv("HOME", "/home/u", 1);
  slurm_env((const char *const[]){NULL});
  ck_assert_int_eq(mr_slurm_step(&s), 0);
  ck_assert_int_eq(s.in_step, 0);
  ck_assert_int_eq(s.in_job_nodes, 0);
  /* the batch script: a job of 4 nodes, not a step */
  slurm_env((const char *const[]){"SLURM_JOB_ID", "77", "SLURM_NNODES", "4", NULL});
  ck_assert_int_eq(mr_slurm_step(&s), 0);
  ck_assert_int_eq(s.in_step, 0);
  ck_assert_int_eq(s.in_job_nodes, 4);
  /* srun --ntasks-per-node=1 on 3 nodes, this one the second */
  slurm_env((const char *const[]){"SLURM_JOB_ID", "123456", "SLURM_STEP_ID", "0",
                                   "SLURM_NNODES", "8", "SLURM_STEP_NUM_NODES", "3",
                                   "SLURM_STEP_NUM_TASKS", "3", "SLURM_NODEID", "1",
                                   "SLURM_JOB_NODELIST", "x[1-8]",
                                   "SLURM_STEP_NODELIST", "gpu[010-012]", NULL});
  ck_assert_int_eq(mr_slurm_step(&s), 0);
  ck_assert_int_eq(s.in_step, 1);
  ck_assert_int_eq(s.nnodes, 3);
  ck_assert_int_eq(s.node_rank, 1);
  ck_assert_str_eq(s.master, "gpu010:23456"); /* 20000 + 123456 % 20000 */
  ck_assert_str_eq(s.token_file, "/home/u/.cache/meshrun/slurm-123456.0.token");
  ck_assert_str_eq(s.host, "gpu010");
  ck_assert_str_eq(s.host_from, "SLURM_STEP_NODELIST \"gpu[010-012]\"");
  ck_assert_int_eq(s.cpus, 0); /* the allocation said nothing */
  ck_assert_int_eq(s.gpus, -1);
  /* what it gives the node: a task's CPUs before the node's, the node's
   * entry of the job's per-node list, the GPUs as a count or a list */
  slurm_env((const char *const[]){"SLURM_JOB_ID", "5", "SLURM_STEP_ID", "3",
                                   "SLURM_STEP_NUM_NODES", "3", "SLURM_NODEID", "2",
                                   "SLURM_STEP_NODELIST", "n[1-3]", "SLURM_CLUSTER_NAME", "c1",
                                   "SLURM_JOB_CPUS_PER_NODE", "8(x2),6", "SLURM_STEP_GPUS",
                                   "0,2,3", NULL});
  ck_assert_int_eq(mr_slurm_step(&s), 0);
  ck_assert_int_eq(s.cpus, 6);
  ck_assert_str_eq(s.cpus_var, "SLURM_JOB_CPUS_PER_NODE");
  ck_assert_int_eq(s.gpus, 3);
  ck_assert_str_eq(s.token_file, "/home/u/.cache/meshrun/slurm-c1-5.3.token");
  setenv("SLURM_CPUS_ON_NODE", "4", 1);
  setenv("SLURM_GPUS_ON_NODE", "1", 1);
  ck_assert_int_eq(mr_slurm_step(&s), 0);
  ck_assert_int_eq(s.cpus, 4);
  ck_assert_int_eq(s.gpus, 1);
  setenv("SLURM_CPUS_PER_TASK", "2", 1);
  ck_assert_int_eq(mr_slurm_step(&s), 0);
  ck_assert_int_eq(s.cpus, 2);
  ck_assert_str_eq(s.cpus_var, "SLURM_CPUS_PER_TASK");
  /* the batch script's shell owns all of the node's: not a task's */
  unsetenv("SLURM_STEP_ID");
  ck_assert_int_eq(mr_slurm_step(&s), 0);
  ck_assert_int_eq(s.cpus, 4);
  setenv("SLURM_CPUS_ON_NODE", "four", 1);
  ck_assert_int_eq(mr_slurm_step(&s), MR_EINVAL);
  ck_assert_msg(strstr(mr_error_message(), "SLURM_CPUS_ON_NODE is \"four\"") != NULL, "%s",
                mr_error_message());
  /* srun -n 16 on 2 nodes: a launcher a GPU */
  slurm_env((const char *const[]){"SLURM_JOB_ID", "9", "SLURM_STEP_ID", "1",
                                   "SLURM_STEP_NUM_NODES", "2", "SLURM_STEP_NUM_TASKS", "16",
                                   "SLURM_NODEID", "0", "SLURM_STEP_NODELIST", "n[1-2]", NULL});
  ck_assert_int_eq(mr_slurm_step(&s), MR_EINVAL);
  ck_assert_msg(strstr(mr_error_message(), "16 tasks on 2 nodes") != NULL &&
                    strstr(mr_error_message(), "--ntasks-per-node=1") != NULL,
                "%s", mr_error_message());
  /* a node id past the step's nodes; a malformed count; a bad host list */
  slurm_env((const char *const[]){"SLURM_JOB_ID", "9", "SLURM_STEP_ID", "1",
                                   "SLURM_STEP_NUM_NODES", "2", "SLURM_NODEID", "2",
                                   "SLURM_STEP_NODELIST", "n[1-2]", NULL});
  ck_assert_int_eq(mr_slurm_step(&s), MR_EINVAL);
  ck_assert_msg(strstr(mr_error_message(), "SLURM_NODEID is \"2\"") != NULL, "%s",
                mr_error_message());
  slurm_env((const char *const[]){"SLURM_JOB_ID", "9x", NULL});
  ck_assert_int_eq(mr_slurm_step(&s), MR_EINVAL);
  ck_assert_msg(strstr(mr_error_message(), "SLURM_JOB_ID") != NULL, "%s", mr_error_message());
  slurm_env((const char *const[]){"SLURM_JOB_ID", "9", "SLURM_STEP_ID", "1",
                                   "SLURM_STEP_NUM_NODES", "2", "SLURM_NODEID", "0",
                                   "SLURM_STEP_NODELIST", "n[1-", NULL});
  ck_assert_int_eq(mr_slurm_step(&s), MR_EINVAL);
  ck_assert_msg(strstr(mr_error_message(), "SLURM_STEP_NODELIST") != NULL, "%s",
                mr_error_message());
}
END_TEST

/* Two launchers of 2 ranks each on dir/job.json, node k with its own
 * environment env[k] and the flags `flags` besides --nproc, train as one
 * launcher of 4 ranks: the same loss at every step.  Returns what node 1
 * printed. */
static char *pair_as_one(const char *dir, char *env[2][10], char *const flags[]) {
  job(dir, "job.json", 6, 0);
  one_node(dir, "job.json", "one");
  struct mr_tproc n[2];
  for (int k = 1; k >= 0; k--) { /* node 1 first: it waits for node 0 */
    static char logdir[2][300], jobf[300];
    snprintf(logdir[k], sizeof logdir[k], "%s/n%d", dir, k);
    snprintf(jobf, sizeof jobf, "%s/job.json", dir);
    char *argv[24] = {(char *)mr_t_meshrun(), "launch", "--nproc", "2", "--threads", "1",
                      "--log-dir", logdir[k]};
    int a = 8;
    for (int i = 0; flags[i] != NULL; i++)
      argv[a++] = flags[i];
    argv[a++] = jobf;
    argv[a] = NULL;
    mr_t_spawn(&n[k], dir, argv, env[k]);
  }
  expect_exit(&n[0], 0, "node 0", 120);
  expect_exit(&n[1], 0, "node 1", 30);
  stderr_has(&n[1], "node 1: starting ranks 2..3 of 4");
  double a[6], b[6];
  ck_assert_int_eq(losses(dir, "one", a, 6), 6);
  ck_assert_int_eq(losses(dir, "n0", b, 6), 6);
  for (int s = 0; s < 6; s++)
    ck_assert_msg(fabs(a[s] - b[s]) <= 1e-5 * fabs(a[s]), "step %d: one node %.7f, two %.7f",
                  s + 1, a[s], b[s]);
  return mr_t_slurp(n[1].out_path);
}

/* Two launchers given nothing but --nproc inside a (simulated) Slurm step
 * of 2 nodes train as one launcher of 4 ranks: the node count, each one's
 * index, node 0's address and port and the token file all from the step,
 * which node 1 says; node 0 removes the token file at the end. */
START_TEST(test_nodes_slurm_step_needs_no_flags) {
  char dir[64], home[200], ids[32], list[] = "SLURM_STEP_NODELIST=127.0.0.[1-2]";
  mr_t_tmpdir(dir, sizeof dir);
  /* a job id whose port is free */
  long id = 0;
  for (long j = getpid() % MR_SLURM_PORT_SPAN; id == 0; j = (j + 7) % MR_SLURM_PORT_SPAN) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)(MR_SLURM_PORT_BASE + j))};
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0)
      id = j + MR_SLURM_PORT_SPAN;
    close(fd);
  }
  snprintf(home, sizeof home, "HOME=%s", dir);
  snprintf(ids, sizeof ids, "SLURM_JOB_ID=%ld", id);
  char *env[2][10] = {{"MESHRUN_COMM_TRANSPORT=tcp", home, ids, "SLURM_STEP_ID=0",
                       "SLURM_STEP_NUM_NODES=2", "SLURM_STEP_NUM_TASKS=2", "SLURM_NODEID=0",
                       list, NULL},
                      {"MESHRUN_COMM_TRANSPORT=tcp", home, ids, "SLURM_STEP_ID=0",
                       "SLURM_STEP_NUM_NODES=2", "SLURM_STEP_NUM_TASKS=2", "SLURM_NODEID=1",
                       list, NULL}};
  /* files a launcher killed before it could remove them left: one of an
   * earlier controller that gave out the same job id (node 1 may read it
   * before node 0 replaces it) and one of an older meshrun */
  char tok[300], old[300];
  snprintf(tok, sizeof tok, "%s/.cache", dir);
  mkdir(tok, 0700);
  snprintf(tok, sizeof tok, "%s/.cache/meshrun", dir);
  mkdir(tok, 0700);
  snprintf(tok, sizeof tok, "%s/.cache/meshrun/slurm-%ld.0.token", dir, id);
  snprintf(old, sizeof old, "%s/.cache/meshrun/slurm-%ld.token", dir, id);
  for (int i = 0; i < 2; i++) {
    FILE *f = fopen(i == 0 ? tok : old, "w");
    fputs("00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n", f);
    fclose(f);
    chmod(i == 0 ? tok : old, 0600);
  }
  char *none[] = {NULL};
  char *out = pair_as_one(dir, env, none), want[500];
  snprintf(want, sizeof want, "meshrun: Slurm job %ld: node 1 of 2, node 0 at 127.0.0.1:%ld, "
           "job token in %s", id, MR_SLURM_PORT_BASE + id % MR_SLURM_PORT_SPAN, tok);
  ck_assert_msg(strstr(out, want) != NULL, "no \"%s\" in:\n%s", want, out);
  free(out);
  /* the job's token file went with it, the stale ones before it; the
   * folder stays */
  ck_assert_int_ne(access(tok, F_OK), 0);
  ck_assert_int_ne(access(old, F_OK), 0);
  *strrchr(tok, '/') = '\0';
  ck_assert_int_eq(access(tok, F_OK), 0);
}
END_TEST

/* Pods of a Kubernetes indexed Job run the same command: each one's
 * JOB_COMPLETION_INDEX is its node index. */
START_TEST(test_nodes_indexed_job_pod_is_the_node) {
  char dir[64], master[64], token[200];
  mr_t_tmpdir(dir, sizeof dir);
  snprintf(master, sizeof master, "127.0.0.1:%d", free_port());
  snprintf(token, sizeof token, "%s/token", dir);
  char *env[2][10] = {{"MESHRUN_COMM_TRANSPORT=tcp", "JOB_COMPLETION_INDEX=0", NULL},
                      {"MESHRUN_COMM_TRANSPORT=tcp", "JOB_COMPLETION_INDEX=1", NULL}};
  char *flags[] = {"--nnodes", "2", "--master", master, "--token-file", token, NULL};
  free(pair_as_one(dir, env, flags));
}
END_TEST

static Suite *nodes_suite(void) {
  Suite *s = suite_create("nodes");
  TCase *tc = mr_t_tcase("nodes");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_nodes_two_nodes_train_as_one);
  tcase_add_test(tc, test_nodes_a_remote_rank_dies_and_both_nodes_restart);
  tcase_add_test(tc, test_nodes_preemption_checkpoints_and_every_node_exits_143);
  tcase_add_test(tc, test_nodes_elastic_goes_on_without_a_lost_node);
  tcase_add_test(tc, test_nodes_elastic_takes_in_a_late_node);
  tcase_add_test(tc, test_nodes_elastic_leaves_out_a_slow_node);
  tcase_add_test(tc, test_nodes_elastic_slow_node_keeps_a_smaller_share);
  tcase_add_test(tc, test_nodes_wrong_token_and_missing_node);
  tcase_add_test(tc, test_nodes_rank_count_mismatch);
  tcase_add_test(tc, test_nodes_bad_flags);
  tcase_add_test(tc, test_nodes_slurm_first_host);
  tcase_add_test(tc, test_nodes_slurm_per_node_counts);
  tcase_add_test(tc, test_nodes_slurm_stale_tokens_removed);
  tcase_add_test(tc, test_nodes_slurm_step_environment);
  tcase_add_test(tc, test_nodes_slurm_step_needs_no_flags);
  tcase_add_test(tc, test_nodes_indexed_job_pod_is_the_node);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(nodes_suite)
