/* test_kernels.c - the CPU kernels other than attention and the optimizer:
 * each forward against a double-precision reference written here from the
 * formula, each backward against central finite differences of that
 * reference, at odd shapes, on 1- and 3-thread pools (bitwise equal). */
#include "check_main.h"
#include "kernels_ref.h"

#include "common/dtype.h"
#include "common/error.h"
#include "common/model_config.h"
#include "worker/backend/cpu/xent_vocab.h"

/* ---- matmul ---- */

static void gemm_ref(bool ta, bool tb, int M, int N, int K, double alpha,
                     const float *A, int lda, const float *B, int ldb,
                     double beta, const float *C0, int ldc, double *C) {
  for (int i = 0; i < M; i++)
    for (int j = 0; j < N; j++) {
      double s = 0;
      for (int k = 0; k < K; k++) {
        double a = ta ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k];
        double b = tb ? B[(size_t)j * ldb + k] : B[(size_t)k * ldb + j];
        s += a * b;
      }
      C[(size_t)i * N + j] = alpha * s + (beta == 0 ? 0 : beta * C0[(size_t)i * ldc + j]);
    }
}

START_TEST(test_kernels_gemm_all_transposes_and_splits) {
  /* tall (row split), wide (column split), odd, below the threading cut,
   * narrow (one 32-column panel) over two K blocks and past the 48 rows
   * of op(A) = A^T copied at once */
  static const int shapes[][3] = {{133, 37, 29}, {21, 150, 47}, {3, 5, 7}, {64, 64, 1},
                                  {110, 29, 400}};
  struct mr_pool *p1 = ref_pool(1), *p3 = ref_pool(3);
  uint64_t seed = 1;
  for (size_t si = 0; si < MR_ARRAY_LEN(shapes); si++)
    for (int tr = 0; tr < 4; tr++) {
      int M = shapes[si][0], N = shapes[si][1], K = shapes[si][2];
      bool ta = tr & 1, tb = tr & 2;
      int lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 1, ldc = N + 2;
      float *A = ref_randf((size_t)lda * (ta ? K : M), &seed, 1);
      float *B = ref_randf((size_t)ldb * (tb ? N : K), &seed, 1);
      float *C = ref_randf((size_t)ldc * M, &seed, 1);
      float *C3 = ref_copyf(C, (size_t)ldc * M);
      double *want = malloc(sizeof(double) * (size_t)M * N);
      gemm_ref(ta, tb, M, N, K, 0.5, A, lda, B, ldb, 2.0, C, ldc, want);
      ck_assert_int_eq(mr_cpu_gemm(p1, ta, tb, M, N, K, 0.5f, A, lda, B, ldb, 2.0f, C, ldc), 0);
      ck_assert_int_eq(mr_cpu_gemm(p3, ta, tb, M, N, K, 0.5f, A, lda, B, ldb, 2.0f, C3, ldc), 0);
      for (int i = 0; i < M; i++) {
        char what[64];
        snprintf(what, sizeof what, "gemm %dx%dx%d t%d row %d", M, N, K, tr, i);
        ref_close(what, C + (size_t)i * ldc, want + (size_t)i * N, (size_t)N, 1e-5, 1e-5);
        ref_close(what, C3 + (size_t)i * ldc, want + (size_t)i * N, (size_t)N, 1e-5, 1e-5);
      }
      free(A); free(B); free(C); free(C3); free(want);
    }
  mr_pool_free(p1);
  mr_pool_free(p3);
}
END_TEST

/* The edges of the blocked kernel against the double reference: K across
 * its 384-deep blocks (383, 384, 385, 769), N at the 32- and 64-column
 * panel edges (31, 32, 33, 64, 65, 97), M around the 6- and 12-row
 * micro-kernels (1, 5, 6, 7, 12, 13), and beta = 0 over a C of NaNs (which
 * must not leak in). */
START_TEST(test_kernels_gemm_block_edges) {
  static const int Ks[] = {383, 384, 385, 769}, Ns[] = {31, 32, 33, 64, 65, 97};
  static const int Ms[] = {1, 5, 6, 7, 12, 13};
  struct mr_pool *p = ref_pool(2);
  uint64_t seed = 3;
  for (size_t a = 0; a < MR_ARRAY_LEN(Ks); a++)
    for (size_t b = 0; b < MR_ARRAY_LEN(Ns); b++)
      for (size_t c = 0; c < MR_ARRAY_LEN(Ms); c++) {
        int K = Ks[a], N = Ns[b], M = Ms[c];
        bool ta = (a + c) & 1, tb = (b + c) & 1;
        int lda = ta ? M : K, ldb = tb ? K : N;
        float *A = ref_randf((size_t)M * K, &seed, 1), *B = ref_randf((size_t)N * K, &seed, 1);
        float *C = malloc(sizeof(float) * (size_t)M * N);
        for (size_t i = 0; i < (size_t)M * N; i++)
          C[i] = NAN;
        double *want = malloc(sizeof(double) * (size_t)M * N);
        gemm_ref(ta, tb, M, N, K, 1.0, A, lda, B, ldb, 0.0, C, N, want);
        ck_assert_int_eq(mr_cpu_gemm(p, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, N), 0);
        char what[64];
        snprintf(what, sizeof what, "gemm %dx%dx%d ta%d tb%d", M, N, K, ta, tb);
        ref_close(what, C, want, (size_t)M * N, 1e-4, 1e-5);
        free(A), free(B), free(C), free(want);
      }
  mr_pool_free(p);
}
END_TEST

START_TEST(test_kernels_gemm_threads_bitwise_equal) {
  /* row blocks over 1, 2, 3 threads give the same bits, at the model's
   * shapes (forward, dx, dW) and at wide and short ones */
  static const int shapes[][5] = {/* M, N, K, ta, tb */
    {2048, 256, 256, 0, 1}, {2048, 256, 688, 0, 0}, {688, 256, 2048, 1, 0},
    {256, 688, 2048, 1, 0}, {300, 500, 64, 0, 1}, {47, 300, 33, 0, 0}, {515, 96, 80, 1, 1}};
  struct mr_pool *p[3] = {ref_pool(1), ref_pool(2), ref_pool(3)};
  uint64_t seed = 2;
  for (size_t si = 0; si < MR_ARRAY_LEN(shapes); si++) {
    int M = shapes[si][0], N = shapes[si][1], K = shapes[si][2];
    bool ta = shapes[si][3], tb = shapes[si][4];
    float *A = ref_randf((size_t)M * K, &seed, 1), *B = ref_randf((size_t)N * K, &seed, 1);
    float *C[3];
    C[0] = ref_randf((size_t)M * N, &seed, 1);
    C[1] = ref_copyf(C[0], (size_t)M * N);
    C[2] = ref_copyf(C[0], (size_t)M * N);
    for (int t = 0; t < 3; t++) {
      ck_assert_int_eq(mr_cpu_gemm(p[t], ta, tb, M, N, K, 1.0f, A, ta ? M : K, B,
                                   tb ? K : N, 1.0f, C[t], N), 0);
    }
    ck_assert_msg(memcmp(C[0], C[1], (size_t)M * N * 4) == 0, "shape %zu, 2 threads", si);
    ck_assert_msg(memcmp(C[0], C[2], (size_t)M * N * 4) == 0, "shape %zu, 3 threads", si);
    free(A); free(B); free(C[0]); free(C[1]); free(C[2]);
  }
  for (int t = 0; t < 3; t++)
    mr_pool_free(p[t]);
}
END_TEST

/* The bf16 matmul (AVX512_BF16) against the double reference of its
 * operands rounded to bf16 by the formula (common/dtype.h, round to
 * nearest even): every transpose, K across its 384-deep blocks and odd
 * (the last pair half empty), N and M at the panel and micro-kernel
 * edges, alpha and beta, beta = 0 over NaNs, padded leading dimensions;
 * and the same bits on 1 and 3 threads.  Where the CPU has no
 * AVX512_BF16 it must say so, not compute. */
START_TEST(test_kernels_gemm_bf16_against_rounded_reference) {
  struct mr_pool *p1 = ref_pool(1), *p3 = ref_pool(3);
  float one = 1;
  if (!mr_cpu_has_bf16_gemm()) {
    ck_assert_int_eq(mr_cpu_gemm_bf16(p1, false, false, 1, 1, 1, 1, &one, 1, &one, 1, 0, &one, 1),
                     MR_ENOTSUP);
    fprintf(stderr, "# no AVX512_BF16 here: the bf16 matmul is refused, as it must be\n");
    mr_pool_free(p1);
    mr_pool_free(p3);
    return;
  }
  static const int shapes[][3] = {/* M, N, K */
    {13, 97, 769}, {7, 65, 385}, {6, 64, 384}, {5, 31, 383}, {1, 33, 1}, {12, 32, 2},
    {133, 37, 29}, {300, 260, 64}};
  uint64_t seed = 11;
  for (size_t si = 0; si < MR_ARRAY_LEN(shapes); si++)
    for (int tr = 0; tr < 4; tr++) {
      int M = shapes[si][0], N = shapes[si][1], K = shapes[si][2];
      bool ta = tr & 1, tb = tr & 2;
      int lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 1, ldc = N + 2;
      size_t na = (size_t)lda * (ta ? K : M), nb = (size_t)ldb * (tb ? N : K);
      float *A = ref_randf(na, &seed, 1), *B = ref_randf(nb, &seed, 1);
      float *Ar = ref_copyf(A, na), *Br = ref_copyf(B, nb);
      for (size_t i = 0; i < na; i++)
        Ar[i] = mr_bf16_to_f32(mr_f32_to_bf16(A[i]));
      for (size_t i = 0; i < nb; i++)
        Br[i] = mr_bf16_to_f32(mr_f32_to_bf16(B[i]));
      float beta = tr == 3 ? 0.0f : 2.0f;
      float *C = ref_randf((size_t)ldc * M, &seed, 1);
      if (beta == 0)
        for (size_t i = 0; i < (size_t)ldc * M; i++)
          C[i] = NAN;
      float *C3 = ref_copyf(C, (size_t)ldc * M);
      double *want = malloc(sizeof(double) * (size_t)M * N);
      gemm_ref(ta, tb, M, N, K, 0.5, Ar, lda, Br, ldb, beta, C, ldc, want);
      ck_assert_int_eq(
          mr_cpu_gemm_bf16(p1, ta, tb, M, N, K, 0.5f, A, lda, B, ldb, beta, C, ldc), 0);
      ck_assert_int_eq(
          mr_cpu_gemm_bf16(p3, ta, tb, M, N, K, 0.5f, A, lda, B, ldb, beta, C3, ldc), 0);
      for (int i = 0; i < M; i++) {
        char what[64];
        snprintf(what, sizeof what, "bf16 gemm %dx%dx%d t%d row %d", M, N, K, tr, i);
        ref_close(what, C + (size_t)i * ldc, want + (size_t)i * N, (size_t)N, 1e-5, 1e-5);
        ck_assert_msg(memcmp(C + (size_t)i * ldc, C3 + (size_t)i * ldc, (size_t)N * 4) == 0,
                      "%s: 3 threads differ from 1", what);
      }
      free(A), free(B), free(Ar), free(Br), free(C), free(C3), free(want);
    }
  mr_pool_free(p1);
  mr_pool_free(p3);
}
END_TEST

struct linear_ctx {
  int M, N, K;
  double *x, *w, *b;
  const float *G; /* upstream gradient [M, N] */
};

static double linear_loss(void *c) {
  struct linear_ctx *l = c;
  double s = 0;
  for (int i = 0; i < l->M; i++)
    for (int j = 0; j < l->N; j++) {
      double y = l->b[j];
      for (int k = 0; k < l->K; k++)
        y += l->x[(size_t)i * l->K + k] * l->w[(size_t)j * l->K + k];
      s += y * l->G[(size_t)i * l->N + j];
    }
  return s;
}

START_TEST(test_kernels_linear_fwd_bwd_finite_differences) {
  struct mr_pool *p = ref_pool(2);
  uint64_t seed = 3;
  int M = 19, N = 7, K = 11;
  float *x = ref_randf((size_t)M * K, &seed, 1), *w = ref_randf((size_t)N * K, &seed, 1);
  float *b = ref_randf((size_t)N, &seed, 1), *G = ref_randf((size_t)M * N, &seed, 1);
  float *y = malloc(sizeof(float) * M * N);
  ck_assert_int_eq(mr_cpu_linear_fwd(p, y, x, w, b, M, N, K), 0);
  struct linear_ctx c = {M, N, K, ref_tod(x, (size_t)M * K), ref_tod(w, (size_t)N * K),
                         ref_tod(b, (size_t)N), G};
  for (int i = 0; i < M; i++)
    for (int j = 0; j < N; j++) {
      double want = c.b[j];
      for (int k = 0; k < K; k++)
        want += c.x[(size_t)i * K + k] * c.w[(size_t)j * K + k];
      ck_assert_double_eq_tol(y[(size_t)i * N + j], want, 1e-5);
    }
  /* dx overwrite, then accumulate doubles it */
  float *dx = ref_randf((size_t)M * K, &seed, 1);
  ck_assert_int_eq(mr_cpu_linear_bwd_x(p, dx, G, w, M, N, K, false), 0);
  ref_fd_check("linear dx", linear_loss, &c, c.x, (size_t)M * K, dx, 1000, 1e-5, 1e-5);
  float *dx2 = ref_copyf(dx, (size_t)M * K);
  ck_assert_int_eq(mr_cpu_linear_bwd_x(p, dx2, G, w, M, N, K, true), 0);
  for (int i = 0; i < M * K; i++)
    ck_assert_float_eq_tol(dx2[i], 2 * dx[i], 1e-5);
  /* dw, db accumulate onto what is there */
  float *dw = calloc((size_t)N * K, 4), *db = calloc((size_t)N, 4);
  for (int rep = 0; rep < 2; rep++)
    ck_assert_int_eq(mr_cpu_linear_bwd_w(p, dw, db, G, x, M, N, K), 0);
  for (int i = 0; i < N * K; i++)
    dw[i] /= 2;
  for (int i = 0; i < N; i++)
    db[i] /= 2;
  ref_fd_check("linear dw", linear_loss, &c, c.w, (size_t)N * K, dw, 1000, 1e-5, 1e-5);
  ref_fd_check("linear db", linear_loss, &c, c.b, (size_t)N, db, 1000, 1e-5, 1e-5);
  free(x); free(w); free(b); free(G); free(y); free(dx); free(dx2); free(dw); free(db);
  free(c.x); free(c.w); free(c.b);
  mr_pool_free(p);
}
END_TEST

/* ---- elementwise ---- */

START_TEST(test_kernels_add_bias_scale) {
  struct mr_pool *p = ref_pool(3);
  uint64_t seed = 4;
  int N = 37, C = 1031; /* several chunks, odd */
  size_t n = (size_t)N * C;
  float *a = ref_randf(n, &seed, 1), *b = ref_randf(n, &seed, 1), *bias = ref_randf((size_t)C, &seed, 1);
  float *out = malloc(n * 4);
  ck_assert_int_eq(mr_cpu_add(p, out, a, b, n), 0);
  for (size_t i = 0; i < n; i++)
    ck_assert_float_eq(out[i], a[i] + b[i]);
  ck_assert_int_eq(mr_cpu_add(p, a, a, b, n), 0); /* in place */
  ck_assert(memcmp(a, out, n * 4) == 0);
  ck_assert_int_eq(mr_cpu_bias_add(p, out, bias, N, C), 0);
  for (int r = 0; r < N; r++)
    for (int c = 0; c < C; c++)
      ck_assert_float_eq(out[(size_t)r * C + c], a[(size_t)r * C + c] + bias[c]);
  float *db = calloc((size_t)C, 4);
  db[5] = 1.0f;
  ck_assert_int_eq(mr_cpu_bias_grad(p, db, b, N, C), 0);
  for (int c = 0; c < C; c++) {
    double s = c == 5 ? 1.0 : 0.0;
    for (int r = 0; r < N; r++)
      s += b[(size_t)r * C + c];
    ck_assert_double_eq_tol(db[c], s, 1e-5);
  }
  float *b0 = ref_copyf(b, n);
  ck_assert_int_eq(mr_cpu_scale(p, b, n, -0.25f), 0);
  for (size_t i = 0; i < n; i++)
    ck_assert_float_eq(b[i], -0.25f * b0[i]);
  free(b0);
  free(a); free(b); free(bias); free(out); free(db);
  mr_pool_free(p);
}
END_TEST

/* ---- activations: forward vs formula, backward vs finite differences ---- */

struct act_ctx {
  size_t n;
  double *x, *u; /* u: the SwiGLU up input */
  const float *G;
  int kind;      /* 0 swiglu, 1 gelu */
};

static double gelu_d(double x) {
  return 0.5 * x * (1 + tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}

static double act_loss(void *c) {
  struct act_ctx *a = c;
  double s = 0;
  for (size_t i = 0; i < a->n; i++) {
    double y = a->kind == 0 ? a->x[i] / (1 + exp(-a->x[i])) * a->u[i] : gelu_d(a->x[i]);
    s += y * a->G[i];
  }
  return s;
}

START_TEST(test_kernels_swiglu_gelu) {
  struct mr_pool *p = ref_pool(2);
  uint64_t seed = 5;
  size_t n = 40000; /* three chunks and a tail */
  float *g = ref_randf(n, &seed, 6), *u = ref_randf(n, &seed, 2), *G = ref_randf(n, &seed, 1);
  g[0] = 90; g[1] = -90; g[2] = 0; g[3] = 20; g[4] = -20; /* saturation */
  float *out = malloc(n * 4), *dg = malloc(n * 4), *du = malloc(n * 4);
  struct act_ctx c = {n, ref_tod(g, n), ref_tod(u, n), G, 0};
  ck_assert_int_eq(mr_cpu_swiglu_fwd(p, out, g, u, n), 0);
  double *want = malloc(n * sizeof(double));
  for (size_t i = 0; i < n; i++)
    want[i] = c.x[i] / (1 + exp(-c.x[i])) * c.u[i];
  ref_close("swiglu", out, want, n, 1e-6, 1e-5);
  ck_assert_int_eq(mr_cpu_swiglu_bwd(p, dg, du, G, g, u, n, false), 0);
  ref_fd_check("swiglu dgate", act_loss, &c, c.x, n, dg, 400, 1e-5, 1e-4);
  ref_fd_check("swiglu dup", act_loss, &c, c.u, n, du, 400, 1e-5, 1e-4);
  /* gelu: in place forward; backward with accumulation onto 1.0 */
  c.kind = 1;
  float *x = ref_copyf(g, n);
  ck_assert_int_eq(mr_cpu_gelu_fwd(p, x, x, n), 0);
  for (size_t i = 0; i < n; i++)
    want[i] = gelu_d(c.x[i]);
  ref_close("gelu", x, want, n, 1e-6, 1e-5);
  for (size_t i = 0; i < n; i++)
    dg[i] = 1.0f;
  ck_assert_int_eq(mr_cpu_gelu_bwd(p, dg, G, g, n, true), 0);
  for (size_t i = 0; i < n; i++)
    dg[i] -= 1.0f;
  ref_fd_check("gelu dx", act_loss, &c, c.x, n, dg, 400, 2e-5, 1e-4);
  free(g); free(u); free(G); free(out); free(dg); free(du); free(x); free(want);
  free(c.x); free(c.u);
  mr_pool_free(p);
}
END_TEST

/* ---- embedding ---- */

START_TEST(test_kernels_embedding) {
  struct mr_pool *p1 = ref_pool(1), *p3 = ref_pool(3);
  uint64_t seed = 6;
  int N = 77, V = 13, C = 131;
  float *table = ref_randf((size_t)V * C, &seed, 1), *dout = ref_randf((size_t)N * C, &seed, 1);
  int32_t *ids = malloc(sizeof(int32_t) * N);
  for (int i = 0; i < N; i++)
    ids[i] = (int32_t)((i * 7 + 3) % V); /* repeats */
  float *out = malloc(sizeof(float) * N * C);
  ck_assert_int_eq(mr_cpu_embedding_fwd(p3, out, table, ids, N, V, C), 0);
  for (int i = 0; i < N; i++)
    ck_assert(memcmp(out + (size_t)i * C, table + (size_t)ids[i] * C, sizeof(float) * C) == 0);
  float *d1 = calloc((size_t)V * C, 4), *d3 = calloc((size_t)V * C, 4);
  ck_assert_int_eq(mr_cpu_embedding_bwd(p1, d1, dout, ids, N, V, C), 0);
  ck_assert_int_eq(mr_cpu_embedding_bwd(p3, d3, dout, ids, N, V, C), 0);
  ck_assert(memcmp(d1, d3, sizeof(float) * V * C) == 0);
  for (int v = 0; v < V; v++)
    for (int c = 0; c < C; c++) {
      double s = 0;
      for (int i = 0; i < N; i++)
        if (ids[i] == v)
          s += dout[(size_t)i * C + c];
      ck_assert_double_eq_tol(d1[(size_t)v * C + c], s, 1e-5);
    }
  ids[40] = V; /* out of range: an error naming the row, nothing written */
  ck_assert_int_eq(mr_cpu_embedding_fwd(p3, out, table, ids, N, V, C), MR_ERANGE);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "row 40"));
  ids[40] = -1;
  ck_assert_int_eq(mr_cpu_embedding_bwd(p3, d1, dout, ids, N, V, C), MR_ERANGE);
  free(table); free(dout); free(ids); free(out); free(d1); free(d3);
  mr_pool_free(p1); mr_pool_free(p3);
}
END_TEST

/* ---- RMSNorm, LayerNorm ---- */

struct norm_ctx {
  int N, C, ln;
  double eps;
  double *x, *w, *b;
  const float *G;
  int only_row; /* >= 0: the loss of that row only (for dx) */
};

static void norm_ref(const struct norm_ctx *c, int r, double *y) {
  const double *x = c->x + (size_t)r * c->C;
  double mean = 0, var = 0;
  if (c->ln) {
    for (int i = 0; i < c->C; i++)
      mean += x[i];
    mean /= c->C;
  }
  for (int i = 0; i < c->C; i++)
    var += (x[i] - mean) * (x[i] - mean);
  var /= c->C;
  for (int i = 0; i < c->C; i++)
    y[i] = (x[i] - mean) / sqrt(var + c->eps) * c->w[i] + (c->ln ? c->b[i] : 0);
}

static double norm_loss(void *v) {
  struct norm_ctx *c = v;
  double *y = malloc(sizeof(double) * c->C), s = 0;
  for (int r = 0; r < c->N; r++) {
    if (c->only_row >= 0 && r != c->only_row)
      continue;
    norm_ref(c, r, y);
    s += ref_dot(y, c->G + (size_t)r * c->C, (size_t)c->C);
  }
  free(y);
  return s;
}

static void check_norm(int ln, int N, int C) {
  struct mr_pool *p1 = ref_pool(1), *p3 = ref_pool(3);
  uint64_t seed = 7 + (uint64_t)C;
  size_t n = (size_t)N * C;
  float *x = ref_randf(n, &seed, 2), *w = ref_randf((size_t)C, &seed, 1);
  float *b = ref_randf((size_t)C, &seed, 1), *G = ref_randf(n, &seed, 1);
  for (size_t i = 0; i < (size_t)C; i++)
    x[i] += 3.0f; /* a row with a large mean */
  float eps = 1e-5f;
  struct norm_ctx c = {N, C, ln, eps, ref_tod(x, n), ref_tod(w, (size_t)C),
                       ref_tod(b, (size_t)C), G, -1};
  float *y = malloc(n * 4), *y3 = malloc(n * 4), *mean = malloc((size_t)N * 4),
        *rstd = malloc((size_t)N * 4);
  if (ln) {
    ck_assert_int_eq(mr_cpu_layernorm_fwd(p1, y, mean, rstd, x, w, b, N, C, eps), 0);
    ck_assert_int_eq(mr_cpu_layernorm_fwd(p3, y3, NULL, NULL, x, w, b, N, C, eps), 0);
  } else {
    ck_assert_int_eq(mr_cpu_rmsnorm_fwd(p1, y, rstd, x, w, N, C, eps), 0);
    ck_assert_int_eq(mr_cpu_rmsnorm_fwd(p3, y3, NULL, x, w, N, C, eps), 0);
  }
  ck_assert(memcmp(y, y3, n * 4) == 0);
  double *want = malloc(sizeof(double) * n);
  for (int r = 0; r < N; r++)
    norm_ref(&c, r, want + (size_t)r * C);
  ref_close(ln ? "layernorm" : "rmsnorm", y, want, n, 1e-5, 1e-4);
  float *dx = ref_randf(n, &seed, 1), *dx0 = ref_copyf(dx, n), *dx3 = malloc(n * 4);
  float *dw = calloc((size_t)C, 4), *db = calloc((size_t)C, 4), *dw3 = calloc((size_t)C, 4),
        *db3 = calloc((size_t)C, 4);
  if (ln) {
    ck_assert_int_eq(mr_cpu_layernorm_bwd(p1, dx, dw, db, G, x, w, mean, rstd, N, C, true), 0);
    ck_assert_int_eq(mr_cpu_layernorm_bwd(p3, dx3, dw3, db3, G, x, w, mean, rstd, N, C, false), 0);
  } else {
    ck_assert_int_eq(mr_cpu_rmsnorm_bwd(p1, dx, dw, G, x, w, rstd, N, C, true), 0);
    ck_assert_int_eq(mr_cpu_rmsnorm_bwd(p3, dx3, dw3, G, x, w, rstd, N, C, false), 0);
  }
  ck_assert(memcmp(dw, dw3, (size_t)C * 4) == 0);
  ck_assert(memcmp(db, db3, (size_t)C * 4) == 0);
  for (size_t i = 0; i < n; i++) {
    ck_assert_float_eq_tol(dx[i] - dx0[i], dx3[i], 1e-5);
    dx[i] = dx3[i];
  }
  for (size_t i = 0; i < n; i += n / 150 + 1) { /* dx: only its row moves */
    c.only_row = (int)(i / (size_t)C);
    ref_fd_check("norm dx", norm_loss, &c, c.x + i, 1, dx + i, 1, 1e-4, 1e-3);
  }
  c.only_row = -1;
  ref_fd_check("norm dw", norm_loss, &c, c.w, (size_t)C, dw, 60, 1e-4, 1e-3);
  if (ln)
    ref_fd_check("norm db", norm_loss, &c, c.b, (size_t)C, db, 60, 1e-4, 1e-3);
  free(x); free(w); free(b); free(G); free(y); free(y3); free(mean); free(rstd);
  free(want); free(dx); free(dx0); free(dx3); free(dw); free(db); free(dw3); free(db3);
  free(c.x); free(c.w); free(c.b);
  mr_pool_free(p1); mr_pool_free(p3);
}

START_TEST(test_kernels_rmsnorm_odd_shapes) {
  check_norm(0, 9, 1);
  check_norm(0, 23, 37);
  check_norm(0, 70, 257); /* several row chunks and 64-column blocks */
}
END_TEST

START_TEST(test_kernels_layernorm_odd_shapes) {
  check_norm(1, 9, 2);
  check_norm(1, 23, 37);
  check_norm(1, 70, 257);
}
END_TEST

/* ---- RoPE ---- */

struct rope_ctx {
  int B, T, H, D;
  double theta;
  double *x;
  const int32_t *pos;
  const float *G;
};

/* HF apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, with
 * rotate_half(x) = cat(-x2, x1) and cos/sin = cat(freqs, freqs). */
static void rope_ref(const struct rope_ctx *c, double *y) {
  int half = c->D / 2;
  for (int b = 0; b < c->B; b++)
    for (int t = 0; t < c->T; t++)
      for (int h = 0; h < c->H; h++) {
        size_t o = (((size_t)b * c->T + t) * c->H + h) * c->D;
        double p = c->pos ? c->pos[b * c->T + t] : t;
        for (int d = 0; d < c->D; d++) {
          int i = d % half;
          double ang = p / pow(c->theta, 2.0 * i / c->D);
          double rot = d < half ? -c->x[o + d + half] : c->x[o + d - half];
          y[o + d] = c->x[o + d] * cos(ang) + rot * sin(ang);
        }
      }
}

static double rope_loss(void *v) {
  struct rope_ctx *c = v;
  size_t n = (size_t)c->B * c->T * c->H * c->D;
  double *y = malloc(n * sizeof(double));
  rope_ref(c, y);
  double s = ref_dot(y, c->G, n);
  free(y);
  return s;
}

START_TEST(test_kernels_rope_positions) {
  struct mr_pool *p = ref_pool(2);
  uint64_t seed = 8;
  int B = 2, T = 11, H = 3, D = 10, P = 40;
  size_t n = (size_t)B * T * H * D;
  float *cs = malloc(sizeof(float) * P * D / 2), *sn = malloc(sizeof(float) * P * D / 2);
  struct mr_rope plain = {.theta = 10000.0};
  ck_assert_int_eq(mr_rope_table(&plain, P, D, cs, sn), 0);
  int32_t pos[22];
  for (int i = 0; i < B * T; i++)
    pos[i] = (int32_t)(i < T ? i : 17 + (i - T) * 2); /* second row offset */
  for (int with_pos = 0; with_pos < 2; with_pos++) {
    float *x = ref_randf(n, &seed, 1), *G = ref_randf(n, &seed, 1);
    struct rope_ctx c = {B, T, H, D, 10000.0, ref_tod(x, n), with_pos ? pos : NULL, G};
    double *want = malloc(n * sizeof(double));
    rope_ref(&c, want);
    ck_assert_int_eq(mr_cpu_rope_fwd(p, x, cs, sn, c.pos, B, T, H, D, P, 0), 0);
    ref_close("rope", x, want, n, 2e-6, 1e-5);
    float *dx = ref_copyf(G, n);
    ck_assert_int_eq(mr_cpu_rope_bwd(p, dx, cs, sn, c.pos, B, T, H, D, P, 0), 0);
    ref_fd_check("rope dx", rope_loss, &c, c.x, n, dx, 200, 1e-5, 1e-4);
    free(x); free(G); free(dx); free(want); free(c.x);
  }
  /* strided: k heads inside a fused [B*T, 5*D] row, the rest untouched */
  float *f = ref_randf((size_t)B * T * 5 * D, &seed, 1), *f0 = ref_copyf(f, (size_t)B * T * 5 * D);
  ck_assert_int_eq(mr_cpu_rope_fwd(p, f + 3 * D, cs, sn, NULL, B, T, 2, D, P, 5 * D), 0);
  for (int r = 0; r < B * T; r++)
    ck_assert(memcmp(f + (size_t)r * 5 * D, f0 + (size_t)r * 5 * D, sizeof(float) * 3 * D) == 0);
  ck_assert_float_eq(f[3 * D], f0[3 * D]); /* position 0: identity */
  ck_assert(memcmp(f + 5 * D + 3 * D, f0 + 5 * D + 3 * D, 4 * D) != 0);
  pos[3] = P;
  ck_assert_int_eq(mr_cpu_rope_fwd(p, f, cs, sn, pos, B, T, H, D, P, 0), MR_ERANGE);
  ck_assert_int_eq(mr_rope_table(&plain, P, 7, cs, sn), MR_EINVAL);
  free(f); free(f0); free(cs); free(sn);
  mr_pool_free(p);
}
END_TEST

/* Scaled RoPE frequencies against Llama 3.1's published rule, worked for
 * its own numbers (theta 500000, D 128, factor 8, low 1, high 4, original
 * 8192): dimension 0 (wavelength 2 pi, under 8192 / 4) unchanged; 35
 * (wavelength 8218.7, past 8192 / 1) divided by 8; 34 (wavelength 6695.1)
 * the blend s f + (1 - s) f / 8 with s = (8192 / 6695.1 - 1) / 3 =
 * 0.074527, 0.190211 f; linear: every one divided by its factor; and the table's
 * angles are position times frequency. */
START_TEST(test_kernels_rope_scaled_frequencies) {
  struct mr_rope r = {.theta = 500000, .kind = MR_ROPE_LLAMA3, .factor = 8,
                      .low_freq_factor = 1, .high_freq_factor = 4,
                      .original_max_positions = 8192};
  double inv[64];
  mr_rope_inv_freq(&r, 128, inv);
  double f34 = pow(500000, -68.0 / 128), f35 = pow(500000, -70.0 / 128);
  ck_assert(fabs(inv[0] - 1.0) < 1e-15);
  ck_assert(fabs(inv[35] - f35 / 8) < 1e-12 * f35);
  ck_assert(fabs(2 * M_PI / f34 - 6695.1) < 0.05 && fabs(2 * M_PI / f35 - 8218.7) < 0.05);
  ck_assert_msg(fabs(inv[34] / f34 - 0.190211) < 2e-6, "blend %.7f", inv[34] / f34);
  for (int i = 0; i < 64; i++) /* never above the plain frequency, never below 1/8 of it */
    ck_assert(inv[i] <= pow(500000, -2.0 * i / 128) * (1 + 1e-15) &&
              inv[i] >= pow(500000, -2.0 * i / 128) / 8 * (1 - 1e-15));
  struct mr_rope lin = {.theta = 10000, .kind = MR_ROPE_LINEAR, .factor = 4};
  mr_rope_inv_freq(&lin, 16, inv);
  for (int i = 0; i < 8; i++)
    ck_assert(fabs(inv[i] - pow(10000, -2.0 * i / 16) / 4) < 1e-15);
  float cs[5 * 8], sn[5 * 8];
  ck_assert_int_eq(mr_rope_table(&lin, 5, 16, cs, sn), 0);
  ck_assert(fabs(cs[3 * 8 + 2] - cos(3 * pow(10000, -4.0 / 16) / 4)) < 1e-7);
  ck_assert(fabs(sn[4 * 8 + 7] - sin(4 * pow(10000, -14.0 / 16) / 4)) < 1e-7);
  lin.factor = 0;
  ck_assert_int_eq(mr_rope_table(&lin, 5, 16, cs, sn), MR_EINVAL);
}
END_TEST

/* ---- cross-entropy ---- */

struct xent_ctx {
  int N, V;
  double *x;
  const int32_t *t;
  const float *dloss;
  int only_row;
};

static double xent_row(const double *x, int V, double *lse_out) {
  double m = -INFINITY, s = 0;
  for (int j = 0; j < V; j++)
    m = fmax(m, x[j]);
  for (int j = 0; j < V; j++)
    s += exp(x[j] - m);
  *lse_out = m + log(s);
  return *lse_out;
}

static double xent_loss(void *v) {
  struct xent_ctx *c = v;
  double s = 0, lse;
  for (int i = 0; i < c->N; i++) {
    if (c->t[i] < 0 || (c->only_row >= 0 && i != c->only_row))
      continue;
    xent_row(c->x + (size_t)i * c->V, c->V, &lse);
    s += (lse - c->x[(size_t)i * c->V + c->t[i]]) * c->dloss[i];
  }
  return s;
}

START_TEST(test_kernels_xent_fused) {
  struct mr_pool *p = ref_pool(3);
  uint64_t seed = 9;
  int N = 29, V = 301;
  size_t n = (size_t)N * V;
  float *x = ref_randf(n, &seed, 4), *dloss = ref_randf((size_t)N, &seed, 1);
  x[5] = 80.0f; x[6] = -80.0f; /* large logits stay finite */
  int32_t *t = malloc(sizeof(int32_t) * N);
  for (int i = 0; i < N; i++)
    t[i] = (int32_t)((i * 37) % V);
  t[3] = -100; t[17] = -100;
  float *loss = malloc(sizeof(float) * N), *lse = malloc(sizeof(float) * N);
  int nv = 0;
  ck_assert_int_eq(mr_cpu_xent_fwd(p, loss, lse, x, t, N, V, &nv), 0);
  ck_assert_int_eq(nv, N - 2);
  struct xent_ctx c = {N, V, ref_tod(x, n), t, dloss, -1};
  for (int i = 0; i < N; i++) {
    double l;
    xent_row(c.x + (size_t)i * V, V, &l);
    ck_assert_double_eq_tol(lse[i], l, 1e-5 * fmax(1, fabs(l)));
    double want = t[i] < 0 ? 0 : l - c.x[(size_t)i * V + t[i]];
    ck_assert_double_eq_tol(loss[i], want, 2e-5 * fmax(1, fabs(want)));
  }
  /* in place over the logits, per-row dloss times a scale */
  float *d = ref_copyf(x, n);
  ck_assert_int_eq(mr_cpu_xent_bwd(p, d, d, lse, t, dloss, 0.5f, N, V), 0);
  for (size_t i = 0; i < n; i++)
    d[i] *= 2.0f;
  for (size_t i = 0; i < n; i += n / 600 + 1) {
    c.only_row = (int)(i / (size_t)V);
    ref_fd_check("xent dlogits", xent_loss, &c, c.x + i, 1, d + i, 1, 1e-5, 1e-4);
  }
  for (int j = 0; j < V; j++)
    ck_assert_float_eq(d[3 * (size_t)V + j], 0.0f); /* ignored row */
  /* a NaN logit (an fp16 overflow upstream) must reach the loss, so the
   * loss-scaling check sees it */
  x[2 * (size_t)V + 9] = NAN;
  ck_assert_int_eq(mr_cpu_xent_fwd(p, loss, lse, x, t, N, V, NULL), 0);
  ck_assert(isnan(loss[2]) && isnan(lse[2]));
  ck_assert(!isnan(loss[1]) && !isnan(loss[4]));
  t[7] = V;
  ck_assert_int_eq(mr_cpu_xent_fwd(p, loss, lse, x, t, N, V, NULL), MR_ERANGE);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "row 7"));
  free(x); free(dloss); free(t); free(loss); free(lse); free(d); free(c.x);
  mr_pool_free(p);
}
END_TEST

/* ---- vocabulary-parallel cross-entropy ---- */

/* Columns [lo, hi) of x[N, V], contiguous. */
static float *columns(const float *x, int N, int V, int lo, int hi) {
  float *c = malloc(sizeof(float) * (size_t)(N * (hi - lo) + 1));
  for (int i = 0; i < N; i++)
    memcpy(c + (size_t)i * (hi - lo), x + (size_t)i * V + lo,
           sizeof(float) * (size_t)(hi - lo));
  return c;
}

/* The three steps run on vocabulary shards (uneven, one empty) and their
 * results combined as the all-reduces would (max, then sums): lse and the
 * loss against the double reference, the backward against finite
 * differences of it, 1 and 3 threads bitwise equal. */
START_TEST(test_kernels_xent_vocab_shards) {
  struct mr_pool *pools[2] = {ref_pool(1), ref_pool(3)};
  uint64_t seed = 21;
  int N = 23, V = 301;
  static const int cut[] = {0, 7, 150, 301, 301};
  int K = (int)MR_ARRAY_LEN(cut) - 1;
  size_t n = (size_t)N * V;
  float *x = ref_randf(n, &seed, 4);
  x[5] = 80.0f; x[V + 200] = -80.0f;
  int32_t *t = malloc(sizeof(int32_t) * N);
  for (int i = 0; i < N; i++)
    t[i] = (int32_t)((i * 37) % V);
  t[3] = -100; t[17] = -100;
  float *d[2];
  for (int pi = 0; pi < 2; pi++) {
    struct mr_pool *p = pools[pi];
    float *m = malloc(sizeof(float) * N), *s = calloc((size_t)N, sizeof(float));
    float *tl = calloc((size_t)N, sizeof(float)), *part = malloc(sizeof(float) * N);
    float *part2 = malloc(sizeof(float) * N);
    for (int i = 0; i < N; i++)
      m[i] = -INFINITY;
    for (int k = 0; k < K; k++) {
      float *c = columns(x, N, V, cut[k], cut[k + 1]);
      ck_assert_int_eq(mr_cpu_xent_rowmax(p, part, c, N, cut[k + 1] - cut[k]), 0);
      for (int i = 0; i < N; i++)
        m[i] = fmaxf(m[i], part[i]);
      free(c);
    }
    for (int k = 0; k < K; k++) {
      float *c = columns(x, N, V, cut[k], cut[k + 1]);
      ck_assert_int_eq(mr_cpu_xent_sumexp(p, part, part2, c, t, m, N,
                                          cut[k + 1] - cut[k], cut[k], V), 0);
      for (int i = 0; i < N; i++) {
        s[i] += part[i];
        tl[i] += part2[i];
      }
      free(c);
    }
    float loss, *lse = malloc(sizeof(float) * N);
    ck_assert_int_eq(mr_cpu_xent_finish(&loss, lse, s, tl, m, t, N, 0), 0);
    double *xd = ref_tod(x, n), want = 0;
    for (int i = 0; i < N; i++) {
      double l;
      xent_row(xd + (size_t)i * V, V, &l);
      ck_assert_double_eq_tol(lse[i], l, 1e-5 * fmax(1, fabs(l)));
      if (t[i] >= 0)
        want += (l - xd[(size_t)i * V + t[i]]) / (N - 2);
    }
    ck_assert_double_eq_tol(loss, want, 2e-5 * fmax(1, fabs(want)));
    /* backward: dloss 0.7 through the finishing step, then each shard */
    float *ds = malloc(sizeof(float) * N), *dtl = malloc(sizeof(float) * N);
    ck_assert_int_eq(mr_cpu_xent_finish_bwd(ds, dtl, 0.7f, NULL, s, t, N, 0), 0);
    d[pi] = malloc(sizeof(float) * n);
    for (int k = 0; k < K; k++) {
      int w = cut[k + 1] - cut[k];
      float *c = columns(x, N, V, cut[k], cut[k + 1]);
      ck_assert_int_eq(mr_cpu_xent_sumexp_bwd(p, c, c, t, m, ds, dtl, N, w,
                                              cut[k], V), 0); /* in place */
      for (int i = 0; i < N; i++)
        memcpy(d[pi] + (size_t)i * V + cut[k], c + (size_t)i * w,
               sizeof(float) * (size_t)w);
      free(c);
    }
    float *dl = malloc(sizeof(float) * N);
    for (int i = 0; i < N; i++)
      dl[i] = 0.7f / (float)(N - 2);
    struct xent_ctx ctx = {N, V, xd, t, dl, -1};
    for (size_t i = 0; i < n; i += n / 500 + 1) {
      ctx.only_row = (int)(i / (size_t)V);
      ref_fd_check("xent_vocab dlogits", xent_loss, &ctx, xd + i, 1, d[pi] + i, 1,
                   1e-5, 1e-4);
    }
    for (int j = 0; j < V; j++)
      ck_assert_float_eq(d[pi][3 * (size_t)V + j], 0.0f); /* ignored row */
    free(m), free(s), free(tl), free(part), free(part2), free(lse);
    free(ds), free(dtl), free(dl), free(xd);
  }
  ck_assert(memcmp(d[0], d[1], sizeof(float) * n) == 0);
  free(d[0]), free(d[1]), free(x), free(t);
  mr_pool_free(pools[0]);
  mr_pool_free(pools[1]);
}
END_TEST

/* NaN, -inf rows, an empty shard, targets out of range. */
START_TEST(test_kernels_xent_vocab_edges) {
  struct mr_pool *p = ref_pool(2);
  float x[3 * 4] = {1, 2, NAN, 0, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
                    0.5f, -1, 3, 2};
  int32_t t[3] = {5, 1, -1};
  float m[3], s[3], tl[3];
  ck_assert_int_eq(mr_cpu_xent_rowmax(p, m, x, 3, 4), 0);
  ck_assert(isnan(m[0]));
  ck_assert(m[1] == -INFINITY);
  ck_assert_float_eq(m[2], 3.0f);
  /* columns 4..7 of a vocabulary of 8: row 0's target 5 is column 1 */
  ck_assert_int_eq(mr_cpu_xent_sumexp(p, s, tl, x, t, m, 3, 4, 4, 8), 0);
  ck_assert(isnan(s[0]));
  ck_assert_float_eq(tl[0], 2.0f);
  ck_assert_float_eq(s[1], 0.0f); /* no mass, not NaN */
  ck_assert_float_eq(tl[1], 0.0f); /* target 1 is another shard's */
  ck_assert_float_eq(tl[2], 0.0f); /* ignored */
  /* an empty shard */
  float me[3], se[3], te[3], mg[3] = {1, 2, 3};
  ck_assert_int_eq(mr_cpu_xent_rowmax(p, me, x, 3, 0), 0);
  ck_assert(me[0] == -INFINITY);
  ck_assert_int_eq(mr_cpu_xent_sumexp(p, se, te, x, t, mg, 3, 0, 8, 8), 0);
  ck_assert(se[0] == 0.0f && te[0] == 0.0f);
  t[2] = 8;
  ck_assert_int_eq(mr_cpu_xent_sumexp(p, s, tl, x, t, m, 3, 4, 4, 8), MR_ERANGE);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "row 2"));
  ck_assert_int_eq(mr_cpu_xent_sumexp(p, s, tl, x, t, m, 3, 4, 6, 8), MR_EINVAL);
  mr_pool_free(p);
}
END_TEST

/* The matmul checks again on the other paths, one per process (the choice
 * is made once): 0, the AVX2 copy of our sgemm (what a CPU without
 * AVX-512 runs, so on one the same as above); 1, single-threaded OpenBLAS
 * calls by rows (MESHRUN_CPU_GEMM=openblas); 2, the portable build of
 * everything, which also calls OpenBLAS. */
START_TEST(test_kernels_gemm_other_paths) {
  if (_i == 0)
    mr_tunable_override(MR_TUNABLE_CPU_SIMD, "avx2");
  else if (_i == 1)
    mr_tunable_override(MR_TUNABLE_CPU_GEMM, "openblas");
  else
    ref_force_portable();
  test_kernels_gemm_all_transposes_and_splits_fn(_i);
  test_kernels_gemm_block_edges_fn(_i);
  test_kernels_gemm_threads_bitwise_equal_fn(_i);
  test_kernels_linear_fwd_bwd_finite_differences_fn(_i);
}
END_TEST

/* The same checks on the portable (non-AVX2) copies of the kernels. */
START_TEST(test_kernels_portable_path) {
  ref_force_portable();
  check_norm(0, 23, 37);
  check_norm(1, 70, 257);
  test_kernels_swiglu_gelu_fn(_i);
  test_kernels_xent_fused_fn(_i);
  test_kernels_xent_vocab_shards_fn(_i);
  test_kernels_rope_positions_fn(_i);
}
END_TEST

static Suite *kernels_suite(void) {
  Suite *s = suite_create("kernels");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_kernels_gemm_all_transposes_and_splits);
  tcase_add_test(tc, test_kernels_gemm_threads_bitwise_equal);
  tcase_add_test(tc, test_kernels_gemm_bf16_against_rounded_reference);
  tcase_add_test(tc, test_kernels_gemm_block_edges);
  tcase_add_test(tc, test_kernels_linear_fwd_bwd_finite_differences);
  tcase_add_test(tc, test_kernels_add_bias_scale);
  tcase_add_test(tc, test_kernels_swiglu_gelu);
  tcase_add_test(tc, test_kernels_embedding);
  tcase_add_test(tc, test_kernels_rmsnorm_odd_shapes);
  tcase_add_test(tc, test_kernels_layernorm_odd_shapes);
  tcase_add_test(tc, test_kernels_rope_positions);
  tcase_add_test(tc, test_kernels_rope_scaled_frequencies);
  tcase_add_test(tc, test_kernels_xent_fused);
  tcase_add_test(tc, test_kernels_xent_vocab_shards);
  tcase_add_test(tc, test_kernels_xent_vocab_edges);
  tcase_add_test(tc, test_kernels_portable_path);
  tcase_add_loop_test(tc, test_kernels_gemm_other_paths, 0, 3);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(kernels_suite)
