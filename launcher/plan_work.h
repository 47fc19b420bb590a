/* plan_work.h - plans made off the launcher's event loop.
 *
 * A plan is the search and the lowering of every rank's program: seconds
 * for a large job.  Run on the loop's thread it would stop the launcher
 * reading heartbeats, answering rendezvous and meeting auth deadlines, and
 * a healthy rank would be blamed for the silence.  So the coordinator
 * hands it to libuv's thread pool (uv_queue_work) and goes on; `done`
 * runs on the loop's thread once the plan is made.
 *
 * The pool's thread uses only the compiler and the job (read only): the
 * coordinator starts one plan at a time and calls no planner while it
 * runs. */
#ifndef MR_PLAN_WORK_H
#define MR_PLAN_WORK_H

#include <stdint.h>
#include <uv.h>

#include "common/job.h"
#include "launcher/strategy_choice.h"

enum mr_plan_work_kind {
  MR_PLAN_WORLD,    // the search again, for `world` ranks
  MR_PLAN_LAYERS,   // `plan` with the pipeline chunks holding counts[n] layers
  MR_PLAN_DP_MICRO, // `plan` with data rank d running counts[d] of n_micro
};

struct mr_plan_work {
  uv_work_t req;
  /* what to plan (set by mr_plan_work_start, owned here) */
  enum mr_plan_work_kind kind;
  const struct mr_job *job; // lives as long as the launch
  char *plan;               // the running plan's text (LAYERS, DP_MICRO)
  int world;
  int *counts, n, n_micro;
  /* what came out, for `done` */
  int rc;                   // 0, or the error (its message in message)
  char message[1024];
  char *text;               // the new plan body, taken by whoever keeps it
  uint64_t *digests;        // [world] its programs' digests, likewise
  double step_s;            // its predicted step time
  struct mr_strategy_choice choice; // MR_PLAN_WORLD: what the search weighed
  void (*done)(struct mr_plan_work *w);
  void *data;               // the caller's
};

/* Starts planning w->kind for job on world ranks (plan and counts copied;
 * counts may be NULL for MR_PLAN_WORLD); done(w) runs on loop's thread
 * when it is made, whatever the outcome (w->rc).  The caller allocates w,
 * sets done and data, and after done calls mr_plan_work_free.  Returns 0
 * or an error (done then never runs). */
int mr_plan_work_start(uv_loop_t *loop, struct mr_plan_work *w, enum mr_plan_work_kind kind,
                       const struct mr_job *job, const char *plan, int world, const int *counts,
                       int n, int n_micro);

/* Frees what w holds (what `done` did not take) and w. */
void mr_plan_work_free(struct mr_plan_work *w);

#endif
