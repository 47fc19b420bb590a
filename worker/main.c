/* main.c - `meshrun-worker`: one rank.  Started by `meshrun launch` (or by
 * hand on a remote node with MESHRUN_COORD and MESHRUN_TOKEN_FILE), it
 * registers with the coordinator, receives the plan, runs it and reports. */
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "common/auth.h"
#include "common/error.h"
#include "common/log.h"
#include "common/job.h"
#include "common/tunable.h"
#include "compiler/plugin.h"
#include "worker/bootstrap_rpc.h"
#include "worker/calibrate.h"
#include "worker/client.h"
#include "worker/logits.h"
#include "worker/sample.h"
#include "worker/comm/comm.h"
#include "worker/device.h"
#include "worker/dist_train.h"
#include "worker/exec_extra.h"
#include "worker/backend/backend.h"
#include "worker/selfcheck.h"
#include "worker/trace.h"

static struct mr_client client;

static pid_t launcher_pid; // the launcher that started us; 0: none

/* A stop from the launcher.  A SIGTERM another process sends is a
 * scheduler's to every process of its step (Slurm's scancel, systemd's
 * control group): the launcher got its own and decides, writing a
 * checkpoint first, so a rank does not stop under it. */
static void on_sigterm(int sig, siginfo_t *info, void *ctx) {
  (void)sig, (void)ctx;
  if (launcher_pid > 0 && info != NULL && info->si_code == SI_USER &&
      info->si_pid != launcher_pid)
    return;
  atomic_store(&client.stop_requested, 1);
}

static int env_int(const char *name, int def) {
  const char *v = getenv(name);
  if (v == NULL || v[0] == '\0')
    return def;
  char *end;
  long x = strtol(v, &end, 10);
  return *end == '\0' ? (int)x : def;
}

/* Dies with the launcher: the kernel sends SIGKILL when the parent exits;
 * a launcher that died before the prctl is caught by the pid check. */
static void bind_to_launcher(void) {
  int launcher = env_int("MESHRUN_LAUNCHER_PID", 0);
  if (launcher <= 0)
    return;
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != launcher) {
    fprintf(stderr, "meshrun-worker: the launcher (pid %d) is gone\n", launcher);
    _exit(1);
  }
  launcher_pid = launcher;
}

static int read_token(uint8_t token[MR_TOKEN_BYTES]) {
  const char *file = getenv("MESHRUN_TOKEN_FILE");
  if (file != NULL && file[0] != '\0')
    return mr_auth_token_read_file(file, token);
  int fd = env_int("MESHRUN_TOKEN_FD", -1);
  if (fd < 0)
    return mr_error_set(MR_EAUTH, "no job token: set MESHRUN_TOKEN_FILE (a 0600 file) "
                                  "or start the worker with meshrun launch");
  int rc = mr_auth_token_read_fd(fd, token);
  close(fd); /* the job's children never see it */
  return rc;
}

static const char *comm_blocked(void *ctx, char *buf, size_t len) {
  struct mr_comm *comm = ctx;
  return comm->ops->blocked(comm, buf, len);
}

/* The coordinator's clock against ours, when the plan asks for a trace. */
static struct {
  int64_t offset_ns;
  uint64_t error_ns;
} trace_clock;

/* The plan's trace of chosen steps, on the coordinator's clock; NULL when
 * none is asked for (or none can be made: training goes on). */
static struct mr_trace *plan_trace(const struct mr_client *c, const Meshrun__Plan *plan) {
  if (plan->trace_dir == NULL || plan->trace_dir[0] == '\0')
    return NULL;
  char host[256] = "";
  gethostname(host, sizeof host - 1);
  struct mr_trace_opts o = {
      .dir = plan->trace_dir,
      .rank = c->rank,
      .world_size = c->world_size,
      .first = plan->trace_first,
      .last = plan->trace_last,
      .clock_offset_ns = trace_clock.offset_ns,
      .clock_error_ns = trace_clock.error_ns,
      .host = host,
      .max_mb = (int)mr_tunable_int(MR_TUNABLE_TRACE_MAX_MB),
  };
  return mr_trace_new(&o);
}

/* A training plan: the job travels in the plan as its canonical text, with
 * every path already resolved by the launcher. */
static int run_training(struct mr_client *c) {
  const Meshrun__Plan *plan = c->plan;
  char *text = malloc(plan->body.len + 1);
  if (text == NULL)
    return MR_ENOMEM;
  memcpy(text, plan->body.data, plan->body.len);
  text[plan->body.len] = '\0';
  struct mr_job job;
  int rc = mr_job_parse(text, "the plan's job", "/", &job);
  free(text);
  MR_TRY(rc);
  if ((rc = mr_plugin_load_job(&job)) < 0) { /* before the program is lowered */
    mr_job_close(&job);
    return rc;
  }
  const char *log_dir = getenv("MESHRUN_LOG_DIR");
  if (log_dir == NULL || log_dir[0] == '\0')
    log_dir = ".";
  char weights[4096];
  snprintf(weights, sizeof weights, "%s/model.safetensors", log_dir);
  /* the device first (a GPU's communicator uses the device opened before
   * it), then the comm backend that goes with it */
  const char *kind = mr_tunable_str(MR_TUNABLE_DEVICE);
  if (kind == NULL || kind[0] == '\0')
    kind = "cpu";
  enum mr_amp_mode amp = job.strategy.amp_dtype == MR_AMP_BF16   ? MR_AMP_ROUND_BF16
                         : job.strategy.amp_dtype == MR_AMP_FP16 ? MR_AMP_ROUND_F16
                                                                  : MR_AMP_NONE;
  struct mr_backend *be = NULL;
  const struct mr_comm_ops *comm_ops = NULL;
  rc = mr_device_open(kind, c->local_rank, (int)mr_tunable_int(MR_TUNABLE_THREADS), amp, &be);
  if (rc == 0)
    rc = mr_device_comm_ops(kind, &comm_ops);
  if (rc < 0) {
    mr_backend_free(be);
    mr_job_close(&job);
    return rc;
  }
  struct mr_comm *comm = NULL;
  if (c->world_size > 1) {
    struct mr_bootstrap_rpc boot;
    mr_bootstrap_rpc_init(&boot, c);
    rc = comm_ops->open(&boot.bs, &comm);
    if (rc < 0) {
      if (comm != NULL)
        comm->ops->close(comm);
      mr_backend_free(be);
      mr_job_close(&job);
      return rc;
    }
  }
  if (comm != NULL)
    mr_client_set_blocked_probe(c, comm_blocked, comm);
  struct mr_reporter rep;
  mr_client_reporter(c, &rep);
  struct mr_run_env env = {
      .rank = c->rank,
      .world_size = c->world_size,
      .local_rank = c->local_rank,
      .threads = (int)mr_tunable_int(MR_TUNABLE_THREADS),
      .log_dir = log_dir,
      .metrics_path = NULL, /* the coordinator writes the job's metrics file */
      .weights_out = weights, /* every rank writes its part; rank 0 merges */
      .reporter = &rep,
      .resume_dir = plan->resume_dir != NULL && plan->resume_dir[0] != '\0' ? plan->resume_dir
                                                                             : NULL,
      .program_digest = plan->program_digest,
      .trace = plan_trace(c, plan),
  };
  rc = mr_dist_train_run(&job, &env, be, comm);
  mr_trace_free(env.trace);
  mr_client_set_blocked_probe(c, NULL, NULL);
  if (comm != NULL)
    comm->ops->close(comm);
  mr_backend_free(be);
  if (rc == 0 && rep.stop_requested(rep.ctx))
    rc = mr_error_set(MR_ECANCELED, "stopped by the coordinator");
  if (rc == 0)
    rc = mr_client_report_done(c, job.train.steps, NULL, 0);
  mr_job_close(&job);
  return rc;
}

static int run(void) {
  const char *coord = getenv("MESHRUN_COORD");
  if (coord == NULL || coord[0] == '\0')
    return mr_error_set(MR_EINVAL, "MESHRUN_COORD is not set (unix:PATH or tcp:HOST:PORT)");
  uint8_t token[MR_TOKEN_BYTES];
  MR_TRY(mr_auth_init());
  MR_TRY(read_token(token));
  int rc = mr_client_connect(&client, coord, token, env_int("RANK", -1),
                             env_int("MESHRUN_RESTART", 0));
  memset(token, 0, sizeof token);
  MR_TRY(rc);
  const char *tdir = client.plan->trace_dir;
  if (tdir != NULL && tdir[0] != '\0' &&
      mr_client_clock_offset(&client, &trace_clock.offset_ns, &trace_clock.error_ns) < 0)
    MR_WARN("trace", "rank %d: %s; the trace is on this rank's own clock", client.rank,
            mr_error_message());
  if (getenv("MESHRUN_LAUNCHER_PID") == NULL) {
    char prefix[32];
    snprintf(prefix, sizeof prefix, "rank %d", client.rank);
    mr_log_set_prefix(prefix);
  }
  MR_TRY(mr_client_start(&client));
  /* STARTING until the training's first step (mr_reporter.running) */
  switch (client.plan->kind) {
  case MESHRUN__PLAN__KIND__SELFCHECK:
    mr_client_set_state(&client, MESHRUN__HEARTBEAT__STATE__RUNNING);
    rc = mr_selfcheck_run(&client);
    break;
  case MESHRUN__PLAN__KIND__TRAIN:
    rc = run_training(&client);
    break;
  default:
    rc = mr_error_set(MR_ENOTSUP, "this worker cannot run plans of kind %d",
                      (int)client.plan->kind);
  }
  /* whatever failed once the launcher stopped the rank (a wait given up,
   * a peer gone first) is the stop, not a failure to report */
  if (rc < 0 && atomic_load(&client.stop_requested)) {
    MR_DEBUG("worker", "stopped: %s", mr_error_of(rc));
    rc = MR_ECANCELED;
  }
  if (rc < 0 && rc != MR_ECANCELED)
    mr_client_report_error(&client, rc, mr_error_of(rc));
  mr_client_set_state(&client, MESHRUN__HEARTBEAT__STATE__DONE);
  return rc;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "sample") == 0)
    return mr_sample_main(argc - 1, argv + 1);
  if (argc > 1 && strcmp(argv[1], "logits") == 0)
    return mr_logits_main(argc - 1, argv + 1);
  if (argc > 1 && strcmp(argv[1], "--calibrate") == 0)
    return mr_calibrate_main(argc - 1, argv + 1);
  if (argc > 1) {
    fprintf(stderr, "meshrun-worker: unknown command \"%s\" (workers are started by "
                    "meshrun launch)\n", argv[1]);
    return 2;
  }
  bind_to_launcher();
  if (getenv("MESHRUN_LAUNCHER_PID") != NULL)
    mr_log_set_prefix(""); /* the launcher prefixes our lines with [rank N] */
  else
    mr_log_set_prefix("worker");
  signal(SIGPIPE, SIG_IGN);
  /* a file past the size limit (ulimit -f) is a write error naming the file
   * (EFBIG), as a full disk is, not a killed rank */
  signal(SIGXFSZ, SIG_IGN);
  signal(SIGINT, SIG_IGN); /* the launcher decides; it stops us with SIGTERM */
  signal(SIGUSR1, SIG_IGN); /* a scheduler's, for the launcher (a checkpoint) */
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_sigterm;
  sa.sa_flags = SA_SIGINFO;
  sigaction(SIGTERM, &sa, NULL);
  mr_comm_watch_stop(&client.stop_requested); /* a stop breaks off every wait */
  setvbuf(stdout, NULL, _IOLBF, 0);
  int rc = run();
  if (rc < 0 && rc != MR_ECANCELED)
    MR_ERROR("worker", "%s", mr_error_of(rc));
  int lost = atomic_load(&client.coordinator_lost);
  mr_client_close(&client);
  if (lost)
    return 1;
  if (rc == MR_ECANCELED)
    return 143;
  return rc < 0 ? 1 : 0;
}
