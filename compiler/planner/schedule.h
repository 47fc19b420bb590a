/* schedule.h - the order in which one pipeline stage runs its passes:
 * GPipe, 1F1B and interleaved 1F1B (Narayanan et al. 2021).  Shared by the
 * cost model (how many micro-batches a stage keeps in flight) and the
 * lowering (the rank program's order), so they agree.  Pure arithmetic. */
#ifndef MR_SCHEDULE_H
#define MR_SCHEDULE_H

#include "common/job.h"

/* One pass: local chunk j (the stage's j-th model chunk, global chunk
 * j * pp + stage), micro-batch, forward 0 / backward 1. */
struct mr_sched_pass {
  int chunk, micro, backward;
};

/* Writes stage `stage`'s passes for m micro-batches, pp stages and vp
 * chunks per stage into out (2 * m * vp entries) and returns their count.
 * vp > 1 is the interleaved schedule (m must be a multiple of pp; the
 * caller checks); otherwise GPipe (all forwards, then all backwards) or
 * 1F1B (pp - stage - 1 warm-up forwards, then one forward and one backward
 * in turn, then the remaining backwards). */
int mr_pipeline_schedule(enum mr_pp_schedule sched, int pp, int stage, int vp, int m,
                         struct mr_sched_pass *out);

/* The most micro-batches stage holds forward activations of at once, per
 * local chunk (in_flight[vp]), under that schedule; returns the most over
 * all chunks together, in chunk-micro-batches. */
int mr_pipeline_in_flight(enum mr_pp_schedule sched, int pp, int stage, int vp, int m,
                          int *in_flight);

#endif
