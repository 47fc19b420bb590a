/* job.h - the job file, parsed into a typed struct and validated as a
 * whole.
 *
 * Every field of the job file format (docs in README.md, "The job file") has
 * a member here.  mr_job_load() reports every problem it finds, each naming
 * the file and the field path (`job.json: strategy.pipeline_parallel.degree:
 * expected a positive integer, got "two"`), and returns MR_EJOB; the CLI
 * turns that into exit code 2.  Relative paths are resolved against the job
 * file's folder.  Unset optional degrees are 0 and unset switches -1, so
 * the planner can tell "fixed" from "search it". */
#ifndef MR_JOB_H
#define MR_JOB_H

#include <stdint.h>

#include "common/model_config.h"

enum mr_schedule { MR_SCHEDULE_CONSTANT = 0, MR_SCHEDULE_COSINE = 1 };
enum mr_auto_mode { MR_AUTO_FULL = 0, MR_AUTO_SEMI = 1, MR_AUTO_MANUAL = 2 };
enum mr_pp_schedule { MR_PP_1F1B = 0, MR_PP_GPIPE = 1, MR_PP_INTERLEAVED = 2 };
enum mr_recompute_granularity { MR_RECOMPUTE_FULL = 0, MR_RECOMPUTE_SELECTIVE = 1 };
enum mr_amp_dtype { MR_AMP_FP32 = 0, MR_AMP_BF16 = 1, MR_AMP_FP16 = 2 };
/* How ranks are numbered over the mesh: tensor parallel fastest, then data
 * then pipeline ("tp,dp,pp", Megatron's order), or pipeline then data. */
enum mr_mesh_mapping { MR_MAP_TP_DP_PP = 0, MR_MAP_TP_PP_DP = 1 };

struct mr_train_config {
  int64_t steps;
  int64_t global_batch;         // sequences per optimizer step
  int64_t seq_len;
  double lr;
  enum mr_schedule schedule;
  int64_t warmup_steps;
  double min_lr;
  double weight_decay;
  double beta1, beta2;
  double eps;
  double grad_clip;             // 0: off
  uint64_t seed;
  char *init;                   // "random" or a path (resolved)
  int64_t eval_interval_steps;  // 0: off
  int64_t eval_batches;
  int64_t log_interval_steps;
};

struct mr_strategy_hint {
  enum mr_auto_mode auto_mode;
  int dp, tp, pp;               // 0: not fixed
  enum mr_pp_schedule pp_schedule;
  int pp_schedule_set;
  int micro_batches;            // 0: not fixed
  int virtual_stages;           // 0: not fixed
  int *chunk_layers;            // pipeline_parallel.layers: decoder layers of
  int n_chunk_layers;           //   each pipeline chunk in order; NULL: by FLOPs
  int *dp_micro;                // data_parallel.micro_batches: micro-batches
  int n_dp_micro;               //   of each data-parallel rank; NULL: even
  int sequence_parallel;        // -1 not fixed, 0/1
  int zero_stage;               // -1 not fixed, 0..3
  int offload;                  // -1 not fixed, 0/1
  int recompute;                // -1 not fixed, 0/1
  enum mr_recompute_granularity recompute_granularity;
  int recompute_every_n_layers; // 0: not fixed
  enum mr_amp_dtype amp_dtype;
  double init_loss_scaling;
  int grad_accum_steps;         // 0: not fixed
  int grad_accum_in_op;         // -1 not set (in the op), 0: a buffer per
                                // gradient, 1: the op producing it adds in
  int mapping;                  // -1 not fixed, enum mr_mesh_mapping
};

struct mr_shard_rule_placement {
  char *mesh_dim;               // e.g. "model"
  char *placement;              // e.g. "Shard(0)", validated syntax
};

struct mr_shard_rule {
  char *match;                  // POSIX extended regex, validated
  struct mr_shard_rule_placement *placements;
  int n_placements;
};

struct mr_trace_config {        // not part of the computation: left out of text
  char *dir;                    // NULL: no trace
  int64_t first, last;          // 0: a few steps after each group's warm-up
};

struct mr_checkpoint_config {
  char *dir;                    // NULL: no checkpoints
  int64_t save_interval_steps;  // 0: only on demand
  int64_t keep_last;
};

struct mr_job {
  char *path;                   // the job file as given
  char *dir;                    // its folder, for relative paths
  char *model_path;             // NULL when the model is inline
  char *model_json;             // the model's config object as given (every
                                // field, those meshrun does not read too):
                                // what workers, checkpoints and export carry
  struct mr_model_config model;
  char *data_train;             // resolved path
  char *data_val;               // resolved path or NULL
  struct mr_train_config train;
  struct mr_strategy_hint strategy;
  struct mr_shard_rule *shard_rules;
  int n_shard_rules;
  struct mr_checkpoint_config checkpoint;
  char *cluster;                // resolved path or NULL (measure this machine)
  char **plugins;               // shared objects adding ops (resolved paths),
  int n_plugins;                // loaded by launch, plan and every worker
  struct mr_trace_config trace;
  char *text;                   // the job, re-serialized with paths resolved
};

/* Reads, parses and validates a job file into job (caller-allocated).
 * Returns 0, or MR_ENOENT / MR_EJOB with every problem in
 * mr_error_message() (one per line).  On failure job holds nothing to free. */
int mr_job_load(const char *path, struct mr_job *job);

/* Same, from JSON text; `name` stands in for the path in messages and
 * `dir` resolves relative paths. */
int mr_job_parse(const char *text, const char *name, const char *dir,
                 struct mr_job *job);

/* "A:B" (steps A to B, inclusive) or "A" (that step) of a run of `steps`
 * into first and last.  Returns 0, or MR_EINVAL with a message naming
 * what (e.g. "--trace-steps"; NULL: nothing) and the value. */
int mr_job_steps_range(const char *what, const char *text, int64_t steps, int64_t *first,
                       int64_t *last);

/* The model's config object as the job gave it (model_json), or, for a
 * job built in code, the one mr_model_config_to_json writes.  The caller's
 * (cJSON_Delete). */
struct cJSON *mr_job_model_object(const struct mr_job *job);

/* Frees everything job owns.  A zeroed job is fine. */
void mr_job_close(struct mr_job *job);

#endif
