/* reduce.h - the element-wise reductions of the CPU comm backend.
 *
 * One function reduces n sources in a fixed order (srcs[0] first), so every
 * rank and every transport computes bitwise the same result: float32
 * accumulates in float32, bf16 and fp16 are widened to float32, accumulated,
 * and rounded once (to nearest even); integers wrap on overflow, and their
 * average is the exact sum truncated toward zero.  Max propagates NaN. */
#ifndef MR_COMM_REDUCE_H
#define MR_COMM_REDUCE_H

#include <stddef.h>

#include "common/dtype.h"
#include "worker/comm/comm.h"

/* dst[i] = op(srcs[0][i], ..., srcs[nsrc-1][i]) for i < count.  dst may
 * equal any source.  Returns 0 or MR_ENOTSUP for a dtype without
 * reductions. */
int mr__reduce(enum mr_dtype dt, enum mr_red_op op, void *dst,
               const void *const *srcs, int nsrc, size_t count);

/* Whether dt supports reductions (f32, bf16, f16, i32, i64). */
int mr__reducible(enum mr_dtype dt);

#endif
