/* xent_vocab.h - cross-entropy in three steps for logits split by
 * vocabulary (Megatron's vocabulary-parallel cross-entropy): the row maxima,
 * the sums of exponentials relative to them with the targets' logits, and
 * the finishing step from their reductions over the vocabulary shards.
 *
 * A shard holds columns [lo, lo + V) of a vocabulary of `vocab`; targets
 * are ids in the whole vocabulary (negative: ignored), and a target outside
 * the shard contributes nothing.  Like the fused kernels (xent.c), nothing
 * of size [N, V] is kept: the backward rebuilds the softmax from m and s.
 * Conventions as in kernels.h: fp32, row-major, borrowed pointers, results
 * independent of the thread count (every reduction runs within one row). */
#ifndef MR_CPU_XENT_VOCAB_H
#define MR_CPU_XENT_VOCAB_H

#include <stdint.h>

#include "worker/backend/cpu/pool.h"

/* m[i] = max_j logits[i, j] over V >= 0 columns (-inf for none; NaN when
 * the row has a NaN, so an overflow upstream reaches the loss).  Returns 0
 * or MR_EINVAL (a negative size). */
int mr_cpu_xent_rowmax(struct mr_pool *pool, float *m, const float *logits,
                       int N, int V);

/* s[i] = sum_j exp(logits[i, j] - m[i]) (0 where m[i] is -inf), and
 * tl[i] = logits[i, targets[i] - lo] when the target lies in the shard,
 * else 0.  Returns 0, MR_EINVAL (bad sizes) or MR_ERANGE (a target >=
 * vocab, naming its row). */
int mr_cpu_xent_sumexp(struct mr_pool *pool, float *s, float *tl,
                       const float *logits, const int32_t *targets,
                       const float *m, int N, int V, int64_t lo, int64_t vocab);

/* dlogits[i, j] = ds[i] exp(logits[i, j] - m[i]), plus dtl[i] at the
 * target's column when it lies in the shard; ds or dtl NULL is zero.
 * Overwrites dlogits (which may be logits itself).  Returns as
 * mr_cpu_xent_sumexp. */
int mr_cpu_xent_sumexp_bwd(struct mr_pool *pool, float *dlogits,
                           const float *logits, const int32_t *targets,
                           const float *m, const float *ds, const float *dtl,
                           int N, int V, int64_t lo, int64_t vocab);

/* lse[i] = m[i] + log s[i]; *loss = sum (lse[i] - tl[i]) over the rows
 * whose target is >= 0, divided by `rows` (0: by their count; no such row:
 * 0), summed in double.  Serial: [N] work.  Returns 0 or MR_EINVAL. */
int mr_cpu_xent_finish(float *loss, float *lse, const float *s,
                       const float *tl, const float *m, const int32_t *targets,
                       int N, double rows);

/* The gradient of mr_cpu_xent_finish with m held fixed: for a row whose
 * target is >= 0, ds = dloss / (rows s) and dtl = -dloss / rows; plus
 * dlse / s on every row when dlse is not NULL.  rows as above.  Returns 0
 * or MR_EINVAL. */
int mr_cpu_xent_finish_bwd(float *ds, float *dtl, float dloss,
                           const float *dlse, const float *s,
                           const int32_t *targets, int N, double rows);

#endif
