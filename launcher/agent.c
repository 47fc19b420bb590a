/* agent.c - the launcher of node K > 0: joins node 0's launcher and runs
 * this node's ranks when told to (agent.h). */
#include "launcher/agent.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include "common/auth.h"
#include "common/clock.h"
#include "common/error.h"
#include "common/frame.h"
#include "common/log.h"
#include "common/rpc.h"
#include "common/tunable.h"
#include "launcher/cli.h"
#include "launcher/ranks.h"

struct agent {
  const struct mr_agent_opts *o;
  uv_loop_t loop;
  uv_poll_t poll;
  uv_signal_t sigint, sigterm;
  uv_timer_t tick;
  struct mr_frame_reader reader;
  struct mr_ranks ranks;
  int fd;                   // the connection to node 0
  int token_fd;             // inherited by the workers
  uint8_t token[MR_TOKEN_BYTES];
  char coord[300];          // "tcp:HOST:PORT"
  char master_host[256];
  int master_port;
  char job_id[64];
  int pending;              // a START waiting for the last group to exit (its
  int pending_first;        //   restart; -1: none), this node's first rank in
  int pending_world;        //   that group and the group's ranks
  int stopping, killed;     // stopping the ranks; SIGKILL sent
  int64_t stop_ms;
  int connected;            // the connection is open
  int exit_code;            // from FINISH; 1 until then
  int told;                 // FINISH received
  int signals;              // SIGINT/SIGTERM received
  int finished;             // the loop is closing down
};

/* Waits for node 0 to write the token file, up to the deadline. */
static int read_token(struct agent *a, int64_t deadline) {
  for (;;) {
    int rc = mr_auth_token_read_file(a->o->token_file, a->token);
    if (rc == MR_ENOENT && mr_clock_ms() >= deadline)
      return mr_error_set(MR_ETIMEDOUT, "no job token at %s within %.0f s: node 0 writes it "
                          "there, so it must be on a file system every node sees (--token-file)",
                          a->o->token_file, a->o->join_timeout_s);
    if (rc != MR_ENOENT)
      return rc;
    usleep(200000);
  }
}

/* Connects, authenticates and says Hello as this node; takes Welcome.
 * Retries refused connections until the deadline (node 0 may still be
 * planning). */
static int join(struct agent *a, int64_t deadline) {
  int timeout = (int)mr_tunable_int(MR_TUNABLE_CONNECT_TIMEOUT_MS);
  for (;;) {
    a->fd = mr_rpc_connect(a->coord);
    if (a->fd < 0) {
      if (mr_clock_ms() >= deadline)
        return mr_error_set(MR_ETIMEDOUT, "no launcher of node 0 at %s within %.0f s (%s)",
                            a->o->master, a->o->join_timeout_s, mr_error_message());
      usleep(500000);
      continue;
    }
    int rc = mr_auth_client_handshake(a->fd, &a->reader, a->token,
                                      (int)mr_tunable_int(MR_TUNABLE_AUTH_TIMEOUT_MS));
    if (rc == 0)
      break;
    /* the file read may be one an earlier job left, which node 0 has
     * since replaced with this job's: then again with the new token */
    uint8_t now[MR_TOKEN_BYTES];
    int renewed = rc == MR_EAUTH && mr_auth_token_read_file(a->o->token_file, now) == 0 &&
                  sodium_memcmp(now, a->token, sizeof now) != 0;
    if (renewed)
      memcpy(a->token, now, sizeof now);
    sodium_memzero(now, sizeof now);
    if (!renewed || mr_clock_ms() >= deadline)
      return rc;
    MR_INFO("launch", "node %d: the job token in %s changed while joining: joining again",
            a->o->node_rank, a->o->token_file);
    close(a->fd);
    a->fd = -1;
    mr_frame_reader_close(&a->reader);
    mr_frame_reader_init(&a->reader, (size_t)mr_tunable_int(MR_TUNABLE_MAX_FRAME_BYTES));
  }
  char host[256] = "";
  gethostname(host, sizeof host - 1);
  Meshrun__Hello hello = MESHRUN__HELLO__INIT;
  hello.protocol_version = MR_PROTOCOL_VERSION;
  hello.host = host;
  hello.pid = (uint32_t)getpid();
  hello.requested_rank = -1;
  hello.node_rank = a->o->node_rank;
  hello.node_ranks = a->o->nproc;
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_HELLO;
  env.hello = &hello;
  MR_TRY(mr_rpc_send_fd(a->fd, &env));
  Meshrun__Envelope *w;
  int rc = mr_rpc_recv_fd(a->fd, &a->reader, timeout, &w);
  if (rc == MR_ECLOSED)
    return mr_error_set(MR_ECLOSED, "node 0's launcher at %s refused node %d (its log says why: "
                        "the node count, the ranks per node, or a node joined twice)",
                        a->o->master, a->o->node_rank);
  if (rc < 0)
    return rc;
  if (w->msg_case != MESHRUN__ENVELOPE__MSG_WELCOME) {
    rc = mr_error_set(MR_EPROTO, "expected welcome from node 0's launcher, got %s",
                      mr_rpc_name(w));
  } else if (w->welcome->world_size % a->o->nproc != 0 ||
             w->welcome->world_size > a->o->nnodes * a->o->nproc) {
    rc = mr_error_set(MR_EPROTO, "node 0's job has %d ranks, not up to %d nodes of %d",
                      w->welcome->world_size, a->o->nnodes, a->o->nproc);
  } else {
    snprintf(a->job_id, sizeof a->job_id, "%s", w->welcome->job_id ? w->welcome->job_id : "");
  }
  mr_rpc_free(w);
  return rc;
}

static int running(const struct agent *a) {
  return !mr_ranks_all_exited(&a->ranks) || !mr_ranks_all_closed(&a->ranks);
}

static void stop_ranks(struct agent *a) {
  if (!a->stopping) {
    a->stopping = 1;
    a->killed = 0;
    a->stop_ms = mr_clock_ms();
  }
  mr_ranks_signal_all(&a->ranks, SIGTERM);
}

/* Starts the ranks of the START pending: ranks first .. first + nproc - 1 of
 * world (an elastic job's group may number its nodes otherwise than the
 * last). */
static void spawn(struct agent *a, int restart, int first, int world) {
  mr_ranks_renumber(&a->ranks, a->o->nproc, first);
  struct mr_spawn_env env = {
      .worker_bin = a->o->worker_bin,
      .coord_address = a->coord,
      .master_addr = a->master_host,
      .master_port = a->master_port,
      .job_id = a->job_id,
      .token_fd = a->token_fd,
      .restart = restart,
      .threads = a->o->threads,
      .log_dir = a->o->log_dir,
      .world = world,
  };
  a->stopping = 0;
  MR_INFO("launch", "node %d: starting ranks %d..%d of %d (restart %d)", a->o->node_rank,
          first, first + a->o->nproc - 1, world, restart);
  if (mr_ranks_spawn_all(&a->ranks, &env) < 0) {
    /* node 0 sees the ranks never register and fails the group */
    MR_ERROR("launch", "node %d: %s", a->o->node_rank, mr_error_message());
    stop_ranks(a);
  }
}

static void finish(struct agent *a) {
  if (a->finished)
    return;
  a->finished = 1;
  uv_timer_stop(&a->tick);
  uv_close((uv_handle_t *)&a->tick, NULL);
  uv_close((uv_handle_t *)&a->sigint, NULL);
  uv_close((uv_handle_t *)&a->sigterm, NULL);
}

/* Stops listening to node 0 (the loop ends once the ranks have exited). */
static void disconnect(struct agent *a) {
  a->connected = 0;
  uv_poll_stop(&a->poll);
  uv_close((uv_handle_t *)&a->poll, NULL);
}

static void lost(struct agent *a, const char *why) {
  if (!a->connected)
    return;
  disconnect(a);
  if (why != NULL)
    MR_ERROR("launch", "node %d: lost node 0's launcher (%s): stopping this node's ranks",
             a->o->node_rank, why);
  a->pending = -1;
  stop_ranks(a);
}

static void on_control(struct agent *a, const Meshrun__Control *ctl) {
  switch (ctl->kind) {
  case MESHRUN__CONTROL__KIND__START:
    a->pending = (int)ctl->restart;
    a->pending_first = ctl->first_rank;
    a->pending_world = ctl->world_size;
    if (running(a))
      stop_ranks(a); /* the last group's first: they are on their way out */
    break;
  case MESHRUN__CONTROL__KIND__STOP:
    a->pending = -1;
    stop_ranks(a);
    break;
  case MESHRUN__CONTROL__KIND__FINISH:
    a->exit_code = ctl->exit_code;
    a->told = 1;
    break;
  default:
    break;
  }
}

static void on_readable(uv_poll_t *h, int status, int events) {
  struct agent *a = h->data;
  if (status < 0 || !(events & UV_READABLE)) {
    lost(a, status < 0 ? uv_strerror(status) : "poll");
    return;
  }
  uint8_t chunk[16384];
  ssize_t n = recv(a->fd, chunk, sizeof chunk, 0);
  if (n < 0 && (errno == EAGAIN || errno == EINTR))
    return;
  if (n <= 0) {
    lost(a, n == 0 && a->told ? NULL : n == 0 ? "closed" : strerror(errno));
    return;
  }
  if (mr_frame_reader_feed(&a->reader, chunk, (size_t)n) < 0) {
    lost(a, mr_error_message());
    return;
  }
  for (;;) {
    const uint8_t *payload;
    size_t len;
    int got = mr_frame_reader_next(&a->reader, &payload, &len);
    if (got == 0)
      return;
    Meshrun__Envelope *env = NULL;
    if (got < 0 || mr_rpc_decode(payload, len, &env) < 0 || mr_rpc_validate(env) < 0) {
      lost(a, mr_error_message());
      mr_rpc_free(env);
      return;
    }
    if (env->msg_case == MESHRUN__ENVELOPE__MSG_CONTROL)
      on_control(a, env->control);
    else
      MR_WARN("launch", "node %d: ignoring %s from node 0's launcher", a->o->node_rank,
              mr_rpc_name(env));
    mr_rpc_free(env);
  }
}

static void on_rank_exit(void *ctx, int i, int64_t status, int signal) {
  struct agent *a = ctx;
  const struct mr_rank *r = &a->ranks.r[i];
  if (signal != 0 && !a->stopping)
    MR_WARN("launch", "rank %d (pid %d) was killed by signal %d (%s)", r->rank, r->pid, signal,
            sigabbrev_np(signal) ? sigabbrev_np(signal) : "?");
  else if (status != 0 && !a->stopping)
    MR_WARN("launch", "rank %d (pid %d) exited with status %lld", r->rank, r->pid,
            (long long)status);
}

static void on_signal(uv_signal_t *h, int signum) {
  struct agent *a = h->data;
  if (a->signals++ == 0) {
    MR_WARN("launch", "node %d: %s: node 0's launcher stops the job (again to stop this "
            "node's ranks now)", a->o->node_rank, strsignal(signum));
    return;
  }
  a->exit_code = 128 + signum;
  a->pending = -1;
  mr_ranks_signal_all(&a->ranks, SIGKILL);
  if (a->connected)
    disconnect(a);
}

static void on_tick(uv_timer_t *t) {
  struct agent *a = t->data;
  if (running(a)) {
    if (a->stopping && !a->killed &&
        mr_clock_ms() - a->stop_ms > mr_tunable_int(MR_TUNABLE_STOP_GRACE_MS)) {
      MR_WARN("launch", "node %d: ranks still running after %.1f s: killing them",
              a->o->node_rank, (double)mr_tunable_int(MR_TUNABLE_STOP_GRACE_MS) / 1000.0);
      mr_ranks_signal_all(&a->ranks, SIGKILL);
      a->killed = 1;
    }
    return;
  }
  if (!a->connected) {
    finish(a);
    return;
  }
  if (a->pending >= 0) {
    int restart = a->pending;
    a->pending = -1;
    spawn(a, restart, a->pending_first, a->pending_world);
  }
}

static void close_walk(uv_handle_t *h, void *arg) {
  (void)arg;
  if (!uv_is_closing(h))
    uv_close(h, NULL);
}

int mr_agent_run(const struct mr_agent_opts *o) {
  struct agent *a = calloc(1, sizeof *a);
  if (a == NULL)
    return 1;
  a->o = o;
  a->fd = a->token_fd = -1;
  a->pending = -1;
  a->exit_code = 1;
  mr_frame_reader_init(&a->reader, (size_t)mr_tunable_int(MR_TUNABLE_MAX_FRAME_BYTES));
  int code = 1;
  int64_t deadline = mr_clock_ms() + (int64_t)(o->join_timeout_s * 1000.0);
  if (mr_auth_init() < 0 ||
      mr_cli_host_port(o->master, a->master_host, sizeof a->master_host, &a->master_port) < 0) {
    MR_ERROR("launch", "%s", mr_error_message());
    goto out;
  }
  snprintf(a->coord, sizeof a->coord, strchr(a->master_host, ':') ? "tcp:[%s]:%d" : "tcp:%s:%d",
           a->master_host, a->master_port);
  if (read_token(a, deadline) < 0 || join(a, deadline) < 0 ||
      (a->token_fd = mr_auth_token_memfd(a->token)) < 0) {
    MR_ERROR("launch", "node %d: %s", o->node_rank, mr_error_message());
    goto out;
  }
  int fl = fcntl(a->fd, F_GETFL);
  fcntl(a->fd, F_SETFL, fl | O_NONBLOCK);
  MR_INFO("launch", "node %d of %d joined job %s at %s (%d ranks), logs in %s", o->node_rank,
          o->nnodes, a->job_id, o->master, o->nproc, o->log_dir);
  uv_loop_init(&a->loop);
  if (mr_ranks_init(&a->ranks, &a->loop, o->nproc, o->nproc, o->node_rank * o->nproc,
                    o->log_dir, a, on_rank_exit) < 0) {
    MR_ERROR("launch", "%s", mr_error_message());
    uv_loop_close(&a->loop);
    goto out;
  }
  uv_poll_init(&a->loop, &a->poll, a->fd);
  a->poll.data = a;
  a->connected = 1;
  uv_poll_start(&a->poll, UV_READABLE | UV_DISCONNECT, on_readable);
  uv_signal_init(&a->loop, &a->sigint);
  uv_signal_init(&a->loop, &a->sigterm);
  a->sigint.data = a->sigterm.data = a;
  uv_signal_start(&a->sigint, on_signal, SIGINT);
  uv_signal_start(&a->sigterm, on_signal, SIGTERM);
  signal(SIGUSR1, SIG_IGN); /* a checkpoint asked for: node 0's to write */
  uv_timer_init(&a->loop, &a->tick);
  a->tick.data = a;
  uv_timer_start(&a->tick, on_tick, 20, 20);
  uv_run(&a->loop, UV_RUN_DEFAULT);
  code = a->exit_code;
  uv_walk(&a->loop, close_walk, NULL);
  uv_run(&a->loop, UV_RUN_DEFAULT);
  uv_loop_close(&a->loop);
  mr_ranks_close(&a->ranks);
out:
  if (a->fd >= 0)
    close(a->fd);
  if (a->token_fd >= 0)
    close(a->token_fd);
  mr_frame_reader_close(&a->reader);
  sodium_memzero(a->token, sizeof a->token);
  /* node 0 removes the step's token when it ends; when it is gone
   * without an end (killed), the file is no use to anyone */
  if (o->token_file_of_step && !a->told && unlink(o->token_file) == 0)
    MR_INFO("launch", "node %d: removed %s: node 0 is gone", o->node_rank, o->token_file);
  free(a);
  return code;
}
