/* checkpoint.h - a rank's part of a distributed checkpoint: saving its
 * shards asynchronously and loading what its plan needs.
 *
 * Files of step S in folder D (common/ckpt.h names it):
 *   D/rank-R.safetensors   the tensors rank R owns: parameters under their
 *                          Hugging Face names, AdamW moments as
 *                          "optim.exp_avg.NAME" / "optim.exp_avg_sq.NAME"
 *   D/index.json           written by rank 0: format, step, world size,
 *                          mesh, strategy, seed (the data position is the
 *                          step: rows are a formula of (seed, step, row)),
 *                          loss-scaler state, and per tensor its global
 *                          shape, dtype, placements and the file holding it
 * Under data parallelism every rank holds the same state, so rank 0 writes
 * it all and the others write nothing; any world size can load it.
 *
 * Saving takes a snapshot of the state into host memory (a copy), then a
 * thread writes and checksums the files while training goes on; the rank
 * reports the files through its reporter when they are durable. */
#ifndef MR_CHECKPOINT_H
#define MR_CHECKPOINT_H

#include <stdint.h>

#include "common/job.h"
#include "worker/reporter.h"
#include "worker/train.h"

struct mr_ckpt_saver;

/* A saver for this rank.  Returns 0 or MR_ENOMEM. */
int mr_ckpt_saver_new(int rank, int world_size, const struct mr_job *job,
                      struct mr_ckpt_saver **out);

/* Snapshots t's state after step `step` and starts writing it under
 * job->checkpoint.dir; waits first for a save still in flight.  When the
 * files are durable, reporter->checkpoint_written is called (from the
 * writer thread).  Returns 0 or an error. */
int mr_ckpt_save(struct mr_ckpt_saver *s, struct mr_trainer *t, int64_t step,
                 const struct mr_reporter *reporter);

/* Waits for the save in flight, if any; returns its result. */
int mr_ckpt_saver_wait(struct mr_ckpt_saver *s);

/* Waits, then frees.  NULL is a no-op. */
void mr_ckpt_saver_free(struct mr_ckpt_saver *s);

/* Loads the checkpoint in folder dir into t; *step gets its step.  Every
 * tensor's shape and name is checked against the trainer's.  Returns 0 or
 * MR_EFORMAT with a message naming the file and tensor. */
int mr_ckpt_load(struct mr_trainer *t, const char *dir, int64_t *step);

#endif
