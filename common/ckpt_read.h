/* ckpt_read.h - reading any slice of a tensor from a distributed
 * checkpoint, whatever sharding wrote it: the reshard of checkpoints.
 *
 * A checkpoint's rank files (rank-R.safetensors) hold pieces: each stored
 * 1-D, and described in the file's __metadata__ "pieces" entry as
 *   {"NAME": [off_0, .., off_{n-1}, len_0, .., len_{n-1}, begin, count]}
 * — elements [begin, begin + count) of the row-major box of lengths len at
 * offset off within the global tensor NAME (a rank's tensor-parallel shard,
 * and of that a ZeRO block).  A reader gathers the elements any other box
 * and range needs from the pieces that overlap it, so a job resumes on
 * another strategy or world size reading only what it needs.  Tensors of
 * 1 to MR_CKPT_MAX_DIMS dims (every parameter and optimizer moment). */
#ifndef MR_CKPT_READ_H
#define MR_CKPT_READ_H

#include <stddef.h>
#include <stdint.h>

#define MR_CKPT_MAX_DIMS 4

struct mr_ckpt_reader;

/* Opens the rank files of checkpoint folder dir, exactly those its
 * COMPLETE lists (common/ckpt.h; their checksums are the launcher's to
 * check), and parses their pieces.  Returns 0, MR_ENOENT (no marker, or
 * no rank file listed) or MR_EFORMAT naming the file and the entry that
 * is wrong. */
int mr_ckpt_reader_open(const char *dir, struct mr_ckpt_reader **out);

/* Checks, from the pieces' metadata alone, that the pieces of tensor name
 * (global shape shape[ndim]) cover it exactly once: each lies in the
 * tensor, they hold as many elements as it has, and none overlaps another
 * (ranges apart within one box, boxes apart).  Returns 0 or MR_EFORMAT
 * naming the tensor. */
int mr_ckpt_reader_covers(struct mr_ckpt_reader *r, const char *name, int ndim,
                          const int64_t *shape);

void mr_ckpt_reader_free(struct mr_ckpt_reader *r);

/* An empty reader, and one rank file given as bytes (borrowed until the
 * reader is freed; name stands in for its path in messages): the way the
 * fuzz target feeds it.  Return 0, MR_ENOMEM or mr_ckpt_reader_open's
 * errors for that file. */
int mr_ckpt_reader_new(struct mr_ckpt_reader **out);
int mr_ckpt_reader_add_memory(struct mr_ckpt_reader *r, const void *data, size_t size,
                              const char *name);

/* Fills dst[0 .. count) with elements [begin, begin + count) of the box
 * (off[ndim], len[ndim]) of tensor name, global shape shape[ndim].  Returns
 * 0 or MR_EFORMAT naming the tensor when the pieces do not cover it, a
 * piece lies outside the tensor, or pieces disagree on its rank. */
int mr_ckpt_reader_read(struct mr_ckpt_reader *r, const char *name, int ndim,
                        const int64_t *shape, const int64_t *off, const int64_t *len,
                        int64_t begin, int64_t count, float *dst);

/* The pieces' metadata entry for one piece (JSON text, malloc'd). */
char *mr_ckpt_piece_json(int ndim, const int64_t *off, const int64_t *len, int64_t begin,
                         int64_t count);

#endif
