/* slow_ranks.c - the coordinator's answers to ranks that run slow: a rank
 * slower than the others of its stage is named; a pipeline stage, a
 * data-parallel rank (or replica) or an elastic job's node that holds up
 * the step has layers moved off it, fewer micro-batches, or is left out,
 * by a checkpoint and a restart with the new plan (launcher/rebalance.h
 * does the arithmetic). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#include "common/tunable.h"
#include "launcher/coordinator_internal.h"
#include "launcher/plan_work.h"

/* Names a rank whose work per step stays well above that of the other
 * ranks of its pipeline stage (which do the same work and wait for it at
 * every collective): a throttled or shared device, a slow node. */
void mr__co_check_stragglers(struct coordinator *co) {
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
              i, mr__co_node_of(co, i), r->remote ? "" : ", here", r->busy_s * 1e3, median * 1e3);
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

/* v[0..n) times scale as "1.00, 3.97" (`digits` decimals) into buf. */
static void format_values(const double *v, int n, double scale, int digits, char *buf,
                          size_t size) {
  size_t at = 0;
  buf[0] = '\0';
  for (int i = 0; i < n && at + 16 < size; i++)
    at += (size_t)snprintf(buf + at, size - at, "%s%.*f", i ? ", " : "", digits, v[i] * scale);
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
 * (its programs' digests, its predicted step; both taken) from then on, and
 * says so: what runs unbalanced, and what the plan changes.  Where the plan
 * could not be made (text NULL), says that the new split cannot run. */
static void regroup_with(struct coordinator *co, char *text, uint64_t *digests, double step_s,
                         enum regroup kind, const char *unbalanced, const char *split,
                         const char *change) {
  if (text == NULL) {
    MR_WARN("launch", "%s but %s cannot run: %s", unbalanced, split, mr_error_message());
    free(digests);
    return;
  }
  MR_WARN("launch", "%s: %s; writing a checkpoint, then starting again", unbalanced, change);
  free(co->balanced_text), free(co->balanced_digests);
  co->balanced_text = text, co->balanced_digests = digests, co->balanced_s = step_s;
  mr__co_ask_regroup(co, kind);
}

/* A regroup's plan being made off the loop (launcher/plan_work.h), and
 * what to say once it is. */
struct replan {
  struct coordinator *co;
  enum regroup kind;
  int restart;              // the group it is for
  char unbalanced[400], split[300], change[700];
};

/* The plan is made: the regroup is asked for, unless its group is gone or
 * another regroup or a preemption came first. */
static void replanned(struct mr_plan_work *w) {
  struct replan *p = w->data;
  struct coordinator *co = p->co;
  co->planning = NULL;
  if (co->state == GROUP_RUNNING && co->restart == p->restart && co->pending == REGROUP_NONE &&
      !co->preempting) {
    regroup_with(co, w->rc == 0 ? w->text : NULL, w->digests, w->step_s, p->kind, p->unbalanced,
                 p->split, p->change);
    w->text = NULL, w->digests = NULL; /* taken */
  } else {
    MR_DEBUG("launch", "a re-plan for slow ranks came too late for its group: dropped");
  }
  free(p);
  mr_plan_work_free(w);
}

/* Makes the running plan with its layers moved (MR_PLAN_LAYERS: counts[n])
 * or its micro-batches dealt anew (MR_PLAN_DP_MICRO: counts[n] of n_micro)
 * off the loop; then replanned asks for the regroup (p given, taken). */
static void replan(struct coordinator *co, struct replan *p, enum mr_plan_work_kind kind,
                   const int *counts, int n, int n_micro) {
  struct mr_plan_work *w = calloc(1, sizeof *w);
  int rc = w != NULL ? 0 : mr_error_set(MR_ENOMEM, "out of memory");
  p->co = co;
  p->restart = co->restart;
  if (rc == 0) {
    w->done = replanned;
    w->data = p;
    rc = mr_plan_work_start(&co->loop, w, kind, co->opts->job, co->plan_text, co->world, counts,
                            n, n_micro);
  }
  if (rc < 0) {
    MR_WARN("launch", "%s but %s cannot be planned: %s", p->unbalanced, p->split,
            mr_error_message());
    mr_plan_work_free(w);
    free(p);
    return;
  }
  co->planning = w;
}

/* Plans the layers moved, then asks for the checkpoint the group starts
 * again from with them. */
static void begin_rebalance(struct coordinator *co, const struct mr_rebalance_out *out) {
  int pp = co->split.pp, k = pp * co->split.vp;
  struct replan *p = calloc(1, sizeof *p);
  if (p == NULL)
    return;
  char speeds[256], was[256], now[256];
  format_values(out->slowness, pp, 1, 2, speeds, sizeof speeds);
  format_counts(co->split.counts, k, was, sizeof was);
  format_counts(out->counts, k, now, sizeof now);
  p->kind = REGROUP_BALANCE;
  snprintf(p->unbalanced, sizeof p->unbalanced, "the pipeline's stages run unbalanced (time "
           "per unit of work by stage: %s)", speeds);
  snprintf(p->split, sizeof p->split, "layers %s", now);
  snprintf(p->change, sizeof p->change, "moving layers %s -> %s cuts the slowest chunk's time "
           "by %.0f%%", was, now, 100.0 * out->gain);
  replan(co, p, MR_PLAN_LAYERS, out->counts, k, 0);
}

/* The least share of the step a regroup for slow ranks must save
 * (MESHRUN_REBALANCE_GAIN), or 0 when none may be asked for now: no
 * checkpoints to start again from, another regroup or a preemption under
 * way, or too few steps left to gain back the restart. */
static double replan_gain(const struct coordinator *co) {
  const struct mr_job *job = co->opts->job;
  double min_gain = atof(mr_tunable_str(MR_TUNABLE_REBALANCE_GAIN));
  if (job == NULL || job->checkpoint.dir == NULL || !(min_gain > 0) || co->plan_text == NULL ||
      co->pending != REGROUP_NONE || co->preempting || co->state != GROUP_RUNNING ||
      co->planning != NULL || job->train.steps - mr__co_newest_step(co) < 4 * STRAGGLER_EVERY)
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
 * - give the slow data rank fewer of the step's micro-batches (unless
 *   the job fixes the split; ZeRO 0-1, or ZeRO-2 without a pipeline,
 *   where it posts the reduce-scatters of the micro-batches it no longer
 *   runs first and goes on to its own): each data rank's work per step (its
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
  double *busy;               // [pp]
  struct mr_rebalance_out out; // (its arrays owned here)
  double gain;
};

static void layer_option_close(struct layer_option *o) {
  free(o->busy), free(o->out.slowness), free(o->out.counts);
  memset(o, 0, sizeof *o);
}

/* Moving layers' gain into o (0 when it does not apply). */
static void layer_option(struct coordinator *co, struct layer_option *o) {
  memset(o, 0, sizeof *o);
  int pp = co->split.pp, k = pp * co->split.vp;
  if (pp < 2 || co->opts->job->strategy.n_chunk_layers > 0)
    return;
  o->busy = calloc((size_t)pp, sizeof *o->busy);
  o->out.slowness = calloc((size_t)pp, sizeof *o->out.slowness);
  o->out.counts = calloc((size_t)k, sizeof *o->out.counts);
  struct mr_rebalance_in in = {pp, co->split.vp, co->split.n_layers, co->split.counts,
                               co->split.layer, co->split.first, co->split.last, o->busy};
  if (o->busy != NULL && o->out.slowness != NULL && o->out.counts != NULL &&
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
  /* under ZeRO-3, or ZeRO-2 with a pipeline, a rank with fewer micro-batches
   * still waits for the others' at every micro-batch's collectives (its
   * phantom slots come last): fewer would not make it finish sooner */
  if (h->n_dp_micro > 0 || dp < 2 || co->split.data_of == NULL || co->split.zero >= 3 ||
      (co->split.zero == 2 && co->split.pp > 1))
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
  struct replan *p = calloc(1, sizeof *p);
  if (p == NULL)
    return;
  char work[256], now[256];
  format_values(o->busy, o->dp, 1e3, 1, work, sizeof work);
  format_counts(o->counts, o->dp, now, sizeof now);
  int n_micro = o->n_micro == co->split.n_micro ? 0 : o->n_micro; /* 0: the plan's count */
  p->kind = REGROUP_DP_BALANCE;
  snprintf(p->unbalanced, sizeof p->unbalanced, "the data-parallel ranks run unbalanced (work "
           "per step by data rank: %s ms)", work);
  snprintf(p->split, sizeof p->split, "micro-batches %s", now);
  snprintf(p->change, sizeof p->change, "running %s of %d micro-batches cuts the step by about "
           "%.0f%%", now, o->dp * o->n_micro, 100.0 * o->gain);
  replan(co, p, MR_PLAN_DP_MICRO, o->counts, o->dp, n_micro);
}

struct node_option {
  int top;                    // the node's place in the group
  double worst, others, gain; // its work a step, the others' most, the share saved
};

/* Leaving out the busiest node's gain into o (0 when it does not apply). */
static void node_option(struct coordinator *co, struct node_option *o) {
  int n = co->n_group_nodes;
  memset(o, 0, sizeof *o);
  if (!mr__co_elastic(co) || n - 1 < co->opts->min_nodes)
    return;
  /* a world the job's fixed degrees do not divide has no plan to go on with */
  const struct mr_strategy_hint *h = &co->opts->job->strategy;
  int64_t fixed = (int64_t)(h->dp > 0 ? h->dp : 1) * (h->tp > 0 ? h->tp : 1) *
                  (h->pp > 0 ? h->pp : 1);
  if ((int64_t)(co->world - co->node_ranks) % fixed != 0)
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

void mr__co_check_slow_ranks(struct coordinator *co) {
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
      begin_rebalance(co, &l.out);
    } else if (kind == REGROUP_DP_BALANCE) {
      begin_dp_rebalance(co, &d);
    } else {
      co->leaving = co->group_nodes[k.top];
      MR_WARN("launch", "node %d runs slow: %.1f ms of work a step against at most %.1f ms on "
              "the others; leaving it out (%d of %d nodes) cuts the step by about %.0f%%; "
              "writing a checkpoint, then starting again", co->leaving, k.worst * 1e3,
              k.others * 1e3, co->n_group_nodes - 1, co->nnodes, 100.0 * k.gain);
      mr__co_ask_regroup(co, REGROUP_SLOW_NODE);
    }
  }
  layer_option_close(&l);
  dp_option_close(&d);
}

