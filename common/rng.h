/* rng.h - a counter-based random generator: Philox4x32-10.
 *
 * Every random number meshrun uses is a pure function of (seed, stream,
 * index): no generator state is carried from one call to the next, so any
 * rank can compute any element and the result never depends on which range a
 * caller asks for, in which order, or how a tensor is sharded.
 *
 * The bijection is Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel
 * random numbers: as easy as 1, 2, 3", SC 2011): a 128-bit counter and a
 * 64-bit key, ten rounds of two 32x32->64 multiplications (0xD2511F53,
 * 0xCD9E8D57) with the key bumped by the Weyl constants (0x9E3779B9,
 * 0xBB67AE85) between rounds.
 *
 * Derived draws (documented here because checkpoints and tests rely on them):
 *   block(seed, stream, c) = philox(ctr = {lo(c), hi(c), lo(stream),
 *                                          hi(stream)},
 *                                   key = {lo(seed), hi(seed)})
 *   mr_rng_u64(seed, stream, i)  = w0 | w1 << 32 of block(seed, stream, i)
 *   mr_rng_normal(seed, stream, i): with {w0..w3} = block(seed, stream, i/2),
 *     u1 = (((w0 | w1 << 32) >> 11) + 1) * 2^-53    (in (0, 1], never 0)
 *     u2 = ((w2 | w3 << 32) >> 11) * 2^-53           (in [0, 1))
 *     r = sqrt(-2 ln u1), theta = 2 pi u2
 *     value = r cos(theta) for even i, r sin(theta) for odd i  (Box-Muller)
 * so elements 2k and 2k+1 share one Philox block. */
#ifndef MR_RNG_H
#define MR_RNG_H

#include <stddef.h>
#include <stdint.h>

/* One Philox4x32-10 block: out = philox(ctr, key).  out may alias ctr. */
void mr_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2],
                      uint32_t out[4]);

/* The stable 64-bit FNV-1a hash of the NUL-terminated string s (offset basis
 * 0xcbf29ce484222325, prime 0x100000001b3).  Used as the stream of a named
 * parameter, so it never changes between releases. */
uint64_t mr_hash_str(const char *s);

/* 64 uniform random bits for (seed, stream, index); see the formula above. */
uint64_t mr_rng_u64(uint64_t seed, uint64_t stream, uint64_t index);

/* A uniform double in [0, 1) with 53 random bits: mr_rng_u64(...) >> 11
 * times 2^-53. */
double mr_rng_uniform(uint64_t seed, uint64_t stream, uint64_t index);

/* A standard normal N(0, 1) for (seed, stream, index), by Box-Muller as
 * documented above.  Always finite (|value| < 8.6). */
double mr_rng_normal(uint64_t seed, uint64_t stream, uint64_t index);

/* Fills out[k] = (float)((double)mean + (double)std * mr_rng_normal(seed,
 * stream, first + k)) for k in [0, n): the same values element by element as
 * the single call, about twice as fast (one block per pair), so a shard
 * [first, first + n) of a tensor gets exactly its part of the whole.  out is
 * caller-owned. */
void mr_rng_normal_fill(uint64_t seed, uint64_t stream, uint64_t first,
                        size_t n, float mean, float std, float *out);

/* mr_rng_normal_fill split over up to `threads` threads (the caller one of
 * them), in chunks of 2^20 elements: the same values, faster for the
 * first weights of a large model. */
void mr_rng_normal_fill_threads(int threads, uint64_t seed, uint64_t stream, uint64_t first,
                                int64_t n, float mean, float std, float *out);

/* The same for a box of a row-major tensor of `shape` (ndim >= 1): the
 * elements off[d] <= i[d] < off[d] + len[d], written to out in the box's
 * own row-major order, each the value mr_rng_normal_fill gives at its index
 * in the whole tensor.  A box of whole rows is one run drawn as above; any
 * other (a shard of columns) is dealt to the threads by rows of its first
 * dimension, each part walked run by run (box.h's mr_box_runs). */
void mr_rng_normal_fill_box(int threads, uint64_t seed, uint64_t stream, int ndim,
                            const int64_t *shape, const int64_t *off, const int64_t *len,
                            float mean, float std, float *out);

#endif
