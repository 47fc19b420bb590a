/* box.h - boxes of row-major tensors: the run-by-run walk that shard
 * copies, checkpoint slices and seeded initialisation share.  A box is
 * an offset and a length per dimension of a tensor's shape. */
#ifndef MR_BOX_H
#define MR_BOX_H

#include <stdint.h>

#define MR_MAX_DIMS 4 // the most dimensions a tensor has

/* Visits the box (off, len) of a row-major tensor of shape[ndim] run by
 * run of contiguous elements, in the box's row-major order: fn(ctx, the
 * run's first element in the tensor, its first element in the box, its
 * length). */
void mr_box_runs(int ndim, const int64_t *shape, const int64_t *off, const int64_t *len,
                 void (*fn)(void *ctx, int64_t at, int64_t in_box, int64_t n), void *ctx);

/* Copies the box (off, len) of a whole row-major float tensor of
 * shape[ndim] to box (dense, row-major), or box into the whole tensor. */
void mr_box_gather(int ndim, const int64_t *shape, const int64_t *off, const int64_t *len,
                   const float *whole, float *box);
void mr_box_scatter(int ndim, const int64_t *shape, const int64_t *off, const int64_t *len,
                    const float *box, float *whole);

#endif
