/* strategy.h - one parallel training strategy: how a model is split over a
 * world of ranks and how each step is scheduled.
 *
 * This is the strategy part of the plan the launcher sends to workers.  The
 * rank layout is a three-dimensional mesh, tensor-parallel fastest; `mapping`
 * says which of data or pipeline parallelism comes next (and so which of
 * them stays inside a node when the node has room).  Fields are in the job
 * file's terms (docs/PLANNER.md lists the correspondence). */
#ifndef MR_STRATEGY_H
#define MR_STRATEGY_H

#include "common/job.h"

enum mr_recompute_mode {
  MR_RECOMPUTE_NONE = 0,
  MR_RECOMPUTE_MODE_SELECTIVE = 1, // attention core only (Korthikanti et al. 2022)
  MR_RECOMPUTE_MODE_FULL = 2,      // whole block from its stored input
};

struct mr_strategy {
  int dp, tp, pp;                  // degrees; dp * tp * pp = world size
  enum mr_mesh_mapping mapping;
  int sequence_parallel;           // 0/1, only with tp > 1
  int zero_stage;                  // 0..3 (Rajbhandari et al. 2020)
  int offload;                     // optimizer states in host memory (stage >= 1)
  enum mr_recompute_mode recompute;
  int recompute_every_n;           // full: store the input of every n-th layer
  int micro_batch_size;            // sequences per micro-batch
  int micro_batches;               // per pipeline flush, per data-parallel rank
  int grad_accum_steps;            // pipeline flushes per optimizer step
  int virtual_stages;              // model chunks per pipeline rank (interleaved)
  enum mr_pp_schedule schedule;
  enum mr_amp_dtype amp_dtype;
};

#endif
