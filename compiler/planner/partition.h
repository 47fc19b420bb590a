/* partition.h - splitting a stack of layers over pipeline chunks so the
 * slowest chunk is as fast as it can be.
 *
 * Chunks are contiguous; the first also runs the embedding and the last
 * the output head, so they may hold fewer layers.  Pure arithmetic. */
#ifndef MR_PARTITION_H
#define MR_PARTITION_H

/* General case by dynamic programming, O(k·n²): item costs cost[0..n-1]
 * in order, k chunks (k <= n), each at least one item.  Chunk j costs
 * speed[j] times the sum of its items (a device that runs slower gets
 * less; speed NULL: all 1).  Writes the first item of each chunk to
 * start[0..k-1] (start[0] = 0) and returns the largest chunk cost, or a
 * negative MR_E code (k out of range; n > MR_PARTITION_MAX_ITEMS). */
#define MR_PARTITION_MAX_ITEMS 4096
double mr_partition_dp(const double *cost, int n, int k, const double *speed, int *start);

/* Uniform layers in closed form: l layers of cost c each over k chunks,
 * the first carrying an extra cost `first`, the last `last` (both when
 * k == 1).  Returns the smallest possible largest chunk cost and writes the
 * layer count of each chunk to counts[0..k-1] (may be NULL); negative when
 * l < 1 or k < 1.  Equals mr_partition_dp on [first, c × l, last] with
 * every chunk holding at least one layer. */
double mr_partition_uniform(int l, double c, double first, double last, int k, int *counts);

#endif
