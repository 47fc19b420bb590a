/* coordinator.c - the launcher's event loop: ranks, connections, plan,
 * supervision and restarts.  Worker processes and their output live in
 * launcher/ranks.c; this file decides what happens to them. */
#include "launcher/coordinator.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/auth.h"
#include "common/checksum.h"
#include "common/ckpt.h"
#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/rpc.h"
#include "common/tunable.h"
#include "launcher/conn.h"
#include "launcher/ranks.h"
#include "launcher/rebalance.h"
#include "launcher/sockdir.h"
#include "launcher/strategy_choice.h"
#include "worker/comm/comm.h"

/* Why a group stops to start again without a failure. */
enum regroup {
  REGROUP_NONE = 0,
  REGROUP_NODES,
  REGROUP_BALANCE,    // the pipeline's layers moved
  REGROUP_DP_BALANCE, // the data-parallel ranks' micro-batches moved
  REGROUP_SLOW_NODE
};

enum phase {
  PHASE_RUNNING,   // the group is starting or training
  PHASE_STOPPING,  // a failure or a signal: waiting for every worker to exit
  PHASE_FINISHED,  // the loop is closing down
};

struct rendezvous {
  char *key;
  ProtobufCBinaryData *blobs; // n entries (the group's ranks), owned
  int n;
  int have;
  struct rendezvous *next;
};

/* A checkpoint the ranks are writing: which have reported their files. */
struct pending_ckpt {
  int64_t step;
  int reported;             // ranks that reported
  char **files, **sha;      // gathered from every rank
  int n_files;
  unsigned char *seen;      // [world] reported already
  struct pending_ckpt *next;
};

struct coordinator {
  uv_loop_t loop;
  const struct mr_launch_opts *opts;
  uv_pipe_t unix_server;
  uv_tcp_t tcp_server;
  uv_signal_t sigint, sigterm, sigusr1;
  uv_timer_t tick;
  uint8_t token[MR_TOKEN_BYTES];
  int token_fd;
  char job_id[17];
  char sock_dir[64];
  int sock_lock_fd;         // held locked while the folder lives (sockdir.h)
  char unix_path[128];
  char unix_address[140];   // "unix:" unix_path
  char master_addr[64];
  int master_port;
  struct mr_ranks ranks;
  int nnodes, node_ranks;   // nodes of the job, ranks on each
  struct mr_conn **agents;  // [nnodes] the other nodes' launchers (0: unused)
  int world;                // ranks of the current group
  int *group_nodes;         // [nnodes] the current group's nodes in rank order
  int n_group_nodes;        //   (node 0 first; an elastic job's may be fewer)
  int gathering;            // an elastic group waits for nodes to join
  int64_t gather_ms;
  const char *plan_text;    // the plan body the workers get, and their
  const uint64_t *digests;  //   programs' digests: the launch's, or
  char *own_text;           //   one made here (re-planned for another world,
  uint64_t *own_digests;    //   or re-balanced), owned
  double predicted_s;       // the plan's predicted step time (0: none)
  double *step_s;           // rank 0's step times under that plan, past
  int n_step_s, cap_step_s; //   each group's first WARMUP_STEPS
  int group_steps;          // rank 0's steps reported in this group
  enum phase phase;
  int restart;              // groups started before this one (workers say
                            // which they belong to)
  int failures;             // restarts after failures (--max-restarts)
  enum regroup pending;     // a regroup waiting for its checkpoint (of
  int64_t pending_step;     //   pending_step or later), taking in the nodes
  int leaving;              //   that joined, leaving out this node, or
  char *balanced_text;      //   running this plan (and its programs'
  uint64_t *balanced_digests; //  digests, its predicted step); then
  double balanced_s;
  enum regroup regroup;     //   the group stops to start again, not a failure
  struct mr_split split;    // the running plan's layers per pipeline chunk
  int split_known;          //   (read at the group's first balance check)
  enum regroup slow_kind;   // the way out of slow ranks the last check chose
  int slow_streak;          //   and the checks in a row that chose it
  unsigned char *left_out;  // [nnodes] elastic nodes left out for running slow
  int stop_signal;          // SIGINT/SIGTERM that stopped us, or 0
  int exit_code;
  int next_conn_id;
  int64_t stop_started_ms;
  int64_t restart_at_ms;    // back-off: when the next group may start
  int killed;               // SIGKILL already sent in this stop
  struct rendezvous *rdv;
  struct pending_ckpt *ckpts;
  char resume_dir[4096];    // the checkpoint the current group resumes from
  int64_t resume_step;
  int64_t last_ckpt_step;   // newest complete checkpoint of this job, -1 none
  int preempting;           // SIGTERM: checkpoint, then stop and exit 0
  int64_t preempt_started_ms;
  int64_t preempt_step;     // the newest step any rank had reached then: the
                            // checkpoint that ends the job is of it or later
  FILE *metrics;
  int64_t last_step_printed;
  int failure_reported;
  char failure[512];        // why the current group is stopping
  int failed_rank;
};

static void rendezvous_free(struct rendezvous *r) {
  for (int i = 0; r->blobs != NULL && i < r->n; i++)
    free(r->blobs[i].data);
  free(r->blobs);
  free(r->key);
  free(r);
}

static void rendezvous_clear(struct coordinator *co) {
  while (co->rdv != NULL) {
    struct rendezvous *r = co->rdv;
    co->rdv = r->next;
    rendezvous_free(r);
  }
}

/* The first failure of a group names it; later ones are consequences. */
static void group_fail(struct coordinator *co, int rank, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* An elastic job (--nnodes MIN:MAX) goes on with the nodes it has. */
static int elastic(const struct coordinator *co) {
  return co->opts->min_nodes > 0 && co->opts->min_nodes < co->nnodes;
}

/* Node k's place in the current group, or -1. */
static int group_pos(const struct coordinator *co, int k) {
  for (int i = 0; i < co->n_group_nodes; i++)
    if (co->group_nodes[i] == k)
      return i;
  return -1;
}

/* The node that runs rank r in the current group. */
static int node_of(const struct coordinator *co, int r) {
  return co->group_nodes[r / co->node_ranks];
}

/* Tells the launcher of node k (when connected) to start its ranks for the
 * current group, to stop them, or the job's exit code. */
static void send_node_control(struct coordinator *co, int k, Meshrun__Control__Kind kind) {
  if (co->agents == NULL || co->agents[k] == NULL)
    return;
  Meshrun__Control ctl = MESHRUN__CONTROL__INIT;
  ctl.kind = kind;
  ctl.restart = (uint32_t)co->restart;
  ctl.world_size = co->world;
  if (kind == MESHRUN__CONTROL__KIND__START) /* to a node of the group */
    ctl.first_rank = group_pos(co, k) * co->node_ranks;
  ctl.exit_code = co->exit_code; /* FINISH */
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_CONTROL;
  env.control = &ctl;
  mr_conn_send(co->agents[k], &env);
}

/* The newest step any rank has reached: a checkpoint asked for now is of
 * it or a later one. */
static int64_t newest_step(const struct coordinator *co) {
  int64_t s = 0;
  for (int i = 0; i < co->world; i++)
    if (co->ranks.r[i].step > s)
      s = co->ranks.r[i].step;
  return s;
}

/* Asks for the checkpoint a regroup of this kind starts again from. */
static void ask_regroup(struct coordinator *co, enum regroup kind) {
  co->pending = kind;
  co->pending_step = newest_step(co);
  mr_ranks_send_control(&co->ranks, MESHRUN__CONTROL__KIND__CHECKPOINT_NOW);
}

/* The plan the next groups run becomes text (with its programs' digests),
 * owned here. */
static void adopt_plan(struct coordinator *co, char *text, uint64_t *digests,
                       double predicted_s) {
  free(co->own_text), free(co->own_digests);
  co->own_text = text, co->own_digests = digests;
  co->plan_text = text, co->digests = digests;
  co->predicted_s = predicted_s;
  co->n_step_s = 0; /* measured under another plan */
}

static void begin_stop(struct coordinator *co) {
  if (co->phase == PHASE_STOPPING)
    return;
  co->phase = PHASE_STOPPING;
  co->gathering = 0;
  co->stop_started_ms = mr_clock_ms();
  co->killed = 0;
  mr_ranks_send_control(&co->ranks, MESHRUN__CONTROL__KIND__STOP);
  mr_ranks_signal_all(&co->ranks, SIGTERM);
  for (int k = 1; k < co->nnodes; k++)
    send_node_control(co, k, MESHRUN__CONTROL__KIND__STOP);
  for (int i = 0; i < co->ranks.n; i++) /* a remote rank is gone with its connection */
    if (co->ranks.r[i].remote && co->ranks.r[i].conn == NULL)
      co->ranks.r[i].exited = 1;
}

static void group_fail(struct coordinator *co, int rank, const char *fmt, ...) {
  if (co->phase != PHASE_RUNNING)
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(co->failure, sizeof co->failure, fmt, ap);
  va_end(ap);
  co->failed_rank = rank;
  MR_ERROR("launch", "%s", co->failure);
  begin_stop(co);
}

static void on_signal(uv_signal_t *h, int signum) {
  struct coordinator *co = h->data;
  const struct mr_job *job = co->opts->job;
  /* a scheduler's preemption: save a checkpoint first, then exit 0 */
  if (signum == SIGTERM && !co->preempting && co->stop_signal == 0 &&
      co->phase == PHASE_RUNNING && !co->opts->selfcheck && job != NULL &&
      job->checkpoint.dir != NULL) {
    co->preempting = 1;
    co->preempt_started_ms = mr_clock_ms();
    co->preempt_step = newest_step(co);
    MR_WARN("launch", "SIGTERM: writing a checkpoint, then stopping");
    mr_ranks_send_control(&co->ranks, MESHRUN__CONTROL__KIND__CHECKPOINT_NOW);
    return;
  }
  if (co->stop_signal != 0) { /* second signal: no more patience */
    mr_ranks_signal_all(&co->ranks, SIGKILL);
    return;
  }
  co->stop_signal = signum;
  MR_WARN("launch", "%s: stopping all workers", strsignal(signum));
  co->failure[0] = '\0';
  co->phase = PHASE_RUNNING; /* so begin_stop runs even mid-restart */
  begin_stop(co);
}

/* SIGUSR1, a scheduler's warning before a time limit (Slurm's --signal):
 * a checkpoint now, and training goes on. */
static void on_usr1(uv_signal_t *h, int signum) {
  (void)signum;
  struct coordinator *co = h->data;
  const struct mr_job *job = co->opts->job;
  if (job == NULL || co->opts->selfcheck || co->phase != PHASE_RUNNING || co->preempting)
    return;
  if (job->checkpoint.dir == NULL) {
    MR_WARN("launch", "SIGUSR1: the job has no checkpoint.dir: no checkpoint to write");
    return;
  }
  MR_WARN("launch", "SIGUSR1: writing a checkpoint (training goes on)");
  mr_ranks_send_control(&co->ranks, MESHRUN__CONTROL__KIND__CHECKPOINT_NOW);
}

/* ---- messages from workers ------------------------------------------- */

/* Welcome for rank (a node's launcher: 0, mesh NULL; START gives it its
 * ranks). */
static void send_welcome(struct coordinator *co, struct mr_conn *c, int rank,
                         Meshrun__Mesh *mesh) {
  Meshrun__Welcome w = MESHRUN__WELCOME__INIT;
  w.rank = rank;
  w.world_size = co->world;
  w.local_rank = rank % co->node_ranks;
  w.local_world_size = co->node_ranks;
  w.mesh = mesh;
  w.job_id = co->job_id;
  w.restart = (uint32_t)co->restart;
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_WELCOME;
  env.welcome = &w;
  mr_conn_send(c, &env);
}

static void send_welcome_and_plan(struct coordinator *co, struct mr_conn *c,
                                  int rank) {
  const struct mr_launch_opts *o = co->opts;
  int32_t shape[1] = {co->world};
  char *names[1] = {"world"};
  int32_t *ids = calloc((size_t)co->world, sizeof *ids);
  for (int i = 0; ids != NULL && i < co->world; i++)
    ids[i] = i;
  Meshrun__Mesh mesh = MESHRUN__MESH__INIT;
  mesh.n_shape = 1;
  mesh.shape = shape;
  mesh.n_dim_names = 1;
  mesh.dim_names = names;
  mesh.n_process_ids = ids != NULL ? (size_t)co->world : 0;
  mesh.process_ids = ids;
  send_welcome(co, c, rank, &mesh);
  free(ids);

  Meshrun__Plan plan = MESHRUN__PLAN__INIT;
  plan.kind = o->selfcheck ? MESHRUN__PLAN__KIND__SELFCHECK : MESHRUN__PLAN__KIND__TRAIN;
  if (co->plan_text != NULL) {
    plan.body.data = (uint8_t *)co->plan_text;
    plan.body.len = strlen(co->plan_text);
  }
  plan.seed = o->job != NULL ? o->job->train.seed : 0;
  plan.resume_dir = co->resume_dir;
  plan.resume_step = co->resume_step;
  if (co->digests != NULL) {
    plan.program_digest = co->digests[rank];
    if (rank == mr_tunable_int(MR_TUNABLE_TEST_PLAN_DIGEST))
      plan.program_digest ^= 1; /* test hook: a worker that lowers otherwise */
  }
  plan.steps = o->selfcheck ? mr_tunable_int(MR_TUNABLE_SELFCHECK_STEPS)
                            : (o->job != NULL ? o->job->train.steps : 0);
  Meshrun__Envelope penv = MESHRUN__ENVELOPE__INIT;
  penv.msg_case = MESHRUN__ENVELOPE__MSG_PLAN;
  penv.plan = &plan;
  mr_conn_send(c, &penv);
}

/* Node k joined an elastic job while a group runs without it: a
 * checkpoint is asked for, and once written the group stops and starts
 * again with the node (the strategy planned for the ranks there are then).
 * A job without checkpoints takes it in at its next restart. */
static void grow(struct coordinator *co, int k) {
  const struct mr_job *job = co->opts->job;
  if (job == NULL || job->checkpoint.dir == NULL) {
    MR_INFO("launch", "node %d takes part from the next group (without checkpoints the "
            "group cannot start again without losing its steps)", k);
    return;
  }
  MR_WARN("launch", "node %d joined: writing a checkpoint, then starting the group again with "
          "it", k);
  ask_regroup(co, REGROUP_NODES);
}

/* The launcher of node k > 0: welcome it (the job and the world size), and
 * have it start its ranks if a group it is part of is running. */
static void on_node_hello(struct coordinator *co, struct mr_conn *c, const Meshrun__Hello *h) {
  int k = h->node_rank;
  char why[192] = "";
  if (k >= co->nnodes)
    snprintf(why, sizeof why, "node %d of a job of %d node%s (--node-rank must be below "
             "--nnodes)", k, co->nnodes, co->nnodes == 1 ? "" : "s");
  else if (h->node_ranks != co->node_ranks)
    snprintf(why, sizeof why, "node %d runs %d ranks; every node runs %d (--nproc)", k,
             h->node_ranks, co->node_ranks);
  else if (co->agents[k] != NULL)
    snprintf(why, sizeof why, "node %d is connected already", k);
  if (why[0] != '\0') {
    MR_ERROR("launch", "refused the launcher of %s: %s", h->host, why);
    mr_conn_close(c, why);
    return;
  }
  c->node = k;
  co->agents[k] = c;
  int pos = group_pos(co, k);
  if (pos >= 0)
    MR_INFO("launch", "node %d joined from %s (ranks %d..%d)", k, h->host, pos * co->node_ranks,
            (pos + 1) * co->node_ranks - 1);
  else
    MR_INFO("launch", "node %d joined from %s, outside the running group%s", k, h->host,
            co->left_out[k] ? " (left out for running slow)" : "");
  send_welcome(co, c, 0, NULL);
  if (pos >= 0 && co->phase == PHASE_RUNNING && !co->ranks.waiting_restart && !co->gathering)
    send_node_control(co, k, MESHRUN__CONTROL__KIND__START);
  else if (pos < 0 && co->phase == PHASE_RUNNING && !co->ranks.waiting_restart &&
           !co->gathering && !co->preempting && co->pending == REGROUP_NONE &&
           !co->left_out[k])
    grow(co, k); /* a node left out for running slow stays out */
}

static void on_hello(struct coordinator *co, struct mr_conn *c,
                     const Meshrun__Hello *h) {
  if (h->node_rank > 0) {
    on_node_hello(co, c, h);
    return;
  }
  int rank = h->requested_rank;
  struct mr_rank *r = rank >= 0 && rank < co->world ? &co->ranks.r[rank] : NULL;
  if (r == NULL || co->gathering || r->registered || (!r->remote && r->pid != (int)h->pid) ||
      (r->remote && (co->phase != PHASE_RUNNING || r->exited)) ||
      h->restart != (uint32_t)co->restart) {
    char why[160];
    snprintf(why, sizeof why, "hello from pid %u for rank %d (restart %u) matches no waiting worker",
             h->pid, rank, h->restart);
    mr_conn_close(c, why);
    return;
  }
  c->rank = rank;
  r->conn = c;
  r->registered = 1;
  if (r->remote)
    r->pid = (int)h->pid;
  r->last_seen_ms = mr_clock_ms();
  MR_DEBUG("launch", "rank %d registered (pid %u, host %s, %zu devices)", rank, h->pid,
           h->host, h->n_devices);
  send_welcome_and_plan(co, c, rank);
}

static void on_rendezvous(struct coordinator *co, struct mr_conn *c,
                          const Meshrun__Rendezvous *rv) {
  struct rendezvous *r;
  for (r = co->rdv; r != NULL && strcmp(r->key, rv->key) != 0; r = r->next)
    ;
  if (r == NULL) {
    r = calloc(1, sizeof *r);
    if (r == NULL)
      return;
    r->key = strdup(rv->key);
    r->n = co->world;
    r->blobs = calloc((size_t)r->n, sizeof *r->blobs);
    r->next = co->rdv;
    co->rdv = r;
  }
  ProtobufCBinaryData *b = &r->blobs[c->rank];
  if (b->data != NULL || b->len != 0) {
    group_fail(co, c->rank, "rank %d joined rendezvous \"%s\" twice", c->rank, rv->key);
    return;
  }
  b->len = rv->blob.len;
  b->data = malloc(rv->blob.len > 0 ? rv->blob.len : 1);
  if (b->data != NULL && rv->blob.len > 0)
    memcpy(b->data, rv->blob.data, rv->blob.len);
  if (++r->have < r->n)
    return;
  Meshrun__RendezvousDone done = MESHRUN__RENDEZVOUS_DONE__INIT;
  done.key = r->key;
  done.n_blobs = (size_t)r->n;
  done.blobs = r->blobs;
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_RENDEZVOUS_DONE;
  env.rendezvous_done = &done;
  for (int i = 0; i < co->world; i++)
    if (co->ranks.r[i].conn != NULL)
      mr_conn_send(co->ranks.r[i].conn, &env);
  /* unlink and free this rendezvous */
  struct rendezvous **pp = &co->rdv;
  while (*pp != r)
    pp = &(*pp)->next;
  *pp = r->next;
  rendezvous_free(r);
}

/* The self-check's expected digest for a rank: SHA-256 of the job id, the
 * rank and the world size, which each worker computes independently. */
static void selfcheck_digest(const char *job_id, int rank, int world,
                             uint8_t out[crypto_hash_sha256_BYTES]) {
  char msg[96];
  int n = snprintf(msg, sizeof msg, "meshrun-selfcheck:%s:%d:%d", job_id, rank, world);
  crypto_hash_sha256(out, (const uint8_t *)msg, (unsigned long long)n);
}

static void pending_free(struct pending_ckpt *p) {
  for (int i = 0; i < p->n_files; i++) {
    free(p->files[i]);
    free(p->sha[i]);
  }
  free(p->files);
  free(p->sha);
  free(p->seen);
  free(p);
}

static void pending_clear(struct coordinator *co) {
  while (co->ckpts != NULL) {
    struct pending_ckpt *p = co->ckpts;
    co->ckpts = p->next;
    pending_free(p);
  }
}

/* Every rank has written its part of step `p->step`: write the marker that
 * makes it a checkpoint, then drop the ones beyond keep_last. */
static void complete_checkpoint(struct coordinator *co, struct pending_ckpt *p) {
  const struct mr_checkpoint_config *cc = &co->opts->job->checkpoint;
  char dir[4096];
  mr_ckpt_step_dir(cc->dir, p->step, dir, sizeof dir);
  if (mr_ckpt_write_marker(dir, p->step, (const char *const *)p->files,
                           (const char *const *)p->sha, p->n_files) < 0) {
    MR_ERROR("ckpt", "checkpoint of step %lld not completed: %s", (long long)p->step,
             mr_error_message());
    return;
  }
  co->last_ckpt_step = p->step;
  int removed = mr_ckpt_prune(cc->dir, (int)cc->keep_last);
  MR_INFO("ckpt", "checkpoint of step %lld complete: %s%s", (long long)p->step, dir,
          removed > 0 ? " (older ones pruned)" : "");
  /* a save begun before the signal completing now is not the one asked for:
   * stopping at it would lose the steps since */
  if (co->preempting && co->phase == PHASE_RUNNING && p->step >= co->preempt_step) {
    MR_WARN("launch", "checkpoint written: stopping for preemption (the next launch resumes "
                      "from step %lld)", (long long)p->step);
    begin_stop(co);
  } else if (co->pending != REGROUP_NONE && co->phase == PHASE_RUNNING &&
             p->step >= co->pending_step) {
    if (co->pending == REGROUP_SLOW_NODE)
      co->left_out[co->leaving] = 1;
    if (co->pending == REGROUP_BALANCE || co->pending == REGROUP_DP_BALANCE) {
      adopt_plan(co, co->balanced_text, co->balanced_digests, co->balanced_s);
      co->balanced_text = NULL, co->balanced_digests = NULL;
    }
    co->regroup = co->pending;
    co->pending = REGROUP_NONE;
    begin_stop(co);
  }
}

static void on_checkpoint_written(struct coordinator *co, int rank,
                                  const Meshrun__Report__CheckpointWritten *cw) {
  if (co->opts->job == NULL || co->opts->job->checkpoint.dir == NULL ||
      cw->n_files != cw->n_checksum)
    return;
  struct pending_ckpt *p;
  for (p = co->ckpts; p != NULL && p->step != cw->step; p = p->next)
    ;
  if (p == NULL) {
    p = calloc(1, sizeof *p);
    if (p == NULL || (p->seen = calloc((size_t)co->world, 1)) == NULL) {
      free(p);
      return;
    }
    p->step = cw->step;
    p->next = co->ckpts;
    co->ckpts = p;
  }
  if (p->seen[rank])
    return;
  p->seen[rank] = 1;
  p->reported++;
  char **nf = realloc(p->files, (size_t)(p->n_files + (int)cw->n_files + 1) * sizeof *nf);
  char **ns = nf ? realloc(p->sha, (size_t)(p->n_files + (int)cw->n_files + 1) * sizeof *ns) : NULL;
  if (nf != NULL)
    p->files = nf;
  if (ns != NULL)
    p->sha = ns;
  for (size_t i = 0; nf != NULL && ns != NULL && i < cw->n_files; i++) {
    if (strchr(cw->files[i], '/') != NULL || strlen(cw->checksum[i]) != MR_CHECKSUM_HEX - 1)
      continue; /* a file outside the step's folder is never trusted */
    p->files[p->n_files] = strdup(cw->files[i]);
    p->sha[p->n_files] = strdup(cw->checksum[i]);
    p->n_files++;
  }
  if (p->reported < co->world)
    return;
  struct pending_ckpt **pp = &co->ckpts;
  while (*pp != p)
    pp = &(*pp)->next;
  *pp = p->next;
  complete_checkpoint(co, p);
  pending_free(p);
}

static void on_report(struct coordinator *co, struct mr_conn *c,
                      const Meshrun__Report *rep) {
  struct mr_rank *r = &co->ranks.r[c->rank];
  switch (rep->what_case) {
  case MESHRUN__REPORT__WHAT_ERROR:
    snprintf(r->error, sizeof r->error, "%s", rep->error->message);
    MR_ERROR("launch", "rank %d reported an error: %s", c->rank, rep->error->message);
    break;
  case MESHRUN__REPORT__WHAT_DONE:
    if (co->opts->selfcheck) {
      uint8_t want[crypto_hash_sha256_BYTES];
      selfcheck_digest(co->job_id, c->rank, co->world, want);
      if (rep->done->result.len != sizeof want ||
          memcmp(rep->done->result.data, want, sizeof want) != 0) {
        group_fail(co, c->rank, "rank %d: self-check result does not match", c->rank);
        return;
      }
    }
    r->done = 1;
    break;
  case MESHRUN__REPORT__WHAT_CHECKPOINT:
    on_checkpoint_written(co, c->rank, rep->checkpoint);
    break;
  default:
    break;
  }
}

/* ", \"key\": value" with JSON's null for what JSON cannot hold (an
 * overflowed gradient norm, a diverged loss). */
static void json_field(FILE *f, const char *key, double v, const char *fmt) {
  fprintf(f, ", \"%s\": ", key);
  if (isfinite(v))
    fprintf(f, fmt, v);
  else
    fputs("null", f);
}

#define STRAGGLER_EVERY 5  // steps between checks
#define STRAGGLER_STREAK 3 // checks in a row that name a rank slow
#define STRAGGLER_MIN_S 0.005 // a lead too small to tell from noise

/* Names a rank whose work per step stays well above that of the other
 * ranks of its pipeline stage (which do the same work and wait for it at
 * every collective): a throttled or shared device, a slow node. */
static void check_stragglers(struct coordinator *co) {
  double ratio = atof(mr_tunable_str(MR_TUNABLE_STRAGGLER_RATIO));
  double *others = malloc((size_t)co->world * sizeof *others);
  if (others == NULL || !(ratio > 1.0)) {
    free(others);
    return;
  }
  for (int i = 0; i < co->world; i++) {
    struct mr_rank *r = &co->ranks.r[i];
    if (r->busy_n < 2 * STRAGGLER_EVERY)
      continue;
    int n = 0;
    for (int j = 0; j < co->world; j++) /* the others of its stage, in order */
      if (j != i && co->ranks.r[j].stage == r->stage &&
          co->ranks.r[j].busy_n >= 2 * STRAGGLER_EVERY) {
        double v = co->ranks.r[j].busy_s;
        int at = n++;
        for (; at > 0 && others[at - 1] > v; at--)
          others[at] = others[at - 1];
        others[at] = v;
      }
    if (n == 0)
      continue;
    double median = n % 2 ? others[n / 2] : 0.5 * (others[n / 2 - 1] + others[n / 2]);
    int slow = r->busy_s > ratio * median && r->busy_s - median > STRAGGLER_MIN_S;
    r->slow_streak = slow ? r->slow_streak + 1 : 0;
    if (r->slow_streak >= STRAGGLER_STREAK && !r->slow_named) {
      r->slow_named = 1;
      MR_WARN("launch", "rank %d (node %d%s) is persistently slow: %.1f ms of work a step "
              "against %.1f ms for the other ranks of its stage, which wait for it",
              i, node_of(co, i), r->remote ? "" : ", here", r->busy_s * 1e3, median * 1e3);
    }
  }
  free(others);
}

/* Layers per chunk as "4,4" into buf. */
static void format_counts(const int *counts, int n, char *buf, size_t size) {
  size_t at = 0;
  buf[0] = '\0';
  for (int i = 0; i < n && at + 12 < size; i++)
    at += (size_t)snprintf(buf + at, size - at, "%s%d", i ? "," : "", counts[i]);
}

/* Each stage's work per step (its slowest rank's) into busy[pp]; 0 while
 * some rank has not reported enough steps to tell. */
static int stage_busy(const struct coordinator *co, int pp, double *busy) {
  for (int i = 0; i < co->world; i++) {
    const struct mr_rank *r = &co->ranks.r[i];
    if (r->busy_n < 2 * STRAGGLER_EVERY || r->stage < 0 || r->stage >= pp)
      return 0;
    busy[r->stage] = fmax(busy[r->stage], r->busy_s);
  }
  return 1;
}

/* Asks for the checkpoint the group starts again from, running plan text
 * (its programs' digests, its predicted step) from then on. */
static void regroup_with(struct coordinator *co, char *text, uint64_t *digests, double step_s,
                         enum regroup kind) {
  free(co->balanced_text), free(co->balanced_digests);
  co->balanced_text = text, co->balanced_digests = digests, co->balanced_s = step_s;
  ask_regroup(co, kind);
}

/* Lowers and checks the plan with the layers moved, then asks for the
 * checkpoint the group starts again from with it. */
static void begin_rebalance(struct coordinator *co, const struct mr_rebalance_out *out, int k,
                            int pp) {
  const struct mr_job *job = co->opts->job;
  uint64_t *digests = calloc((size_t)co->world, sizeof *digests);
  double step_s = 0;
  char *text = digests != NULL ? mr_plan_with_split(job, co->plan_text, co->world, out->counts,
                                                    k, digests, &step_s) : NULL;
  char speeds[256] = "", was[256], now[256];
  for (int s = 0; s < pp && strlen(speeds) + 16 < sizeof speeds; s++)
    snprintf(speeds + strlen(speeds), sizeof speeds - strlen(speeds), "%s%.2f", s ? ", " : "",
             out->slowness[s]);
  format_counts(co->split.counts, k, was, sizeof was);
  format_counts(out->counts, k, now, sizeof now);
  if (text == NULL) {
    MR_WARN("launch", "the pipeline's stages run unbalanced (time per unit of work by stage: "
            "%s) but layers %s cannot run: %s", speeds, now, mr_error_message());
    free(digests);
    return;
  }
  MR_WARN("launch", "the pipeline's stages run unbalanced (time per unit of work by stage: %s): "
          "moving layers %s -> %s cuts the slowest chunk's time by %.0f%%; writing a checkpoint, "
          "then starting again", speeds, was, now, 100.0 * out->gain);
  regroup_with(co, text, digests, step_s, REGROUP_BALANCE);
}

/* The least share of the step a regroup for slow ranks must save
 * (MESHRUN_REBALANCE_GAIN), or 0 when none may be asked for now: no
 * checkpoints to start again from, another regroup or a preemption under
 * way, or too few steps left to gain back the restart. */
static double replan_gain(const struct coordinator *co) {
  const struct mr_job *job = co->opts->job;
  double min_gain = atof(mr_tunable_str(MR_TUNABLE_REBALANCE_GAIN));
  if (job == NULL || job->checkpoint.dir == NULL || !(min_gain > 0) || co->plan_text == NULL ||
      co->pending != REGROUP_NONE || co->preempting || co->phase != PHASE_RUNNING ||
      co->ranks.waiting_restart || job->train.steps - newest_step(co) < 4 * STRAGGLER_EVERY)
    return 0;
  return min_gain;
}

/* The running plan's split, read once a group (pp stays 0 when it cannot
 * be: nothing is then balanced). */
static void read_split(struct coordinator *co) {
  if (co->split_known)
    return;
  co->split_known = 1;
  if (mr_split_of_plan(co->opts->job, co->plan_text, co->world, &co->split) < 0)
    mr_split_close(&co->split);
}

/* A rank that runs slow holds up the step: its stage's peers wait for it
 * at every collective, the pipeline at every send, the data ranks at the
 * gradient all-reduce.  Three ways out, weighed by the share of the step
 * each saves, the largest taken when it reaches MESHRUN_REBALANCE_GAIN in
 * STRAGGLER_STREAK checks running (a checkpoint is written and the group
 * starts again from it with the new plan; not a failure):
 * - move layers off the slow pipeline stages (unless the job fixes the
 *   split): each stage's work per step (its slowest rank's) against the
 *   work its layers give it; launcher/rebalance.h splits the layers and
 *   says the share of the pipeline's pace saved;
 * - give the slow data rank fewer of the step's micro-batches (ZeRO 0-1,
 *   unless the job fixes the split): each data rank's work per step (its
 *   slowest rank's, over every stage of its pipeline) and the part its
 *   micro-batches do give its speed and the part that stays;
 *   launcher/rebalance.h deals the step's slices;
 * - leave the slow node out of an elastic job without a pipeline
 *   (--nnodes MIN allowing; node 0 stays): when a node's ranks work B_k a
 *   step against at most B_o on the others, the step T carries B_k - B_o
 *   of waiting for it; without the node the others' share grows by
 *   n/(n - 1), so the step would be T - (B_k - B_o) + B_o/(n - 1),
 *   communication unchanged.
 * A node slow by a fixed time a step (its micro-batches no slower) gains
 * nothing from fewer of them and is left out; a node slow at its work
 * keeps what it can do; a slow replica of every stage keeps its layers
 * and gets fewer micro-batches. */
struct layer_option {
  double *busy, *slowness;    // [pp]
  struct mr_rebalance_out out;
  double gain;
};

static void layer_option_close(struct layer_option *o) {
  free(o->busy), free(o->slowness), free(o->out.counts);
  memset(o, 0, sizeof *o);
}

/* Moving layers' gain into o (0 when it does not apply). */
static void layer_option(struct coordinator *co, struct layer_option *o) {
  memset(o, 0, sizeof *o);
  int pp = co->split.pp, k = pp * co->split.vp;
  if (pp < 2 || co->opts->job->strategy.n_chunk_layers > 0)
    return;
  o->busy = calloc((size_t)pp, sizeof *o->busy);
  o->slowness = calloc((size_t)pp, sizeof *o->slowness);
  o->out.counts = calloc((size_t)k, sizeof *o->out.counts);
  o->out.slowness = o->slowness;
  struct mr_rebalance_in in = {pp, co->split.vp, co->split.n_layers, co->split.counts,
                               co->split.layer, co->split.first, co->split.last, o->busy};
  if (o->busy != NULL && o->slowness != NULL && o->out.counts != NULL &&
      stage_busy(co, pp, o->busy) && mr_rebalance(&in, &o->out) == 0 &&
      memcmp(o->out.counts, co->split.counts, (size_t)k * sizeof *o->out.counts) != 0)
    o->gain = o->out.gain;
}

struct dp_option {
  int dp, n_micro;
  double *busy, *micro;       // [dp] each data rank's work and its micro-batches' part
  int *counts;                // [dp] the split
  double gain;
};

static void dp_option_close(struct dp_option *o) {
  free(o->busy), free(o->micro), free(o->counts);
  memset(o, 0, sizeof *o);
}

/* The micro-batch split's gain into o (0 when it does not apply). */
static void dp_option(struct coordinator *co, struct dp_option *o) {
  const struct mr_strategy_hint *h = &co->opts->job->strategy;
  memset(o, 0, sizeof *o);
  int dp = co->split.dp;
  if (h->n_dp_micro > 0 || dp < 2 || co->split.zero >= 2 || co->split.data_of == NULL)
    return;
  o->dp = dp;
  o->busy = calloc((size_t)dp, sizeof *o->busy);
  o->micro = calloc((size_t)dp, sizeof *o->micro);
  o->counts = calloc((size_t)dp, sizeof *o->counts);
  int ok = o->busy != NULL && o->micro != NULL && o->counts != NULL;
  for (int i = 0; i < co->world && ok; i++) { /* each data rank's slowest */
    const struct mr_rank *r = &co->ranks.r[i];
    int d = co->split.data_of[i];
    ok = r->busy_n >= 2 * STRAGGLER_EVERY;
    if (ok && r->busy_s > o->busy[d])
      o->busy[d] = r->busy_s, o->micro[d] = r->micro_s;
  }
  int pp = co->split.pp, vp = co->split.vp;
  struct mr_dp_rebalance_in in = {dp, co->split.n_micro, co->split.dp_micro, o->busy, o->micro,
                                  co->split.global_batch,
                                  pp > 1 || h->grad_accum_steps > 0 || h->micro_batches > 0,
                                  (double)(pp - 1) / vp, vp > 1 ? pp : 1};
  struct mr_dp_rebalance_out out = {0, o->counts, 0, 0};
  double step = co->ranks.r[0].step_s;
  if (ok && step > 0 && mr_dp_rebalance(&in, &out) == 0) {
    o->gain = (out.now - out.then) / step;
    o->n_micro = out.n_micro;
  }
}

static void begin_dp_rebalance(struct coordinator *co, const struct dp_option *o) {
  char work[256] = "", now[256];
  for (int d = 0; d < o->dp && strlen(work) + 16 < sizeof work; d++)
    snprintf(work + strlen(work), sizeof work - strlen(work), "%s%.1f", d ? ", " : "",
             o->busy[d] * 1e3);
  format_counts(o->counts, o->dp, now, sizeof now);
  uint64_t *digests = calloc((size_t)co->world, sizeof *digests);
  double step_s = 0;
  int n_micro = o->n_micro == co->split.n_micro ? 0 : o->n_micro; /* 0: the plan's count */
  char *text = digests != NULL ? mr_plan_with_dp_split(co->opts->job, co->plan_text, co->world,
                                                       n_micro, o->counts, o->dp, digests,
                                                       &step_s)
                               : NULL;
  if (text == NULL) {
    MR_WARN("launch", "the data-parallel ranks run unbalanced (work per step by data rank: "
            "%s ms) but micro-batches %s cannot run: %s", work, now, mr_error_message());
    free(digests);
    return;
  }
  MR_WARN("launch", "the data-parallel ranks run unbalanced (work per step by data rank: %s ms): "
          "running %s of %d micro-batches cuts the step by about %.0f%%; writing a checkpoint, "
          "then starting again", work, now, o->dp * o->n_micro, 100.0 * o->gain);
  regroup_with(co, text, digests, step_s, REGROUP_DP_BALANCE);
}

struct node_option {
  int top;                    // the node's place in the group
  double worst, others, gain; // its work a step, the others' most, the share saved
};

/* Leaving out the busiest node's gain into o (0 when it does not apply). */
static void node_option(struct coordinator *co, struct node_option *o) {
  int n = co->n_group_nodes;
  memset(o, 0, sizeof *o);
  if (!elastic(co) || n - 1 < co->opts->min_nodes)
    return;
  double *node_busy = calloc((size_t)n, sizeof *node_busy); /* by place in the group */
  if (node_busy == NULL)
    return;
  for (int i = 0; i < co->world; i++) {
    const struct mr_rank *r = &co->ranks.r[i];
    if (r->busy_n < 2 * STRAGGLER_EVERY) {
      free(node_busy);
      return;
    }
    node_busy[i / co->node_ranks] = fmax(node_busy[i / co->node_ranks], r->busy_s);
  }
  /* only the busiest node can be worth leaving out: any other waits for it */
  for (int pos = 1; pos < n; pos++)
    o->top = node_busy[pos] > node_busy[o->top] ? pos : o->top;
  o->worst = node_busy[o->top];
  for (int pos = 0; pos < n; pos++)
    o->others = pos != o->top ? fmax(o->others, node_busy[pos]) : o->others;
  free(node_busy);
  double step = co->ranks.r[0].step_s;
  o->gain = o->top > 0 && o->worst - o->others > STRAGGLER_MIN_S && step > 0
                ? (o->worst - o->others - o->others / (n - 1)) / step : 0;
}

static void check_slow_ranks(struct coordinator *co) {
  double min_gain = replan_gain(co); /* 0 without a job (the self-check) */
  if (!(min_gain > 0))
    return;
  read_split(co);
  if (co->split.pp < 1)
    return;
  struct layer_option l;
  struct dp_option d;
  struct node_option k = {0};
  layer_option(co, &l);
  dp_option(co, &d);
  if (co->split.pp == 1)
    node_option(co, &k);
  double best = fmax(l.gain, fmax(d.gain, k.gain));
  enum regroup kind = !(best >= min_gain)  ? REGROUP_NONE
                      : best == l.gain ? REGROUP_BALANCE
                      : best == d.gain ? REGROUP_DP_BALANCE
                                       : REGROUP_SLOW_NODE;
  if (kind != REGROUP_NONE)
    MR_DEBUG("launch", "slow ranks: moving layers would save %.0f%% of the step, fewer "
             "micro-batches for the slow %.0f%%, leaving node %d out %.0f%%", 100.0 * l.gain,
             100.0 * d.gain, co->group_nodes[k.top], 100.0 * k.gain);
  co->slow_streak = kind == REGROUP_NONE ? 0 : kind == co->slow_kind ? co->slow_streak + 1 : 1;
  co->slow_kind = kind;
  if (kind != REGROUP_NONE && co->slow_streak >= STRAGGLER_STREAK) {
    co->slow_streak = 0;
    co->slow_kind = REGROUP_NONE;
    if (kind == REGROUP_BALANCE) {
      begin_rebalance(co, &l.out, co->split.pp * co->split.vp, co->split.pp);
    } else if (kind == REGROUP_DP_BALANCE) {
      begin_dp_rebalance(co, &d);
    } else {
      co->leaving = co->group_nodes[k.top];
      MR_WARN("launch", "node %d runs slow: %.1f ms of work a step against at most %.1f ms on "
              "the others; leaving it out (%d of %d nodes) cuts the step by about %.0f%%; "
              "writing a checkpoint, then starting again", co->leaving, k.worst * 1e3,
              k.others * 1e3, co->n_group_nodes - 1, co->nnodes, 100.0 * k.gain);
      ask_regroup(co, REGROUP_SLOW_NODE);
    }
  }
  layer_option_close(&l);
  dp_option_close(&d);
}

#define WARMUP_STEPS 2 // a group's first steps allocate and fill caches

/* Keeps rank 0's step time for the closing summary. */
static void record_step(struct coordinator *co, double step_s) {
  if (co->group_steps++ < WARMUP_STEPS)
    return;
  if (co->n_step_s == co->cap_step_s) {
    int cap = co->cap_step_s ? 2 * co->cap_step_s : 256;
    double *p = realloc(co->step_s, (size_t)cap * sizeof *p);
    if (p == NULL)
      return;
    co->step_s = p, co->cap_step_s = cap;
  }
  co->step_s[co->n_step_s++] = step_s;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The median of the recorded step times (sorts them), 0 when none. */
static double median_step(struct coordinator *co) {
  int n = co->n_step_s;
  if (n == 0)
    return 0;
  qsort(co->step_s, (size_t)n, sizeof *co->step_s, cmp_double);
  return n % 2 ? co->step_s[n / 2] : 0.5 * (co->step_s[n / 2 - 1] + co->step_s[n / 2]);
}

static void on_metrics(struct coordinator *co, struct mr_conn *c,
                       const Meshrun__Metrics *m) {
  struct mr_rank *r = &co->ranks.r[c->rank];
  double busy = m->step_time_s - m->comm_wait_s;
  busy = busy > 0 ? busy : 0;
  r->step_s = r->busy_n == 0 ? m->step_time_s : 0.8 * r->step_s + 0.2 * m->step_time_s;
  double micro = fmin(m->micro_work_s, busy);
  r->micro_s = r->busy_n == 0 ? micro : 0.8 * r->micro_s + 0.2 * micro;
  r->busy_s = r->busy_n++ == 0 ? busy : 0.8 * r->busy_s + 0.2 * busy;
  r->stage = m->stage;
  if (c->rank == 0 && m->step % STRAGGLER_EVERY == 0) {
    check_stragglers(co);
    check_slow_ranks(co);
  }
  r->step = m->step;
  if (m->peak_memory_bytes > r->peak_memory)
    r->peak_memory = m->peak_memory_bytes;
  if (c->rank != 0 || co->opts->selfcheck)
    return;
  record_step(co, m->step_time_s);
  uint64_t peak = 0, rss = 0;
  for (int i = 0; i < co->world; i++) {
    if (co->ranks.r[i].peak_memory > peak)
      peak = co->ranks.r[i].peak_memory;
    if (co->ranks.r[i].rss_peak > rss)
      rss = co->ranks.r[i].rss_peak;
  }
  if (co->metrics != NULL) {
    fprintf(co->metrics, "{\"step\": %lld", (long long)m->step);
    json_field(co->metrics, "loss", m->loss, "%.9g");
    json_field(co->metrics, "lr", m->lr, "%.9g");
    json_field(co->metrics, "grad_norm", m->grad_norm, "%.9g");
    json_field(co->metrics, "tokens_per_s", m->tokens_per_s, "%.6g");
    json_field(co->metrics, "loss_scale", m->loss_scale, "%.9g");
    json_field(co->metrics, "step_time_s", m->step_time_s, "%.6g");
    json_field(co->metrics, "comm_wait_s", m->comm_wait_s, "%.6g");
    fprintf(co->metrics, ", \"peak_memory_bytes\": %llu, \"skipped\": %s",
            (unsigned long long)peak, m->skipped ? "true" : "false");
    fprintf(co->metrics, ", \"rss_peak_bytes\": %llu", (unsigned long long)rss);
    if (!isnan(m->val_loss))
      json_field(co->metrics, "val_loss", m->val_loss, "%.9g");
    fprintf(co->metrics, ", \"restart\": %d}\n", co->restart);
    fflush(co->metrics);
  }
  mr_ranks_progress(&co->ranks, m, peak,
                    co->opts->job != NULL ? co->opts->job->train.steps : 0,
                    co->opts->job != NULL ? co->opts->job->train.log_interval_steps : 1);
}

static void on_message(void *ctx, struct mr_conn *c, const Meshrun__Envelope *env) {
  struct coordinator *co = ctx;
  if (c->node > 0) {
    mr_conn_close(c, "a node's launcher sends nothing after hello");
    return;
  }
  if (c->rank < 0) {
    if (env->msg_case == MESHRUN__ENVELOPE__MSG_HELLO)
      on_hello(co, c, env->hello);
    else
      mr_conn_close(c, "expected hello after authenticating");
    return;
  }
  co->ranks.r[c->rank].last_seen_ms = mr_clock_ms();
  switch (env->msg_case) {
  case MESHRUN__ENVELOPE__MSG_HEARTBEAT:
    mr_ranks_heartbeat(&co->ranks, c->rank, env->heartbeat);
    break;
  case MESHRUN__ENVELOPE__MSG_METRICS:
    on_metrics(co, c, env->metrics);
    break;
  case MESHRUN__ENVELOPE__MSG_REPORT:
    on_report(co, c, env->report);
    break;
  case MESHRUN__ENVELOPE__MSG_RENDEZVOUS:
    on_rendezvous(co, c, env->rendezvous);
    break;
  default: {
    char why[96];
    snprintf(why, sizeof why, "unexpected %s from a worker", mr_rpc_name(env));
    mr_conn_close(c, why);
  }
  }
}

static void on_conn_close(void *ctx, struct mr_conn *c) {
  struct coordinator *co = ctx;
  if (c->node > 0 && co->agents[c->node] == c) {
    co->agents[c->node] = NULL;
    int pos = group_pos(co, c->node);
    if (pos >= 0 && !co->gathering)
      group_fail(co, -1, "the launcher of node %d disconnected (its ranks %d..%d stop with it)",
                 c->node, pos * co->node_ranks, (pos + 1) * co->node_ranks - 1);
    else
      MR_WARN("launch", "the launcher of node %d disconnected", c->node);
    return;
  }
  if (c->rank < 0 || c->rank >= co->world || co->ranks.r[c->rank].conn != c)
    return;
  struct mr_rank *r = &co->ranks.r[c->rank];
  r->conn = NULL;
  if (r->remote) {
    r->exited = 1;
    if (!r->done)
      group_fail(co, c->rank, "rank %d (node %d, pid %d) disconnected before finishing its "
                 "job%s%s", c->rank, node_of(co, c->rank), r->pid, r->error[0] ? ": " : "",
                 r->error);
    return;
  }
  /* a rank that exited 0 is judged once all it sent has been read */
  if (r->exited && r->exit_status == 0 && !r->done)
    group_fail(co, c->rank, "rank %d (pid %d) exited before finishing its job", c->rank,
               r->pid);
}

static void on_connection(uv_stream_t *server, int status) {
  struct coordinator *co = server->data;
  if (status < 0) {
    MR_WARN("rpc", "accept: %s", uv_strerror(status));
    return;
  }
  struct mr_conn_callbacks cb = {.ctx = co, .on_message = on_message,
                                 .on_close = on_conn_close};
  int is_tcp = server == (uv_stream_t *)&co->tcp_server;
  mr_conn_accept(server, is_tcp, co->token, &cb, ++co->next_conn_id);
}

/* Appends, for every open rendezvous, the ranks that have not joined it. */
static void describe_rendezvous(const struct coordinator *co, char *buf, size_t n) {
  size_t used = strlen(buf);
  for (const struct rendezvous *r = co->rdv; r != NULL && used < n; r = r->next) {
    int w = snprintf(buf + used, n - used, "\n  rendezvous \"%s\": %d of %d arrived; missing:",
                     r->key, r->have, r->n);
    if (w < 0)
      return;
    used += (size_t)w;
    for (int i = 0; i < r->n && used < n; i++)
      if (r->blobs[i].data == NULL) {
        w = snprintf(buf + used, n - used, " rank %d", i);
        if (w < 0)
          return;
        used += (size_t)w;
      }
  }
}

/* No rank has completed an instruction for the hang timeout: say what
 * each one is doing and who the others wait for, then fail the group. */
static void check_hang(struct coordinator *co, int64_t now) {
  if (co->opts->hang_timeout_s <= 0)
    return;
  int64_t limit = (int64_t)(co->opts->hang_timeout_s * 1000.0);
  int64_t newest = 0;
  int live = 0;
  for (int i = 0; i < co->world; i++) {
    const struct mr_rank *r = &co->ranks.r[i];
    if (r->exited || r->conn == NULL || r->done)
      continue;
    live++;
    if (r->progress_ms > newest)
      newest = r->progress_ms;
  }
  if (live == 0 || now - newest <= limit)
    return;
  char where[4096];
  mr_ranks_describe_positions(&co->ranks, where, sizeof where);
  describe_rendezvous(co, where, sizeof where);
  /* the culprit: a rank that waits on nothing while others wait */
  int culprit = -1;
  for (int i = 0; i < co->world && culprit < 0; i++) {
    const struct mr_rank *r = &co->ranks.r[i];
    if (!r->exited && !r->done && r->waiting_on < 0)
      culprit = i;
  }
  char who[96] = "";
  if (culprit >= 0)
    snprintf(who, sizeof who, "; rank %d is stuck outside communication", culprit);
  group_fail(co, culprit, "hang: no rank made progress for %.1f s%s:%s",
             (double)(now - newest) / 1000.0, who, where);
}

/* ---- the group ----------------------------------------------------------- */

static void on_rank_exit(void *ctx, int rank, int64_t status, int signal);

/* A training job with a checkpoint folder resumes from its newest complete
 * checkpoint (an incomplete or corrupt one is skipped with a warning). */
static void choose_resume(struct coordinator *co) {
  co->resume_dir[0] = '\0';
  co->resume_step = 0;
  const struct mr_job *job = co->opts->job;
  if (co->opts->selfcheck || job == NULL || job->checkpoint.dir == NULL)
    return;
  int64_t step;
  if (mr_ckpt_find_latest(job->checkpoint.dir, co->resume_dir, sizeof co->resume_dir, &step) == 1) {
    co->resume_step = step;
    MR_INFO("ckpt", "resuming from %s (step %lld)", co->resume_dir, (long long)step);
  } else {
    co->resume_dir[0] = '\0';
  }
}

static int nodes_connected(const struct coordinator *co) {
  int n = 1;
  for (int k = 1; k < co->nnodes; k++)
    n += co->agents[k] != NULL;
  return n;
}

/* The plan for a group of `world` ranks: the launch's for all the nodes,
 * else the search run again for the ranks there are. */
static int plan_for(struct coordinator *co, int world) {
  const struct mr_launch_opts *o = co->opts;
  if (world == o->nproc || o->job == NULL) {
    co->plan_text = o->job != NULL ? o->job->text : NULL;
    co->digests = o->program_digests;
    if (co->predicted_s != o->predicted_step_s)
      co->predicted_s = o->predicted_step_s, co->n_step_s = 0;
    return 0;
  }
  co->plan_text = NULL;
  co->digests = NULL;
  struct mr_strategy_choice choice;
  int rc = mr_strategy_choose(o->job, world, &choice);
  char *text = rc == 0 ? mr_strategy_apply(o->job, &choice.chosen.strategy) : NULL;
  if (rc == 0 && text == NULL)
    rc = MR_ENOMEM;
  if (rc == 0) {
    adopt_plan(co, text, choice.program_digests, choice.chosen.cost.step_time_s);
    choice.program_digests = NULL;
    MR_WARN("launch", "re-planned for %d ranks on %d node%s:", world, co->n_group_nodes,
            co->n_group_nodes == 1 ? "" : "s");
    mr_strategy_print(&choice, stdout);
    fflush(stdout);
  }
  mr_strategy_choice_close(&choice);
  return rc;
}

/* Starts a group on its nodes: every node in its place, or for an elastic
 * job the nodes connected now, numbered in node order. */
static int begin_group(struct coordinator *co) {
  co->n_group_nodes = 0;
  co->group_steps = 0;
  for (int k = 0; k < co->nnodes; k++)
    if ((!elastic(co) || k == 0 || co->agents[k] != NULL) && !co->left_out[k])
      co->group_nodes[co->n_group_nodes++] = k;
  int world = co->n_group_nodes * co->node_ranks;
  if (world != co->world) {
    int rc = plan_for(co, world);
    if (rc < 0) {
      group_fail(co, -1, "no plan for %d ranks on %d nodes: %s", world, co->n_group_nodes,
                 mr_error_message());
      return rc;
    }
    co->world = world;
    mr_ranks_renumber(&co->ranks, world, 0);
  }
  struct mr_spawn_env env = {
      .worker_bin = co->opts->worker_bin,
      .coord_address = co->unix_address,
      .master_addr = co->master_addr,
      .master_port = co->master_port,
      .job_id = co->job_id,
      .token_fd = co->token_fd,
      .restart = co->restart,
      .threads = co->opts->threads,
      .log_dir = co->opts->log_dir,
      .world = co->world,
  };
  int rc = mr_ranks_spawn_all(&co->ranks, &env);
  if (rc < 0) {
    group_fail(co, -1, "could not start the workers: %s", mr_error_message());
    return rc;
  }
  for (int i = 1; i < co->n_group_nodes; i++)
    send_node_control(co, co->group_nodes[i], MESHRUN__CONTROL__KIND__START);
  return 0;
}

static int start_group(struct coordinator *co) {
  rendezvous_clear(co);
  pending_clear(co);
  choose_resume(co);
  co->phase = PHASE_RUNNING;
  co->failure[0] = '\0';
  co->failed_rank = -1;
  co->pending = REGROUP_NONE;
  co->slow_kind = REGROUP_NONE;
  co->slow_streak = 0;
  co->split_known = 0;
  mr_split_close(&co->split);
  if (elastic(co) && nodes_connected(co) < co->nnodes) { /* wait for the others a while */
    co->gathering = 1;
    co->gather_ms = mr_clock_ms();
    MR_INFO("launch", "%d of %d nodes here: waiting up to %.0f s for the others",
            nodes_connected(co), co->nnodes, co->opts->join_timeout_s);
    return 0;
  }
  return begin_group(co);
}

static void finish(struct coordinator *co, int code) {
  if (co->phase == PHASE_FINISHED)
    return;
  co->phase = PHASE_FINISHED;
  co->exit_code = code;
  uv_timer_stop(&co->tick);
  uv_close((uv_handle_t *)&co->tick, NULL);
  uv_close((uv_handle_t *)&co->unix_server, NULL);
  uv_close((uv_handle_t *)&co->tcp_server, NULL);
  uv_close((uv_handle_t *)&co->sigint, NULL);
  uv_close((uv_handle_t *)&co->sigterm, NULL);
  uv_close((uv_handle_t *)&co->sigusr1, NULL);
  mr_ranks_close_conns(&co->ranks);
  for (int k = 1; k < co->nnodes; k++) { /* the verdict, then the connection */
    send_node_control(co, k, MESHRUN__CONTROL__KIND__FINISH);
    if (co->agents[k] != NULL)
      mr_conn_close(co->agents[k], NULL);
  }
}

/* Called when every worker of a stopping group has exited. */
static void group_stopped(struct coordinator *co) {
  /* a rank killed while its group was being created leaves the segment */
  int swept = mr_comm_shm_sweep(co->job_id);
  if (swept > 0)
    MR_INFO("launch", "removed %d shared-memory segment%s left by the stopped group", swept,
            swept == 1 ? "" : "s");
  if (co->preempting && co->stop_signal == 0) {
    finish(co, 0);
    return;
  }
  if (co->stop_signal != 0) {
    finish(co, 128 + co->stop_signal);
    return;
  }
  if (co->regroup != REGROUP_NONE) { /* not a failure */
    MR_WARN("launch", "starting the group again %s",
            co->regroup == REGROUP_NODES     ? "with the nodes that have joined"
            : co->regroup == REGROUP_BALANCE ? "with the pipeline re-balanced"
            : co->regroup == REGROUP_DP_BALANCE
                ? "with the data-parallel ranks' micro-batches re-balanced"
                                             : "without the slow node");
    co->regroup = REGROUP_NONE;
    co->restart++;
    co->phase = PHASE_RUNNING;
    co->failed_rank = -1;
    start_group(co);
    return;
  }
  if (co->failures < co->opts->max_restarts) {
    co->failures++;
    co->restart++;
    int64_t backoff = mr_tunable_int(MR_TUNABLE_RESTART_BACKOFF_MS);
    for (int i = 1; i < co->failures && backoff < 60000; i++)
      backoff *= 2;
    MR_WARN("launch", "restarting the group (restart %d of %d)%s", co->failures,
            co->opts->max_restarts, backoff > 0 ? " after a pause" : "");
    co->restart_at_ms = mr_clock_ms() + backoff;
    co->phase = PHASE_RUNNING;
    co->failed_rank = -1;
    if (backoff <= 0)
      start_group(co);
    else
      co->ranks.waiting_restart = 1;
    return;
  }
  mr_ranks_report_failure(&co->ranks, co->failed_rank, co->failure, co->opts->max_restarts);
  finish(co, 1);
}

static void on_rank_exit(void *ctx, int rank, int64_t status, int signal) {
  struct coordinator *co = ctx;
  struct mr_rank *r = &co->ranks.r[rank];
  if (co->phase == PHASE_RUNNING) {
    char why[160] = "";
    if (signal == SIGKILL && r->rss_peak > 0) /* not ours: we were running */
      snprintf(why, sizeof why, " (the kernel's out-of-memory killer sends it: the rank's "
               "resident size had reached %.0f MiB)", (double)r->rss_peak / 1048576.0);
    if (signal != 0)
      group_fail(co, rank, "rank %d (pid %d) was killed by signal %d (%s)%s", rank, r->pid,
                 signal, sigabbrev_np(signal) ? sigabbrev_np(signal) : "?", why);
    else if (status != 0)
      group_fail(co, rank, "rank %d (pid %d) exited with status %lld%s%s", rank, r->pid,
                 (long long)status, r->error[0] ? ": " : "", r->error);
    else if (!r->done && r->conn == NULL)
      group_fail(co, rank, "rank %d (pid %d) exited before finishing its job", rank, r->pid);
    /* else its last reports may still be unread: on_conn_close decides */
  }
}

static void on_tick(uv_timer_t *t) {
  struct coordinator *co = t->data;
  int64_t now = mr_clock_ms();
  if (co->phase == PHASE_RUNNING && co->ranks.waiting_restart) {
    if (now >= co->restart_at_ms) {
      co->ranks.waiting_restart = 0;
      start_group(co);
    }
    return;
  }
  if (co->phase == PHASE_RUNNING && co->gathering) {
    int have = nodes_connected(co);
    int64_t waited = now - co->gather_ms, limit = (int64_t)(co->opts->join_timeout_s * 1000.0);
    if (have == co->nnodes || (waited > limit && have >= co->opts->min_nodes)) {
      co->gathering = 0;
      begin_group(co);
    } else if (waited > limit) {
      co->gathering = 0;
      group_fail(co, -1, "%d of the %d nodes needed (--nnodes %d:%d) joined within %.0f s",
                 have, co->opts->min_nodes, co->opts->min_nodes, co->nnodes,
                 co->opts->join_timeout_s);
    }
    return;
  }
  if (co->phase == PHASE_RUNNING && co->preempting &&
      now - co->preempt_started_ms > mr_tunable_int(MR_TUNABLE_PREEMPT_GRACE_MS)) {
    MR_ERROR("launch", "no checkpoint within %.1f s of SIGTERM: stopping without one",
             (double)mr_tunable_int(MR_TUNABLE_PREEMPT_GRACE_MS) / 1000.0);
    co->stop_signal = SIGTERM;
    begin_stop(co);
    return;
  }
  if (co->phase == PHASE_RUNNING) {
    int64_t hb = (int64_t)(co->opts->heartbeat_timeout_s * 1000.0);
    int64_t conn_timeout = mr_tunable_int(MR_TUNABLE_CONNECT_TIMEOUT_MS);
    int all_done = 1;
    int64_t join_timeout = (int64_t)(co->opts->join_timeout_s * 1000.0);
    for (int i = 0; i < co->world; i++) {
      struct mr_rank *r = &co->ranks.r[i];
      if (!r->exited || !r->done || r->exit_status != 0)
        all_done = 0;
      if (r->exited)
        continue;
      if (r->remote && !r->registered && now - r->spawn_ms > join_timeout) {
        int k = node_of(co, i);
        group_fail(co, i, "rank %d did not register within %.1f s: %s", i,
                   (double)join_timeout / 1000.0,
                   co->agents[k] != NULL ? "its node's launcher did not start it"
                                         : "no launcher joined as its node (is `meshrun launch "
                                           "--node-rank` running there?)");
        return;
      }
      if (!r->remote && !r->registered && now - r->spawn_ms > conn_timeout) {
        group_fail(co, i, "rank %d (pid %d) did not register within %.1f s", i, r->pid,
                   (double)conn_timeout / 1000.0);
        return;
      }
      if (r->conn != NULL && now - r->last_seen_ms > hb) {
        group_fail(co, i, "rank %d (pid %d) sent no heartbeat for %.1f s (stopped or hung)",
                   i, r->pid, (double)(now - r->last_seen_ms) / 1000.0);
        /* a stopped process cannot act on SIGTERM */
        mr_ranks_signal(&co->ranks, i, SIGKILL);
        return;
      }
    }
    check_hang(co, now);
    if (co->phase != PHASE_RUNNING)
      return;
    if (all_done && mr_ranks_all_closed(&co->ranks)) {
      if (co->opts->selfcheck)
        printf("meshrun: self-check passed: %d ranks registered, authenticated, "
               "exchanged a rendezvous and reported the expected digests\n",
               co->world);
      mr_ranks_print_summary(&co->ranks, median_step(co), co->n_step_s, co->predicted_s);
      finish(co, 0);
    }
    return;
  }
  if (co->phase == PHASE_STOPPING) {
    if (mr_ranks_all_exited(&co->ranks)) {
      if (mr_ranks_all_closed(&co->ranks))
        group_stopped(co);
      return;
    }
    if (!co->killed && now - co->stop_started_ms > mr_tunable_int(MR_TUNABLE_STOP_GRACE_MS)) {
      MR_WARN("launch", "workers still running after %.1f s: killing them",
              (double)mr_tunable_int(MR_TUNABLE_STOP_GRACE_MS) / 1000.0);
      mr_ranks_signal_all(&co->ranks, SIGKILL);
      for (int i = co->ranks.local; i < co->ranks.n; i++) /* their nodes kill them */
        if (co->ranks.r[i].conn != NULL)
          mr_conn_close(co->ranks.r[i].conn, "still connected after the stop grace");
      co->killed = 1;
    }
  }
}

/* ---- setup ----------------------------------------------------------- */

int mr_bind_parse(const char *bind, char *host, size_t hn, int *port) {
  const char *colon = strrchr(bind, ':');
  if (colon == NULL || colon == bind || (size_t)(colon - bind) >= hn)
    return mr_error_set(MR_EINVAL, "--bind %s: expected HOST:PORT", bind);
  char *end;
  long p = strtol(colon + 1, &end, 10);
  if (*end != '\0' || p < 0 || p > 65535)
    return mr_error_set(MR_EINVAL, "--bind %s: port must be 0..65535", bind);
  memcpy(host, bind, (size_t)(colon - bind));
  host[colon - bind] = '\0';
  if (host[0] == '[') { /* [::1] */
    size_t l = strlen(host);
    memmove(host, host + 1, l);
    if (l >= 2 && host[l - 2] == ']')
      host[l - 2] = '\0';
  }
  *port = (int)p;
  struct sockaddr_storage sa;
  if (uv_ip4_addr(host, *port, (struct sockaddr_in *)&sa) != 0 &&
      uv_ip6_addr(host, *port, (struct sockaddr_in6 *)&sa) != 0)
    return mr_error_set(MR_EINVAL, "--bind %s: not an IP address", bind);
  return 0;
}

static int listen_all(struct coordinator *co) {
  int swept = mr_sockdir_sweep("/tmp");
  if (swept > 0)
    MR_DEBUG("launch", "removed %d socket folders of launchers that died", swept);
  MR_TRY(mr_sockdir_make("/tmp", co->sock_dir, sizeof co->sock_dir, &co->sock_lock_fd));
  snprintf(co->unix_path, sizeof co->unix_path, "%s/" MR_SOCKDIR_SOCKET, co->sock_dir);
  snprintf(co->unix_address, sizeof co->unix_address, "unix:%s", co->unix_path);
  int rc = uv_pipe_init(&co->loop, &co->unix_server, 0);
  if (rc == 0)
    rc = uv_pipe_bind(&co->unix_server, co->unix_path);
  if (rc == 0)
    rc = uv_listen((uv_stream_t *)&co->unix_server, 128, on_connection);
  if (rc < 0)
    return mr_error_set(MR_ESYS, "listen on %s: %s", co->unix_path, uv_strerror(rc));
  co->unix_server.data = co;

  char host[64];
  int port = 0;
  MR_TRY(mr_bind_parse(co->opts->bind, host, sizeof host, &port)); /* an address */
  struct sockaddr_storage sa;
  if (uv_ip4_addr(host, port, (struct sockaddr_in *)&sa) != 0)
    uv_ip6_addr(host, port, (struct sockaddr_in6 *)&sa);
  uv_tcp_init(&co->loop, &co->tcp_server);
  co->tcp_server.data = co;
  rc = uv_tcp_bind(&co->tcp_server, (struct sockaddr *)&sa, 0);
  if (rc == 0)
    rc = uv_listen((uv_stream_t *)&co->tcp_server, 128, on_connection);
  if (rc < 0)
    return mr_error_set(MR_ESYS, "listen on %s: %s%s", co->opts->bind, uv_strerror(rc),
                        rc == UV_EADDRINUSE ? " (another process has the port: --master, or "
                                              "--bind, can name another)" : "");
  int len = sizeof sa;
  uv_tcp_getsockname(&co->tcp_server, (struct sockaddr *)&sa, &len);
  co->master_port = sa.ss_family == AF_INET ? ntohs(((struct sockaddr_in *)&sa)->sin_port)
                                            : ntohs(((struct sockaddr_in6 *)&sa)->sin6_port);
  snprintf(co->master_addr, sizeof co->master_addr, "%s",
           co->opts->master_host != NULL ? co->opts->master_host : host);
  return 0;
}

static int write_coordinator_file(struct coordinator *co) {
  char path[1024];
  snprintf(path, sizeof path, "%s/coordinator.json", co->opts->log_dir);
  FILE *f = fopen(path, "w");
  if (f == NULL)
    return mr_error_set(MR_EIO, "%s: %s", path, strerror(errno));
  fprintf(f,
          "{\"job_id\": \"%s\", \"pid\": %d, \"unix\": \"unix:%s\", "
          "\"tcp\": \"tcp:%s:%d\", \"world_size\": %d, \"nodes\": %d}\n",
          co->job_id, (int)getpid(), co->unix_path, co->master_addr, co->master_port,
          co->opts->nproc, co->nnodes);
  fclose(f);
  return 0;
}

/* The job token: fresh, or the one in opts->token_file (which other
 * nodes read), written there first when the file does not exist. */
static int make_token(struct coordinator *co) {
  const char *path = co->opts->token_file;
  if (path == NULL) {
    mr_auth_random(co->token, sizeof co->token);
    return 0;
  }
  int rc = mr_auth_token_read_file(path, co->token);
  if (rc != MR_ENOENT)
    return rc;
  mr_auth_random(co->token, sizeof co->token);
  rc = mr_auth_token_write_file(path, co->token);
  if (rc < 0 && access(path, F_OK) == 0) /* another writer won: use its token */
    rc = mr_auth_token_read_file(path, co->token);
  return rc;
}

/* Closes whatever an early failure left open, so the loop can close. */
static void close_walk(uv_handle_t *h, void *arg) {
  (void)arg;
  if (!uv_is_closing(h))
    uv_close(h, NULL);
}

int mr_coordinator_run(const struct mr_launch_opts *opts) {
  struct coordinator *co = calloc(1, sizeof *co);
  if (co == NULL)
    return 1;
  co->opts = opts;
  co->token_fd = -1;
  co->sock_lock_fd = -1;
  co->failed_rank = -1;
  co->last_ckpt_step = -1;
  co->predicted_s = opts->predicted_step_s;
  int code = 1;
  if (mr_auth_init() < 0)
    goto out;
  co->nnodes = opts->nnodes > 1 ? opts->nnodes : 1;
  co->node_ranks = opts->node_ranks > 0 ? opts->node_ranks : opts->nproc;
  co->agents = calloc((size_t)co->nnodes, sizeof *co->agents);
  co->group_nodes = calloc((size_t)co->nnodes, sizeof *co->group_nodes);
  co->left_out = calloc((size_t)co->nnodes, 1);
  if (co->agents == NULL || co->group_nodes == NULL || co->left_out == NULL)
    goto out;
  co->world = opts->nproc; /* the launch planned for every node */
  co->n_group_nodes = co->nnodes;
  for (int k = 0; k < co->nnodes; k++)
    co->group_nodes[k] = k;
  plan_for(co, co->world);
  if (make_token(co) < 0) {
    MR_ERROR("launch", "%s", mr_error_message());
    goto out;
  }
  uint8_t id[8];
  mr_auth_random(id, sizeof id);
  sodium_bin2hex(co->job_id, sizeof co->job_id, id, sizeof id);
  uv_loop_init(&co->loop);
  if (listen_all(co) < 0 || (co->token_fd = mr_auth_token_memfd(co->token)) < 0 ||
      write_coordinator_file(co) < 0) {
    MR_ERROR("launch", "%s", mr_error_message());
    goto close_loop;
  }
  const char *mpath = opts->metrics_path;
  char mbuf[1024];
  if (mpath == NULL && !opts->selfcheck) {
    snprintf(mbuf, sizeof mbuf, "%s/metrics.jsonl", opts->log_dir);
    mpath = mbuf;
  }
  if (mpath != NULL && (co->metrics = fopen(mpath, "a")) == NULL) {
    MR_ERROR("launch", "metrics file %s: %s", mpath, strerror(errno));
    goto close_loop;
  }
  if (mr_ranks_init(&co->ranks, &co->loop, opts->nproc, co->node_ranks, 0, opts->log_dir, co,
                    on_rank_exit) < 0) {
    MR_ERROR("launch", "%s", mr_error_message());
    goto close_loop;
  }
  uv_signal_init(&co->loop, &co->sigint);
  uv_signal_init(&co->loop, &co->sigterm);
  co->sigint.data = co->sigterm.data = co;
  uv_signal_start(&co->sigint, on_signal, SIGINT);
  uv_signal_start(&co->sigterm, on_signal, SIGTERM);
  uv_signal_init(&co->loop, &co->sigusr1);
  co->sigusr1.data = co;
  uv_signal_start(&co->sigusr1, on_usr1, SIGUSR1);
  uv_timer_init(&co->loop, &co->tick);
  co->tick.data = co;
  uv_timer_start(&co->tick, on_tick, 20, 20);
  MR_INFO("launch", "job %s: %d ranks%s, logs in %s, coordinator on unix:%s and tcp:%s:%d",
          co->job_id, opts->nproc, co->nnodes > 1 ? " on several nodes" : "", opts->log_dir,
          co->unix_path, co->master_addr, co->master_port);
  start_group(co);
  uv_run(&co->loop, UV_RUN_DEFAULT);
  code = co->exit_code;
  mr_ranks_close(&co->ranks);
  uv_run(&co->loop, UV_RUN_DEFAULT);
  mr_comm_shm_sweep(co->job_id);
close_loop:
  rendezvous_clear(co);
  pending_clear(co);
  if (co->metrics != NULL)
    fclose(co->metrics);
  if (co->token_fd >= 0)
    close(co->token_fd);
  if (co->sock_dir[0] != '\0')
    mr_sockdir_remove(co->sock_dir, co->sock_lock_fd);
  uv_walk(&co->loop, close_walk, NULL);
  uv_run(&co->loop, UV_RUN_DEFAULT);
  uv_loop_close(&co->loop);
out:
  sodium_memzero(co->token, sizeof co->token);
  mr_split_close(&co->split);
  free(co->balanced_text), free(co->balanced_digests);
  free(co->own_text), free(co->own_digests);
  free(co->step_s);
  free(co->left_out);
  free(co->group_nodes);
  free(co->agents);
  free(co);
  return code;
}
