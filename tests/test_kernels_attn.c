/* test_kernels_attn.c - causal grouped-query attention: the forward and its
 * saved log-sum-exp against a plain softmax(q k^T / sqrt(D)) v computed in
 * double, the backward against central finite differences of it, at T not a
 * multiple of the key block, Hkv < H, odd D and strided (fused qkv) rows;
 * 1 and 3 threads bitwise equal. */
#include "check_main.h"
#include "kernels_ref.h"

#include "common/error.h"

struct attn_ctx {
  int B, T, H, Hkv, D;
  int ldq, ldk, ldv, ldo; /* as the kernel sees them */
  double *q, *k, *v;      /* same layout and strides as the float inputs */
  const float *G;         /* upstream gradient, ldo rows */
};

/* o[b,t,h] = sum_{s<=t} softmax_s(q.k / sqrt(D)) v; lse per (b,h,t) */
static void attn_ref(const struct attn_ctx *c, double *o, double *lse) {
  double *w = malloc(sizeof(double) * c->T);
  int g = c->H / c->Hkv;
  for (int b = 0; b < c->B; b++)
    for (int h = 0; h < c->H; h++)
      for (int t = 0; t < c->T; t++) {
        const double *qr = c->q + ((size_t)b * c->T + t) * c->ldq + (size_t)h * c->D;
        double m = -INFINITY;
        for (int s = 0; s <= t; s++) {
          const double *kr = c->k + ((size_t)b * c->T + s) * c->ldk + (size_t)(h / g) * c->D;
          double dot = 0;
          for (int d = 0; d < c->D; d++)
            dot += qr[d] * kr[d];
          w[s] = dot / sqrt((double)c->D);
          m = fmax(m, w[s]);
        }
        double z = 0;
        for (int s = 0; s <= t; s++)
          z += exp(w[s] - m);
        if (lse)
          lse[((size_t)b * c->H + h) * c->T + t] = m + log(z);
        double *orow = o + ((size_t)b * c->T + t) * c->ldo + (size_t)h * c->D;
        for (int d = 0; d < c->D; d++) {
          double acc = 0;
          for (int s = 0; s <= t; s++)
            acc += exp(w[s] - m) / z *
                   c->v[((size_t)b * c->T + s) * c->ldv + (size_t)(h / g) * c->D + d];
          orow[d] = acc;
        }
      }
  free(w);
}

static double attn_loss(void *v) {
  struct attn_ctx *c = v;
  size_t n = (size_t)c->B * c->T * c->ldo;
  double *o = calloc(n, sizeof(double));
  attn_ref(c, o, NULL);
  double s = 0;
  for (int r = 0; r < c->B * c->T; r++)
    for (int i = 0; i < c->H * c->D; i++)
      s += o[(size_t)r * c->ldo + i] * c->G[(size_t)r * c->ldo + i];
  free(o);
  return s;
}

/* fused: q, k, v live in one [B*T, (H + 2 Hkv) D] buffer and o, do in a
 * [B*T, H*D + 5] one, exercising the row strides */
static void check_attn(int B, int T, int H, int Hkv, int D, int fused, size_t samples) {
  struct mr_pool *p1 = ref_pool(1), *p3 = ref_pool(3);
  uint64_t seed = (uint64_t)(B * 1000 + T * 10 + H + D);
  int W = (H + 2 * Hkv) * D;
  struct mr_attn_shape s = {.B = B, .T = T, .H = H, .Hkv = Hkv, .D = D};
  if (fused) {
    s.ldq = s.ldk = s.ldv = W;
    s.ldo = H * D + 5;
  }
  int ldq = fused ? W : H * D, ldk = fused ? W : Hkv * D, ldo = fused ? H * D + 5 : H * D;
  size_t rows = (size_t)B * T;
  size_t nq = rows * ldq, nk = rows * ldk, no = rows * ldo;
  float *qkv = NULL, *q, *k, *v;
  if (fused) {
    qkv = ref_randf(rows * W, &seed, 1.5);
    q = qkv;
    k = qkv + H * D;
    v = qkv + (H + Hkv) * D;
  } else {
    q = ref_randf(nq, &seed, 1.5);
    k = ref_randf(nk, &seed, 1.5);
    v = ref_randf(nk, &seed, 1.5);
  }
  float *G = ref_randf(no, &seed, 1);
  float *o = calloc(no, 4), *o3 = calloc(no, 4);
  float *lse = malloc(sizeof(float) * B * H * T), *lse3 = malloc(sizeof(float) * B * H * T);
  ck_assert_int_eq(mr_cpu_attention_fwd(p1, o, lse, q, k, v, &s), 0);
  ck_assert_int_eq(mr_cpu_attention_fwd(p3, o3, lse3, q, k, v, &s), 0);
  ck_assert(memcmp(o, o3, no * 4) == 0);
  ck_assert(memcmp(lse, lse3, sizeof(float) * B * H * T) == 0);

  /* the double copies keep the float layout (offsets inside the fused row) */
  size_t nall = fused ? rows * W : 0;
  double *qkvd = fused ? ref_tod(qkv, nall) : NULL;
  struct attn_ctx c = {B, T, H, Hkv, D, ldq, ldk, ldk, ldo,
                       fused ? qkvd : ref_tod(q, nq),
                       fused ? qkvd + H * D : ref_tod(k, nk),
                       fused ? qkvd + (H + Hkv) * D : ref_tod(v, nk), G};
  double *want = calloc(no, sizeof(double)), *lse_want = malloc(sizeof(double) * B * H * T);
  attn_ref(&c, want, lse_want);
  for (size_t r = 0; r < rows; r++)
    ref_close("attention o", o + r * ldo, want + r * ldo, (size_t)H * D, 2e-6, 2e-5);
  ref_close("attention lse", lse, lse_want, (size_t)B * H * T, 2e-6, 2e-6);

  float *dq = calloc(nq, 4), *dk = calloc(nk, 4), *dv = calloc(nk, 4);
  float *dq3 = calloc(nq, 4), *dk3 = calloc(nk, 4), *dv3 = calloc(nk, 4);
  if (fused) { /* one buffer for dq, dk, dv, as the fused weight wants */
    free(dk); free(dv); free(dk3); free(dv3);
    dk = dq + H * D; dv = dq + (H + Hkv) * D;
    dk3 = dq3 + H * D; dv3 = dq3 + (H + Hkv) * D;
  }
  ck_assert_int_eq(mr_cpu_attention_bwd(p1, dq, dk, dv, G, q, k, v, o, lse, &s), 0);
  ck_assert_int_eq(mr_cpu_attention_bwd(p3, dq3, dk3, dv3, G, q, k, v, o, lse, &s), 0);
  ck_assert(memcmp(dq, dq3, nq * 4) == 0);
  if (!fused) {
    ck_assert(memcmp(dk, dk3, nk * 4) == 0);
    ck_assert(memcmp(dv, dv3, nk * 4) == 0);
  }
  /* finite differences over each operand's own elements */
  for (int which = 0; which < 3; which++) {
    double *x = which == 0 ? c.q : which == 1 ? c.k : c.v;
    const float *an = which == 0 ? dq : which == 1 ? dk : dv;
    int width = which == 0 ? H * D : Hkv * D, ld = which == 0 ? ldq : ldk;
    size_t n = rows * (size_t)width, step = samples >= n ? 1 : n / samples;
    for (size_t e = 0; e < n; e += step) {
      size_t r = e / (size_t)width, i = r * (size_t)ld + e % (size_t)width;
      char what[64];
      snprintf(what, sizeof what, "attention d%c", "qkv"[which]);
      float a = an[i];
      ref_fd_check(what, attn_loss, &c, x + i, 1, &a, 1, 2e-5, 2e-4);
    }
  }
  free(want); free(lse_want); free(lse); free(lse3); free(o); free(o3); free(G);
  if (fused) {
    free(qkv); free(qkvd);
  } else {
    free(q); free(k); free(v); free(c.q); free(c.k); free(c.v);
    free(dk); free(dv); free(dk3); free(dv3);
  }
  free(dq); free(dq3);
  mr_pool_free(p1); mr_pool_free(p3);
}

START_TEST(test_kernels_attention_tiny_every_element) {
  check_attn(1, 5, 3, 1, 6, 0, 1000);
}
END_TEST

START_TEST(test_kernels_attention_gqa_partial_block) {
  check_attn(2, 70, 4, 2, 8, 0, 150); /* 70 = one key block of 64 + 6 */
}
END_TEST

START_TEST(test_kernels_attention_odd_dim_multi_block) {
  check_attn(1, 130, 2, 2, 5, 0, 120);
}
END_TEST

START_TEST(test_kernels_attention_fused_qkv_strides) {
  check_attn(2, 67, 4, 1, 4, 1, 120);
}
END_TEST

START_TEST(test_kernels_attention_bad_shape) {
  struct mr_pool *p = ref_pool(1);
  float x[64] = {0};
  struct mr_attn_shape s = {.B = 1, .T = 2, .H = 3, .Hkv = 2, .D = 4};
  ck_assert_int_eq(mr_cpu_attention_fwd(p, x, x, x, x, x, &s), MR_EINVAL);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "Hkv must divide H"));
  s.Hkv = 3;
  s.ldq = 5; /* shorter than H*D */
  ck_assert_int_eq(mr_cpu_attention_bwd(p, x, x, x, x, x, x, x, x, x, &s), MR_EINVAL);
  mr_pool_free(p);
}
END_TEST

static Suite *kernels_attn_suite(void) {
  Suite *s = suite_create("kernels_attn");
  TCase *tc = tcase_create("attention");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_kernels_attention_tiny_every_element);
  tcase_add_test(tc, test_kernels_attention_gqa_partial_block);
  tcase_add_test(tc, test_kernels_attention_odd_dim_multi_block);
  tcase_add_test(tc, test_kernels_attention_fused_qkv_strides);
  tcase_add_test(tc, test_kernels_attention_bad_shape);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(kernels_attn_suite)
