/* bgemm.c - the bf16 matmul on AVX512_BF16 (see bgemm.h): operands rounded
 * to bf16 as they are packed (VCVTNE2PS2BF16, round to nearest even), a
 * 6 x 64 micro-kernel of 24 fp32 accumulators, four panel loads and six
 * broadcast pairs of op(A) per two k, VDPBF16PS for each. */
#include "worker/backend/cpu/bgemm.h"

#include <stddef.h>

#include <immintrin.h>

#include "worker/backend/cpu/gemm_tile.h"
#include "worker/backend/cpu/sgemm.h"

#define MR 6
#define NR MR__BGEMM_NR
#define KC 384        // most k per block (even: blocks start on a pair)
#define KCP (KC / 2)  // pairs per block

#define BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

int mr__cpu_has_avx512_bf16(void) {
  static int cached = -1;
  int c = __atomic_load_n(&cached, __ATOMIC_RELAXED);
  if (c < 0) {
    c = mr__cpu_has_avx512() && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512bf16");
    __atomic_store_n(&cached, c, __ATOMIC_RELAXED);
  }
  return c;
}

size_t mr__bgemm_packed_words(int K, int N) {
  return (size_t)((N + NR - 1) / NR) * (size_t)((K + 1) / 2) * NR;
}

static __mmask16 lanes(int n) {
  return n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}

/* 16 words of bf16 pairs: lo[c] in the low half of word c, hi[c] above. */
BF16 static __m512i pairs16(__m512 lo, __m512 hi) {
  __m512i l = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
  __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
  return _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
}

/* r[i] word j becomes r[j] word i: pairs of rows interleaved by words,
 * then by word pairs, leaving each 128-bit lane L of r[4b + e] with
 * column 4L + e of rows 4b..4b+3; those lanes are then moved across. */
BF16 static void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int e = 0; e < 4; e++) {
    __m512i v0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44);
    __m512i v1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xee);
    __m512i v2 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44);
    __m512i v3 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xee);
    t[e] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    t[4 + e] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    t[8 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
  for (int i = 0; i < 16; i++)
    r[i] = t[i];
}

BF16 int mr__bgemm_pack_b(bool tb, int K, int N, const float *B, int ldb, uint32_t *bp, int p0,
                          int p1) {
  int kpairs = (K + 1) / 2;
  for (int p = p0; p < p1; p++) {
    int j = p * NR, nv = N - j < NR ? N - j : NR;
    uint32_t *dst = bp + (size_t)p * (size_t)kpairs * NR;
    if (!tb) {
      /* rows k and k + 1 of B, 16 columns at a time, side by side */
      __mmask16 m[4];
      for (int q = 0; q < 4; q++)
        m[q] = lanes(nv - 16 * q);
      for (int kp = 0; kp < kpairs; kp++) {
        const float *lo = B + (size_t)(2 * kp) * (size_t)ldb + j;
        int has_hi = 2 * kp + 1 < K;
        for (int q = 0; q < 4; q++) {
          __m512 l = _mm512_maskz_loadu_ps(m[q], lo + 16 * q);
          __m512 h = has_hi ? _mm512_maskz_loadu_ps(m[q], lo + ldb + 16 * q) : _mm512_setzero_ps();
          _mm512_store_si512((__m512i *)(dst + (size_t)kp * NR + 16 * q), pairs16(l, h));
        }
      }
      continue;
    }
    /* op(B)[k, j + c] = B[(j + c) ldb + k]: a column's k and k + 1 are
     * neighbours, so 32 of its k are 16 pairs; 16 columns' 16 pairs are
     * turned in registers into 16 rows of the panel */
    for (int c0 = 0; c0 < NR; c0 += 16) {
      for (int k = 0; k < K; k += 32) {
        __m512i w[16];
        for (int c = 0; c < 16; c++) {
          if (c0 + c >= nv) {
            w[c] = _mm512_setzero_si512();
            continue;
          }
          const float *col = B + (size_t)(j + c0 + c) * (size_t)ldb + k;
          __m512 lo = _mm512_maskz_loadu_ps(lanes(K - k), col);
          __m512 hi = _mm512_maskz_loadu_ps(lanes(K - k - 16), col + 16);
          w[c] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        }
        transpose16(w);
        int np = kpairs - k / 2 < 16 ? kpairs - k / 2 : 16;
        for (int q = 0; q < np; q++)
          _mm512_store_si512((__m512i *)(dst + (size_t)(k / 2 + q) * NR + c0), w[q]);
      }
    }
  }
  return 0;
}

/* Six rows of op(A), k in [k0, k0 + kc), as pairs: row r's pair kp at
 * ap[r * *rs + kp * *ks] (rows past mr repeat row mr - 1; an odd kc ends
 * on a zero).  A row-major op(A) is packed row by row (rs KCP, ks 1),
 * a transposed one k by k, the six rows' pairs side by side (rs 1, ks 6). */
BF16 static void pack_a(bool ta, const float *A, int lda, int i, int mr, int k0, int kc,
                        uint32_t *ap, ptrdiff_t *rs, ptrdiff_t *ks) {
  int kcp = (kc + 1) / 2;
  if (!ta) {
    *rs = KCP, *ks = 1;
    for (int r = 0; r < MR; r++) {
      const float *row = A + (size_t)(i + (r < mr ? r : mr - 1)) * (size_t)lda + k0;
      uint32_t *d = ap + (size_t)r * KCP;
      /* 32 consecutive k are 16 consecutive pairs */
      for (int k = 0; k < kc; k += 32) {
        __m512 lo = _mm512_maskz_loadu_ps(lanes(kc - k), row + k);
        __m512 hi = _mm512_maskz_loadu_ps(lanes(kc - k - 16), row + k + 16);
        __m512i w = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        _mm512_mask_storeu_epi32(d + k / 2, lanes(kcp - k / 2), w);
      }
    }
    return;
  }
  /* op(A)[i + r, k] = A[k lda + i + r]: rows k and k + 1 of A, six
   * columns, make the six rows' pair kp */
  *rs = 1, *ks = MR;
  __m512i last = _mm512_set_epi32(5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 4, 3, 2, 1, 0);
  last = _mm512_min_epi32(last, _mm512_set1_epi32(mr - 1)); /* rows past mr: row mr - 1 */
  __mmask16 am = lanes(mr);
  for (int kp = 0; kp < kcp; kp++) {
    const float *a = A + (size_t)(k0 + 2 * kp) * (size_t)lda + i;
    __m512 lo = _mm512_maskz_loadu_ps(am, a);
    __m512 hi = 2 * kp + 1 < kc ? _mm512_maskz_loadu_ps(am, a + lda) : _mm512_setzero_ps();
    __m512i w = _mm512_permutexvar_epi32(last, pairs16(lo, hi));
    _mm512_mask_storeu_epi32(ap + (size_t)kp * MR, 0x3f, w);
  }
}

#define DOT_ROW(r)                                                             \
  do {                                                                         \
    __m512bh x = (__m512bh)_mm512_set1_epi32((int)a[(r) * rs]);               \
    c##r##0 = _mm512_dpbf16_ps(c##r##0, x, b0);                                \
    c##r##1 = _mm512_dpbf16_ps(c##r##1, x, b1);                                \
    c##r##2 = _mm512_dpbf16_ps(c##r##2, x, b2);                                \
    c##r##3 = _mm512_dpbf16_ps(c##r##3, x, b3);                                \
  } while (0)

#define HALF_ROW(r)                                                            \
  do {                                                                         \
    __m512bh x = (__m512bh)_mm512_set1_epi32((int)a[(r) * rs]);               \
    c##r##0 = _mm512_dpbf16_ps(c##r##0, x, b0);                                \
    c##r##1 = _mm512_dpbf16_ps(c##r##1, x, b1);                                \
  } while (0)

/* One 6 x 64 block of C from kcp pairs: C = alpha acc + beta C on the
 * first K block, else C += alpha acc; bias with the last.  Not wide: a
 * block at most 32 columns wide (attention's head dimension), two of the
 * four panel vectors, half the multiply-adds (m[2], m[3] are empty).
 * Inlined into the two kernels below, each with `wide` a constant. */
BF16 static inline __attribute__((always_inline)) void
kernel_6x(int wide, int kcp, const uint32_t *ap, ptrdiff_t rs, ptrdiff_t ks, const uint32_t *b,
          float *c, int ldc, int mr, const __mmask16 *m, float alpha, float beta, int first,
          const float *bias) {
  ACC_TILE();
  const uint32_t *a = ap;
  for (int kp = 0; kp < kcp; kp++, a += ks, b += NR) {
    __m512bh b0 = (__m512bh)_mm512_load_si512((const __m512i *)b),
             b1 = (__m512bh)_mm512_load_si512((const __m512i *)(b + 16));
    if (wide) {
      __m512bh b2 = (__m512bh)_mm512_load_si512((const __m512i *)(b + 32)),
               b3 = (__m512bh)_mm512_load_si512((const __m512i *)(b + 48));
      DOT_ROW(0);
      DOT_ROW(1);
      DOT_ROW(2);
      DOT_ROW(3);
      DOT_ROW(4);
      DOT_ROW(5);
    } else {
      HALF_ROW(0);
      HALF_ROW(1);
      HALF_ROW(2);
      HALF_ROW(3);
      HALF_ROW(4);
      HALF_ROW(5);
    }
  }
  STORE_TILE(alpha, beta);
}

#define KERNEL_ARGS                                                                      \
  int kcp, const uint32_t *ap, ptrdiff_t rs, ptrdiff_t ks, const uint32_t *b, float *c, \
      int ldc, int mr, const __mmask16 *m, float alpha, float beta, int first,          \
      const float *bias
BF16 static void kernel_6x64(KERNEL_ARGS) {
  kernel_6x(1, kcp, ap, rs, ks, b, c, ldc, mr, m, alpha, beta, first, bias);
}
BF16 static void kernel_6x32(KERNEL_ARGS) {
  kernel_6x(0, kcp, ap, rs, ks, b, c, ldc, mr, m, alpha, beta, first, bias);
}

BF16 void mr__bgemm_block(bool ta, int K, float alpha, const float *A, int lda, const uint32_t *bp,
                          int kp, float beta, float *C, int ldc, const float *bias, int i0, int i1,
                          int j0, int j1) {
  _Alignas(64) uint32_t ap[MR * KCP];
  size_t kpairs = (size_t)kp;
  for (int k0 = 0; k0 < K; k0 += KC) {
    int kc = K - k0 < KC ? K - k0 : KC, first = k0 == 0;
    const float *bs = k0 + KC >= K ? bias : NULL;
    for (int i = i0; i < i1; i += MR) {
      int mr = i1 - i < MR ? i1 - i : MR;
      ptrdiff_t rs, ks;
      pack_a(ta, A, lda, i, mr, k0, kc, ap, &rs, &ks);
      for (int j = j0; j < j1; j += NR) {
        int nv = j1 - j < NR ? j1 - j : NR;
        __mmask16 m[4];
        for (int q = 0; q < 4; q++)
          m[q] = lanes(nv - 16 * q);
        const uint32_t *b = bp + (size_t)(j / NR) * kpairs * NR + (size_t)(k0 / 2) * NR;
        (nv <= 32 ? kernel_6x32 : kernel_6x64)((kc + 1) / 2, ap, rs, ks, b,
                                               C + (size_t)i * (size_t)ldc + j, ldc, mr, m,
                                               alpha, beta, first, bs ? bs + j : NULL);
      }
    }
  }
}
