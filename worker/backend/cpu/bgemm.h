/* bgemm.h - private to the CPU kernels: the matmul of bf16 automatic mixed
 * precision on CPUs with AVX512_BF16.
 *
 * Under `--amp bf16` a matmul's operands are rounded to bf16 and their
 * products summed in fp32.  Without this, each operand is rounded in a
 * pass of its own and the fp32 kernel multiplies the rounded copies.  Here
 * the rounding is the packing: op(B) goes into panels of 64 columns as bf16
 * pairs (two consecutive k of a column in one 32-bit word), six rows of
 * op(A) likewise per K block, and a 6 x 64 micro-kernel runs VDPBF16PS,
 * which multiplies 32 bf16 pairs and adds both products into 16 fp32
 * accumulators in one instruction: twice the multiply-adds of an fp32 FMA,
 * from half the bytes.
 *
 * As in sgemm.h, every element of C is summed in one order (K blocks of
 * 384 from k = 0, pairs ascending within a block) whatever rectangle of C
 * a task computes, so results do not depend on the thread count. */
#ifndef MR_CPU_BGEMM_H
#define MR_CPU_BGEMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MR__BGEMM_NR 64 // columns of op(B) per packed panel

/* 1 when the bf16 matmul runs: the CPU has AVX512_BF16 (and AVX-512F/BW)
 * and MESHRUN_CPU_SIMD is "auto".  Decided once per process. */
int mr__cpu_has_avx512_bf16(void);

/* 32-bit words of op(B) packed: ceil(N / 64) panels of ceil(K / 2) x 64. */
size_t mr__bgemm_packed_words(int K, int N);

/* Packs panels [p0, p1) of op(B), K x N (B[K, N], ldb; or B[N, K]
 * transposed when tb), rounded to bf16, into bp (64-byte aligned,
 * mr__bgemm_packed_words(K, N) words).  Returns 0. */
int mr__bgemm_pack_b(bool tb, int K, int N, const float *B, int ldb, uint32_t *bp, int p0,
                     int p1);

/* C[i, j] = alpha * sum_k bf16(op(A)[i, k]) bf16(op(B)[k, j]) + beta C[i, j]
 * (+ bias[j] when not NULL) for i in [i0, i1), j in [j0, j1), op(B) the
 * first K rows of panels packed by mr__bgemm_pack_b with kp pairs each
 * ((K' + 1) / 2 for a K' >= K; bp may point kp0 pairs into them, so a
 * product can start at an even row of the packed operand).  op(A) is
 * A[M, K] (lda), or A[K, M] transposed when ta.  j0 is a multiple of 64;
 * K >= 1; beta == 0 ignores C's old contents. */
void mr__bgemm_block(bool ta, int K, float alpha, const float *A, int lda, const uint32_t *bp,
                     int kp, float beta, float *C, int ldc, const float *bias, int i0, int i1,
                     int j0, int j1);

#endif
