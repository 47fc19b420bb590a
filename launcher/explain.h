/* explain.h - `meshrun plan JOB.json --explain`: the completed distributed
 * graph of a job on one data x model mesh, in words: every tensor's
 * placements, every reshard with its steps and bytes, and the collectives
 * per mesh dim.  `meshrun explain ARGS` is `meshrun plan ARGS --explain`. */
#ifndef MR_EXPLAIN_H
#define MR_EXPLAIN_H

#include <stdio.h>

#include "common/job.h"
#include "compiler/mesh.h"

/* Builds the job's training graph (forward + backward) for one step of
 * train.global_batch x train.seq_len tokens and completes it on mesh m
 * (batch split over the dim named "data"; sequence parallel over "model"
 * when sequence_parallel is 1), with the job's shard_rules — or, for a
 * LLaMA job without any, Megatron's layout (q/k/v/gate/up Shard(0),
 * o/down Shard(1) on "model"), which the cost model assumes — and the loss
 * in the form that moves fewer bytes (mr_spmd_complete_model).  Writes the
 * result to out.  Returns 0, MR_EINVAL (a hint that cannot hold, heads
 * that do not divide; message set) or another error from building the
 * graph. */
int mr_explain(const struct mr_job *job, const struct mr_mesh *m,
               int sequence_parallel, FILE *out);

/* `meshrun explain JOB.json [--plugin lib.so]... [plan options]`: loads
 * the plugins, then runs `meshrun plan` with --explain.  Exit code as
 * mr_cmd_plan's. */
int mr_cmd_explain(int argc, char **argv);

#endif
