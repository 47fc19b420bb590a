/* coordinator_internal.h - the coordinator's state, shared by the files of
 * the launcher's event loop: coordinator.c (listening, signals, each
 * group's life), messages.c (what the ranks and nodes send: registration,
 * rendezvous, reports, checkpoints, metrics) and slow_ranks.c (ranks that
 * run slow: named, layers or micro-batches moved off them, their node
 * left out).  Everything runs on the loop's thread but the plans made in
 * launcher/plan_work.c, which read nothing of this.  Not for use outside
 * them: launcher/coordinator.h is the interface. */
#ifndef MR_COORDINATOR_INTERNAL_H
#define MR_COORDINATOR_INTERNAL_H

#include <stdint.h>
#include <stdio.h>
#include <uv.h>

#include "common/auth.h"
#include "launcher/conn.h"
#include "launcher/coordinator.h"
#include "launcher/ranks.h"
#include "launcher/rebalance.h"
#include "proto/meshrun.pb-c.h"

/* Why a group stops to start again without a failure. */
enum regroup {
  REGROUP_NONE = 0,
  REGROUP_NODES,
  REGROUP_BALANCE,    // the pipeline's layers moved
  REGROUP_DP_BALANCE, // the data-parallel ranks' micro-batches moved
  REGROUP_SLOW_NODE
};

/* A group's life.  Only group_enter (coordinator.c) changes it.
 *
 *   a group starts   GATHERING (an elastic job short of nodes), PLANNING
 *                    (a world other than the plan's) or RUNNING
 *   GATHERING        -> PLANNING or RUNNING once the nodes are there
 *   PLANNING         -> RUNNING once the plan is made
 *   RUNNING          -> FINISHED when every rank is done
 *   any but FINISHED -> STOPPING on a failure, a signal or a regroup
 *   STOPPING         -> (every worker exited) the next group, BACKOFF
 *                       after a failure, or FINISHED
 *   BACKOFF          -> the next group */
enum group_state {
  GROUP_GATHERING, // an elastic job waits a while for its nodes to join
  GROUP_PLANNING,  // the plan for the group's world is made off the loop
  GROUP_RUNNING,   // the ranks are starting or training
  GROUP_STOPPING,  // waiting for every worker to exit
  GROUP_BACKOFF,   // the pause after a failure before the next group
  GROUP_FINISHED,  // the loop is closing down
};

struct mr_plan_work;

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
  struct mr_preauth preauth_unix, preauth_tcp; // each listener's connections
                            //   waiting to authenticate (launcher/conn.h)
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
  int64_t last_tick_ms;     // when on_tick last ran (or the loop began)
  const char *plan_text;    // the plan body the workers get, and their
  const uint64_t *digests;  //   programs' digests: the launch's, or
  char *own_text;           //   one made here (re-planned for another world,
  uint64_t *own_digests;    //   or re-balanced), owned
  double predicted_s;       // the plan's predicted step time (0: none)
  double *step_s;           // rank 0's step times under that plan, past
  int n_step_s, cap_step_s; //   each group's first WARMUP_STEPS
  int group_steps;          // rank 0's steps reported in this group
  enum group_state state;
  int64_t state_ms;         // when it was entered
  struct mr_plan_work *planning; // the plan being made off the loop (for
                            //   PLANNING, or a regroup's while RUNNING), or 0
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
  struct mr_tb_writer *tb;  // TensorBoard's event file beside the metrics
  struct mr_run_log *run_log; // run.jsonl: plans, failures, restarts, memory
  int64_t last_step_printed;
  int failure_reported;
  char failure[16384];      // why the current group is stopping
  int failed_rank;
};

/* The slow-rank checks run every STRAGGLER_EVERY steps of rank 0. */
#define STRAGGLER_EVERY 5  // steps between checks
#define STRAGGLER_STREAK 3 // checks in a row that name a rank slow
#define STRAGGLER_MIN_S 0.005 // a lead too small to tell from noise

/* An elastic job (--nnodes MIN:MAX) goes on with the nodes it has. */
int mr__co_elastic(const struct coordinator *co);

/* The node that runs rank r in the current group. */
int mr__co_node_of(const struct coordinator *co, int r);

/* The newest step any rank has reached: a checkpoint asked for now is of
 * it or a later one. */
int64_t mr__co_newest_step(const struct coordinator *co);

/* Asks for the checkpoint a regroup of this kind starts again from; once
 * it is complete the group stops and starts again (running
 * co->balanced_text for REGROUP_BALANCE and REGROUP_DP_BALANCE, without
 * co->leaving for REGROUP_SLOW_NODE). */
void mr__co_ask_regroup(struct coordinator *co, enum regroup kind);

/* The first failure of a group names it (logged, the group stopped);
 * later ones are consequences. */
void mr__co_group_fail(struct coordinator *co, int rank, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Stops the group: STOP to every rank and node, SIGTERM to local ranks;
 * on_tick escalates and group_stopped decides what follows. */
void mr__co_begin_stop(struct coordinator *co);

/* The group can still fail or stop: it is not stopping or finished. */
int mr__co_live(const struct coordinator *co);

/* Node k's place in the current group, or -1. */
int mr__co_group_pos(const struct coordinator *co, int k);

/* Tells the launcher of node k (when connected) to start its ranks for the
 * current group, to stop them, or the job's exit code. */
void mr__co_send_node_control(struct coordinator *co, int k, Meshrun__Control__Kind kind);

/* The plan the next groups run becomes text (with its programs' digests),
 * owned by the coordinator from then on. */
void mr__co_adopt_plan(struct coordinator *co, char *text, uint64_t *digests, double predicted_s);

/* Every rank's peak memory and resident size into run.jsonl when they
 * moved (launcher/run_log.h), as of rank 0's step. */
void mr__co_log_memory(struct coordinator *co, int64_t step);

/* Frees one rendezvous and what it gathered. */
void mr__co_rendezvous_free(struct rendezvous *r);

/* messages.c.  A connection accepted on either listening socket, read by
 * the message handlers (uv_connection_cb; the server's data is co). */
void mr__co_on_connection(uv_stream_t *server, int status);

/* A connection closed: a rank's fails the group unless it finished; a
 * node's launcher's takes its ranks with it (struct mr_conn_callbacks). */
void mr__co_on_conn_close(void *ctx, struct mr_conn *c);

/* Drops the checkpoints whose files are still being gathered. */
void mr__co_pending_clear(struct coordinator *co);

/* The median of the recorded step times (sorts them), 0 when none. */
double mr__co_median_step(struct coordinator *co);

/* slow_ranks.c.  Names a rank whose work per step stays well above that
 * of the other ranks of its stage, once per group. */
void mr__co_check_stragglers(struct coordinator *co);

/* Weighs moving layers, fewer micro-batches for a slow data rank and
 * leaving a slow node out, and asks for the regroup that saves the most
 * once it is worth it in STRAGGLER_STREAK checks running. */
void mr__co_check_slow_ranks(struct coordinator *co);

#endif
