/* checkpoint.h - a rank's part of a distributed checkpoint: saving its
 * shards asynchronously and loading whatever slices its plan needs.
 *
 * Files of step S in folder D (common/ckpt.h names it):
 *   D/rank-R.safetensors   one copy of each distinct shard in the job:
 *                          parameters under their Hugging Face names and
 *                          AdamW moments as "optim.exp_avg.NAME" and
 *                          "optim.exp_avg_sq.NAME", each stored 1-D, with
 *                          the pieces they are (common/ckpt_read.h) in the
 *                          file's __metadata__ — a rank of data coordinate 0
 *                          writes its tensor-parallel shards; under ZeRO
 *                          every data rank writes its block of the moments
 *                          (ZeRO-3: and of the parameters)
 *   D/index.json           written by rank 0: format, step, world size,
 *                          the layout (strategy), mesh, seed (the data
 *                          position is the step: rows are a formula of
 *                          (seed, step, row)), the loss-scaler state, and
 *                          every parameter's global shape, dtype and
 *                          placements
 * Loading reads, for every parameter this rank holds under its own plan,
 * the box and range it needs from whichever pieces overlap it, so a job
 * resumes on another strategy or world size.
 *
 * Saving takes a snapshot of the state into host memory (a copy), then a
 * thread writes and checksums the files while training goes on; the rank
 * reports the files through its reporter when they are durable. */
#ifndef MR_CHECKPOINT_H
#define MR_CHECKPOINT_H

#include <stdint.h>

#include "common/job.h"
#include "worker/reporter.h"
#include "worker/runtime.h"

struct mr_ckpt_saver;

/* A saver for rank `rank` of world_size.  Returns 0 or MR_ENOMEM. */
int mr_ckpt_saver_new(int rank, int world_size, const struct mr_job *job,
                      struct mr_ckpt_saver **out);

/* Puts the writer's files on trace's timeline (borrowed; NULL: none). */
struct mr_trace;
void mr_ckpt_saver_set_trace(struct mr_ckpt_saver *s, struct mr_trace *trace);

/* Snapshots rt's state after step `step` and starts writing it under
 * job->checkpoint.dir; waits first for a save still in flight.  When the
 * files are durable, reporter->checkpoint_written is called (from the
 * writer thread).  Returns 0 or an error. */
int mr_ckpt_save(struct mr_ckpt_saver *s, struct mr_runtime *rt, int64_t step,
                 const struct mr_reporter *reporter);

/* Waits for the save in flight, if any; returns its result. */
int mr_ckpt_saver_wait(struct mr_ckpt_saver *s);

/* Without waiting: the result of a save that has finished (joining its
 * thread), 0 while one is still being written or none is.  A rank calls it
 * every step, so a save that failed (a full disk) fails the rank at once
 * instead of at the next save, and the group restarts from the last
 * complete checkpoint having lost the fewest steps.  NULL is a no-op. */
int mr_ckpt_saver_poll(struct mr_ckpt_saver *s);

/* Waits, then frees.  NULL is a no-op. */
void mr_ckpt_saver_free(struct mr_ckpt_saver *s);

/* Loads the checkpoint in folder dir into rt; *step gets its step.  Every
 * tensor's shape and name is checked against the model's.  Returns 0 or
 * MR_EFORMAT with a message naming the file and tensor. */
int mr_ckpt_load(struct mr_runtime *rt, const char *dir, int64_t *step);

#endif
