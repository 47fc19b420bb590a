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
#include "worker/client.h"
#include "worker/selfcheck.h"

static struct mr_client client;

static void on_sigterm(int sig) {
  (void)sig;
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
  if (getenv("MESHRUN_LAUNCHER_PID") == NULL) {
    char prefix[32];
    snprintf(prefix, sizeof prefix, "rank %d", client.rank);
    mr_log_set_prefix(prefix);
  }
  MR_TRY(mr_client_start(&client));
  mr_client_set_state(&client, MESHRUN__HEARTBEAT__STATE__RUNNING);
  switch (client.plan->kind) {
  case MESHRUN__PLAN__KIND__SELFCHECK:
    rc = mr_selfcheck_run(&client);
    break;
  default:
    rc = mr_error_set(MR_ENOTSUP, "this worker cannot run plans of kind %d",
                      (int)client.plan->kind);
  }
  if (rc < 0 && rc != MR_ECANCELED)
    mr_client_report_error(&client, rc, mr_error_message());
  mr_client_set_state(&client, MESHRUN__HEARTBEAT__STATE__DONE);
  return rc;
}

int main(int argc, char **argv) {
  (void)argc;
  (void)argv;
  bind_to_launcher();
  if (getenv("MESHRUN_LAUNCHER_PID") != NULL)
    mr_log_set_prefix(""); /* the launcher prefixes our lines with [rank N] */
  else
    mr_log_set_prefix("worker");
  signal(SIGPIPE, SIG_IGN);
  signal(SIGINT, SIG_IGN); /* the launcher decides; it stops us with SIGTERM */
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_sigterm;
  sigaction(SIGTERM, &sa, NULL);
  setvbuf(stdout, NULL, _IOLBF, 0);
  int rc = run();
  if (rc < 0 && rc != MR_ECANCELED)
    MR_ERROR("worker", "%s", mr_error_message());
  mr_client_close(&client);
  if (rc == MR_ECANCELED)
    return 143;
  return rc < 0 ? 1 : 0;
}
