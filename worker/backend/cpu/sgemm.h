/* sgemm.h - private to the CPU kernels: our own single-precision matmul,
 * an AVX-512 copy (sgemm.c) and an AVX2+FMA one (sgemm_avx2.c).
 *
 * Debian's OpenBLAS 0.3.21 picks its AVX2 (Haswell) kernels on the AMD
 * EPYC cores it does not know (Zen 4 and 5), which run at half of what
 * those cores' 512-bit FMAs can do; and on any CPU each of its calls packs
 * op(B) again, so a product cut across threads packs it once per thread.
 * Where the CPU has AVX2 and FMA (see mr__sgemm_own), matmul.c and
 * attention_gemm.c use this instead of OpenBLAS: the AVX-512 copy where
 * the CPU has AVX-512F and MESHRUN_CPU_SIMD is "auto", else the AVX2 one.
 *
 * The product is split in two steps, so a pool can share the work: op(B)
 * is packed once into panels of 64 columns (zero padded), then any
 * rectangle of C is computed from the packed panels by a register-blocked
 * micro-kernel (6 x 64 with AVX-512, 6 x 16 with AVX2), K in fixed blocks
 * of at most 384.
 * Every element of C is summed in the same order (k ascending within a
 * block, blocks in order) whatever rectangle it falls in, so the result
 * does not depend on how C is cut or on the number of threads, nor on
 * which of the two copies runs. */
#ifndef MR_CPU_SGEMM_H
#define MR_CPU_SGEMM_H

#include <stdbool.h>
#include <stddef.h>

#define MR__SGEMM_MR 6  // rows of C per micro-kernel call
#define MR__SGEMM_NR 64 // columns of op(B) per packed panel
#define MR__SGEMM_KC 384 // most k per block

/* 1 when the AVX-512 matmul runs: the CPU has AVX-512F and
 * MESHRUN_CPU_SIMD is "auto".  Decided once per process. */
int mr__cpu_has_avx512(void);

/* 1 when this matmul runs rather than OpenBLAS: the CPU has AVX2 and FMA,
 * MESHRUN_CPU_SIMD is not "portable" and MESHRUN_CPU_GEMM not "openblas".
 * Decided once per process. */
int mr__sgemm_own(void);

/* Panels of op(B) per tile of C that a pool hands out: a K block of them
 * stays in L2 (8 with AVX-512, where L2 is 1 MiB; 4 with AVX2). */
int mr__sgemm_tile_panels(void);

/* Floats from one packed row of op(B) to the next: 64 (the AVX-512 copy
 * packs each 64-column panel row by row), or 16 (the AVX2 copy packs a
 * panel as four 16-column strips, each K x 16).  Row r of every panel or
 * strip is at bp + r * mr__sgemm_row_floats(). */
size_t mr__sgemm_row_floats(void);

/* Floats of op(B) packed: ceil(N / 64) panels of K x 64. */
size_t mr__sgemm_packed_floats(int K, int N);

/* Packs panels [p0, p1) of op(B), which is K x N: B[K, N] with leading
 * dimension ldb, or B[N, K] transposed when tb.  bp (64-byte aligned,
 * mr__sgemm_packed_floats(K, N) floats) is written; B is borrowed. */
void mr__sgemm_pack_b(bool tb, int K, int N, const float *B, int ldb,
                      float *bp, int p0, int p1);

/* C[i, j] = alpha * sum_k op(A)[i, k] op(B)[k, j] + beta * C[i, j]
 * (+ bias[j] when bias is not NULL) for i in [i0, i1), j in [j0, j1), with
 * op(B) the first K rows of panels packed by mr__sgemm_pack_b with kp rows
 * each (kp >= K; bp may point at row r of the panels to start there, see
 * mr__sgemm_row_floats).
 * op(A) is A[M, K] (lda), or A[K, M] transposed when ta.  j0 is a multiple
 * of 64; K >= 1.  beta == 0 ignores C's old contents (NaNs included).
 * Columns of one panel at most 32 wide take a 12 x 32 micro-kernel. */
void mr__sgemm_block(bool ta, int K, float alpha, const float *A, int lda,
                     const float *bp, int kp, float beta, float *C, int ldc,
                     const float *bias, int i0, int i1, int j0, int j1);

/* The whole product C = alpha op(A) op(B) + beta C on the calling thread
 * (a task inside a pool job may call it); pack is scratch of
 * mr__sgemm_packed_floats(K, N) floats, 64-byte aligned.  M, N, K >= 1. */
void mr__sgemm_serial(bool ta, bool tb, int M, int N, int K, float alpha,
                      const float *A, int lda, const float *B, int ldb,
                      float beta, float *C, int ldc, float *pack);

/* The AVX2 copies of mr__sgemm_pack_b and mr__sgemm_block, which call
 * them where the CPU has no AVX-512 (same contracts). */
void mr__sgemm_pack_b_avx2(bool tb, int K, int N, const float *B, int ldb,
                           float *bp, int p0, int p1);
void mr__sgemm_block_avx2(bool ta, int K, float alpha, const float *A, int lda,
                          const float *bp, int kp, float beta, float *C, int ldc,
                          const float *bias, int i0, int i1, int j0, int j1);

#endif
