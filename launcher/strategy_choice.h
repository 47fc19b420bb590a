/* strategy_choice.h - the strategy `meshrun launch` runs a job with.
 *
 * The planner (launcher/planner) searches everything the job leaves open.
 * The worker runtime executes a subset of what the planner models: data
 * parallelism over every rank, ZeRO stage 0 or 1 and gradient
 * accumulation, in fp32/bf16/fp16.  So the launcher searches twice: once
 * unconstrained, to report what the planner would pick, and once within
 * what runs, to pick the strategy it sends.  A job that fixes something
 * the runtime cannot execute (tensor or pipeline parallelism, sequence
 * parallelism, ZeRO-2/3, recompute, offload) is refused with a message
 * naming the field. */
#ifndef MR_STRATEGY_CHOICE_H
#define MR_STRATEGY_CHOICE_H

#include <stdio.h>

#include "common/job.h"
#include "launcher/planner/search.h"

struct mr_strategy_choice {
  struct mr_plan_candidate chosen;   // what runs
  struct mr_plan_candidate best;     // the planner's unconstrained best
  int have_best;
  char cluster_path[4096];
};

/* Chooses for job on world ranks.  Returns 0, MR_ENOTSUP (a fixed field the
 * runtime cannot run; message names it), MR_ENOFIT, or a cluster error. */
int mr_strategy_choose(const struct mr_job *job, int world, struct mr_strategy_choice *out);

/* Writes the chosen strategy into the job's canonical text (the plan body
 * the workers parse), under the job file's field names.  Returns a new
 * malloc'd text or NULL. */
char *mr_strategy_apply(const struct mr_job *job, const struct mr_strategy *s);

/* Prints the choice: strategy, predictions, and the unconstrained best. */
void mr_strategy_print(const struct mr_strategy_choice *c, FILE *f);

#endif
