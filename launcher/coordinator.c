/* coordinator.c - the launcher's event loop: listening, the job token,
 * signals, and each group's life (planned for its nodes, started, watched
 * for hangs and silent ranks, stopped, restarted or finished).  Worker
 * processes and their output live in launcher/ranks.c; the messages the
 * ranks send are handled in messages.c, ranks that run slow in
 * slow_ranks.c (the state they share: coordinator_internal.h). */
#include "launcher/coordinator_internal.h"

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
#include "common/file.h"
#include "common/log.h"
#include "common/rpc.h"
#include "common/tunable.h"
#include "launcher/cli.h"
#include "launcher/conn.h"
#include "launcher/plan_work.h"
#include "launcher/ranks.h"
#include "launcher/rebalance.h"
#include "launcher/run_log.h"
#include "launcher/sockdir.h"
#include "launcher/strategy_choice.h"
#include "launcher/tb_events.h"
#include "common/shm_name.h"

void mr__co_rendezvous_free(struct rendezvous *r) {
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
    mr__co_rendezvous_free(r);
  }
}

/* An elastic job (--nnodes MIN:MAX) goes on with the nodes it has. */
int mr__co_elastic(const struct coordinator *co) {
  return co->opts->min_nodes > 0 && co->opts->min_nodes < co->nnodes;
}

/* Node k's place in the current group, or -1. */
int mr__co_group_pos(const struct coordinator *co, int k) {
  for (int i = 0; i < co->n_group_nodes; i++)
    if (co->group_nodes[i] == k)
      return i;
  return -1;
}

/* The node that runs rank r in the current group. */
int mr__co_node_of(const struct coordinator *co, int r) {
  return co->group_nodes[r / co->node_ranks];
}

/* Tells the launcher of node k (when connected) to start its ranks for the
 * current group, to stop them, or the job's exit code. */
void mr__co_send_node_control(struct coordinator *co, int k, Meshrun__Control__Kind kind) {
  if (co->agents == NULL || co->agents[k] == NULL)
    return;
  Meshrun__Control ctl = MESHRUN__CONTROL__INIT;
  ctl.kind = kind;
  ctl.restart = (uint32_t)co->restart;
  ctl.world_size = co->world;
  if (kind == MESHRUN__CONTROL__KIND__START) /* to a node of the group */
    ctl.first_rank = mr__co_group_pos(co, k) * co->node_ranks;
  ctl.exit_code = co->exit_code; /* FINISH */
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_CONTROL;
  env.control = &ctl;
  mr_conn_send(co->agents[k], &env);
}

/* The newest step any rank has reached: a checkpoint asked for now is of
 * it or a later one. */
int64_t mr__co_newest_step(const struct coordinator *co) {
  int64_t s = 0;
  for (int i = 0; i < co->world; i++)
    if (co->ranks.r[i].step > s)
      s = co->ranks.r[i].step;
  return s;
}

/* Asks for the checkpoint a regroup of this kind starts again from. */
void mr__co_ask_regroup(struct coordinator *co, enum regroup kind) {
  co->pending = kind;
  co->pending_step = mr__co_newest_step(co);
  mr_ranks_send_control(&co->ranks, MESHRUN__CONTROL__KIND__CHECKPOINT_NOW);
}

/* The plan the next groups run becomes text (with its programs' digests),
 * owned here. */
void mr__co_adopt_plan(struct coordinator *co, char *text, uint64_t *digests, double predicted_s) {
  free(co->own_text), free(co->own_digests);
  co->own_text = text, co->own_digests = digests;
  co->plan_text = text, co->digests = digests;
  co->predicted_s = predicted_s;
  co->n_step_s = 0; /* measured under another plan */
}

static const char *const state_names[] = {
    [GROUP_GATHERING] = "gathering", [GROUP_PLANNING] = "planning",
    [GROUP_RUNNING] = "running",     [GROUP_STOPPING] = "stopping",
    [GROUP_BACKOFF] = "back-off",    [GROUP_FINISHED] = "finished",
};

/* The one place the group's state changes (coordinator_internal.h draws
 * the transitions). */
static void group_enter(struct coordinator *co, enum group_state s) {
  MR_DEBUG("launch", "group %d: %s -> %s", co->restart, state_names[co->state], state_names[s]);
  co->state = s;
  co->state_ms = mr_clock_ms();
}

int mr__co_live(const struct coordinator *co) {
  return co->state != GROUP_STOPPING && co->state != GROUP_FINISHED;
}

void mr__co_begin_stop(struct coordinator *co) {
  if (!mr__co_live(co))
    return;
  group_enter(co, GROUP_STOPPING);
  co->killed = 0;
  mr_ranks_send_control(&co->ranks, MESHRUN__CONTROL__KIND__STOP);
  mr_ranks_signal_all(&co->ranks, SIGTERM);
  for (int k = 1; k < co->nnodes; k++)
    mr__co_send_node_control(co, k, MESHRUN__CONTROL__KIND__STOP);
  for (int i = 0; i < co->ranks.n; i++) /* a remote rank is gone with its connection */
    if (co->ranks.r[i].remote && co->ranks.r[i].conn == NULL)
      co->ranks.r[i].exited = 1;
}

void mr__co_group_fail(struct coordinator *co, int rank, const char *fmt, ...) {
  if (!mr__co_live(co))
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(co->failure, sizeof co->failure, fmt, ap);
  va_end(ap);
  co->failed_rank = rank;
  MR_ERROR("launch", "%s", co->failure);
  const struct mr_rank *r = rank >= 0 ? &co->ranks.r[rank] : NULL;
  mr_run_log_failure(co->run_log, co->restart, rank, co->failure, r != NULL && r->exited,
                     r != NULL ? r->exit_status : 0, r != NULL ? r->term_signal : 0);
  mr__co_begin_stop(co);
}

static void on_signal(uv_signal_t *h, int signum) {
  struct coordinator *co = h->data;
  const struct mr_job *job = co->opts->job;
  /* a scheduler's preemption: save a checkpoint first, then stop */
  if (signum == SIGTERM && !co->preempting && co->stop_signal == 0 &&
      co->state == GROUP_RUNNING && !co->opts->selfcheck && job != NULL &&
      job->checkpoint.dir != NULL) {
    co->preempting = 1;
    co->preempt_started_ms = mr_clock_ms();
    co->preempt_step = mr__co_newest_step(co);
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
  mr__co_begin_stop(co); /* stopping already: group_stopped reads stop_signal */
}

/* SIGUSR1, a scheduler's warning before a time limit (Slurm's --signal):
 * a checkpoint now, and training goes on. */
static void on_usr1(uv_signal_t *h, int signum) {
  (void)signum;
  struct coordinator *co = h->data;
  const struct mr_job *job = co->opts->job;
  if (job == NULL || co->opts->selfcheck || co->state != GROUP_RUNNING || co->preempting)
    return;
  if (job->checkpoint.dir == NULL) {
    MR_WARN("launch", "SIGUSR1: the job has no checkpoint.dir: no checkpoint to write");
    return;
  }
  MR_WARN("launch", "SIGUSR1: writing a checkpoint (training goes on)");
  mr_ranks_send_control(&co->ranks, MESHRUN__CONTROL__KIND__CHECKPOINT_NOW);
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
 * each one is doing and who the others wait for, then fail the group.
 * While a rank is still starting (lowering its program, opening its
 * communication: slow under a sanitizer or on a loaded machine) there is
 * no step to make progress in: the group is not judged while its starting
 * ranks are heard from, only once one of them falls silent (stopped). */
static void check_hang(struct coordinator *co, int64_t now) {
  if (co->opts->hang_timeout_s <= 0)
    return;
  int64_t limit = (int64_t)(co->opts->hang_timeout_s * 1000.0);
  int64_t newest = 0;
  int live = 0, starting = 0, silent = 0;
  for (int i = 0; i < co->world; i++) {
    const struct mr_rank *r = &co->ranks.r[i];
    if (r->exited || r->conn == NULL || r->done)
      continue;
    if (now - r->last_seen_ms > limit)
      silent = 1;
    else if (r->starting)
      starting = 1;
    live++;
    if (r->progress_ms > newest)
      newest = r->progress_ms;
  }
  if (live == 0 || now - newest <= limit || (starting && !silent))
    return;
  char where[8192];
  mr_ranks_describe_positions(&co->ranks, where, sizeof where);
  describe_rendezvous(co, where, sizeof where);
  /* the culprit: the rank gone silent the longest (stopped: its position
   * is the last it sent, which may well be a wait), else a rank that waits
   * on nothing while others wait */
  int culprit = -1;
  int64_t silent_ms = 10 * mr_tunable_int(MR_TUNABLE_HEARTBEAT_MS), quiet = 0;
  for (int i = 0; i < co->world; i++) {
    const struct mr_rank *r = &co->ranks.r[i];
    if (!r->exited && !r->done && r->conn != NULL && now - r->last_seen_ms > silent_ms &&
        now - r->last_seen_ms > quiet)
      culprit = i, quiet = now - r->last_seen_ms;
  }
  for (int i = 0; i < co->world && culprit < 0; i++) {
    const struct mr_rank *r = &co->ranks.r[i];
    if (!r->exited && !r->done && r->waiting_on < 0)
      culprit = i;
  }
  char who[160] = "";
  if (culprit >= 0 && quiet > 0)
    snprintf(who, sizeof who, "; rank %d (pid %d) has sent nothing for %.1f s: stopped or "
             "hung, the others wait for it", culprit, co->ranks.r[culprit].pid,
             (double)quiet / 1000.0);
  else if (culprit >= 0)
    snprintf(who, sizeof who, "; rank %d is stuck outside communication", culprit);
  mr__co_group_fail(co, culprit, "hang: no rank made progress for %.1f s%s:%s",
                    (double)(now - newest) / 1000.0, who, where);
}

/* ---- the group ----------------------------------------------------------- */

static void on_rank_exit(void *ctx, int rank, int64_t status, int signal);

/* A training job with a checkpoint folder resumes from its newest complete
 * checkpoint (an incomplete or corrupt one is skipped with a warning), and
 * what lies beyond it is cleared away, so each save the group makes starts
 * in a folder of its own. */
static int choose_resume(struct coordinator *co) {
  co->resume_dir[0] = '\0';
  co->resume_step = 0;
  const struct mr_job *job = co->opts->job;
  if (co->opts->selfcheck || job == NULL || job->checkpoint.dir == NULL)
    return 0;
  int64_t step;
  int rc = mr_ckpt_find_latest(job->checkpoint.dir, co->resume_dir, sizeof co->resume_dir, &step);
  if (rc == 1) {
    co->resume_step = step;
    MR_INFO("ckpt", "resuming from %s (step %lld)", co->resume_dir, (long long)step);
  } else {
    co->resume_dir[0] = '\0';
  }
  if (rc < 0)
    return rc;
  return mr_ckpt_clear_after(job->checkpoint.dir, co->resume_step);
}

static int nodes_connected(const struct coordinator *co) {
  int n = 1;
  for (int k = 1; k < co->nnodes; k++)
    n += co->agents[k] != NULL;
  return n;
}

/* The launch's plan: for a group of every node (or the self-check). */
static void use_launch_plan(struct coordinator *co) {
  const struct mr_launch_opts *o = co->opts;
  co->plan_text = o->job != NULL ? o->job->text : NULL;
  co->digests = o->program_digests;
  if (co->predicted_s != o->predicted_step_s)
    co->predicted_s = o->predicted_step_s, co->n_step_s = 0;
}

/* The group's ranks renumbered for a world of `world`. */
static void set_world(struct coordinator *co, int world) {
  co->world = world;
  mr_ranks_renumber(&co->ranks, world, 0);
}

/* Every rank's peak memory and resident size into the run's events, when
 * they moved. */
void mr__co_log_memory(struct coordinator *co, int64_t step) {
  uint64_t *peak = calloc(2 * (size_t)co->world, sizeof *peak);
  if (peak == NULL)
    return;
  for (int i = 0; i < co->world; i++)
    peak[i] = co->ranks.r[i].peak_memory, peak[co->world + i] = co->ranks.r[i].rss_peak;
  mr_run_log_memory(co->run_log, co->restart, step, peak, peak + co->world, co->world);
  free(peak);
}

/* The plan the group runs into the run's events, with where its steps
 * begin in the metrics file. */
static void log_plan(struct coordinator *co) {
  struct stat sb;
  struct mr_run_log_plan p = {
      .restart = co->restart, .world = co->world, .nodes = co->n_group_nodes,
      .plan_text = co->plan_text, .predicted_s = co->predicted_s,
      .peak_device_s = co->opts->peak_device_s,
      .metrics_at = co->metrics != NULL && fstat(fileno(co->metrics), &sb) == 0 ? sb.st_size : 0};
  mr_run_log_plan(co->run_log, &p);
}

/* Starts the group's workers, here and on its other nodes. */
static int spawn_group(struct coordinator *co) {
  group_enter(co, GROUP_RUNNING);
  log_plan(co);
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
    mr__co_group_fail(co, -1, "could not start the workers: %s", mr_error_of(rc));
    return rc;
  }
  for (int i = 1; i < co->n_group_nodes; i++)
    mr__co_send_node_control(co, co->group_nodes[i], MESHRUN__CONTROL__KIND__START);
  return 0;
}

/* The plan for the group's world is made: the group starts with it, unless
 * it was stopped meanwhile. */
static void group_planned(struct mr_plan_work *w) {
  struct coordinator *co = w->data;
  co->planning = NULL;
  if (co->state != GROUP_PLANNING) {
    mr_plan_work_free(w);
    return;
  }
  if (w->rc < 0) {
    mr__co_group_fail(co, -1, "no plan for %d ranks on %d nodes: %s", w->world,
                      co->n_group_nodes, mr_error_of(w->rc));
    mr_plan_work_free(w);
    return;
  }
  mr__co_adopt_plan(co, w->text, w->digests, w->step_s);
  w->text = NULL, w->digests = NULL;
  MR_WARN("launch", "re-planned for %d ranks on %d node%s:", w->world, co->n_group_nodes,
          co->n_group_nodes == 1 ? "" : "s");
  mr_strategy_print(&w->choice, stdout);
  fflush(stdout);
  set_world(co, w->world);
  mr_plan_work_free(w);
  spawn_group(co);
}

/* Plans for a group of `world` ranks off the loop (launcher/plan_work.h);
 * the group starts once it is made. */
static int plan_group(struct coordinator *co, int world) {
  co->plan_text = NULL;
  co->digests = NULL;
  group_enter(co, GROUP_PLANNING);
  struct mr_plan_work *w = calloc(1, sizeof *w);
  int rc = w != NULL ? 0 : mr_error_set(MR_ENOMEM, "out of memory");
  if (rc == 0) {
    w->done = group_planned;
    w->data = co;
    rc = mr_plan_work_start(&co->loop, w, MR_PLAN_WORLD, co->opts->job, NULL, world, NULL, 0, 0);
  }
  if (rc < 0) {
    mr_plan_work_free(w);
    mr__co_group_fail(co, -1, "no plan for %d ranks on %d nodes: %s", world, co->n_group_nodes,
                      mr_error_of(rc));
    return rc;
  }
  co->planning = w;
  return 0;
}

/* Starts a group on its nodes: every node in its place, or for an elastic
 * job the nodes connected now, numbered in node order; planned first when
 * their ranks are not the plan's. */
static int begin_group(struct coordinator *co) {
  co->n_group_nodes = 0;
  co->group_steps = 0;
  for (int k = 0; k < co->nnodes; k++)
    if ((!mr__co_elastic(co) || k == 0 || co->agents[k] != NULL) && !co->left_out[k])
      co->group_nodes[co->n_group_nodes++] = k;
  int world = co->n_group_nodes * co->node_ranks;
  if (world != co->world) {
    if (world != co->opts->nproc && co->opts->job != NULL)
      return plan_group(co, world);
    use_launch_plan(co);
    set_world(co, world);
  }
  return spawn_group(co);
}

static void finish(struct coordinator *co, int code);

static int start_group(struct coordinator *co) {
  rendezvous_clear(co);
  mr__co_pending_clear(co);
  int rc = choose_resume(co);
  if (rc < 0) { /* no rank starts on checkpoints it cannot read, nor over them */
    MR_ERROR("ckpt", "%s", mr_error_of(rc));
    snprintf(co->failure, sizeof co->failure, "%s", mr_error_of(rc));
    finish(co, 2);
    return rc;
  }
  const struct mr_job *job = co->opts->job;
  if (co->resume_dir[0] != '\0' && co->resume_step >= job->train.steps) {
    /* a finished job launched again: nothing to train, nothing to wait for */
    mr_cli_say_complete(job, co->resume_dir, (long long)co->resume_step);
    finish(co, 0);
    return 0;
  }
  co->failure[0] = '\0';
  co->failed_rank = -1;
  co->pending = REGROUP_NONE;
  co->slow_kind = REGROUP_NONE;
  co->slow_streak = 0;
  co->split_known = 0;
  mr_split_close(&co->split);
  if (mr__co_elastic(co) && nodes_connected(co) < co->nnodes) { /* wait for the others a while */
    group_enter(co, GROUP_GATHERING);
    MR_INFO("launch", "%d of %d nodes here: waiting up to %.0f s for the others",
            nodes_connected(co), co->nnodes, co->opts->join_timeout_s);
    return 0;
  }
  return begin_group(co);
}

static void finish(struct coordinator *co, int code) {
  if (co->state == GROUP_FINISHED)
    return;
  group_enter(co, GROUP_FINISHED);
  co->exit_code = code;
  mr__co_log_memory(co, mr__co_newest_step(co));
  mr_run_log_end(co->run_log, code, co->restart, co->failures,
                 code > 128 ? strsignal(code - 128) : co->failure);
  uv_timer_stop(&co->tick);
  uv_close((uv_handle_t *)&co->tick, NULL);
  uv_close((uv_handle_t *)&co->unix_server, NULL);
  uv_close((uv_handle_t *)&co->tcp_server, NULL);
  uv_close((uv_handle_t *)&co->sigint, NULL);
  uv_close((uv_handle_t *)&co->sigterm, NULL);
  uv_close((uv_handle_t *)&co->sigusr1, NULL);
  mr_ranks_close_conns(&co->ranks);
  for (int k = 1; k < co->nnodes; k++) { /* the verdict, then the connection */
    mr__co_send_node_control(co, k, MESHRUN__CONTROL__KIND__FINISH);
    if (co->agents[k] != NULL)
      mr_conn_close(co->agents[k], NULL);
  }
}

/* Called when every worker of a stopping group has exited. */
static void group_stopped(struct coordinator *co) {
  /* a rank killed while its group was being created leaves the segment */
  int swept = mr_shm_sweep(co->job_id);
  if (swept > 0)
    MR_INFO("launch", "removed %d shared-memory segment%s left by the stopped group", swept,
            swept == 1 ? "" : "s");
  /* stopped by SIGTERM, checkpoint or none: 143, as every stop by a
   * signal, so that a scheduler never takes a preempted job for a
   * finished one; 0 is a job trained to its last step */
  if (co->preempting && co->stop_signal == 0) {
    /* said once the ranks are gone: a save in flight at the stop may have
     * completed after the one asked for */
    int64_t at = co->last_ckpt_step >= 0 ? co->last_ckpt_step : co->resume_step;
    if (at > 0)
      MR_WARN("launch", "stopped for preemption: the next launch resumes from step %lld",
              (long long)at);
    else
      MR_WARN("launch", "stopped for preemption before any checkpoint: the next launch starts "
                        "over");
    finish(co, 128 + SIGTERM);
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
    static const char *const causes[] = {[REGROUP_NODES] = "nodes", [REGROUP_BALANCE] = "balance",
                                         [REGROUP_DP_BALANCE] = "dp_balance",
                                         [REGROUP_SLOW_NODE] = "slow_node"};
    mr_run_log_restart(co->run_log, co->restart + 1, causes[co->regroup], co->failures,
                       co->opts->max_restarts, (double)(mr_clock_ms() - co->state_ms) / 1000.0);
    co->regroup = REGROUP_NONE;
    co->restart++;
    start_group(co);
    return;
  }
  if (co->failures < co->opts->max_restarts) {
    co->failures++;
    co->restart++;
    int64_t backoff = mr_tunable_int(MR_TUNABLE_RESTART_BACKOFF_MS);
    for (int i = 1; i < co->failures && backoff < 60000; i++)
      backoff *= 2;
    MR_WARN("launch", "restarting the group (restart %d of %d; it stopped in %.2f s)%s",
            co->failures, co->opts->max_restarts,
            (double)(mr_clock_ms() - co->state_ms) / 1000.0, backoff > 0 ? " after a pause" : "");
    mr_run_log_restart(co->run_log, co->restart, "failure", co->failures, co->opts->max_restarts,
                       (double)(mr_clock_ms() - co->state_ms) / 1000.0);
    co->restart_at_ms = mr_clock_ms() + backoff;
    if (backoff <= 0)
      start_group(co);
    else
      group_enter(co, GROUP_BACKOFF);
    return;
  }
  mr_ranks_report_failure(&co->ranks, co->failed_rank, co->failure, co->opts->max_restarts);
  finish(co, 1);
}

/* Who sent a SIGKILL the launcher did not: the out-of-memory killer only
 * when the kernel's count of its kills moved since the rank started. */
static void kill_cause(const struct mr_rank *r, char *why, size_t n) {
  int64_t kills = mr_oom_kill_count();
  char rss[80] = "";
  if (r->rss_peak > 0)
    snprintf(rss, sizeof rss, "; the rank's resident size had reached %.0f MiB",
             (double)r->rss_peak / 1048576.0);
  if (kills < 0 || r->oom_kills < 0)
    snprintf(why, n, " (not sent by the launcher: the out-of-memory killer, or another "
             "process%s)", rss);
  else if (kills > r->oom_kills)
    snprintf(why, n, " (the kernel's out-of-memory killer: it killed %lld process%s since "
             "the rank started%s)", (long long)(kills - r->oom_kills),
             kills - r->oom_kills == 1 ? "" : "es", rss);
  else
    snprintf(why, n, " (not sent by the launcher, nor the out-of-memory killer, which killed "
             "nothing since the rank started: another process, an operator or a "
             "scheduler%s)", rss);
}

static void on_rank_exit(void *ctx, int rank, int64_t status, int signal) {
  struct coordinator *co = ctx;
  struct mr_rank *r = &co->ranks.r[rank];
  if (co->state == GROUP_RUNNING) {
    char why[256] = "";
    if (signal == SIGKILL) /* not ours: we were running */
      kill_cause(r, why, sizeof why);
    if (signal != 0)
      mr__co_group_fail(co, rank, "rank %d (pid %d) was killed by signal %d (%s)%s", rank, r->pid,
                        signal, sigabbrev_np(signal) ? sigabbrev_np(signal) : "?", why);
    else if (status != 0)
      mr__co_group_fail(co, rank, "rank %d (pid %d) exited with status %lld%s%s", rank, r->pid,
                        (long long)status, r->error[0] ? ": " : "", r->error);
    else if (!r->done && r->conn == NULL)
      mr__co_group_fail(co, rank, "rank %d (pid %d) exited before finishing its job", rank, r->pid);
    /* else its last reports may still be unread: mr__co_on_conn_close decides */
  }
}

/* A tick this much later than its 20 ms means the loop did not run. */
#define STALL_MS 500

/* Time the loop did not run (the launcher stopped, a slow disk, a paused
 * machine) is not the ranks' silence: what they sent meanwhile waits
 * unread in the sockets, and libuv runs timers before it reads them.  So
 * the gap is credited to every rank before anything is judged. */
static void credit_stall(struct coordinator *co, int64_t now) {
  int64_t gap = now - co->last_tick_ms;
  co->last_tick_ms = now;
  if (gap <= STALL_MS)
    return;
  mr_ranks_credit(&co->ranks, gap);
  MR_WARN("launch", "the launcher did not run for %.1f s (stopped, or the machine busy): "
          "the ranks' silence is measured from now", (double)gap / 1000.0);
}

/* GATHERING: the group begins once every node is here, or once the join
 * timeout has passed with enough of them. */
static void tick_gathering(struct coordinator *co, int64_t now) {
  int have = nodes_connected(co);
  int64_t waited = now - co->state_ms, limit = (int64_t)(co->opts->join_timeout_s * 1000.0);
  if (have == co->nnodes || (waited > limit && have >= co->opts->min_nodes))
    begin_group(co);
  else if (waited > limit)
    mr__co_group_fail(co, -1, "%d of the %d nodes needed (--nnodes %d:%d) joined within %.0f s",
                      have, co->opts->min_nodes, co->opts->min_nodes, co->nnodes,
                      co->opts->join_timeout_s);
}

/* RUNNING: a rank that did not register or went silent fails the group, as
 * does a hang or a preemption that found no checkpoint; the group that is
 * done finishes the job. */
static void tick_running(struct coordinator *co, int64_t now) {
  if (co->preempting && now - co->preempt_started_ms > mr_tunable_int(MR_TUNABLE_PREEMPT_GRACE_MS)) {
    MR_ERROR("launch", "no checkpoint within %.1f s of SIGTERM: stopping without one",
             (double)mr_tunable_int(MR_TUNABLE_PREEMPT_GRACE_MS) / 1000.0);
    co->stop_signal = SIGTERM;
    mr__co_begin_stop(co);
    return;
  }
  int64_t hb = (int64_t)(co->opts->heartbeat_timeout_s * 1000.0);
  int64_t conn_timeout = mr_tunable_int(MR_TUNABLE_CONNECT_TIMEOUT_MS);
  int64_t join_timeout = (int64_t)(co->opts->join_timeout_s * 1000.0);
  int all_done = 1;
  for (int i = 0; i < co->world; i++) {
    struct mr_rank *r = &co->ranks.r[i];
    if (!r->exited || !r->done || r->exit_status != 0)
      all_done = 0;
    if (r->exited)
      continue;
    if (r->remote && !r->registered && now - r->spawn_ms > join_timeout) {
      int k = mr__co_node_of(co, i);
      if (co->agents[k] != NULL)
        mr__co_group_fail(co, i, "rank %d did not register within %.1f s: its node's "
                          "launcher (node %d) did not start it", i,
                          (double)join_timeout / 1000.0, k);
      else
        mr__co_group_fail(co, i, "node %d never joined within %.1f s, so its rank %d did not "
                          "register: no launcher of node %d reached this one (%s, port %s); "
                          "its own output says why.  A node that cannot resolve or reach "
                          "this node's address needs --master HOST:PORT with one it can",
                          k, (double)join_timeout / 1000.0, i, k,
                          co->opts->master_host != NULL ? co->opts->master_host : "this host",
                          strrchr(co->opts->bind, ':') != NULL ? strrchr(co->opts->bind, ':') + 1
                                                               : co->opts->bind);
      return;
    }
    if (!r->remote && !r->registered && now - r->spawn_ms > conn_timeout) {
      mr__co_group_fail(co, i, "rank %d (pid %d) did not register within %.1f s", i, r->pid,
                        (double)conn_timeout / 1000.0);
      return;
    }
    if (r->conn != NULL && now - r->last_seen_ms > hb) {
      mr__co_group_fail(co, i, "rank %d (pid %d) sent no heartbeat for %.1f s (stopped or hung)",
                        i, r->pid, (double)(now - r->last_seen_ms) / 1000.0);
      /* a stopped process cannot act on SIGTERM */
      mr_ranks_signal(&co->ranks, i, SIGKILL);
      return;
    }
  }
  check_hang(co, now);
  if (co->state != GROUP_RUNNING || !all_done || !mr_ranks_all_closed(&co->ranks))
    return;
  if (co->opts->selfcheck)
    printf("meshrun: self-check passed: %d ranks registered, authenticated, "
           "exchanged a rendezvous and reported the expected digests\n",
           co->world);
  mr_ranks_print_summary(&co->ranks, mr__co_median_step(co), co->n_step_s, co->predicted_s);
  finish(co, 0);
}

/* STOPPING: once every worker has exited (and no plan is being made) what
 * follows is decided; workers still running after the grace are killed. */
static void tick_stopping(struct coordinator *co, int64_t now) {
  if (mr_ranks_all_exited(&co->ranks)) {
    if (mr_ranks_all_closed(&co->ranks) && co->planning == NULL)
      group_stopped(co);
    return;
  }
  if (!co->killed && now - co->state_ms > mr_tunable_int(MR_TUNABLE_STOP_GRACE_MS)) {
    MR_WARN("launch", "workers still running after %.1f s: killing them",
            (double)mr_tunable_int(MR_TUNABLE_STOP_GRACE_MS) / 1000.0);
    mr_ranks_signal_all(&co->ranks, SIGKILL);
    for (int i = co->ranks.local; i < co->ranks.n; i++) /* their nodes kill them */
      if (co->ranks.r[i].conn != NULL)
        mr_conn_close(co->ranks.r[i].conn, "still connected after the stop grace");
    co->killed = 1;
  }
}

static void on_tick(uv_timer_t *t) {
  struct coordinator *co = t->data;
  int64_t now = mr_clock_ms();
  credit_stall(co, now);
  switch (co->state) {
  case GROUP_GATHERING:
    tick_gathering(co, now);
    break;
  case GROUP_RUNNING:
    tick_running(co, now);
    break;
  case GROUP_STOPPING:
    tick_stopping(co, now);
    break;
  case GROUP_BACKOFF:
    if (now >= co->restart_at_ms)
      start_group(co);
    break;
  case GROUP_PLANNING: /* group_planned goes on */
  case GROUP_FINISHED:
    break;
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
    rc = uv_listen((uv_stream_t *)&co->unix_server, 128, mr__co_on_connection);
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
    rc = uv_listen((uv_stream_t *)&co->tcp_server, 128, mr__co_on_connection);
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
  char text[2048];
  snprintf(text, sizeof text,
           "{\"job_id\": \"%s\", \"pid\": %d, \"unix\": \"unix:%s\", "
           "\"tcp\": \"tcp:%s:%d\", \"world_size\": %d, \"nodes\": %d}\n",
           co->job_id, (int)getpid(), co->unix_path, co->master_addr, co->master_port,
           co->opts->nproc, co->nnodes);
  /* read by tools and tests while the job runs: never seen half written */
  return mr_file_write_text(path, text, MR_FILE_ATOMIC);
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

/* The coordinator's state before its loop: the group's nodes, the plan,
 * the job's token and id.  Returns 0 or -1 (logged). */
static int coordinator_init(struct coordinator *co, const struct mr_launch_opts *opts) {
  co->opts = opts;
  co->token_fd = -1;
  co->sock_lock_fd = -1;
  co->failed_rank = -1;
  co->last_ckpt_step = -1;
  co->predicted_s = opts->predicted_step_s;
  if (mr_auth_init() < 0)
    return -1;
  co->nnodes = opts->nnodes > 1 ? opts->nnodes : 1;
  co->node_ranks = opts->node_ranks > 0 ? opts->node_ranks : opts->nproc;
  co->agents = calloc((size_t)co->nnodes, sizeof *co->agents);
  co->group_nodes = calloc((size_t)co->nnodes, sizeof *co->group_nodes);
  co->left_out = calloc((size_t)co->nnodes, 1);
  if (co->agents == NULL || co->group_nodes == NULL || co->left_out == NULL)
    return -1;
  co->world = opts->nproc; /* the launch planned for every node */
  co->n_group_nodes = co->nnodes;
  for (int k = 0; k < co->nnodes; k++)
    co->group_nodes[k] = k;
  use_launch_plan(co);
  if (make_token(co) < 0) {
    MR_ERROR("launch", "%s", mr_error_message());
    return -1;
  }
  uint8_t id[8];
  mr_auth_random(id, sizeof id);
  sodium_bin2hex(co->job_id, sizeof co->job_id, id, sizeof id);
  return 0;
}

/* The run's records: metrics.jsonl (required), TensorBoard's scalars and
 * the run log (a run without them trains on).  Returns 0 or -1 (logged). */
static int open_records(struct coordinator *co) {
  const struct mr_launch_opts *opts = co->opts;
  const char *mpath = opts->metrics_path;
  char mbuf[1024];
  if (mpath == NULL && !opts->selfcheck) {
    snprintf(mbuf, sizeof mbuf, "%s/metrics.jsonl", opts->log_dir);
    mpath = mbuf;
  }
  int64_t tb_written = mpath != NULL ? mr_tb_written(opts->log_dir, mpath) : 0;
  if (mpath != NULL && (co->metrics = fopen(mpath, "a")) == NULL) {
    MR_ERROR("launch", "metrics file %s: %s", mpath, strerror(errno));
    return -1;
  }
  if (mpath != NULL && mr_tb_open(opts->log_dir, tb_written, &co->tb) < 0)
    MR_WARN("launch", "%s: no TensorBoard scalars for this run", mr_error_message());
  /* what happens to the run, for `meshrun report` */
  if (!opts->selfcheck && mr_run_log_open(opts->log_dir, &co->run_log) < 0)
    MR_WARN("launch", "%s: no record of the run's plan, failures and restarts",
            mr_error_message());
  mr_run_log_start(co->run_log, co->job_id, opts->nproc, co->nnodes, opts->max_restarts);
  return 0;
}

/* What the loop serves: the listeners, the token for the ranks, the
 * coordinator file, the records and the rank set.  Returns 0 or -1
 * (logged). */
static int open_loop(struct coordinator *co) {
  const struct mr_launch_opts *opts = co->opts;
  if (listen_all(co) < 0 || (co->token_fd = mr_auth_token_memfd(co->token)) < 0 ||
      write_coordinator_file(co) < 0) {
    MR_ERROR("launch", "%s", mr_error_message());
    return -1;
  }
  if (open_records(co) < 0)
    return -1;
  if (mr_ranks_init(&co->ranks, &co->loop, opts->nproc, co->node_ranks, 0, opts->log_dir, co,
                    on_rank_exit) < 0) {
    MR_ERROR("launch", "%s", mr_error_message());
    return -1;
  }
  return 0;
}

/* The loop's handles: signals and the 20 ms tick. */
static void start_handles(struct coordinator *co) {
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
}

/* Everything the loop and the records hold, the loop closed last. */
static void close_loop(struct coordinator *co) {
  rendezvous_clear(co);
  mr__co_pending_clear(co);
  if (co->metrics != NULL)
    fclose(co->metrics);
  mr_tb_close(co->tb);
  mr_run_log_close(co->run_log);
  if (co->token_fd >= 0)
    close(co->token_fd);
  if (co->sock_dir[0] != '\0')
    mr_sockdir_remove(co->sock_dir, co->sock_lock_fd);
  uv_walk(&co->loop, close_walk, NULL);
  uv_run(&co->loop, UV_RUN_DEFAULT);
  uv_loop_close(&co->loop);
}

static void coordinator_free(struct coordinator *co) {
  sodium_memzero(co->token, sizeof co->token);
  mr_split_close(&co->split);
  free(co->balanced_text), free(co->balanced_digests);
  free(co->own_text), free(co->own_digests);
  free(co->step_s);
  free(co->left_out);
  free(co->group_nodes);
  free(co->agents);
  free(co);
}

int mr_coordinator_run(const struct mr_launch_opts *opts) {
  struct coordinator *co = calloc(1, sizeof *co);
  if (co == NULL)
    return 1;
  int code = 1;
  if (coordinator_init(co, opts) < 0) {
    coordinator_free(co);
    return 1;
  }
  uv_loop_init(&co->loop);
  if (open_loop(co) == 0) {
    start_handles(co);
    MR_INFO("launch", "job %s: %d ranks%s, logs in %s, coordinator on unix:%s and tcp:%s:%d",
            co->job_id, opts->nproc, co->nnodes > 1 ? " on several nodes" : "", opts->log_dir,
            co->unix_path, co->master_addr, co->master_port);
    start_group(co);
    co->last_tick_ms = mr_clock_ms();
    uv_run(&co->loop, UV_RUN_DEFAULT);
    code = co->exit_code;
    mr_ranks_close(&co->ranks);
    uv_run(&co->loop, UV_RUN_DEFAULT);
    mr_shm_sweep(co->job_id);
  }
  close_loop(co);
  coordinator_free(co);
  return code;
}
