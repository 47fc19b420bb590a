/* kernels.c - microbenchmark of the CPU backend's kernels at the shapes of
 * the LLaMA models this project trains.
 *
 *   bench_kernels [threads [repetitions]]   (default: MESHRUN_THREADS, else
 *                                            2; 7 repetitions)
 *
 * Prints, per matmul shape, GFLOP/s of our sgemm on the pool next
 * to OpenBLAS's own multi-threaded sgemm with the same thread count and
 * single-threaded OpenBLAS, all in the same run (best of several
 * repetitions, alternating); then attention forward/backward GFLOP/s and
 * the memory-bound kernels in GB/s beside memcpy of the same bytes. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/dtype.h"
#include "common/error.h"
#include "common/model_config.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/backend/cpu/sgemm.h"

static float *randf(size_t n) {
  float *x = aligned_alloc(64, (n * 4 + 63) / 64 * 64);
  if (!x) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  uint32_t s = 12345;
  for (size_t i = 0; i < n; i++) {
    s = s * 1664525u + 1013904223u;
    x[i] = (float)(s >> 8) / 16777216.0f - 0.5f;
  }
  return x;
}

static int REPS = 7; /* repetitions; the best is kept */

struct mm {
  const char *what;
  int M, N, K;
  bool ta, tb;
};

static double time_ours(struct mr_pool *pool, const struct mm *m, const float *A,
                        const float *B, float *C) {
  double t0 = mr_clock_s();
  int rc = mr_cpu_gemm(pool, m->ta, m->tb, m->M, m->N, m->K, 1.0f, A,
                       m->ta ? m->M : m->K, B, m->tb ? m->K : m->N, 0.0f, C, m->N);
  if (rc < 0) {
    fprintf(stderr, "gemm: %s\n", mr_error_message());
    exit(1);
  }
  return mr_clock_s() - t0;
}

static double time_blas(int threads, const struct mm *m, const float *A,
                        const float *B, float *C) {
  openblas_set_num_threads(threads);
  double t0 = mr_clock_s();
  cblas_sgemm(CblasRowMajor, m->ta ? CblasTrans : CblasNoTrans,
              m->tb ? CblasTrans : CblasNoTrans, m->M, m->N, m->K, 1.0f, A,
              m->ta ? m->M : m->K, B, m->tb ? m->K : m->N, 0.0f, C, m->N);
  double t = mr_clock_s() - t0;
  openblas_set_num_threads(1);
  return t;
}

/* After a multi-threaded call OpenBLAS's idle threads spin for 2^28
 * cycles (OPENBLAS_THREAD_TIMEOUT) before they sleep, about 70 ms here:
 * measured right after one, our pool shares the cores with them and runs
 * at one thread's speed.  Wait them out. */
static void blas_settle(void) {
  struct timespec ts = {0, 150 * 1000 * 1000};
  nanosleep(&ts, NULL);
}

static void bench_matmul(struct mr_pool *pool, int threads) {
  /* y = x W^T (forward), dx = dy W, dW = dy^T x; B*T = 2048 tokens */
  static const struct mm shapes[] = {
      {"h256 qkvo fwd   2048x256x256", 2048, 256, 256, 0, 1},
      {"h256 gate/up fwd 2048x688x256", 2048, 688, 256, 0, 1},
      {"h256 down fwd   2048x256x688", 2048, 256, 688, 0, 1},
      {"h256 down dx    2048x688x256", 2048, 688, 256, 0, 0},
      {"h256 qkvo dW    256x256x2048", 256, 256, 2048, 1, 0},
      {"h256 gate dW    688x256x2048", 688, 256, 2048, 1, 0},
      {"h256 down dW    256x688x2048", 256, 688, 2048, 1, 0},
      {"h512 qkvo fwd   2048x512x512", 2048, 512, 512, 0, 1},
      {"h512 gate fwd   2048x1376x512", 2048, 1376, 512, 0, 1},
      {"h512 down dW    512x1376x2048", 512, 1376, 2048, 1, 0},
      /* h256 split over 2 tensor-parallel ranks, the whole batch of 4096
       * tokens on each: a rank's GEMMs are as many FLOPs as dp2's above */
      {"h256/tp2 qkv fwd  4096x384x256", 4096, 384, 256, 0, 1},
      {"h256/tp2 o fwd    4096x256x128", 4096, 256, 128, 0, 1},
      {"h256/tp2 up fwd   4096x344x256", 4096, 344, 256, 0, 1},
      {"h256/tp2 down dx  4096x344x256", 4096, 344, 256, 0, 0},
      {"h256/tp2 qkv dW   384x256x4096", 384, 256, 4096, 1, 0},
      {"h256/tp2 down dW  256x344x4096", 256, 344, 4096, 1, 0},
  };
  printf("matmul GFLOP/s (best of %d)            ours(%dT)  openblas(%dT)  openblas(1T)  ours/openblas\n",
         REPS, threads, threads);
  double sum_ours = 0, sum_blas = 0;
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
    const struct mm *m = &shapes[i];
    size_t na = (size_t)m->M * m->K, nb = (size_t)m->K * m->N, nc = (size_t)m->M * m->N;
    float *A = randf(na), *B = randf(nb), *C = randf(nc);
    double to = 1e9, tb = 1e9, t1 = 1e9;
    time_ours(pool, m, A, B, C); /* warm up: pack buffers, page faults */
    time_blas(threads, m, A, B, C);
    blas_settle();
    /* each timed call follows an untimed one, so both pools' threads are
     * awake (as they are within a training step) */
    for (int r = 0; r < REPS; r++) {
      time_ours(pool, m, A, B, C);
      to = fmin(to, time_ours(pool, m, A, B, C));
      t1 = fmin(t1, time_blas(1, m, A, B, C));
      time_blas(threads, m, A, B, C);
      tb = fmin(tb, time_blas(threads, m, A, B, C));
      blas_settle();
    }
    double fl = 2.0 * m->M * m->N * m->K * 1e-9;
    sum_ours += to;
    sum_blas += tb;
    printf("  %-36s %9.1f  %13.1f  %12.1f  %12.2fx\n", m->what, fl / to, fl / tb,
           fl / t1, tb / to);
    free(A); free(B); free(C);
  }
  printf("  all shapes, total time                 ours %.2f ms, openblas(%dT) %.2f ms: %.2fx\n",
         sum_ours * 1e3, threads, sum_blas * 1e3, sum_blas / sum_ours);
}

/* Rounds through bf16 as the runtime does without the bf16 kernel
 * (worker/exec_extra.c's round_inputs). */
static void round_bf16(float *dst, const float *src, size_t n) {
  for (size_t i = 0; i < n; i++)
    dst[i] = mr_bf16_to_f32(mr_f32_to_bf16(src[i]));
}

/* The matmul of --amp bf16 three ways, the same run: the AVX512_BF16
 * kernel (operands rounded as they are packed), the path without it
 * (both operands rounded in a pass of their own, then the fp32 kernel),
 * and fp32 alone. */
static void bench_matmul_bf16(struct mr_pool *pool, int threads) {
  static const struct mm shapes[] = {
      {"h256 gate/up fwd 2048x688x256", 2048, 688, 256, 0, 1},
      {"h256 down dx    2048x688x256", 2048, 688, 256, 0, 0},
      {"h256 gate dW    688x256x2048", 688, 256, 2048, 1, 0},
      {"h512 qkvo fwd   2048x512x512", 2048, 512, 512, 0, 1},
      {"h512 gate fwd   2048x1376x512", 2048, 1376, 512, 0, 1},
      {"h512 down dW    512x1376x2048", 512, 1376, 2048, 1, 0},
  };
  if (!mr_cpu_has_bf16_gemm()) {
    printf("bf16 matmul: this CPU has no AVX512_BF16\n");
    return;
  }
  printf("bf16 matmul GFLOP/s (%dT, best of %d)   bf16 kernel  rounded+fp32  fp32   "
         "bf16/rounded  bf16/fp32\n", threads, REPS);
  double sb = 0, se = 0, sf = 0;
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
    const struct mm *m = &shapes[i];
    size_t na = (size_t)m->M * m->K, nb = (size_t)m->K * m->N, nc = (size_t)m->M * m->N;
    float *A = randf(na), *B = randf(nb), *C = randf(nc), *Ar = randf(na), *Br = randf(nb);
    double tbf = 1e9, tem = 1e9, tf = 1e9;
    for (int r = 0; r <= REPS; r++) {
      double t0 = mr_clock_s();
      if (mr_cpu_gemm_bf16(pool, m->ta, m->tb, m->M, m->N, m->K, 1.0f, A, m->ta ? m->M : m->K,
                           B, m->tb ? m->K : m->N, 0.0f, C, m->N) < 0) {
        fprintf(stderr, "bf16 gemm: %s\n", mr_error_message());
        exit(1);
      }
      double t1 = mr_clock_s();
      round_bf16(Ar, A, na);
      round_bf16(Br, B, nb);
      time_ours(pool, m, Ar, Br, C);
      double t2 = mr_clock_s();
      double t3 = time_ours(pool, m, A, B, C);
      if (r > 0) /* the first: pack buffers, page faults */
        tbf = fmin(tbf, t1 - t0), tem = fmin(tem, t2 - t1), tf = fmin(tf, t3);
    }
    double fl = 2.0 * m->M * m->N * m->K * 1e-9;
    sb += tbf, se += tem, sf += tf;
    printf("  %-36s %11.1f  %12.1f  %5.1f  %12.2fx  %9.2fx\n", m->what, fl / tbf, fl / tem,
           fl / tf, tem / tbf, tf / tbf);
    free(A); free(B); free(C); free(Ar); free(Br);
  }
  printf("  all shapes, total time                 bf16 %.2f ms, rounded+fp32 %.2f ms, fp32 "
         "%.2f ms: %.2fx, %.2fx\n", sb * 1e3, se * 1e3, sf * 1e3, se / sb, sf / sb);
}

static void bench_attention(struct mr_pool *pool, int B, int T, int H, int Hkv, int D,
                            bool bf16) {
  struct mr_attn_shape s = {.B = B, .T = T, .H = H, .Hkv = Hkv, .D = D, .bf16 = bf16};
  size_t nq = (size_t)B * T * H * D, nk = (size_t)B * T * Hkv * D;
  float *q = randf(nq), *k = randf(nk), *v = randf(nk), *o = randf(nq), *dout = randf(nq);
  float *dq = randf(nq), *dk = randf(nk), *dv = randf(nk);
  float *lse = randf((size_t)B * H * T);
  double tf = 1e9, tb = 1e9;
  for (int r = 0; r < REPS; r++) {
    double t0 = mr_clock_s();
    mr_cpu_attention_fwd(pool, o, lse, q, k, v, &s);
    double t1 = mr_clock_s();
    mr_cpu_attention_bwd(pool, dq, dk, dv, dout, q, k, v, o, lse, &s);
    double t2 = mr_clock_s();
    tf = fmin(tf, t1 - t0);
    tb = fmin(tb, t2 - t1);
  }
  /* causal pairs: T(T+1)/2 per (b, h); 2 products of 2D flops forward,
   * 5 backward */
  double pairs = (double)B * H * T * (T + 1) / 2;
  printf("  attention B%d T%d H%d Hkv%d D%d %s: forward %.1f GFLOP/s (%.2f ms), "
         "backward %.1f GFLOP/s (%.2f ms)\n", B, T, H, Hkv, D, bf16 ? "bf16" : "fp32",
         4.0 * D * pairs / tf * 1e-9, tf * 1e3, 10.0 * D * pairs / tb * 1e-9, tb * 1e3);
  free(q); free(k); free(v); free(o); free(dout); free(dq); free(dk); free(dv); free(lse);
}

struct stream_case {
  const char *what;
  double bytes; /* moved per call */
  double t;
};

static void bench_streaming(struct mr_pool *pool) {
  int N = 2048, C = 256, F = 688, V = 256;
  size_t nc = (size_t)N * C, nf = (size_t)N * F, nv = (size_t)N * V;
  float *x = randf(nf), *y = randf(nf), *z = randf(nf), *w = randf(C), *dw = randf(C);
  float *r = randf(N), *a = randf(nf), *b = randf(nf);
  int32_t *t = malloc(sizeof(int32_t) * N);
  for (int i = 0; i < N; i++)
    t[i] = (i * 7) % V;
  size_t np = 3300000; /* about the h256 model's parameter count */
  float *p = randf(np), *g = randf(np), *m = randf(np), *vv = randf(np);
  memset(m, 0, np * 4);
  memset(vv, 0, np * 4);
  struct mr_adamw h = mr_adamw_defaults();
  struct stream_case cs[] = {
      {"rmsnorm fwd  2048x256", 4.0 * 2 * nc, 1e9},
      {"rmsnorm bwd  2048x256", 4.0 * 5 * nc, 1e9},
      {"swiglu fwd   2048x688", 4.0 * 3 * nf, 1e9},
      {"swiglu bwd   2048x688", 4.0 * 5 * nf, 1e9},
      {"residual add 2048x256", 4.0 * 3 * nc, 1e9},
      {"xent fwd+bwd 2048x256", 4.0 * 3 * nv, 1e9},
      {"adamw        3.3M params", 4.0 * 7 * np, 1e9},
      {"memcpy       3.3M floats", 4.0 * 2 * np, 1e9},
  };
  double s;
  for (int rep = 0; rep < REPS; rep++) {
    double t0 = mr_clock_s();
    mr_cpu_rmsnorm_fwd(pool, y, r, x, w, N, C, 1e-6f);
    double t1 = mr_clock_s();
    mr_cpu_rmsnorm_bwd(pool, z, dw, y, x, w, r, N, C, false);
    double t2 = mr_clock_s();
    mr_cpu_swiglu_fwd(pool, z, x, y, nf);
    double t3 = mr_clock_s();
    mr_cpu_swiglu_bwd(pool, a, b, z, x, y, nf, false);
    double t4 = mr_clock_s();
    mr_cpu_add(pool, z, x, y, nc);
    double t5 = mr_clock_s();
    mr_cpu_xent_fwd(pool, a, r, x, t, N, V, NULL);
    mr_cpu_xent_bwd(pool, y, x, r, t, NULL, 1.0f / N, N, V);
    double t6 = mr_clock_s();
    mr_cpu_adamw_step(pool, p, g, m, vv, np, &h, rep + 1);
    double t7 = mr_clock_s();
    memcpy(m, g, np * 4);
    double t8 = mr_clock_s();
    double d[] = {t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6, t8 - t7};
    for (int i = 0; i < 8; i++)
      cs[i].t = fmin(cs[i].t, d[i]);
    (void)mr_cpu_sumsq(pool, &s, g, np);
  }
  printf("memory-bound kernels (bytes = operands read + written once)\n");
  for (int i = 0; i < 8; i++)
    printf("  %-26s %8.3f ms  %6.1f GB/s\n", cs[i].what, cs[i].t * 1e3,
           cs[i].bytes / cs[i].t * 1e-9);
  free(x); free(y); free(z); free(w); free(dw); free(r); free(a); free(b); free(t);
  free(p); free(g); free(m); free(vv);
}

/* Every kernel of one LLaMA training step (forward, backward, AdamW) at the
 * model's shapes, run back to back as the engine will, without the graph:
 * a floor for the engine's step time. */
struct llama {
  int L, C, F, H, Hkv, V, B, T;
};

#define CHECK(x)                                                             \
  do {                                                                       \
    if ((x) < 0) {                                                           \
      fprintf(stderr, "%s: %s\n", #x, mr_error_message());                  \
      exit(1);                                                               \
    }                                                                        \
  } while (0)

static void bench_llama_step(struct mr_pool *pool, const struct llama *m) {
  int N = m->B * m->T, C = m->C, F = m->F, D = C / m->H, KV = m->Hkv * D;
  size_t per_layer = (size_t)C * (C + 2 * KV + C) + 3 * (size_t)C * F + 2 * (size_t)C;
  size_t nparam = (size_t)m->L * per_layer + 2 * (size_t)m->V * C + C;
  float *P = randf(nparam), *G = randf(nparam), *M1 = calloc(nparam, 4), *M2 = calloc(nparam, 4);
  /* activations kept for the backward, per layer */
  size_t act = (size_t)N * (4 * C + 2 * KV + 3 * (size_t)F) + (size_t)N * 2;
  float *A = randf(act * (size_t)m->L), *x = randf((size_t)N * C), *dx = randf((size_t)N * C);
  float *t1 = randf((size_t)N * F), *t2 = randf((size_t)N * F), *t3 = randf((size_t)N * F);
  float *logits = randf((size_t)N * m->V), *loss = randf(N), *lse = randf(N);
  float *lse_a = randf((size_t)m->L * m->B * m->H * m->T);
  float *cs = randf((size_t)m->T * D / 2), *sn = randf((size_t)m->T * D / 2);
  int32_t *tok = malloc(sizeof(int32_t) * N);
  for (int i = 0; i < N; i++)
    tok[i] = (i * 31) % m->V;
  CHECK(mr_rope_table(&(struct mr_rope){.theta = 10000.0}, m->T, D, cs, sn));
  struct mr_attn_shape as = {.B = m->B, .T = m->T, .H = m->H, .Hkv = m->Hkv, .D = D};
  struct mr_adamw h = mr_adamw_defaults();
  double best = 1e9, t_attn = 0, t_mm = 0;
  for (int rep = 0; rep < (REPS + 1) / 2; rep++) {
    double t0 = mr_clock_s(), ta = 0, tm = 0, q0;
    float *emb = P + (size_t)m->L * per_layer, *head = emb + (size_t)m->V * C;
    CHECK(mr_cpu_embedding_fwd(pool, x, emb, tok, N, m->V, C));
    for (int l = 0; l < m->L; l++) {
      float *w = P + (size_t)l * per_layer, *wq = w, *wk = wq + (size_t)C * C,
            *wv = wk + (size_t)KV * C, *wo = wv + (size_t)KV * C,
            *wg = wo + (size_t)C * C, *wu = wg + (size_t)F * C, *wd = wu + (size_t)F * C,
            *n1 = wd + (size_t)C * F, *n2 = n1 + C;
      float *a = A + act * (size_t)l, *hn = a, *q = hn + (size_t)N * C, *k = q + (size_t)N * C,
            *v = k + (size_t)N * KV, *o = v + (size_t)N * KV, *h2 = o + (size_t)N * C,
            *g = h2 + (size_t)N * C, *u = g + (size_t)N * F, *sw = u + (size_t)N * F,
            *r1 = sw + (size_t)N * F, *r2 = r1 + N;
      CHECK(mr_cpu_rmsnorm_fwd(pool, hn, r1, x, n1, N, C, 1e-6f));
      q0 = mr_clock_s();
      CHECK(mr_cpu_linear_fwd(pool, q, hn, wq, NULL, N, C, C));
      CHECK(mr_cpu_linear_fwd(pool, k, hn, wk, NULL, N, KV, C));
      CHECK(mr_cpu_linear_fwd(pool, v, hn, wv, NULL, N, KV, C));
      tm += mr_clock_s() - q0;
      CHECK(mr_cpu_rope_fwd(pool, q, cs, sn, NULL, m->B, m->T, m->H, D, m->T, 0));
      CHECK(mr_cpu_rope_fwd(pool, k, cs, sn, NULL, m->B, m->T, m->Hkv, D, m->T, 0));
      q0 = mr_clock_s();
      CHECK(mr_cpu_attention_fwd(pool, o, lse_a + (size_t)l * m->B * m->H * m->T, q, k, v, &as));
      ta += mr_clock_s() - q0;
      q0 = mr_clock_s();
      CHECK(mr_cpu_linear_fwd(pool, t1, o, wo, NULL, N, C, C));
      tm += mr_clock_s() - q0;
      CHECK(mr_cpu_add(pool, x, x, t1, (size_t)N * C));
      CHECK(mr_cpu_rmsnorm_fwd(pool, h2, r2, x, n2, N, C, 1e-6f));
      q0 = mr_clock_s();
      CHECK(mr_cpu_linear_fwd(pool, g, h2, wg, NULL, N, F, C));
      CHECK(mr_cpu_linear_fwd(pool, u, h2, wu, NULL, N, F, C));
      tm += mr_clock_s() - q0;
      CHECK(mr_cpu_swiglu_fwd(pool, sw, g, u, (size_t)N * F));
      q0 = mr_clock_s();
      CHECK(mr_cpu_linear_fwd(pool, t1, sw, wd, NULL, N, C, F));
      tm += mr_clock_s() - q0;
      CHECK(mr_cpu_add(pool, x, x, t1, (size_t)N * C));
    }
    q0 = mr_clock_s();
    CHECK(mr_cpu_linear_fwd(pool, logits, x, head, NULL, N, m->V, C));
    tm += mr_clock_s() - q0;
    CHECK(mr_cpu_xent_fwd(pool, loss, lse, logits, tok, N, m->V, NULL));
    CHECK(mr_cpu_xent_bwd(pool, logits, logits, lse, tok, NULL, 1.0f / N, N, m->V));
    float *gemb = G + (size_t)m->L * per_layer, *ghead = gemb + (size_t)m->V * C;
    q0 = mr_clock_s();
    CHECK(mr_cpu_linear_bwd_w(pool, ghead, NULL, logits, x, N, m->V, C));
    CHECK(mr_cpu_linear_bwd_x(pool, dx, logits, head, N, m->V, C, false));
    tm += mr_clock_s() - q0;
    for (int l = m->L - 1; l >= 0; l--) {
      float *w = P + (size_t)l * per_layer, *gw = G + (size_t)l * per_layer;
      float *wq = w, *wk = wq + (size_t)C * C, *wv = wk + (size_t)KV * C, *wo = wv + (size_t)KV * C,
            *wg = wo + (size_t)C * C, *wu = wg + (size_t)F * C, *wd = wu + (size_t)F * C,
            *n1 = wd + (size_t)C * F, *n2 = n1 + C;
      float *gq = gw, *gk = gq + (size_t)C * C, *gv = gk + (size_t)KV * C, *go = gv + (size_t)KV * C,
            *gg = go + (size_t)C * C, *gu = gg + (size_t)F * C, *gd = gu + (size_t)F * C,
            *gn1 = gd + (size_t)C * F, *gn2 = gn1 + C;
      float *a = A + act * (size_t)l, *hn = a, *q = hn + (size_t)N * C, *k = q + (size_t)N * C,
            *v = k + (size_t)N * KV, *o = v + (size_t)N * KV, *h2 = o + (size_t)N * C,
            *g = h2 + (size_t)N * C, *u = g + (size_t)N * F, *sw = u + (size_t)N * F,
            *r1 = sw + (size_t)N * F, *r2 = r1 + N;
      /* MLP */
      q0 = mr_clock_s();
      CHECK(mr_cpu_linear_bwd_w(pool, gd, NULL, dx, sw, N, C, F));
      CHECK(mr_cpu_linear_bwd_x(pool, t1, dx, wd, N, C, F, false));
      tm += mr_clock_s() - q0;
      CHECK(mr_cpu_swiglu_bwd(pool, t2, t3, t1, g, u, (size_t)N * F, false));
      q0 = mr_clock_s();
      CHECK(mr_cpu_linear_bwd_w(pool, gg, NULL, t2, h2, N, F, C));
      CHECK(mr_cpu_linear_bwd_w(pool, gu, NULL, t3, h2, N, F, C));
      CHECK(mr_cpu_linear_bwd_x(pool, t1, t2, wg, N, F, C, false));
      CHECK(mr_cpu_linear_bwd_x(pool, t1, t3, wu, N, F, C, true));
      tm += mr_clock_s() - q0;
      CHECK(mr_cpu_rmsnorm_bwd(pool, dx, gn2, t1, x, n2, r2, N, C, true));
      /* attention */
      q0 = mr_clock_s();
      CHECK(mr_cpu_linear_bwd_w(pool, go, NULL, dx, o, N, C, C));
      CHECK(mr_cpu_linear_bwd_x(pool, t1, dx, wo, N, C, C, false));
      tm += mr_clock_s() - q0;
      float *dq = t2, *dk = t3, *dv = t3 + (size_t)N * KV;
      q0 = mr_clock_s();
      CHECK(mr_cpu_attention_bwd(pool, dq, dk, dv, t1, q, k, v, o,
                                 lse_a + (size_t)l * m->B * m->H * m->T, &as));
      ta += mr_clock_s() - q0;
      CHECK(mr_cpu_rope_bwd(pool, dq, cs, sn, NULL, m->B, m->T, m->H, D, m->T, 0));
      CHECK(mr_cpu_rope_bwd(pool, dk, cs, sn, NULL, m->B, m->T, m->Hkv, D, m->T, 0));
      q0 = mr_clock_s();
      CHECK(mr_cpu_linear_bwd_w(pool, gq, NULL, dq, hn, N, C, C));
      CHECK(mr_cpu_linear_bwd_w(pool, gk, NULL, dk, hn, N, KV, C));
      CHECK(mr_cpu_linear_bwd_w(pool, gv, NULL, dv, hn, N, KV, C));
      CHECK(mr_cpu_linear_bwd_x(pool, t1, dq, wq, N, C, C, false));
      CHECK(mr_cpu_linear_bwd_x(pool, t1, dk, wk, N, KV, C, true));
      CHECK(mr_cpu_linear_bwd_x(pool, t1, dv, wv, N, KV, C, true));
      tm += mr_clock_s() - q0;
      CHECK(mr_cpu_rmsnorm_bwd(pool, dx, gn1, t1, x, n1, r1, N, C, true));
    }
    CHECK(mr_cpu_embedding_bwd(pool, gemb, dx, tok, N, m->V, C));
    double ss;
    CHECK(mr_cpu_sumsq(pool, &ss, G, nparam));
    CHECK(mr_cpu_adamw_step(pool, P, G, M1, M2, nparam, &h, rep + 1));
    double t = mr_clock_s() - t0;
    if (t < best) {
      best = t;
      t_attn = ta;
      t_mm = tm;
    }
  }
  double tokens = (double)N;
  double mm_flops = 6.0 * tokens * ((double)m->L * (per_layer - 2 * C) + (double)m->V * C);
  double attn_flops = (double)m->L * 14.0 * D * m->B * m->H * (double)m->T * (m->T + 1) / 2;
  printf("  LLaMA L%d C%d F%d H%d Hkv%d V%d, batch %dx%d: step %.1f ms (matmuls %.1f, "
         "attention %.1f, rest %.1f) = %.0f tokens/s, %.1f GFLOP/s\n",
         m->L, C, F, m->H, m->Hkv, m->V, m->B, m->T, best * 1e3, t_mm * 1e3, t_attn * 1e3,
         (best - t_mm - t_attn) * 1e3, tokens / best, (mm_flops + attn_flops) / best * 1e-9);
  free(P); free(G); free(M1); free(M2); free(A); free(x); free(dx); free(t1); free(t2);
  free(t3); free(logits); free(loss); free(lse); free(lse_a); free(cs); free(sn); free(tok);
}

static int nop_task(void *arg, int task, int thread) {
  ((volatile int *)arg)[thread & 1] += task;
  return 0;
}

/* Cost of handing one job to the pool and waiting for it. */
static void bench_pool(struct mr_pool *pool) {
  int sink[2] = {0, 0};
  enum { JOBS = 20000 };
  double best = 1e9;
  for (int rep = 0; rep < 3; rep++) {
    double t0 = mr_clock_s();
    for (int i = 0; i < JOBS; i++)
      mr_pool_run(pool, mr_pool_threads(pool), nop_task, sink);
    best = fmin(best, (mr_clock_s() - t0) / JOBS);
  }
  printf("pool: one job of %d empty tasks, dispatch + join: %.2f us\n",
         mr_pool_threads(pool), best * 1e6);
}

int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 0;
  if (threads <= 0) {
    const char *e = getenv("MESHRUN_THREADS");
    threads = e ? atoi(e) : 2;
  }
  if (threads <= 0)
    threads = 2;
  if (argc > 2 && atoi(argv[2]) > 0)
    REPS = atoi(argv[2]);
  struct mr_pool *pool = NULL;
  if (mr_pool_new(threads, &pool) < 0) {
    fprintf(stderr, "pool: %s\n", mr_error_message());
    return 1;
  }
  printf("threads: %d; matmul: %s\n", threads,
         !mr__sgemm_own()       ? "single-threaded OpenBLAS per block of rows"
         : mr__cpu_has_avx512() ? "own AVX-512 sgemm, rectangles of C over the pool"
                                : "own AVX2 sgemm, rectangles of C over the pool");
  bench_pool(pool);
  bench_matmul(pool, threads);
  bench_matmul_bf16(pool, threads);
  printf("attention (causal; FLOPs: 4*D per query-key pair forward, 10*D backward)\n");
  for (int bf16 = 0; bf16 <= mr_cpu_has_bf16_gemm(); bf16++) {
    bench_attention(pool, 8, 256, 8, 8, 32, bf16);
    bench_attention(pool, 8, 256, 8, 2, 32, bf16);
    bench_attention(pool, 4, 256, 8, 8, 64, bf16);
  }
  bench_streaming(pool);
  printf("one training step's kernels, back to back (best of %d)\n", (REPS + 1) / 2);
  bench_llama_step(pool, &(struct llama){4, 256, 688, 8, 8, 256, 8, 256});
  bench_llama_step(pool, &(struct llama){8, 512, 1376, 8, 8, 256, 8, 256});
  mr_pool_free(pool);
  return 0;
}
