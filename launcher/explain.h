/* explain.h - `meshrun plan JOB.json --mesh ... --explain`: the completed
 * distributed graph of a job on one mesh, in words. */
#ifndef MR_EXPLAIN_H
#define MR_EXPLAIN_H

#include <stdio.h>

#include "common/job.h"

/* Builds the job's training graph (forward + backward) for one step of
 * train.global_batch x train.seq_len tokens, completes it on the mesh
 * given as "data=2,model=4" (data dim "data"; sequence parallel on "model"
 * when strategy.sequence_parallel is 1) and writes every tensor's
 * placements and local bytes and every reshard with its steps and bytes to
 * out.  Returns 0, MR_EINVAL (bad mesh, a hint that cannot hold; message
 * set) or another error from building the graph. */
int mr_explain(const struct mr_job *job, const char *mesh_spec, FILE *out);

/* `meshrun explain JOB.json --mesh SPEC`: exit code 0, 1 or 2. */
int mr_cmd_explain(int argc, char **argv);

#endif
