/* strategy_choice.h - the strategy `meshrun launch` runs a job with.
 *
 * The planner (compiler/planner) searches everything the job leaves open
 * (manual mode: the job's strategy, evaluated).  The launcher takes the
 * fastest candidate that lowers to rank programs whose communication fits
 * together (compiler/spmd/lower.h, checked for every rank before any
 * worker starts); one that does not lower (more than 64 virtual stages,
 * say) gives way to the next. */
#ifndef MR_STRATEGY_CHOICE_H
#define MR_STRATEGY_CHOICE_H

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>

#include "common/job.h"
#include "compiler/planner/search.h"

struct mr_strategy_choice {
  struct mr_plan_candidate chosen;   // what runs
  struct mr_plan_candidate best;     // the planner's unconstrained best
  int have_best;
  char cluster_path[4096];
  uint64_t *program_digests;         // [world]: each rank's program as checked
  char dp_split[128];                // "3,1": the job's micro-batches per data
                                     // rank, when it sets them; else ""
};

/* Chooses for job on world ranks.  Returns 0, MR_ENOFIT, MR_EINVAL /
 * MR_ENOTSUP / MR_EPLAN (the job's own strategy cannot be lowered or its
 * programs do not fit together; the message names why), or a cluster
 * error. */
int mr_strategy_choose(const struct mr_job *job, int world, struct mr_strategy_choice *out);

/* Frees what a choice holds (the digests). */
void mr_strategy_choice_close(struct mr_strategy_choice *c);

/* The strategy as a job file's "strategy" object (manual mode, every field
 * set; init_loss_scaling only when > 0; the splits the workload fixes —
 * pipeline_parallel.layers when it has one entry per chunk,
 * data_parallel.micro_batches one per data rank), for the plan body and
 * `meshrun plan --json`. */
cJSON *mr_strategy_json(const struct mr_strategy *s, double init_loss_scaling,
                        const struct mr_workload *w);

/* Writes the chosen strategy into the job's canonical text (the plan body
 * the workers parse), under the job file's field names.  Returns a new
 * malloc'd text or NULL. */
char *mr_strategy_apply(const struct mr_job *job, const struct mr_strategy *s);

/* Prints rank `rank`'s program for job under strategy s on world ranks,
 * after checking every rank's communication fits together (meshrun plan
 * --rank R --dump).  Returns an exit code: 0, 1 (the check or the lowering
 * failed, with a message on stderr) or 2 (a bad rank). */
int mr_plan_dump_rank(const struct mr_job *job, const struct mr_strategy *s, int world, int rank,
                      FILE *f);

/* Prints the choice: strategy, predictions, and the unconstrained best. */
void mr_strategy_print(const struct mr_strategy_choice *c, FILE *f);

#endif
