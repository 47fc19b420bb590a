/* rebalance.h - moving pipeline layers off a stage that runs slow, and
 * micro-batches off a data-parallel rank that does.
 *
 * Every micro-batch passes through every pipeline stage, so a stage that
 * takes longer for its share of the work (a throttled GPU, a busy node)
 * holds up the whole pipeline.  From each stage's measured work per step
 * (step time less communication wait) and the work the split gives it,
 * each stage's slowness relative to the fastest; then the split of layers
 * over the chunks that is fastest at those speeds (compiler/planner/
 * partition.h, weighted) and the share of the step it saves.  The cost of
 * a chunk is its layers' work, the embedding's on the first chunk and the
 * head's on the last; the slowest chunk paces the pipeline, as in the cost
 * model (docs/PLANNER.md, "Pipeline schedule").  mr_rebalance is pure
 * arithmetic; the split of a plan and a plan with another split are read
 * and written by lowering the plan as every rank does. */
#ifndef MR_REBALANCE_H
#define MR_REBALANCE_H

#include <stdint.h>

#include "common/job.h"

struct mr_rebalance_in {
  int pp, vp;                 // pipeline degree, chunks per stage (chunk c on stage c % pp)
  int n_layers;
  const int *counts;          // [pp * vp] layers of each chunk now
  double layer, first, last;  // work of a layer, of the embedding, of the head
  const double *busy;         // [pp] each stage's measured work per step, s
};

struct mr_rebalance_out {
  double *slowness;           // [pp] time per unit of work over the fastest stage's
  int *counts;                // [pp * vp] the split fastest at those speeds
  double now, then;           // the slowest chunk's time, this split and that one
  double gain;                // 1 - then / now: the share of the pipeline's pace saved
};

/* Fills out (arrays caller-allocated).  Returns 0, or MR_EINVAL when the
 * input cannot be weighed (a stage with no measured work, layers that do
 * not add up). */
int mr_rebalance(const struct mr_rebalance_in *in, struct mr_rebalance_out *out);

/* Data parallelism: every data-parallel rank (with its tensor-parallel
 * peers) runs its micro-batches, then waits for the slowest at the
 * gradient all-reduce, so a rank that takes longer for its share holds up
 * the step.  From each data rank's measured work per step and the
 * sequences its micro-batches hold, its time per sequence; then the
 * micro-batches per step and their split over the data ranks fastest at
 * those speeds: the step's slices (micro_seqs / dp sequences each) dealt
 * one at a time to the rank that would finish it first, which is optimal
 * for equal slices.  A rank's time is its per-step work (measured as its
 * work less its micro-batches') plus its slices' at its measured time per
 * sequence.  The micro-batch count of the step changes only when the
 * slices it has cannot be moved (one a rank) and the job leaves it open:
 * then, of the counts the batch divides into, the fewest micro-batches
 * that save at least 80% of what the best saves (smaller micro-batches
 * cost efficiency the arithmetic does not see).  Over a pipeline a data
 * rank is a replica of every stage, whose step is its micro-batches plus
 * the fill and drain: (k + p - 1) slots under 1F1B and GPipe, (k + (p -
 * 1)/v) interleaved (whose micro-batches go p at a time), a slot being
 * its slowest rank's work per micro-batch (Narayanan et al. 2021, §2.2);
 * the count is then kept (more micro-batches would shrink the bubble for
 * every replica, a choice the planner weighs with what they cost). */
struct mr_dp_rebalance_in {
  int dp, n_micro;            // data-parallel degree, micro-batches per step now
  const int *counts;          // [dp] each data rank's micro-batches now (NULL: n_micro each)
  const double *busy;         // [dp] each data rank's measured work per step, s,
  const double *micro;        //   and the part of it its micro-batches do (the
                              //   rest, gradient sync and optimizer, stays with
                              //   it whatever its share); NULL: all of it
  int64_t global_batch;       // sequences per step
  int fixed_micro;            // 1: keep n_micro (the job fixes the micro-batches)
  double bubble;              // slots of pipeline fill and drain (0: no pipeline)
  int unit;                   // micro-batches dealt at a time (0 or 1: one)
};

struct mr_dp_rebalance_out {
  int n_micro;                // micro-batches per step
  int *counts;                // [dp] each data rank's (caller-allocated)
  double now, then;           // the slowest rank's work now, and with those counts
};

/* Fills out.  Returns 0, or MR_EINVAL when the input cannot be weighed (a
 * rank with no measured work, counts that do not add up). */
int mr_dp_rebalance(const struct mr_dp_rebalance_in *in, struct mr_dp_rebalance_out *out);

/* The split of a plan (a job's canonical text with its strategy fixed, as
 * the workers get it; `job` names it in messages) on world ranks.  */
struct mr_split {
  int pp, vp, n_layers;
  int *counts;                // [pp * vp]
  double layer, first, last;  // forward FLOPs (struct mr_lowered)
  int dp, tp, zero, n_micro;  // the layout (struct mr_layout)
  int64_t global_batch;
  int *dp_micro;              // [dp] data_parallel.micro_batches, NULL: even
  int *data_of;               // [world] each rank's data-parallel coordinate
};
int mr_split_of_plan(const struct mr_job *job, const char *plan, int world, struct mr_split *out);
void mr_split_close(struct mr_split *s);

/* The plan with strategy.pipeline_parallel.layers set to counts[n],
 * evaluated by the cost model on job's cluster spec (the one the launch
 * planned with: it must fit the device memory) and lowered for every rank
 * and checked; their program digests into digests[world], its predicted
 * step time into *step_s (unless NULL).  Returns a new malloc'd text, or
 * NULL with a message. */
char *mr_plan_with_split(const struct mr_job *job, const char *plan, int world,
                         const int *counts, int n, uint64_t *digests, double *step_s);

/* The plan with n_micro micro-batches a step (gradient accumulation; no
 * pipeline; 0: the plan's count, pipeline or not) split over the
 * data-parallel ranks as counts[dp] (strategy.data_parallel.micro_batches),
 * checked as mr_plan_with_split checks. */
char *mr_plan_with_dp_split(const struct mr_job *job, const char *plan, int world, int n_micro,
                            const int *counts, int dp, uint64_t *digests, double *step_s);

#endif
