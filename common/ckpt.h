/* ckpt.h - the checkpoint directory: naming, the completion marker, and
 * finding the newest complete checkpoint.
 *
 * A checkpoint of step S is the folder ROOT/step-SSSSSSSS holding each
 * rank's safetensors files and index.json (written by the workers, see
 * worker/checkpoint.h) and, written last by the coordinator once every rank
 * has reported its files, COMPLETE: JSON naming every file with its
 * checksum (common/checksum.h).  COMPLETE is written to a temporary name, fsynced, renamed and
 * the folder fsynced, so it exists only when everything before it is on
 * disk.  A folder without COMPLETE, or whose files do not match their
 * checksums, is never loaded. */
#ifndef MR_CKPT_H
#define MR_CKPT_H

#include <stddef.h>
#include <stdint.h>

#define MR_CKPT_MARKER "COMPLETE"
#define MR_CKPT_INDEX "index.json"

/* ROOT/step-SSSSSSSS into buf. */
void mr_ckpt_step_dir(const char *root, int64_t step, char *buf, size_t n);

/* Writes dir/COMPLETE for step: the n files (names relative to dir) with
 * their checksums, atomically and durably.  Returns 0 or MR_EIO. */
int mr_ckpt_write_marker(const char *dir, int64_t step, const char *const *files,
                         const char *const *checksum, int n);

/* Checks dir/COMPLETE and every file's checksum.  Returns 0 when the
 * checkpoint is complete and intact, MR_ENOENT when there is no marker,
 * MR_EFORMAT with a message naming the file otherwise. */
int mr_ckpt_verify(const char *dir, int64_t *step);

/* The newest complete, intact checkpoint under root: its folder into
 * dir_out and its step.  Broken or incomplete ones are skipped with a
 * warning naming them.  Returns 1 when one was found, 0 when none, or an
 * error: MR_EFORMAT when checkpoints were completed there but none is
 * intact now (a run would otherwise start over and discard them). */
int mr_ckpt_find_latest(const char *root, char *dir_out, size_t n, int64_t *step);

/* Removes complete checkpoints beyond the newest keep_last, and incomplete
 * ones older than the newest complete one.  Returns the number removed. */
int mr_ckpt_prune(const char *root, int keep_last);

#endif
