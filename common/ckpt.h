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
/* In a checkpoint root: {"folder": the model folder the job's config came
 * from} (written at launch), so that export can carry its tokenizer and
 * generation config through. */
#define MR_CKPT_MODEL_SOURCE "model-source.json"

/* ROOT/step-SSSSSSSS into buf. */
void mr_ckpt_step_dir(const char *root, int64_t step, char *buf, size_t n);

/* Writes dir/COMPLETE for step: the n files (names relative to dir) with
 * their checksums, atomically and durably.  Returns 0 or MR_EIO. */
int mr_ckpt_write_marker(const char *dir, int64_t step, const char *const *files,
                         const char *const *checksum, int n);

/* What dir/COMPLETE lists: the checkpoint's step and its files (plain
 * names within dir) with their checksums.  The checkpoint is exactly these
 * files: anything else in the folder (a shard left by an earlier,
 * interrupted save, a file an operator put there) is not read. */
struct mr_ckpt_manifest {
  int64_t step;
  int n;
  char **names, **sums;
};

/* Reads dir/COMPLETE into m (freed with mr_ckpt_manifest_free, also after
 * a failure).  Returns 0, MR_ENOENT when there is no marker (an
 * interrupted save), MR_EFORMAT naming the file otherwise. */
int mr_ckpt_manifest_load(const char *dir, struct mr_ckpt_manifest *m);
void mr_ckpt_manifest_free(struct mr_ckpt_manifest *m);

/* Checks dir/COMPLETE and every file's checksum.  Returns 0 when the
 * checkpoint is complete and intact, MR_ENOENT when there is no marker,
 * MR_EFORMAT with a message naming the file otherwise. */
int mr_ckpt_verify(const char *dir, int64_t *step);

/* mr_ckpt_verify, then what a load needs without reading the data: the
 * index parses, and the pieces of every tensor it lists, and of both its
 * AdamW moments, cover the tensor exactly once (no piece missing, none
 * twice).  So a checkpoint the ranks could not load is found by the
 * launcher, before any rank spends a restart on it.  Returns as
 * mr_ckpt_verify. */
int mr_ckpt_check(const char *dir, int64_t *step);

/* The newest complete checkpoint under root that passes mr_ckpt_check: its
 * folder into dir_out and its step.  Broken or incomplete ones are skipped
 * with a warning naming them, and an entry step-N that is not a folder is
 * named and left alone.  Returns 1 when one was found, 0 when none, or an
 * error: MR_EFORMAT when checkpoints were completed there but none is
 * intact now (a run would otherwise start over and discard them). */
int mr_ckpt_find_latest(const char *root, char *dir_out, size_t n, int64_t *step);

/* Before a group that resumes from step `from` (0: from the start) saves
 * again: every step-N under root with N > from is cleared out of the way,
 * so that each save of step N starts in a folder of its own.  An
 * interrupted save (no COMPLETE) has its files removed; a complete one
 * that failed mr_ckpt_check is renamed step-N.bad (kept for whoever wants
 * to look, never loaded); files not written by a save are named and left
 * alone.  Returns 0, or MR_EINVAL naming an entry step-N that is not a
 * folder (the save of step N could not be written there), or MR_EIO. */
int mr_ckpt_clear_after(const char *root, int64_t from);

/* Removes complete checkpoints beyond the newest keep_last, and incomplete
 * ones older than the newest complete one (only the files a save writes:
 * others are named and left).  Returns the number removed. */
int mr_ckpt_prune(const char *root, int keep_last);

#endif
