/* gemm_tile.h - private to the CPU matmuls (sgemm.c, bgemm.c): the 6 x 64
 * tile of C both AVX-512 micro-kernels accumulate in (24 zmm, c<row><q>)
 * and its store.  The store expects in scope: c (the tile's first
 * element) and ldc, mr (rows to store), m[4] (column masks), va and vb
 * (alpha, beta broadcast: STORE_TILE makes them), beta, first (the first K block: C = alpha acc
 * + beta C, else C += alpha acc) and bias (or NULL). */
#ifndef MR_CPU_GEMM_TILE_H
#define MR_CPU_GEMM_TILE_H

#include <immintrin.h>

#define ACC_ROW(r)                                                             \
  __m512 c##r##0 = _mm512_setzero_ps(), c##r##1 = c##r##0, c##r##2 = c##r##0, \
         c##r##3 = c##r##0
#define STORE1(r, q)                                                           \
  do {                                                                         \
    float *p = c + (size_t)(r) * (size_t)ldc + 16 * (q);                       \
    __m512 v = _mm512_mul_ps(va, c##r##q);                                     \
    if (!first)                                                                \
      v = _mm512_add_ps(_mm512_maskz_loadu_ps(m[q], p), v);                    \
    else if (beta != 0.0f)                                                     \
      v = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m[q], p), v);              \
    if (bias)                                                                  \
      v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m[q], bias + 16 * (q)));      \
    _mm512_mask_storeu_ps(p, m[q], v);                                         \
  } while (0)
#define STORE_ROW(r)                                                           \
  do {                                                                         \
    if ((r) < mr) {                                                            \
      STORE1(r, 0);                                                            \
      STORE1(r, 1);                                                            \
      STORE1(r, 2);                                                            \
      STORE1(r, 3);                                                            \
    }                                                                          \
  } while (0)

/* The whole tile: declared zero, and stored (alpha and beta as above). */
#define ACC_TILE()                                                             \
  ACC_ROW(0);                                                                  \
  ACC_ROW(1);                                                                  \
  ACC_ROW(2);                                                                  \
  ACC_ROW(3);                                                                  \
  ACC_ROW(4);                                                                  \
  ACC_ROW(5)
#define STORE_TILE(alpha, beta)                                                \
  do {                                                                         \
    __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);              \
    STORE_ROW(0);                                                              \
    STORE_ROW(1);                                                              \
    STORE_ROW(2);                                                              \
    STORE_ROW(3);                                                              \
    STORE_ROW(4);                                                              \
    STORE_ROW(5);                                                              \
  } while (0)

#endif
