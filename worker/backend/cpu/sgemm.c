/* sgemm.c - the AVX-512 matmul (see sgemm.h): op(B) packed into 64-column
 * panels, a 6 x 64 micro-kernel (24 zmm accumulators, four panel loads and
 * six broadcasts of op(A) per k), K in blocks of at most 384 so that a
 * block of panels stays in L2 while six rows of op(A) stay in L1. */
#include "worker/backend/cpu/sgemm.h"

#include <stdint.h>
#include <string.h>

#include <immintrin.h>

#include "worker/backend/cpu/gemm_tile.h"
#include "common/tunable.h"
#include "worker/backend/cpu/simd.h"

#define MR MR__SGEMM_MR
#define NR MR__SGEMM_NR
#define KC MR__SGEMM_KC

#define AVX512 __attribute__((target("avx512f")))

int mr__cpu_has_avx512(void) {
  static int cached = -1;
  int c = __atomic_load_n(&cached, __ATOMIC_RELAXED);
  if (c < 0) {
    c = __builtin_cpu_supports("avx512f") && mr__cpu_has_avx2() &&
        strcmp(mr_tunable_str(MR_TUNABLE_CPU_SIMD), "auto") == 0;
    __atomic_store_n(&cached, c, __ATOMIC_RELAXED);
  }
  return c;
}

int mr__sgemm_own(void) {
  static int cached = -1;
  int c = __atomic_load_n(&cached, __ATOMIC_RELAXED);
  if (c < 0) {
    c = mr__cpu_has_avx2() && strcmp(mr_tunable_str(MR_TUNABLE_CPU_GEMM), "openblas") != 0;
    __atomic_store_n(&cached, c, __ATOMIC_RELAXED);
  }
  return c;
}

int mr__sgemm_tile_panels(void) { return mr__cpu_has_avx512() ? 8 : 4; }

size_t mr__sgemm_row_floats(void) { return mr__cpu_has_avx512() ? NR : 16; }

size_t mr__sgemm_packed_floats(int K, int N) {
  return (size_t)((N + NR - 1) / NR) * (size_t)K * NR;
}

/* The K blocks: nkb of them, block b is [K b / nkb, K (b + 1) / nkb). */
static int k_blocks(int K) { return (K + KC - 1) / KC; }

/* Transposes a 16 x 16 tile: out row k (at out + k * NR) gets column k of
 * the 16 rows at in + r * ld. */
AVX512 static void transpose16(float *out, const float *in, size_t ld) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; i++)
    r[i] = _mm512_loadu_ps(in + (size_t)i * ld);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  /* t[2i]: r2i[0] r2i+1[0] r2i[1] r2i+1[1] per 128-bit lane (elements
   * 4l, 4l+1); t[2i+1]: elements 4l+2, 4l+3 */
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  /* r[4g + e], lane l: rows 4g..4g+3 at element 4l + e */
  for (int e = 0; e < 4; e++) {
    t[e] = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88);
    t[4 + e] = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xdd);
    t[8 + e] = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88);
    t[12 + e] = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xdd);
  }
  /* t[e] lanes: (rows 0-3, el e), (rows 4-7, el e), (rows 0-3, el 8+e),
   * (rows 4-7, el 8+e); t[4+e]: the same for elements 4+e, 12+e; t[8+e],
   * t[12+e]: rows 8-15 */
  for (int e = 0; e < 4; e++) {
    _mm512_store_ps(out + (size_t)e * NR, _mm512_shuffle_f32x4(t[e], t[8 + e], 0x88));
    _mm512_store_ps(out + (size_t)(8 + e) * NR, _mm512_shuffle_f32x4(t[e], t[8 + e], 0xdd));
    _mm512_store_ps(out + (size_t)(4 + e) * NR, _mm512_shuffle_f32x4(t[4 + e], t[12 + e], 0x88));
    _mm512_store_ps(out + (size_t)(12 + e) * NR, _mm512_shuffle_f32x4(t[4 + e], t[12 + e], 0xdd));
  }
}

AVX512 static void pack_b_512(bool tb, int K, int N, const float *B, int ldb,
                              float *bp, int p0, int p1) {
  for (int p = p0; p < p1; p++) {
    int j = p * NR, nv = N - j < NR ? N - j : NR;
    float *dst = bp + (size_t)p * (size_t)K * NR;
    if (!tb) {
      __mmask16 m[4];
      for (int q = 0; q < 4; q++) {
        int n = nv - 16 * q;
        m[q] = n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
      }
      for (int k = 0; k < K; k++) {
        const float *s = B + (size_t)k * (size_t)ldb + j;
        float *d = dst + (size_t)k * NR;
        for (int q = 0; q < 4; q++)
          _mm512_store_ps(d + 16 * q, _mm512_maskz_loadu_ps(m[q], s + 16 * q));
      }
      continue;
    }
    /* op(B)[k, j + c] = B[(j + c) ldb + k]: whole 16 x 16 tiles first */
    int c16 = nv / 16 * 16, k16 = K / 16 * 16;
    for (int c = 0; c < c16; c += 16)
      for (int k = 0; k < k16; k += 16)
        transpose16(dst + (size_t)k * NR + c, B + (size_t)(j + c) * (size_t)ldb + k,
                    (size_t)ldb);
    for (int c = 0; c < NR; c++) {
      const float *s = B + (size_t)(j + c) * (size_t)ldb;
      int k = c < c16 ? k16 : 0;
      if (c >= nv)
        for (; k < K; k++)
          dst[(size_t)k * NR + c] = 0;
      else
        for (; k < K; k++)
          dst[(size_t)k * NR + c] = s[k];
    }
  }
}

/* One 6 x 64 block of C: row r of op(A) is a[r][k * as] for k < kc, the
 * panel rows are b[k * 64 .. k * 64 + 63].  Rows r >= mr and columns
 * outside the masks are computed but not stored.  first: this is the
 * first K block (C = alpha acc + beta C), else C += alpha acc; bias (only
 * with the last K block) is added on top. */
#define FMA_ROW(r)                                                             \
  do {                                                                         \
    __m512 x = _mm512_set1_ps(a##r[ka]);                                       \
    c##r##0 = _mm512_fmadd_ps(x, b0, c##r##0);                                 \
    c##r##1 = _mm512_fmadd_ps(x, b1, c##r##1);                                 \
    c##r##2 = _mm512_fmadd_ps(x, b2, c##r##2);                                 \
    c##r##3 = _mm512_fmadd_ps(x, b3, c##r##3);                                 \
  } while (0)

AVX512 static void kernel_6x64(int kc, const float *a0, const float *a1,
                               const float *a2, const float *a3,
                               const float *a4, const float *a5, ptrdiff_t as,
                               const float *b, float *c, int ldc, int mr,
                               const __mmask16 *m, float alpha, float beta,
                               int first, const float *bias) {
  ACC_TILE();
  /* C is read at the end (a later K block, or beta: a gradient added into
   * its accumulator): fetched while the products run */
  if (!first || beta != 0.0f)
    for (int r = 0; r < mr; r++)
      for (int q = 0; q < 4; q++)
        _mm_prefetch((const char *)(c + (size_t)r * (size_t)ldc + 16 * q), _MM_HINT_T0);
  ptrdiff_t ka = 0;
  for (int k = 0; k < kc; k++, ka += as, b += NR) {
    __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16),
           b2 = _mm512_load_ps(b + 32), b3 = _mm512_load_ps(b + 48);
    FMA_ROW(0);
    FMA_ROW(1);
    FMA_ROW(2);
    FMA_ROW(3);
    FMA_ROW(4);
    FMA_ROW(5);
  }
  STORE_TILE(alpha, beta);
}

/* The same for a panel with at most 32 valid columns (attention's head
 * dimension): 12 rows x 32 columns, two panel loads and twelve broadcasts
 * per k. */
#define ACC2_ROW(r) __m512 c##r##0 = _mm512_setzero_ps(), c##r##1 = c##r##0
#define FMA2_ROW(r)                                                            \
  do {                                                                         \
    __m512 x = _mm512_set1_ps(a##r[ka]);                                       \
    c##r##0 = _mm512_fmadd_ps(x, b0, c##r##0);                                 \
    c##r##1 = _mm512_fmadd_ps(x, b1, c##r##1);                                 \
  } while (0)
#define STORE2_ROW(r)                                                          \
  do {                                                                         \
    if ((r) < mr) {                                                            \
      STORE1(r, 0);                                                            \
      STORE1(r, 1);                                                            \
    }                                                                          \
  } while (0)

AVX512 static void kernel_12x32(int kc, const float *const *a, ptrdiff_t as,
                                const float *b, float *c, int ldc, int mr,
                                const __mmask16 *m, float alpha, float beta,
                                int first, const float *bias) {
  const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4],
              *a5 = a[5], *a6 = a[6], *a7 = a[7], *a8 = a[8], *a9 = a[9],
              *a10 = a[10], *a11 = a[11];
  ACC2_ROW(0);
  ACC2_ROW(1);
  ACC2_ROW(2);
  ACC2_ROW(3);
  ACC2_ROW(4);
  ACC2_ROW(5);
  ACC2_ROW(6);
  ACC2_ROW(7);
  ACC2_ROW(8);
  ACC2_ROW(9);
  ACC2_ROW(10);
  ACC2_ROW(11);
  ptrdiff_t ka = 0;
  for (int k = 0; k < kc; k++, ka += as, b += NR) {
    __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16);
    FMA2_ROW(0);
    FMA2_ROW(1);
    FMA2_ROW(2);
    FMA2_ROW(3);
    FMA2_ROW(4);
    FMA2_ROW(5);
    FMA2_ROW(6);
    FMA2_ROW(7);
    FMA2_ROW(8);
    FMA2_ROW(9);
    FMA2_ROW(10);
    FMA2_ROW(11);
  }
  __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  STORE2_ROW(0);
  STORE2_ROW(1);
  STORE2_ROW(2);
  STORE2_ROW(3);
  STORE2_ROW(4);
  STORE2_ROW(5);
  STORE2_ROW(6);
  STORE2_ROW(7);
  STORE2_ROW(8);
  STORE2_ROW(9);
  STORE2_ROW(10);
  STORE2_ROW(11);
}

#define CH_ROWS 48          // rows of op(A) copied at once when it is transposed

/* Rows [i, i + n) of op(A) = A^T, n <= CH_ROWS, for the K block [k0, k0 +
 * kc), in strips of h rows (6 or 12): strip t (rows i + h t ..) at apack +
 * t h KC, h floats per k, rows past n zero.  Each k reads one run of A's
 * row k, so each of its cache lines is fetched once for all the strips:
 * strip by strip, a K block of rows lda apart was fetched once per strip
 * (a 2 KiB stride maps them onto a few L1 sets), 0.6x OpenBLAS on the
 * weight gradients. */
AVX512 static void pack_a(const float *A, int lda, int i, int n, int k0, int kc, int h,
                          float *apack) {
  __mmask16 keep = (__mmask16)((1u << h) - 1);
  for (int k = 0; k < kc; k++) {
    const float *s = A + (size_t)(k0 + k) * (size_t)lda + i;
    for (int t = 0; t * h < n; t++) {
      int m = n - t * h < h ? n - t * h : h;
      __m512 v = _mm512_maskz_loadu_ps((__mmask16)((1u << m) - 1), s + t * h);
      _mm512_mask_storeu_ps(apack + (size_t)(t * h) * KC + (size_t)k * (size_t)h, keep, v);
    }
  }
}

/* Columns [j0, j1) within one panel, at most 32 wide. */
AVX512 static void block_narrow(bool ta, int K, float alpha, const float *A,
                                int lda, const float *b, size_t kp, float beta,
                                float *C, int ldc, const float *bias, int i0,
                                int i1, int j0, int j1, float *apack) {
  __mmask16 m[2];
  for (int q = 0; q < 2; q++) {
    int n = j1 - j0 - 16 * q;
    m[q] = n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
  }
  int nkb = k_blocks(K);
  b += (size_t)(j0 / NR) * kp * NR;
  for (int kb = 0; kb < nkb; kb++) {
    int k0 = (int)((int64_t)K * kb / nkb), k1 = (int)((int64_t)K * (kb + 1) / nkb);
    int kc = k1 - k0, first = kb == 0;
    const float *bs = kb == nkb - 1 ? bias : NULL;
    for (int ic = i0; ic < i1; ic += CH_ROWS) {
      int n = i1 - ic < CH_ROWS ? i1 - ic : CH_ROWS;
      if (ta)
        pack_a(A, lda, ic, n, k0, kc, 12, apack);
      for (int i = ic; i < ic + n; i += 12) {
        int mr = ic + n - i < 12 ? ic + n - i : 12;
        const float *a[12];
        for (int r = 0; r < 12; r++)
          a[r] = ta ? apack + (size_t)(i - ic) * KC + r
                    : A + (size_t)(i + (r < mr ? r : mr - 1)) * (size_t)lda + k0;
        kernel_12x32(kc, a, ta ? 12 : 1, b + (size_t)k0 * NR, C + (size_t)i * (size_t)ldc + j0,
                     ldc, mr, m, alpha, beta, first, bs ? bs + j0 : NULL);
      }
    }
  }
}

AVX512 static void block_512(bool ta, int K, float alpha, const float *A,
                             int lda, const float *bp, int kp, float beta,
                             float *C, int ldc, const float *bias, int i0,
                             int i1, int j0, int j1) {
  _Alignas(64) float apack[CH_ROWS * KC];
  if (j1 - j0 <= 32) {
    block_narrow(ta, K, alpha, A, lda, bp, (size_t)kp, beta, C, ldc, bias, i0,
                 i1, j0, j1, apack);
    return;
  }
  int nkb = k_blocks(K);
  for (int kb = 0; kb < nkb; kb++) {
    int k0 = (int)((int64_t)K * kb / nkb), k1 = (int)((int64_t)K * (kb + 1) / nkb);
    int kc = k1 - k0, first = kb == 0;
    const float *bs = kb == nkb - 1 ? bias : NULL;
    for (int ic = i0; ic < i1; ic += CH_ROWS) {
      int rows = i1 - ic < CH_ROWS ? i1 - ic : CH_ROWS;
      if (ta)
        pack_a(A, lda, ic, rows, k0, kc, MR, apack);
      for (int i = ic; i < ic + rows; i += MR) {
        int mr = ic + rows - i < MR ? ic + rows - i : MR;
        const float *a[MR];
        for (int r = 0; r < MR; r++)
          a[r] = ta ? apack + (size_t)(i - ic) * KC + r
                    : A + (size_t)(i + (r < mr ? r : mr - 1)) * (size_t)lda + k0;
        for (int j = j0; j < j1; j += NR) {
          int nv = j1 - j < NR ? j1 - j : NR;
          __mmask16 m[4];
          for (int q = 0; q < 4; q++) {
            int n = nv - 16 * q;
            m[q] = n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
          }
          const float *b = bp + (size_t)(j / NR) * (size_t)kp * NR + (size_t)k0 * NR;
          kernel_6x64(kc, a[0], a[1], a[2], a[3], a[4], a[5], ta ? MR : 1, b,
                      C + (size_t)i * (size_t)ldc + j, ldc, mr, m, alpha, beta,
                      first, bs ? bs + j : NULL);
        }
      }
    }
  }
}

void mr__sgemm_pack_b(bool tb, int K, int N, const float *B, int ldb,
                      float *bp, int p0, int p1) {
  if (mr__cpu_has_avx512())
    pack_b_512(tb, K, N, B, ldb, bp, p0, p1);
  else
    mr__sgemm_pack_b_avx2(tb, K, N, B, ldb, bp, p0, p1);
}

void mr__sgemm_block(bool ta, int K, float alpha, const float *A, int lda,
                     const float *bp, int kp, float beta, float *C, int ldc,
                     const float *bias, int i0, int i1, int j0, int j1) {
  if (mr__cpu_has_avx512())
    block_512(ta, K, alpha, A, lda, bp, kp, beta, C, ldc, bias, i0, i1, j0, j1);
  else
    mr__sgemm_block_avx2(ta, K, alpha, A, lda, bp, kp, beta, C, ldc, bias, i0, i1, j0,
                         j1);
}

void mr__sgemm_serial(bool ta, bool tb, int M, int N, int K, float alpha,
                      const float *A, int lda, const float *B, int ldb,
                      float beta, float *C, int ldc, float *pack) {
  mr__sgemm_pack_b(tb, K, N, B, ldb, pack, 0, (N + NR - 1) / NR);
  mr__sgemm_block(ta, K, alpha, A, lda, pack, K, beta, C, ldc, NULL, 0, M, 0, N);
}
