/* sgemm_avx2.c - the AVX2+FMA copy of the matmul (sgemm.h), for CPUs
 * without AVX-512: the same K blocks, computed by a 6 x 16 micro-kernel
 * (12 ymm accumulators, two strip loads and six broadcasts of op(A) per
 * k).  A 64-column panel of op(B) is packed as four strips of 16 columns,
 * each K x 16 contiguous, so the kernel reads its strip as one stream.  Each element of C is summed in the order the
 * AVX-512 kernel sums it (k ascending within a block, blocks in order,
 * then the same alpha, beta and bias steps), so both copies give the same
 * bits. */
#include <stdint.h>
#include <string.h>

#include <immintrin.h>

#include "worker/backend/cpu/sgemm.h"

#define MR MR__SGEMM_MR
#define NR MR__SGEMM_NR
#define KC MR__SGEMM_KC

#define AVX2 __attribute__((target("avx2,fma")))

#define SW 16 // columns per strip

/* Transposes an 8 x 8 tile: out row k (at out + k * SW, 32-byte aligned)
 * gets column k of the 8 rows at in + r * ld. */
AVX2 static void transpose8(float *out, const float *in, size_t ld) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; i++)
    r[i] = _mm256_loadu_ps(in + (size_t)i * ld);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  /* t[2i]: rows 2i, 2i+1 at elements 0, 1 | 4, 5; t[2i+1]: 2, 3 | 6, 7 */
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  /* r[4g + e]: rows 4g..4g+3 at element e | element 4 + e */
  for (int e = 0; e < 4; e++) {
    _mm256_store_ps(out + (size_t)e * SW, _mm256_permute2f128_ps(r[e], r[4 + e], 0x20));
    _mm256_store_ps(out + (size_t)(4 + e) * SW, _mm256_permute2f128_ps(r[e], r[4 + e], 0x31));
  }
}

/* Strip s of op(B) (columns [16 s, 16 s + 16), zero past N) into dst,
 * K x 16. */
AVX2 static void pack_strip(bool tb, int K, int N, const float *B, int ldb, float *dst,
                            int s) {
  int j = s * SW, nv = N - j < SW ? (N - j > 0 ? N - j : 0) : SW;
  if (!tb) {
    for (int k = 0; k < K; k++) {
      const float *src = B + (size_t)k * (size_t)ldb + j;
      float *d = dst + (size_t)k * SW;
      if (nv == SW) {
        _mm256_store_ps(d, _mm256_loadu_ps(src));
        _mm256_store_ps(d + 8, _mm256_loadu_ps(src + 8));
      } else {
        memcpy(d, src, sizeof(float) * (size_t)nv);
        memset(d + nv, 0, sizeof(float) * (size_t)(SW - nv));
      }
    }
    return;
  }
  /* op(B)[k, j + c] = B[(j + c) ldb + k]: whole 8 x 8 tiles first */
  int c8 = nv / 8 * 8, k8 = K / 8 * 8;
  for (int c = 0; c < c8; c += 8)
    for (int k = 0; k < k8; k += 8)
      transpose8(dst + (size_t)k * SW + c, B + (size_t)(j + c) * (size_t)ldb + k, (size_t)ldb);
  for (int c = 0; c < SW; c++) {
    const float *src = B + (size_t)(j + c) * (size_t)ldb;
    int k = c < c8 ? k8 : 0;
    if (c >= nv)
      for (; k < K; k++)
        dst[(size_t)k * SW + c] = 0;
    else
      for (; k < K; k++)
        dst[(size_t)k * SW + c] = src[k];
  }
}

void mr__sgemm_pack_b_avx2(bool tb, int K, int N, const float *B, int ldb,
                           float *bp, int p0, int p1) {
  for (int s = p0 * (NR / SW); s < p1 * (NR / SW); s++)
    pack_strip(tb, K, N, B, ldb, bp + (size_t)s * (size_t)K * SW, s);
}

/* One 8-column half of a row of the tile: the steps of gemm_tile.h's
 * STORE1 (alpha acc, then C or beta C, then bias), masked when the strip
 * is narrower than 16. */
#define STORE8(r, h)                                                           \
  do {                                                                         \
    float *p = c + (size_t)(r) * (size_t)ldc + 8 * (h);                        \
    __m256 v = _mm256_mul_ps(va, c##r##h);                                     \
    if (full) {                                                                \
      if (!first)                                                              \
        v = _mm256_add_ps(_mm256_loadu_ps(p), v);                              \
      else if (beta != 0.0f)                                                   \
        v = _mm256_fmadd_ps(vb, _mm256_loadu_ps(p), v);                        \
      if (bias)                                                                \
        v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * (h)));                 \
      _mm256_storeu_ps(p, v);                                                  \
    } else {                                                                   \
      if (!first)                                                              \
        v = _mm256_add_ps(_mm256_maskload_ps(p, m##h), v);                     \
      else if (beta != 0.0f)                                                   \
        v = _mm256_fmadd_ps(vb, _mm256_maskload_ps(p, m##h), v);               \
      if (bias)                                                                \
        v = _mm256_add_ps(v, _mm256_maskload_ps(bias + 8 * (h), m##h));        \
      _mm256_maskstore_ps(p, m##h, v);                                         \
    }                                                                          \
  } while (0)
#define STORE_ROW8(r)                                                          \
  do {                                                                         \
    if ((r) < mr) {                                                            \
      STORE8(r, 0);                                                            \
      if (w > 8)                                                               \
        STORE8(r, 1);                                                          \
    }                                                                          \
  } while (0)
#define ACC_ROW8(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = c##r##0
#define FMA_ROW8(r)                                                            \
  do {                                                                         \
    __m256 x = _mm256_broadcast_ss(a##r + ka);                                 \
    c##r##0 = _mm256_fmadd_ps(x, b0, c##r##0);                                 \
    c##r##1 = _mm256_fmadd_ps(x, b1, c##r##1);                                 \
  } while (0)

/* One 6 x w block of C (w <= 16): row r of op(A) is a[r][k * as] for
 * k < kc, the strip's rows are b[k * 16 .. k * 16 + 15].  Rows r >= mr and
 * columns >= w are computed but not stored; first and bias as in
 * gemm_tile.h. */
AVX2 static void kernel_6x16(int kc, const float *const *a, ptrdiff_t as,
                             const float *b, float *c, int ldc, int mr, int w,
                             float alpha, float beta, int first, const float *bias) {
  const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4], *a5 = a[5];
  ACC_ROW8(0);
  ACC_ROW8(1);
  ACC_ROW8(2);
  ACC_ROW8(3);
  ACC_ROW8(4);
  ACC_ROW8(5);
  if (!first || beta != 0.0f)
    for (int r = 0; r < mr; r++)
      _mm_prefetch((const char *)(c + (size_t)r * (size_t)ldc), _MM_HINT_T0);
  ptrdiff_t ka = 0;
  for (int k = 0; k < kc; k++, ka += as, b += SW) {
    __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
    FMA_ROW8(0);
    FMA_ROW8(1);
    FMA_ROW8(2);
    FMA_ROW8(3);
    FMA_ROW8(4);
    FMA_ROW8(5);
  }
  int full = w == 16;
  __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(w), lane);
  __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(w - 8), lane);
  __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
  STORE_ROW8(0);
  STORE_ROW8(1);
  STORE_ROW8(2);
  STORE_ROW8(3);
  STORE_ROW8(4);
  STORE_ROW8(5);
}

#define CH 8   // strips of op(A) copied at once when it is transposed
#define AS (MR * KC + 8) // floats per copied strip (8 spare: see pack_a)

/* Rows [i, i + n) of op(A) = A^T, n <= 6 CH, for the K block [k0, k0 +
 * kc): strip t (rows i + 6 t ..) into apack + t AS, six floats per k (rows
 * past n repeat the last).  Each k reads one run of A's row k, whole
 * strips 8 floats at a time (the 2 past the strip are written over by the
 * next k, or land in the spare). */
AVX2 static void pack_a(const float *A, int lda, int i, int n, int k0, int kc, float *apack) {
  for (int k = 0; k < kc; k++) {
    const float *s = A + (size_t)(k0 + k) * (size_t)lda + i;
    for (int t = 0; t * MR < n; t++) {
      float *d = apack + (size_t)t * AS + (size_t)k * MR;
      int r0 = t * MR, m = n - r0 < MR ? n - r0 : MR;
      if (m == MR && i + r0 + 8 <= lda)
        _mm256_storeu_ps(d, _mm256_loadu_ps(s + r0));
      else
        for (int r = 0; r < MR; r++)
          d[r] = s[r0 + (r < m ? r : m - 1)];
    }
  }
}

/* One strip of rows [i, i + mr) over columns [j0, j1) for one K block. */
AVX2 static void strip(const float *const *a, ptrdiff_t as, int k0, int kc, const float *bp,
                       int kp, float alpha, float beta, int first, float *C, int ldc,
                       const float *bias, int i, int mr, int j0, int j1) {
  for (int j = j0; j < j1; j += SW) {
    int w = j1 - j < SW ? j1 - j : SW;
    const float *b = bp + (size_t)(j / SW) * (size_t)kp * SW + (size_t)k0 * SW;
    kernel_6x16(kc, a, as, b, C + (size_t)i * (size_t)ldc + j, ldc, mr, w, alpha, beta,
                first, bias ? bias + j : NULL);
  }
}

void mr__sgemm_block_avx2(bool ta, int K, float alpha, const float *A, int lda,
                          const float *bp, int kp, float beta, float *C, int ldc,
                          const float *bias, int i0, int i1, int j0, int j1) {
  _Alignas(64) float apack[CH * AS];
  int nkb = (K + KC - 1) / KC;
  for (int kb = 0; kb < nkb; kb++) {
    int k0 = (int)((int64_t)K * kb / nkb), k1 = (int)((int64_t)K * (kb + 1) / nkb);
    int kc = k1 - k0, first = kb == 0;
    const float *bs = kb == nkb - 1 ? bias : NULL;
    for (int ic = i0; ic < i1; ic += MR * CH) {
      int n = i1 - ic < MR * CH ? i1 - ic : MR * CH;
      if (ta)
        pack_a(A, lda, ic, n, k0, kc, apack);
      for (int i = ic; i < ic + n; i += MR) {
        int mr = ic + n - i < MR ? ic + n - i : MR;
        const float *a[MR];
        for (int r = 0; r < MR; r++)
          a[r] = ta ? apack + (size_t)(i - ic) / MR * AS + r
                    : A + (size_t)(i + (r < mr ? r : mr - 1)) * (size_t)lda + k0;
        strip(a, ta ? MR : 1, k0, kc, bp, kp, alpha, beta, first, C, ldc, bs, i, mr, j0, j1);
      }
    }
  }
}
