/* test_kernels_attn.c - causal grouped-query attention: the forward and its
 * saved log-sum-exp against a plain softmax(q k^T / sqrt(D)) v computed in
 * double, the backward against central finite differences of it, at T not a
 * multiple of the key block, Hkv < H, odd D and strided (fused qkv) rows;
 * 1 and 3 threads bitwise equal. */
#include "check_main.h"
#include "kernels_ref.h"

#include "common/dtype.h"
#include "common/error.h"

struct attn_ctx {
  int B, T, H, Hkv, D;
  int ldq, ldk, ldv, ldo; /* as the kernel sees them */
  double *q, *k, *v;      /* same layout and strides as the float inputs */
  const float *G;         /* upstream gradient, ldo rows */
  int only_b;             /* >= 0: the loss of that batch row only */
  int window;             /* > 0: query t sees keys (t - window, t] */
};

/* o[b,t,h] = sum_{s<=t} softmax_s(q.k / sqrt(D)) v; lse per (b,h,t) */
static void attn_ref(const struct attn_ctx *c, double *o, double *lse) {
  double *w = malloc(sizeof(double) * c->T);
  int g = c->H / c->Hkv;
  for (int b = 0; b < c->B; b++)
    for (int h = 0; h < c->H; h++)
      for (int t = 0; t < c->T; t++) {
        if (c->only_b >= 0 && b != c->only_b)
          continue;
        const double *qr = c->q + ((size_t)b * c->T + t) * c->ldq + (size_t)h * c->D;
        double m = -INFINITY;
        int lo = c->window > 0 && t - c->window + 1 > 0 ? t - c->window + 1 : 0;
        for (int s = lo; s <= t; s++) {
          const double *kr = c->k + ((size_t)b * c->T + s) * c->ldk + (size_t)(h / g) * c->D;
          double dot = 0;
          for (int d = 0; d < c->D; d++)
            dot += qr[d] * kr[d];
          w[s] = dot / sqrt((double)c->D);
          m = fmax(m, w[s]);
        }
        double z = 0;
        for (int s = lo; s <= t; s++)
          z += exp(w[s] - m);
        if (lse)
          lse[((size_t)b * c->H + h) * c->T + t] = m + log(z);
        double *orow = o + ((size_t)b * c->T + t) * c->ldo + (size_t)h * c->D;
        for (int d = 0; d < c->D; d++) {
          double acc = 0;
          for (int s = lo; s <= t; s++)
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
static void check_attn_w(int B, int T, int H, int Hkv, int D, int fused, size_t samples,
                         int window) {
  struct mr_pool *p1 = ref_pool(1), *p3 = ref_pool(3);
  uint64_t seed = (uint64_t)(B * 1000 + T * 10 + H + D);
  int W = (H + 2 * Hkv) * D;
  struct mr_attn_shape s = {.B = B, .T = T, .H = H, .Hkv = Hkv, .D = D, .window = window};
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
                       fused ? qkvd + (H + Hkv) * D : ref_tod(v, nk), G, -1, window};
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
      c.only_b = (int)(r / (size_t)T); /* other batches do not move */
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

static void check_attn(int B, int T, int H, int Hkv, int D, int fused, size_t samples) {
  check_attn_w(B, T, H, Hkv, D, fused, samples, 0);
}

/* A sliding window (Mistral's): query t sees keys (t - W, t], against the
 * double reference with the same window, forward and finite differences;
 * windows shorter than a 64-query block, across one and past T. */
START_TEST(test_kernels_attention_sliding_window) {
  check_attn_w(1, 9, 2, 1, 6, 0, 1000, 3);
  check_attn_w(2, 70, 4, 2, 8, 0, 60, 20);
  check_attn_w(1, 131, 2, 2, 5, 1, 40, 80);
  check_attn_w(1, 30, 2, 1, 4, 0, 40, 64); /* wider than T: causal */
}
END_TEST

START_TEST(test_kernels_attention_tiny_every_element) {
  check_attn(1, 5, 3, 1, 6, 0, 1000);
}
END_TEST

START_TEST(test_kernels_attention_gqa_partial_block) {
  check_attn(2, 70, 4, 2, 8, 0, 80); /* 70 = one key block of 64 + 6 */
}
END_TEST

START_TEST(test_kernels_attention_odd_dim_multi_block) {
  check_attn(1, 130, 2, 2, 5, 0, 60);
}
END_TEST

START_TEST(test_kernels_attention_fused_qkv_strides) {
  check_attn(2, 67, 4, 1, 4, 1, 80);
}
END_TEST

START_TEST(test_kernels_attention_portable_path) {
  ref_force_portable(); /* the code a CPU without AVX2 runs */
  check_attn(2, 70, 4, 2, 8, 0, 40);
  check_attn(1, 67, 2, 1, 36, 1, 30); /* D: a 32-wide chunk and a tail */
}
END_TEST

/* The AVX2 copy of our sgemm under the products (what a CPU without
 * AVX-512 runs; the same as the default there), and OpenBLAS under them. */
START_TEST(test_kernels_attention_avx2_and_openblas_products) {
  mr_tunable_override(_i ? MR_TUNABLE_CPU_GEMM : MR_TUNABLE_CPU_SIMD, _i ? "openblas" : "avx2");
  check_attn(2, 70, 4, 2, 8, 0, 40);
  check_attn(1, 67, 2, 1, 36, 1, 30);
  check_attn_w(2, 70, 4, 2, 8, 0, 60, 20);
}
END_TEST

START_TEST(test_kernels_attention_wide_head_dim) {
  check_attn(1, 66, 2, 1, 44, 0, 40); /* 32 + 8 + 4 lanes */
}
END_TEST

/* ---- bf16 products (AVX512_BF16) ---- */

static double bf(double x) { return mr_bf16_to_f32(mr_f32_to_bf16((float)x)); }

/* Forward and backward of one (b, h) in double, rounding to bf16 where the
 * kernel's products take their operands: q, k, v, do; the unnormalized
 * probabilities before P V (the sum that divides them is of the unrounded
 * ones); P before dV = P^T dO and dS before dQ = dS K, dK = dS^T Q.  The
 * softmax, lse and D_t = dO . O (from o as given) stay unrounded.  Adds
 * into dk, dv (kv head shared by the group). */
static void attn_bf16_ref(int T, int D, const float *q, const float *k, const float *v,
                          const float *dout, const float *o, int ld, int ldkv, double *ro,
                          double *rlse, double *dq, double *dk, double *dv) {
  double sc = 1.0 / sqrt((double)D);
  double *p = malloc(sizeof(double) * (size_t)T), *dp = malloc(sizeof(double) * (size_t)T);
  for (int t = 0; t < T; t++) {
    double m = -INFINITY, z = 0;
    for (int u = 0; u <= t; u++) {
      double dot = 0;
      for (int d = 0; d < D; d++)
        dot += bf(q[(size_t)t * ld + d]) * bf(k[(size_t)u * ldkv + d]);
      p[u] = dot * sc;
      m = fmax(m, p[u]);
    }
    for (int u = 0; u <= t; u++)
      z += exp(p[u] - m);
    double lse = m + log(z);
    rlse[t] = lse;
    for (int d = 0; d < D; d++) {
      double acc = 0;
      for (int u = 0; u <= t; u++)
        acc += bf(exp(p[u] - m)) * bf(v[(size_t)u * ldkv + d]);
      ro[(size_t)t * D + d] = acc / z;
    }
    double di = 0;
    for (int d = 0; d < D; d++)
      di += (double)dout[(size_t)t * ld + d] * o[(size_t)t * ld + d];
    for (int u = 0; u <= t; u++) {
      double pr = exp(p[u] - lse), g = 0;
      for (int d = 0; d < D; d++)
        g += bf(dout[(size_t)t * ld + d]) * bf(v[(size_t)u * ldkv + d]);
      dp[u] = bf(pr * (g - di));
      for (int d = 0; d < D; d++) {
        dv[(size_t)u * D + d] += bf(pr) * bf(dout[(size_t)t * ld + d]);
        dk[(size_t)u * D + d] += sc * dp[u] * bf(q[(size_t)t * ld + d]);
        dq[(size_t)t * D + d] += sc * dp[u] * bf(k[(size_t)u * ldkv + d]);
      }
    }
  }
  free(p);
  free(dp);
}

/* Tolerance: the kernel sums in fp32, so a product or probability that
 * lies within fp32 noise of a bf16 rounding boundary may round the other
 * way (one bf16 step, 2^-8 relative, of one term); the bound leaves room
 * for a few such terms and no more.  The fp32 path on the same rounded
 * inputs misses it by 10x (P and dS unrounded), as the test shows. */
static void check_attn_bf16(int B, int T, int H, int Hkv, int D) {
  struct mr_pool *p1 = ref_pool(1), *p3 = ref_pool(3);
  uint64_t seed = (uint64_t)(77 + T + D);
  struct mr_attn_shape s = {.B = B, .T = T, .H = H, .Hkv = Hkv, .D = D, .bf16 = true};
  size_t nq = (size_t)B * T * H * D, nk = (size_t)B * T * Hkv * D, nl = (size_t)B * H * T;
  float *q = ref_randf(nq, &seed, 1.5), *k = ref_randf(nk, &seed, 1.5),
        *v = ref_randf(nk, &seed, 1.5), *G = ref_randf(nq, &seed, 1);
  float *o = calloc(nq, 4), *o3 = calloc(nq, 4), *lse = calloc(nl, 4), *lse3 = calloc(nl, 4);
  ck_assert_int_eq(mr_cpu_attention_fwd(p1, o, lse, q, k, v, &s), 0);
  ck_assert_int_eq(mr_cpu_attention_fwd(p3, o3, lse3, q, k, v, &s), 0);
  ck_assert(memcmp(o, o3, nq * 4) == 0 && memcmp(lse, lse3, nl * 4) == 0);
  float *dq = calloc(nq, 4), *dk = calloc(nk, 4), *dv = calloc(nk, 4);
  float *dq3 = calloc(nq, 4), *dk3 = calloc(nk, 4), *dv3 = calloc(nk, 4);
  ck_assert_int_eq(mr_cpu_attention_bwd(p1, dq, dk, dv, G, q, k, v, o, lse, &s), 0);
  ck_assert_int_eq(mr_cpu_attention_bwd(p3, dq3, dk3, dv3, G, q, k, v, o, lse, &s), 0);
  ck_assert(memcmp(dq, dq3, nq * 4) == 0 && memcmp(dk, dk3, nk * 4) == 0 &&
            memcmp(dv, dv3, nk * 4) == 0);
  /* the fp32 path on bf16-rounded inputs, to show the bound separates */
  float *qr = ref_copyf(q, nq), *kr = ref_copyf(k, nk), *vr = ref_copyf(v, nk),
        *Gr = ref_copyf(G, nq);
  float *rnd[] = {qr, kr, vr, Gr};
  size_t rn[] = {nq, nk, nk, nq};
  for (int a = 0; a < 4; a++)
    for (size_t i = 0; i < rn[a]; i++)
      rnd[a][i] = mr_bf16_to_f32(mr_f32_to_bf16(rnd[a][i]));
  struct mr_attn_shape s32 = s;
  s32.bf16 = false;
  float *fo = calloc(nq, 4), *flse = calloc(nl, 4), *fdq = calloc(nq, 4), *fdk = calloc(nk, 4),
        *fdv = calloc(nk, 4);
  ck_assert_int_eq(mr_cpu_attention_fwd(p1, fo, flse, qr, kr, vr, &s32), 0);
  ck_assert_int_eq(mr_cpu_attention_bwd(p1, fdq, fdk, fdv, Gr, qr, kr, vr, o, lse, &s32), 0);

  int g = H / Hkv;
  double worst[2][4] = {{0}}, scale[4] = {0}; /* o, dq, dk, dv: bf16 kernel, fp32 path */
  double *ro = malloc(sizeof(double) * (size_t)T * D), *rl = malloc(sizeof(double) * (size_t)T);
  double *rq = malloc(sizeof(double) * (size_t)T * D), *rk = malloc(sizeof(double) * (size_t)T * D),
         *rv = malloc(sizeof(double) * (size_t)T * D);
  for (int b = 0; b < B; b++)
    for (int kh = 0; kh < Hkv; kh++) {
      memset(rk, 0, sizeof(double) * (size_t)T * D);
      memset(rv, 0, sizeof(double) * (size_t)T * D);
      size_t kvoff = (size_t)b * T * Hkv * D + (size_t)kh * D;
      for (int h = kh * g; h < (kh + 1) * g; h++) {
        size_t off = (size_t)b * T * H * D + (size_t)h * D;
        memset(rq, 0, sizeof(double) * (size_t)T * D);
        attn_bf16_ref(T, D, q + off, k + kvoff, v + kvoff, G + off, o + off, H * D, Hkv * D,
                      ro, rl, rq, rk, rv);
        for (int t = 0; t < T; t++) {
          double el = fabs(lse[((size_t)b * H + h) * T + t] - rl[t]);
          ck_assert_msg(el <= 1e-5 * (1 + fabs(rl[t])), "bf16 lse: err %.3g", el);
          for (int d = 0; d < D; d++) {
            size_t i = off + (size_t)t * H * D + d;
            double wo = ro[(size_t)t * D + d], wq = rq[(size_t)t * D + d];
            worst[0][0] = fmax(worst[0][0], fabs(o[i] - wo));
            worst[1][0] = fmax(worst[1][0], fabs(fo[i] - wo));
            worst[0][1] = fmax(worst[0][1], fabs(dq[i] - wq));
            worst[1][1] = fmax(worst[1][1], fabs(fdq[i] - wq));
            scale[0] = fmax(scale[0], fabs(wo));
            scale[1] = fmax(scale[1], fabs(wq));
          }
        }
      }
      for (int t = 0; t < T; t++)
        for (int d = 0; d < D; d++) {
          size_t i = kvoff + (size_t)t * Hkv * D + d;
          double wk = rk[(size_t)t * D + d], wv = rv[(size_t)t * D + d];
          worst[0][2] = fmax(worst[0][2], fabs(dk[i] - wk));
          worst[1][2] = fmax(worst[1][2], fabs(fdk[i] - wk));
          worst[0][3] = fmax(worst[0][3], fabs(dv[i] - wv));
          worst[1][3] = fmax(worst[1][3], fabs(fdv[i] - wv));
          scale[2] = fmax(scale[2], fabs(wk));
          scale[3] = fmax(scale[3], fabs(wv));
        }
    }
  static const char *names[] = {"o", "dq", "dk", "dv"};
  for (int w = 0; w < 4; w++) {
    double got = worst[0][w] / scale[w], fp32 = worst[1][w] / scale[w];
    fprintf(stderr, "# bf16 attention T%d D%d %s: %.2g of the largest (fp32 path %.2g)\n", T,
            D, names[w], got, fp32);
    ck_assert_msg(got <= 2e-4, "bf16 attention %s: off by %.3g of the largest", names[w], got);
    ck_assert_msg(fp32 > 4 * got, "bf16 attention %s: the fp32 path is as close (%.3g)",
                  names[w], fp32);
  }
  free(ro); free(rl); free(rq); free(rk); free(rv);
  free(fo); free(flse); free(fdq); free(fdk); free(fdv);
  free(qr); free(kr); free(vr); free(Gr);
  free(q); free(k); free(v); free(G); free(o); free(o3); free(lse); free(lse3);
  free(dq); free(dk); free(dv); free(dq3); free(dk3); free(dv3);
  mr_pool_free(p1);
  mr_pool_free(p3);
}

/* Under bf16 the products round every operand as bgemm.h packs it, P and
 * dS included, against the double reference rounding the same values;
 * 1 and 3 threads bitwise equal.  Without AVX512_BF16 it is refused. */
START_TEST(test_kernels_attention_bf16_products) {
  if (!mr_cpu_has_bf16_gemm()) {
    struct mr_pool *p = ref_pool(1);
    float x[64] = {0};
    struct mr_attn_shape s = {.B = 1, .T = 2, .H = 1, .Hkv = 1, .D = 4, .bf16 = true};
    ck_assert_int_eq(mr_cpu_attention_fwd(p, x, x, x, x, x, &s), MR_ENOTSUP);
    ck_assert_ptr_nonnull(strstr(mr_error_message(), "AVX512_BF16"));
    fprintf(stderr, "# no AVX512_BF16 here: bf16 attention is refused, as it must be\n");
    mr_pool_free(p);
    return;
  }
  check_attn_bf16(2, 70, 4, 2, 8);   /* a block of 64 queries + 6, GQA */
  check_attn_bf16(1, 131, 2, 1, 32); /* D 32: the half-panel kernel; odd T */
  check_attn_bf16(1, 67, 2, 2, 44);  /* D 44: 32 + 12 columns */
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
  tcase_add_test(tc, test_kernels_attention_portable_path);
  tcase_add_loop_test(tc, test_kernels_attention_avx2_and_openblas_products, 0, 2);
  tcase_add_test(tc, test_kernels_attention_wide_head_dim);
  tcase_add_test(tc, test_kernels_attention_bf16_products);
  tcase_add_test(tc, test_kernels_attention_sliding_window);
  tcase_add_test(tc, test_kernels_attention_bad_shape);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(kernels_attn_suite)
