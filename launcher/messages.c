/* messages.c - what the coordinator does with each message from a
 * worker or another node's launcher: hellos and rendezvous (welcome, the
 * plan, the groups' exchanges), reports (errors, done, the checkpoint
 * files each rank wrote, gathered into complete checkpoints), heartbeats
 * and per-step metrics (the metrics file, the slow-rank checks), and
 * connections closing.  The group's life (start, stop, restart) is
 * coordinator.c's. */
#include <math.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/checksum.h"
#include "common/ckpt.h"
#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/rpc.h"
#include "common/test_hooks.h"
#include "common/tunable.h"
#include "launcher/coordinator_internal.h"
#include "launcher/tb_events.h"
#include "launcher/trace_merge.h"

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
    plan.program_digest = mr_hook_plan_digest(rank, co->digests[rank]);
  }
  plan.steps = o->selfcheck ? mr_tunable_int(MR_TUNABLE_SELFCHECK_STEPS)
                            : (o->job != NULL ? o->job->train.steps : 0);
  int64_t first, last;
  if (o->trace_dir != NULL && !o->selfcheck &&
      mr_trace_steps_for(o->trace_first, o->trace_last, co->resume_step, plan.steps, &first,
                         &last)) {
    plan.trace_dir = (char *)o->trace_dir;
    plan.trace_first = first;
    plan.trace_last = last;
  }
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
  mr__co_ask_regroup(co, REGROUP_NODES);
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
  int pos = mr__co_group_pos(co, k);
  if (pos >= 0)
    MR_INFO("launch", "node %d joined from %s (ranks %d..%d)", k, h->host, pos * co->node_ranks,
            (pos + 1) * co->node_ranks - 1);
  else
    MR_INFO("launch", "node %d joined from %s, outside the running group%s", k, h->host,
            co->left_out[k] ? " (left out for running slow)" : "");
  send_welcome(co, c, 0, NULL);
  if (pos >= 0 && co->state == GROUP_RUNNING)
    mr__co_send_node_control(co, k, MESHRUN__CONTROL__KIND__START);
  else if (pos < 0 && co->state == GROUP_RUNNING && !co->preempting &&
           co->pending == REGROUP_NONE && !co->left_out[k])
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
  if (r == NULL || co->state == GROUP_GATHERING || r->registered ||
      (!r->remote && r->pid != (int)h->pid) ||
      (r->remote && (co->state != GROUP_RUNNING || r->exited)) ||
      h->restart != (uint32_t)co->restart) {
    char why[160];
    snprintf(why, sizeof why,
             "hello from pid %u for rank %d (restart %u) matches no waiting worker", h->pid, rank,
             h->restart);
    mr_conn_close(c, why);
    return;
  }
  c->rank = rank;
  r->conn = c;
  r->registered = 1;
  r->starting = 1; /* until its heartbeat says it runs */
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
    mr__co_group_fail(co, c->rank, "rank %d joined rendezvous \"%s\" twice", c->rank, rv->key);
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
  mr__co_rendezvous_free(r);
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

void mr__co_pending_clear(struct coordinator *co) {
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
  if (co->preempting && co->state == GROUP_RUNNING && p->step >= co->preempt_step) {
    MR_WARN("launch", "checkpoint of step %lld written: stopping for preemption",
            (long long)p->step);
    mr__co_begin_stop(co);
  } else if (co->pending != REGROUP_NONE && co->state == GROUP_RUNNING &&
             p->step >= co->pending_step) {
    if (co->pending == REGROUP_SLOW_NODE)
      co->left_out[co->leaving] = 1;
    if (co->pending == REGROUP_BALANCE || co->pending == REGROUP_DP_BALANCE) {
      mr__co_adopt_plan(co, co->balanced_text, co->balanced_digests, co->balanced_s);
      co->balanced_text = NULL, co->balanced_digests = NULL;
    }
    co->regroup = co->pending;
    co->pending = REGROUP_NONE;
    mr__co_begin_stop(co);
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
        mr__co_group_fail(co, c->rank, "rank %d: self-check result does not match", c->rank);
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

#define TB_RANKS_MAX 64 // memory a rank is a scalar of its own up to this world

/* The step's scalars into TensorBoard's event file: what metrics.jsonl
 * holds, with MFU and the predicted step time beside the measured. */
static void tb_step(struct coordinator *co, const Meshrun__Metrics *m, uint64_t peak,
                    uint64_t rss) {
  if (co->tb == NULL)
    return;
  const char *tags[16 + TB_RANKS_MAX];
  double vals[16 + TB_RANKS_MAX];
  char rank_tags[TB_RANKS_MAX][40];
  int n = 0;
#define TB(tag, v)                                                                        \
  do {                                                                                    \
    if (isfinite(v))                                                                      \
      tags[n] = (tag), vals[n++] = (v);                                                   \
  } while (0)
  TB("train/loss", m->loss);
  TB("train/lr", m->lr);
  TB("train/grad_norm", m->grad_norm);
  TB("train/loss_scale", m->loss_scale);
  TB("train/restarts", (double)co->restart);
  TB("eval/val_loss", m->val_loss); /* NaN: no evaluation this step */
  TB("perf/tokens_per_s", m->tokens_per_s);
  TB("perf/step_time_s", m->step_time_s);
  TB("perf/comm_wait_s", m->comm_wait_s);
  if (co->predicted_s > 0)
    TB("perf/predicted_step_s", co->predicted_s);
  if (co->opts->peak_device_s > 0 && m->step_time_s > 0)
    TB("perf/mfu", co->opts->peak_device_s / (m->step_time_s * co->world));
  TB("memory/peak_mib", (double)peak / 1048576.0);
  TB("memory/rss_peak_mib", (double)rss / 1048576.0);
  for (int i = 0; i < co->world && co->world <= TB_RANKS_MAX; i++) {
    snprintf(rank_tags[i], sizeof rank_tags[i], "memory/peak_mib/rank_%d", i);
    TB(rank_tags[i], (double)co->ranks.r[i].peak_memory / 1048576.0);
  }
#undef TB
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  if (mr_tb_scalars(co->tb, (int64_t)m->step, (double)t.tv_sec + (double)t.tv_nsec * 1e-9, tags,
                    vals, n) < 0)
    MR_WARN("launch", "%s: no more TensorBoard scalars for this run (training goes on)",
            mr_error_message());
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
double mr__co_median_step(struct coordinator *co) {
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
    mr__co_check_stragglers(co);
    mr__co_check_slow_ranks(co);
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
  tb_step(co, m, peak, rss);
  mr__co_log_memory(co, m->step);
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
  case MESHRUN__ENVELOPE__MSG_CLOCK_PROBE: { /* answered at once: the round trip is its bound */
    Meshrun__ClockProbe echo = MESHRUN__CLOCK_PROBE__INIT;
    echo.worker_ns = env->clock_probe->worker_ns;
    echo.coordinator_ns = (uint64_t)mr_clock_ns();
    Meshrun__Envelope out = MESHRUN__ENVELOPE__INIT;
    out.msg_case = MESHRUN__ENVELOPE__MSG_CLOCK_PROBE;
    out.clock_probe = &echo;
    mr_conn_send(c, &out);
    break;
  }
  default: {
    char why[96];
    snprintf(why, sizeof why, "unexpected %s from a worker", mr_rpc_name(env));
    mr_conn_close(c, why);
  }
  }
}

void mr__co_on_conn_close(void *ctx, struct mr_conn *c) {
  struct coordinator *co = ctx;
  if (c->node > 0 && co->agents[c->node] == c) {
    co->agents[c->node] = NULL;
    int pos = mr__co_group_pos(co, c->node);
    if (pos >= 0 && co->state != GROUP_GATHERING)
      mr__co_group_fail(co, -1,
                        "the launcher of node %d disconnected (its ranks %d..%d stop with it)",
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
      mr__co_group_fail(co, c->rank,
                        "rank %d (node %d, pid %d) disconnected before finishing its "
                        "job%s%s",
                        c->rank, mr__co_node_of(co, c->rank), r->pid, r->error[0] ? ": " : "",
                        r->error);
    return;
  }
  /* a rank that exited 0 is judged once all it sent has been read */
  if (r->exited && r->exit_status == 0 && !r->done)
    mr__co_group_fail(co, c->rank, "rank %d (pid %d) exited before finishing its job", c->rank,
                      r->pid);
}

void mr__co_on_connection(uv_stream_t *server, int status) {
  struct coordinator *co = server->data;
  if (status < 0) {
    MR_WARN("rpc", "accept: %s", uv_strerror(status));
    return;
  }
  struct mr_conn_callbacks cb = {.ctx = co, .on_message = on_message,
                                 .on_close = mr__co_on_conn_close};
  int is_tcp = server == (uv_stream_t *)&co->tcp_server;
  /* per listener: strangers on TCP cannot crowd out the local ranks,
   * whose socket sits in a folder only this user can enter.  Room for
   * every rank and node of the job at once (they all connect together at
   * the start), and the tunable's count of strangers on top. */
  struct mr_preauth *q = is_tcp ? &co->preauth_tcp : &co->preauth_unix;
  q->max = co->nnodes * co->node_ranks + co->nnodes +
           (int)mr_tunable_int(MR_TUNABLE_MAX_PREAUTH_CONNS);
  mr_conn_accept(server, is_tcp, co->token, &cb, ++co->next_conn_id, q);
}
