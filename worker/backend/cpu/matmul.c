/* matmul.c - sgemm across the pool, two ways.
 *
 * With AVX2 (our sgemm.h, its AVX-512 or AVX2 copy): op(B) is packed once,
 * by the pool, then C is cut into rectangles, about 8 per thread, handed
 * out as threads come free, so a thread the host slows down hands its
 * share to the other.
 *
 * On the portable path each thread runs one single-threaded OpenBLAS call
 * on its block of rows of C.  At this project's shapes (thousands of rows,
 * a few hundred columns) two such calls side by side are about twice as
 * fast as OpenBLAS's own 2-thread mode. */
#include <cblas.h>

#include "common/error.h"
#include "worker/backend/cpu/bgemm.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/backend/cpu/sgemm.h"

/* Row blocks start at multiples of 24 rows: OpenBLAS (Haswell/Zen kernels)
 * walks the rows of a row-major C in panels of 24, so a block boundary on a
 * panel boundary leaves every element's arithmetic as in one whole call,
 * and the result is bitwise the same for any thread count (tested).  A
 * column split does not have that property, so C is only ever split by
 * rows, and a product with fewer than 2 panels of rows runs on one thread. */
#define GEMM_ALIGN 24

struct gemm_job {
  bool ta, tb;
  int M, N, K;
  float alpha, beta;
  const float *A, *B;
  int lda, ldb, ldc;
  float *C;
  const float *bias; // [N] added to every row after the product, or NULL
  int ntasks;
};

static void block_range(int n, int ntasks, int task, int *lo, int *hi) {
  int units = (n + GEMM_ALIGN - 1) / GEMM_ALIGN;
  int a = (int)((long)units * task / ntasks), b = (int)((long)units * (task + 1) / ntasks);
  *lo = a * GEMM_ALIGN < n ? a * GEMM_ALIGN : n;
  *hi = b * GEMM_ALIGN < n ? b * GEMM_ALIGN : n;
}

static int gemm_task(void *arg, int task, int thread) {
  const struct gemm_job *j = arg;
  int lo, hi;
  const float *A = j->A, *B = j->B;
  float *C = j->C;
  int N = j->N;
  block_range(j->M, j->ntasks, task, &lo, &hi);
  A += j->ta ? (size_t)lo : (size_t)lo * (size_t)j->lda;
  C += (size_t)lo * (size_t)j->ldc;
  int M = hi - lo;
  if (M <= 0 || N <= 0)
    return 0;
  if (j->K == 0) {
    for (int i = 0; i < M; i++)
      for (int c = 0; c < N; c++)
        C[(size_t)i * j->ldc + c] = j->beta == 0 ? 0 : j->beta * C[(size_t)i * j->ldc + c];
  } else {
    cblas_sgemm(CblasRowMajor, j->ta ? CblasTrans : CblasNoTrans,
                j->tb ? CblasTrans : CblasNoTrans, M, N, j->K, j->alpha, A,
                j->lda, B, j->ldb, j->beta, C, j->ldc);
  }
  if (j->bias) {
    const float *b = j->bias;
    for (int i = 0; i < M; i++) {
      float *row = C + (size_t)i * j->ldc;
      for (int c = 0; c < N; c++)
        row[c] += b[c];
    }
  }
  return 0;
}

/* ---- our sgemm: pack op(B) once across the pool, then rectangles of C ---- */

struct tiled_job {
  bool ta, tb;
  int M, N, K;
  float alpha, beta;
  const float *A, *B;
  int lda, ldb, ldc;
  float *C;
  const float *bias;
  float *bp;       // packed op(B): floats, or bf16 pairs (bf16)
  bool bf16;       // operands rounded to bf16 (bgemm.h)
  int panels;      // ceil(N / 64)
  int pack_per;    // panels per packing task
  int mb, nb;      // rows, columns per tile (multiples of 6 and 64)
  int row_tiles, col_tiles;
};

static int pack_task(void *arg, int task, int thread) {
  (void)thread;
  const struct tiled_job *j = arg;
  int p0 = task * j->pack_per, p1 = p0 + j->pack_per;
  p1 = p1 < j->panels ? p1 : j->panels;
  if (j->bf16)
    return mr__bgemm_pack_b(j->tb, j->K, j->N, j->B, j->ldb, (uint32_t *)j->bp, p0, p1);
  mr__sgemm_pack_b(j->tb, j->K, j->N, j->B, j->ldb, j->bp, p0, p1);
  return 0;
}

static int tile_task(void *arg, int task, int thread) {
  (void)thread;
  const struct tiled_job *j = arg;
  int i0 = task / j->col_tiles * j->mb, j0 = task % j->col_tiles * j->nb;
  int i1 = i0 + j->mb < j->M ? i0 + j->mb : j->M;
  int j1 = j0 + j->nb < j->N ? j0 + j->nb : j->N;
  if (j->bf16)
    mr__bgemm_block(j->ta, j->K, j->alpha, j->A, j->lda, (const uint32_t *)j->bp,
                    (j->K + 1) / 2, j->beta, j->C, j->ldc, j->bias, i0, i1, j0, j1);
  else
    mr__sgemm_block(j->ta, j->K, j->alpha, j->A, j->lda, j->bp, j->K, j->beta, j->C,
                    j->ldc, j->bias, i0, i1, j0, j1);
  return 0;
}

/* Tiles: at most mr__sgemm_tile_panels() panels wide (bf16: 8), so a K
 * block of them stays in L2; rows cut so that there are about 8 tiles per thread (a thread the
 * host slows down hands its share to the other), but at least 48 rows.
 * The cut changes no result (sgemm.h). */
static int gemm_tiled_cols(struct mr_pool *pool, struct tiled_job *j, float *bp) {
  int M = j->M, N = j->N, K = j->K;
  j->bp = bp;
  int nt = mr_pool_threads(pool);
  j->panels = (N + MR__SGEMM_NR - 1) / MR__SGEMM_NR;
  int most = j->bf16 ? 8 : mr__sgemm_tile_panels();
  j->col_tiles = (j->panels + most - 1) / most;
  j->nb = (j->panels + j->col_tiles - 1) / j->col_tiles * MR__SGEMM_NR;
  int want_rows = (8 * nt + j->col_tiles - 1) / j->col_tiles;
  int mb = (M + want_rows - 1) / want_rows;
  mb = mb < 48 ? 48 : mb;
  j->mb = (mb + MR__SGEMM_MR - 1) / MR__SGEMM_MR * MR__SGEMM_MR;
  j->row_tiles = (M + j->mb - 1) / j->mb;
  int tiles = j->row_tiles * j->col_tiles;
  /* Below ~1 MFLOP a second thread costs more than it saves. */
  if (nt == 1 || (double)M * N * K < 1e6) {
    j->pack_per = j->panels;
    MR_TRY(pack_task(j, 0, 0));
    for (int t = 0; t < tiles; t++)
      tile_task(j, t, 0);
    return 0;
  }
  /* packing is ~1/M of the work: two panels per task */
  j->pack_per = 2;
  MR_TRY(mr_pool_run(pool, (j->panels + 1) / 2, pack_task, j));
  return mr_pool_run(pool, tiles, tile_task, j);
}

/* The packed op(B) is kept under about 8 MiB: wider products (a large
 * vocabulary's head) go in column slices, each packed in turn. */
#define PACK_FLOATS_MAX (2 << 20)

static int gemm_tiled(struct mr_pool *pool, bool bf16, bool ta, bool tb, int M, int N,
                      int K, float alpha, const float *A, int lda,
                      const float *B, int ldb, float beta, float *C, int ldc,
                      const float *bias) {
  int slice = PACK_FLOATS_MAX / K / MR__SGEMM_NR * MR__SGEMM_NR;
  slice = slice < MR__SGEMM_NR ? MR__SGEMM_NR : slice;
  slice = slice < N ? slice : N;
  size_t bytes = bf16 ? mr__bgemm_packed_words(K, slice) * sizeof(uint32_t)
                      : mr__sgemm_packed_floats(K, slice) * sizeof(float);
  float *bp = mr__pool_shared_scratch(pool, bytes);
  if (!bp)
    return mr_error_set(MR_ENOMEM, "gemm: %dx%d packing buffer", K, slice);
  for (int c0 = 0; c0 < N; c0 += slice) {
    struct tiled_job j = {
        .ta = ta, .tb = tb, .M = M, .N = N - c0 < slice ? N - c0 : slice, .K = K,
        .alpha = alpha, .beta = beta, .A = A, .lda = lda, .ldb = ldb,
        .B = B + (tb ? (size_t)c0 * (size_t)ldb : (size_t)c0), .ldc = ldc,
        .C = C + c0, .bias = bias ? bias + c0 : NULL, .bf16 = bf16};
    MR_TRY(gemm_tiled_cols(pool, &j, bp));
  }
  return 0;
}

/* Both matmuls: the sizes checked, then fp32 (our sgemm's tiles, else
 * OpenBLAS by rows) or bf16 (bgemm.h tiles, K >= 1). */
static int gemm_any(struct mr_pool *pool, bool bf16, bool ta, bool tb, int M, int N,
                    int K, float alpha, const float *A, int lda,
                    const float *B, int ldb, float beta, float *C, int ldc,
                    const float *bias) {
  if (bf16 && !mr__cpu_has_avx512_bf16())
    return mr_error_set(MR_ENOTSUP, "gemm: the bf16 matmul needs AVX512_BF16");
  if (M < 0 || N < 0 || K < (bf16 ? 1 : 0))
    return mr_error_set(MR_EINVAL, "gemm: size M=%d N=%d K=%d: expected none negative%s", M,
                        N, K, bf16 ? " and K >= 1" : "");
  if (ldc < N || lda < (ta ? M : K) || ldb < (tb ? K : N))
    if (M > 0 && N > 0)
      return mr_error_set(MR_EINVAL,
                          "gemm: leading dimension too small (lda=%d ldb=%d ldc=%d "
                          "for M=%d N=%d K=%d)", lda, ldb, ldc, M, N, K);
  if (M == 0 || N == 0)
    return 0;
  if (bf16 || (K > 0 && mr__sgemm_own()))
    return gemm_tiled(pool, bf16, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C,
                      ldc, bias);
  struct gemm_job j = {
      .ta = ta, .tb = tb, .M = M, .N = N, .K = K,
      .alpha = alpha, .beta = beta, .A = A, .B = B, .lda = lda, .ldb = ldb,
      .ldc = ldc, .C = C, .bias = bias};
  int units = M / GEMM_ALIGN;
  int nt = mr_pool_threads(pool);
  /* Below ~1 MFLOP a second thread costs more than it saves. */
  if ((double)M * N * K < 1e6)
    nt = 1;
  /* Tall products get up to 4 blocks per thread, handed out as threads
   * come free, so a thread the host slows down does not hold up the rest;
   * every block packs op(B) again, so each keeps at least 256 rows. */
  int want = M / 256 < 4 * nt ? M / 256 : 4 * nt;
  want = want > nt ? want : nt;
  j.ntasks = want < units ? want : units;
  if (j.ntasks < 1)
    j.ntasks = 1;
  return mr_pool_run(pool, j.ntasks, gemm_task, &j);
}

int mr_cpu_gemm(struct mr_pool *pool, bool ta, bool tb, int M, int N, int K,
                float alpha, const float *A, int lda, const float *B, int ldb,
                float beta, float *C, int ldc) {
  return gemm_any(pool, false, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, NULL);
}

int mr_cpu_has_bf16_gemm(void) { return mr__cpu_has_avx512_bf16(); }

const char *mr_cpu_gemm_kernel(void) {
  return !mr__sgemm_own() ? "OpenBLAS" : mr__cpu_has_avx512() ? "AVX-512 sgemm" : "AVX2 sgemm";
}

int mr_cpu_gemm_bf16(struct mr_pool *pool, bool ta, bool tb, int M, int N, int K,
                     float alpha, const float *A, int lda, const float *B, int ldb,
                     float beta, float *C, int ldc) {
  return gemm_any(pool, true, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, NULL);
}

int mr_cpu_linear_fwd(struct mr_pool *pool, float *y, const float *x,
                      const float *w, const float *b, int M, int N, int K) {
  return gemm_any(pool, false, false, true, M, N, K, 1.0f, x, K, w, K, 0.0f, y, N, b);
}

int mr_cpu_linear_bwd_x(struct mr_pool *pool, float *dx, const float *dy,
                        const float *w, int M, int N, int K, bool accum) {
  return gemm_any(pool, false, false, false, M, K, N, 1.0f, dy, N, w, K,
                  accum ? 1.0f : 0.0f, dx, K, NULL);
}

int mr_cpu_linear_bwd_w(struct mr_pool *pool, float *dw, float *db,
                        const float *dy, const float *x, int M, int N, int K) {
  MR_TRY(gemm_any(pool, false, true, false, N, K, M, 1.0f, dy, N, x, K, 1.0f, dw, K, NULL));
  if (db)
    MR_TRY(mr_cpu_bias_grad(pool, db, dy, M, N));
  return 0;
}
