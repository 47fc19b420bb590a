/* search.h - choosing the fastest strategy that fits.
 *
 * mr_plan_search() enumerates factorizations dp×tp×pp of the world size,
 * the mesh mapping (tensor parallel always inside a node first), sequence
 * parallelism, ZeRO stage and offload, recompute mode, micro-batch size and
 * count, schedule and virtual stages — keeping whatever the job's strategy
 * hint fixes — prunes by per-rank memory, ranks the rest by predicted step
 * time and keeps the best K.  Pure and deterministic: the same request
 * gives the same result, in the same order. */
#ifndef MR_SEARCH_H
#define MR_SEARCH_H

#include <stddef.h>
#include <stdint.h>

#include "common/job.h"
#include "compiler/planner/cluster.h"
#include "compiler/planner/cost.h"
#include "compiler/planner/strategy.h"

#define MR_PLAN_TOP_MAX 32

struct mr_plan_request {
  const struct mr_model_config *model;   // borrowed
  const struct mr_train_config *train;   // borrowed; global_batch, seq_len
  const struct mr_strategy_hint *hint;   // borrowed; NULL: nothing fixed
  const struct mr_cluster *cluster;      // borrowed
  int world;                             // ranks; 0: every device of the cluster
  int top_k;                             // 1..MR_PLAN_TOP_MAX; 0: 5
};

struct mr_plan_candidate {
  struct mr_strategy strategy;
  struct mr_cost cost;
};

struct mr_plan_result {
  int n_top;                                 // candidates that fit, best first
  struct mr_plan_candidate top[MR_PLAN_TOP_MAX];
  int64_t considered;                        // strategies the hint and model allow
  int64_t pruned_memory;                     // of those, too big for a device
  struct mr_plan_candidate least_memory;     // smallest per-rank total of all considered
  /* When nothing fits: what would (0 = no, 1 = yes, -1 = not tried). */
  int fits_with_offload;                     // letting the search offload
  int fits_with_recompute;                   // letting the search recompute
  int fits_with_both;                        // offload + recompute + any ZeRO stage
  int64_t devices_to_fit;                    // smallest world (doubling) that fits; 0: none up to 64×
};

/* Searches.  Returns 0 with out->n_top >= 1; MR_ENOFIT when no strategy
 * fits (out->least_memory and the fits_with_* fields say by how much and
 * what would help); MR_EINVAL when the hint contradicts itself or the world
 * cannot be split over the model, with a message naming the field. */
int mr_plan_search(const struct mr_plan_request *req, struct mr_plan_result *out);

/* The strategy a hint gives in manual mode (every unset field at its
 * default), checked.  Returns 0 or MR_EINVAL naming the field. */
int mr_plan_manual(const struct mr_plan_request *req, struct mr_strategy *out);

/* What `meshrun launch` calls for a job: manual mode evaluates the job's
 * strategy as given, full and semi search; *out gets the chosen strategy
 * and its prediction.  Returns 0, MR_ENOFIT (out holds the least-memory
 * strategy) or MR_EINVAL, as mr_plan_search. */
int mr_plan_choose(const struct mr_plan_request *req, struct mr_plan_candidate *out);

/* Why `alt` is slower than `best`: one line naming the components that
 * cost it the most ("+12% step: pipeline bubble +0.81 s, ...").  Writes
 * into buf (NUL-terminated, truncated to n). */
void mr_plan_explain(const struct mr_plan_candidate *best, const struct mr_plan_candidate *alt,
                     char *buf, size_t n);

#endif
