/* test_gpu_kernels.c - every op's CUDA kernel against the CPU backend's, on
 * the same random inputs, at several shapes including odd ones: float32
 * within 1e-5 of the largest reference value, bf16 / fp16 amp within 1e-2.
 * Output buffers start with the same garbage on both sides, so a kernel
 * that accumulates where the CPU overwrites (or the reverse) fails.  Skips
 * (77) where there is no GPU. */
#include "check_main.h"
#include "test_gpu_common.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/error.h"
#include "compiler/graph.h"
#include "compiler/ops.h"
#include "common/tunable.h"
#include "worker/backend/backend.h"
#include "worker/device.h"
#include "worker/exec_extra.h"

static uint64_t rng = 0x243f6a8885a308d3ull;

static double uniform(void) { /* splitmix64 -> [-1, 1) */
  uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (double)(z >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

static float *randf(int64_t n, double scale) {
  float *x = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
  ck_assert_ptr_nonnull(x);
  for (int64_t i = 0; i < n; i++)
    x[i] = (float)(uniform() * scale);
  return x;
}

/* ids in [lo, hi); every `ignore`-th one -100 when ignore > 0 */
static int32_t *randi(int64_t n, int64_t lo, int64_t hi, int ignore) {
  int32_t *x = malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
  ck_assert_ptr_nonnull(x);
  for (int64_t i = 0; i < n; i++) {
    double u = (uniform() + 1.0) / 2.0;
    x[i] = (int32_t)(lo + (int64_t)(u * (double)(hi - lo)));
    if (x[i] >= hi)
      x[i] = (int32_t)(hi - 1);
    if (ignore > 0 && i % ignore == 1)
      x[i] = -100;
  }
  return x;
}

static int input(struct mr_graph *g, const char *name, enum mr_dtype dt, int ndim,
                 int64_t a, int64_t b) {
  int64_t shape[2] = {a, b};
  int id = mr_graph_tensor(g, name, dt, MR_ROLE_INPUT, ndim, shape);
  ck_assert_msg(id >= 0, "tensor %s: %s", name, mr_error_message());
  return id;
}

static int op(struct mr_graph *g, int kind, const int *in, int n, const double *attr) {
  int id = mr_graph_op(g, kind, "out", in, n, attr, NULL);
  ck_assert_msg(id >= 0, "op %s: %s", mr_op_def(kind)->name, mr_error_message());
  return id;
}

static size_t tbytes(const struct mr_graph *g, int id) {
  return (size_t)mr_tensor_bytes(&g->tensors[id]);
}

/* Set: the ops checked add into every output their definition allows
 * (accum_out), starting from the same garbage on both sides. */
static int adding;

/* Runs op op_id of g on the CPU (amp as given) and on the GPU from the
 * host inputs in[], and compares every float output.  When cpu_out is not
 * NULL the CPU's outputs are left there (malloc'd) for a later op. */
static void check_op(struct mr_graph *g, int op_id, void *const *in, int amp,
                     double tol, const char *what, void **cpu_out) {
  g->ops[op_id].accum_out = adding ? mr_op_def(g->ops[op_id].kind)->accum_outs : 0;
  const struct mr_op *o = &g->ops[op_id];
  int nb = o->n_in + o->n_out;
  void *hb[MR_OP_MAX_IN + MR_OP_MAX_OUT] = {0};
  void *db[MR_OP_MAX_IN + MR_OP_MAX_OUT] = {0};
  float *garbage[MR_OP_MAX_OUT] = {0};
  struct mr_backend *be = NULL;
  int rc = mr_device_open("cuda", 0, 0, amp, &be);
  ck_assert_msg(rc == 0, "%s: cuda backend: %s", what, mr_error_message());
  for (int i = 0; i < o->n_in; i++) {
    if (o->in[i] < 0)
      continue;
    size_t bytes = tbytes(g, o->in[i]);
    hb[i] = in[i];
    ck_assert_int_eq(be->ops->alloc(be, bytes, &db[i]), 0);
    ck_assert_int_eq(be->ops->copy(be, NULL, db[i], in[i], bytes, MR_COPY_HOST_TO_DEVICE), 0);
  }
  for (int j = 0; j < o->n_out; j++) {
    int t = o->out[j];
    int64_t n = mr_tensor_numel(&g->tensors[t]);
    garbage[j] = randf(n, 3.0);
    hb[o->n_in + j] = malloc(tbytes(g, t) ? tbytes(g, t) : 4);
    memcpy(hb[o->n_in + j], garbage[j], tbytes(g, t));
    ck_assert_int_eq(be->ops->alloc(be, tbytes(g, t), &db[o->n_in + j]), 0);
    ck_assert_int_eq(be->ops->copy(be, NULL, db[o->n_in + j], garbage[j], tbytes(g, t),
                                   MR_COPY_HOST_TO_DEVICE), 0);
  }
  struct mr_cpu_ctx cpu;
  ck_assert_int_eq(mr_cpu_ctx_init(&cpu, 2, (enum mr_amp_mode)amp), 0);
  mr_cpu_kernels_register();
  mr_kernel_fn kc = mr_op_kernel(o->kind, MR_BACKEND_CPU);
  mr_kernel_fn kg = mr_op_kernel(o->kind, MR_BACKEND_CUDA);
  ck_assert(kc != NULL);
  ck_assert_msg(kg != NULL, "%s: no CUDA kernel for %s", what, mr_op_def(o->kind)->name);
  rc = kc(&cpu, g, o, hb);
  ck_assert_msg(rc == 0, "%s: cpu: %s", what, mr_error_message());
  rc = kg(be->ops->kernel_ctx(be), g, o, db);
  ck_assert_msg(rc == 0, "%s: cuda: %s", what, mr_error_message());
  rc = be->ops->synchronize(be, NULL);
  ck_assert_msg(rc == 0, "%s: cuda synchronize: %s", what, mr_error_message());
  for (int j = 0; j < o->n_out; j++) {
    int t = o->out[j];
    int64_t n = mr_tensor_numel(&g->tensors[t]);
    float *got = malloc(tbytes(g, t) ? tbytes(g, t) : 4);
    ck_assert_int_eq(be->ops->copy(be, NULL, got, db[o->n_in + j], tbytes(g, t),
                                   MR_COPY_DEVICE_TO_HOST), 0);
    const float *want = hb[o->n_in + j];
    double scale = 0, worst = 0;
    int64_t at = -1;
    for (int64_t i = 0; i < n; i++)
      if (isfinite(want[i]) && fabs(want[i]) > scale)
        scale = fabs(want[i]);
    for (int64_t i = 0; i < n; i++) {
      if (isnan(want[i]) || isnan(got[i])) {
        ck_assert_msg(isnan(want[i]) && isnan(got[i]),
                      "%s: output %d [%lld]: cpu %g, cuda %g", what, j, (long long)i,
                      (double)want[i], (double)got[i]);
        continue;
      }
      if (isinf(want[i]) || isinf(got[i])) {
        ck_assert_msg(want[i] == got[i], "%s: output %d [%lld]: cpu %g, cuda %g", what,
                      j, (long long)i, (double)want[i], (double)got[i]);
        continue;
      }
      double d = fabs((double)want[i] - (double)got[i]);
      if (d > worst) {
        worst = d;
        at = i;
      }
    }
    /* relative to the output's largest value, but never to less than 0.01:
     * an output that should be zero (a T=1 attention's dq) holds rounding
     * noise on both sides */
    ck_assert_msg(worst <= tol * (scale > 1e-2 ? scale : 1e-2),
                  "%s: output %d (%s) differs: at [%lld] cpu %.9g cuda %.9g (|diff| "
                  "%.3g, %.3g of the largest |value| %.4g; tolerance %g)", what, j,
                  g->tensors[t].name, (long long)at, (double)want[at], (double)got[at],
                  worst, worst / (scale > 0 ? scale : 1), scale, tol);
    free(got);
    if (cpu_out != NULL)
      cpu_out[j] = hb[o->n_in + j];
    else
      free(hb[o->n_in + j]);
    free(garbage[j]);
  }
  for (int i = 0; i < nb; i++)
    be->ops->free(be, db[i]);
  mr_cpu_ctx_close(&cpu);
  mr_backend_free(be);
}

#define FP32_TOL 1e-5
#define AMP_TOL 1e-2

/* ---- matmul ---- */

static void matmul_case(int64_t m, int64_t n, int64_t k, int ta, int tb, int bias,
                        int amp) {
  struct mr_graph g;
  mr_graph_init(&g);
  int a = ta ? input(&g, "a", MR_F32, 2, k, m) : input(&g, "a", MR_F32, 2, m, k);
  int b = tb ? input(&g, "b", MR_F32, 2, n, k) : input(&g, "b", MR_F32, 2, k, n);
  int ins[3] = {a, b, bias ? input(&g, "bias", MR_F32, 1, n, 0) : -1};
  double attr[MR_OP_MAX_ATTR] = {ta, tb};
  int id = op(&g, MR_OP_MATMUL, ins, bias ? 3 : 2, attr);
  void *in[3] = {randf(m * k, 1), randf(k * n, 1), bias ? randf(n, 1) : NULL};
  char what[128];
  snprintf(what, sizeof what, "matmul %lldx%lldx%lld ta=%d tb=%d bias=%d amp=%d",
           (long long)m, (long long)n, (long long)k, ta, tb, bias, amp);
  check_op(&g, id, in, amp, amp ? AMP_TOL : FP32_TOL, what, NULL);
  for (int i = 0; i < 3; i++)
    free(in[i]);
  mr_graph_close(&g);
}

static const int64_t mm_shapes[][3] = {
    {1, 1, 1}, {37, 29, 53}, {128, 256, 64}, {300, 130, 517}, {8, 1000, 3}};

START_TEST(test_gpu_matmul_fp32_every_transpose) {
  for (size_t s = 0; s < MR_ARRAY_LEN(mm_shapes); s++)
    for (int t = 0; t < 4; t++)
      matmul_case(mm_shapes[s][0], mm_shapes[s][1], mm_shapes[s][2], t & 1, t >> 1,
                  s % 2, 0);
}
END_TEST

START_TEST(test_gpu_matmul_bf16_and_fp16_operands) {
  for (int amp = 1; amp <= 2; amp++)
    for (size_t s = 0; s < MR_ARRAY_LEN(mm_shapes); s++)
      matmul_case(mm_shapes[s][0], mm_shapes[s][1], mm_shapes[s][2], (int)s & 1,
                  ((int)s >> 1) & 1, 1, amp);
}
END_TEST

/* ---- embedding ---- */

static void embedding_case(int64_t n, int64_t v, int64_t c, int64_t lo, int64_t all) {
  struct mr_graph g;
  mr_graph_init(&g);
  int ids = input(&g, "ids", MR_I32, 1, n, 0);
  int tab = input(&g, "table", MR_F32, 2, v, c);
  double attr[MR_OP_MAX_ATTR] = {(double)lo, (double)all};
  int ins[2] = {ids, tab};
  int id = op(&g, MR_OP_EMBEDDING, ins, 2, attr);
  /* a small id range, so tokens repeat (the backward sums them in order) */
  int64_t hi = all > 0 ? all : v;
  void *in[2] = {randi(n, 0, hi < 40 ? hi : 40, 0), randf(v * c, 1)};
  check_op(&g, id, in, 0, 0.0, "embedding", NULL);
  int dout = input(&g, "dout", MR_F32, 2, n, c);
  double battr[MR_OP_MAX_ATTR] = {(double)v, (double)lo, (double)all};
  int bins[2] = {ids, dout};
  int bid = op(&g, MR_OP_EMBEDDING_BWD, bins, 2, battr);
  void *bin[2] = {in[0], randf(n * c, 1)};
  check_op(&g, bid, bin, 0, FP32_TOL, "embedding_bwd", NULL);
  free(in[0]);
  free(in[1]);
  free(bin[1]);
  mr_graph_close(&g);
}

START_TEST(test_gpu_embedding_and_its_gradient) {
  embedding_case(37, 101, 67, 0, 0);
  embedding_case(1000, 64, 130, 0, 0);
  embedding_case(1, 1, 1, 0, 0);
  /* a vocabulary shard: rows [20, 40) of 60 */
  embedding_case(77, 20, 33, 20, 60);
}
END_TEST

/* ---- elementwise ---- */

static void unary_pair(int fwd, int bwd, int64_t n) {
  struct mr_graph g;
  mr_graph_init(&g);
  int x = input(&g, "x", MR_F32, 2, n, 1);
  int fid = op(&g, fwd, &x, 1, NULL);
  void *in[1] = {randf(n, 4)};
  check_op(&g, fid, in, 0, FP32_TOL, mr_op_def(fwd)->name, NULL);
  int dy = input(&g, "dy", MR_F32, 2, n, 1);
  int bins[2] = {dy, x};
  int bid = op(&g, bwd, bins, 2, NULL);
  void *bin[2] = {randf(n, 1), in[0]};
  check_op(&g, bid, bin, 0, FP32_TOL, mr_op_def(bwd)->name, NULL);
  free(in[0]);
  free(bin[0]);
  mr_graph_close(&g);
}

START_TEST(test_gpu_elementwise_ops) {
  int64_t sizes[] = {1, 1001, 70001};
  for (size_t s = 0; s < MR_ARRAY_LEN(sizes); s++) {
    int64_t n = sizes[s];
    struct mr_graph g;
    mr_graph_init(&g);
    int a = input(&g, "a", MR_F32, 2, n, 1), b = input(&g, "b", MR_F32, 2, n, 1);
    int ab[2] = {a, b};
    int add = op(&g, MR_OP_ADD, ab, 2, NULL);
    int sw = op(&g, MR_OP_SWIGLU, ab, 2, NULL);
    int dy = input(&g, "dy", MR_F32, 2, n, 1);
    int sb[3] = {dy, a, b};
    int swb = op(&g, MR_OP_SWIGLU_BWD, sb, 3, NULL);
    void *in[3] = {randf(n, 4), randf(n, 4), randf(n, 1)};
    check_op(&g, add, in, 0, FP32_TOL, "add", NULL);
    check_op(&g, sw, in, 0, FP32_TOL, "swiglu", NULL);
    void *bin[3] = {in[2], in[0], in[1]};
    check_op(&g, swb, bin, 0, FP32_TOL, "swiglu_bwd", NULL);
    for (int i = 0; i < 3; i++)
      free(in[i]);
    mr_graph_close(&g);
    unary_pair(MR_OP_GELU, MR_OP_GELU_BWD, n);
  }
}
END_TEST

/* ---- normalization, bias gradient ---- */

static void norm_case(int64_t n, int64_t c) {
  struct mr_graph g;
  mr_graph_init(&g);
  int x = input(&g, "x", MR_F32, 2, n, c), w = input(&g, "w", MR_F32, 1, c, 0);
  int b = input(&g, "b", MR_F32, 1, c, 0), dy = input(&g, "dy", MR_F32, 2, n, c);
  double eps[MR_OP_MAX_ATTR] = {1e-5};
  void *hx = randf(n * c, 2), *hw = randf(c, 1), *hb = randf(c, 1), *hdy = randf(n * c, 1);
  char what[96];

  int xw[2] = {x, w};
  int rms = op(&g, MR_OP_RMSNORM, xw, 2, eps);
  void *rin[2] = {hx, hw}, *rout[2] = {0};
  snprintf(what, sizeof what, "rmsnorm %lldx%lld", (long long)n, (long long)c);
  check_op(&g, rms, rin, 0, FP32_TOL, what, rout);
  int rstd = g.ops[rms].out[1];
  int rb[4] = {dy, x, w, rstd};
  int rmsb = op(&g, MR_OP_RMSNORM_BWD, rb, 4, eps);
  void *rbin[4] = {hdy, hx, hw, rout[1]};
  snprintf(what, sizeof what, "rmsnorm_bwd %lldx%lld", (long long)n, (long long)c);
  check_op(&g, rmsb, rbin, 0, FP32_TOL, what, NULL);

  int xwb[3] = {x, w, b};
  int ln = op(&g, MR_OP_LAYERNORM, xwb, 3, eps);
  void *lin[3] = {hx, hw, hb}, *lout[3] = {0};
  snprintf(what, sizeof what, "layernorm %lldx%lld", (long long)n, (long long)c);
  check_op(&g, ln, lin, 0, FP32_TOL, what, lout);
  int lb[5] = {dy, x, w, g.ops[ln].out[1], g.ops[ln].out[2]};
  int lnb = op(&g, MR_OP_LAYERNORM_BWD, lb, 5, eps);
  void *lbin[5] = {hdy, hx, hw, lout[1], lout[2]};
  snprintf(what, sizeof what, "layernorm_bwd %lldx%lld", (long long)n, (long long)c);
  check_op(&g, lnb, lbin, 0, FP32_TOL, what, NULL);

  int bg = op(&g, MR_OP_BIAS_GRAD, &dy, 1, NULL);
  void *bgin[1] = {hdy};
  snprintf(what, sizeof what, "bias_grad %lldx%lld", (long long)n, (long long)c);
  check_op(&g, bg, bgin, 0, FP32_TOL, what, NULL);
  for (int i = 0; i < 2; i++)
    free(rout[i]);
  for (int i = 0; i < 3; i++)
    free(lout[i]);
  free(hx);
  free(hw);
  free(hb);
  free(hdy);
  mr_graph_close(&g);
}

START_TEST(test_gpu_norms_and_bias_grad) {
  norm_case(3, 7);
  norm_case(37, 67);
  norm_case(300, 1030);
  norm_case(700, 33);
}
END_TEST

/* A parameter's gradient over several micro-batches: the op adds into its
 * accumulator (the GEMM with beta 1, the column sums, the embedding's rows)
 * as the CPU's does. */
START_TEST(test_gpu_parameter_gradients_add_into_their_buffers) {
  adding = 1;
  for (size_t s = 0; s < MR_ARRAY_LEN(mm_shapes); s++)
    for (int t = 0; t < 4; t++)
      matmul_case(mm_shapes[s][0], mm_shapes[s][1], mm_shapes[s][2], t & 1, t >> 1, 0,
                  t == 1);
  embedding_case(37, 101, 67, 0, 0);
  embedding_case(77, 20, 33, 20, 60);
  norm_case(37, 67);
  norm_case(300, 1030);
  adding = 0;
}
END_TEST

/* ---- RoPE ---- */

START_TEST(test_gpu_rope_forward_and_inverse) {
  const int cases[][4] = {{7, 3, 10, 2}, {64, 4, 64, 3}, {1, 1, 2, 1}};
  for (size_t k = 0; k < MR_ARRAY_LEN(cases); k++) {
    int t = cases[k][0], h = cases[k][1], d = cases[k][2], batch = cases[k][3];
    for (int dir = -1; dir <= 1; dir += 2) {
      struct mr_graph g;
      mr_graph_init(&g);
      int x = input(&g, "x", MR_F32, 2, (int64_t)batch * t, (int64_t)h * d);
      double attr[MR_OP_MAX_ATTR] = {t, h, k == 1 ? 500000.0 : 10000.0, dir};
      int id = op(&g, MR_OP_ROPE, &x, 1, attr);
      void *in[1] = {randf((int64_t)batch * t * h * d, 2)};
      check_op(&g, id, in, 0, FP32_TOL, dir > 0 ? "rope" : "rope (inverse)", NULL);
      free(in[0]);
      mr_graph_close(&g);
    }
  }
}
END_TEST

/* ---- attention ---- */

/* tol: the largest difference from the CPU backend allowed, relative to
 * the output's largest value */
static void attention_case_tol(int b, int t, int h, int kh, int d, int amp, double tol) {
  struct mr_graph g;
  mr_graph_init(&g);
  int64_t rows = (int64_t)b * t;
  int q = input(&g, "q", MR_F32, 2, rows, (int64_t)h * d);
  int k = input(&g, "k", MR_F32, 2, rows, (int64_t)kh * d);
  int v = input(&g, "v", MR_F32, 2, rows, (int64_t)kh * d);
  double attr[MR_OP_MAX_ATTR] = {t, h, kh};
  int qkv[3] = {q, k, v};
  int fwd = op(&g, MR_OP_ATTENTION, qkv, 3, attr);
  void *in[3] = {randf(rows * h * d, 2), randf(rows * kh * d, 2), randf(rows * kh * d, 1)};
  void *out[2] = {0};
  char what[128];
  snprintf(what, sizeof what, "attention B=%d T=%d H=%d KH=%d D=%d amp=%d (%s)", b, t, h,
           kh, d, amp, mr_tunable_str(MR_TUNABLE_CUDA_ATTENTION));
  check_op(&g, fwd, in, amp, tol, what, out);
  if (t == 1) { /* a single key: every gradient but dv is rounding noise */
    for (int i = 0; i < 3; i++)
      free(in[i]);
    free(out[0]);
    free(out[1]);
    mr_graph_close(&g);
    return;
  }
  int dout = input(&g, "do", MR_F32, 2, rows, (int64_t)h * d);
  int bins[6] = {dout, q, k, v, g.ops[fwd].out[0], g.ops[fwd].out[1]};
  int bwd = op(&g, MR_OP_ATTENTION_BWD, bins, 6, attr);
  void *bin[6] = {randf(rows * h * d, 1), in[0], in[1], in[2], out[0], out[1]};
  snprintf(what, sizeof what, "attention_bwd B=%d T=%d H=%d KH=%d D=%d amp=%d (%s)", b, t,
           h, kh, d, amp, mr_tunable_str(MR_TUNABLE_CUDA_ATTENTION));
  check_op(&g, bwd, bin, amp, tol, what, NULL);
  for (int i = 0; i < 3; i++)
    free(in[i]);
  free(out[0]);
  free(out[1]);
  free(bin[0]);
  mr_graph_close(&g);
}

static void attention_case(int b, int t, int h, int kh, int d, int amp) {
  attention_case_tol(b, t, h, kh, d, amp, amp ? AMP_TOL : FP32_TOL);
}

START_TEST(test_gpu_attention_fp32_gqa_odd_lengths) {
  attention_case(1, 1, 1, 1, 8, 0);
  attention_case(2, 37, 4, 2, 16, 0);
  attention_case(1, 64, 2, 2, 64, 0);
  attention_case(2, 100, 8, 2, 128, 0);
  attention_case(1, 45, 3, 1, 10, 0);
  attention_case(1, 40, 2, 1, 256, 0);
}
END_TEST

START_TEST(test_gpu_attention_bf16_and_fp16) {
  mr_tunable_override(MR_TUNABLE_CUDA_ATTENTION, "cores");
  attention_case(2, 37, 4, 2, 16, 1);
  attention_case(1, 130, 8, 2, 64, 1);
  attention_case(1, 70, 4, 4, 64, 2);
  mr_tunable_override(MR_TUNABLE_CUDA_ATTENTION, "auto");
}
END_TEST

/* bf16 on the tensor cores (kernels_attn_tc.cu): q, k, v and dout are exact
 * in bf16 and P and dS enter as hi + lo parts, so the results stay within
 * 1e-3 of the CPU's fp32 arithmetic on the rounded operands (P rounded to
 * bf16 once would be off by up to 2^-9 of each weight).  Head dims 16 to
 * 128, grouped and plain heads, lengths that end inside a 64-row tile and
 * span several. */
START_TEST(test_gpu_attention_bf16_tensor_cores) {
  mr_tunable_override(MR_TUNABLE_CUDA_ATTENTION, "auto");
  attention_case_tol(2, 37, 4, 2, 16, 1, 1e-3);
  attention_case_tol(1, 130, 8, 2, 64, 1, 1e-3);
  attention_case_tol(2, 100, 4, 4, 128, 1, 1e-3);
  attention_case_tol(1, 70, 6, 3, 48, 1, 1e-3);
  attention_case_tol(1, 256, 2, 1, 32, 1, 1e-3);
  attention_case_tol(1, 1, 2, 1, 64, 1, 1e-3);
}
END_TEST

START_TEST(test_gpu_attention_kernel_choice_is_checked) {
  struct mr_graph g;
  mr_graph_init(&g);
  int q = input(&g, "q", MR_F32, 2, 8, 64);
  int k = input(&g, "k", MR_F32, 2, 8, 64);
  int v = input(&g, "v", MR_F32, 2, 8, 64);
  double attr[MR_OP_MAX_ATTR] = {8, 1, 1};
  int qkv[3] = {q, k, v};
  int fwd = op(&g, MR_OP_ATTENTION, qkv, 3, attr);
  mr_tunable_override(MR_TUNABLE_CUDA_ATTENTION, "fast");
  struct mr_backend *be = NULL;
  ck_assert_int_eq(mr_device_open("cuda", 0, 0, 1, &be), 0);
  void *buf[5] = {0};
  for (int i = 0; i < 5; i++) {
    int t = i < 3 ? qkv[i] : g.ops[fwd].out[i - 3];
    ck_assert_int_eq(be->ops->alloc(be, tbytes(&g, t), &buf[i]), 0);
  }
  mr_kernel_fn kg = mr_op_kernel(MR_OP_ATTENTION, MR_BACKEND_CUDA);
  ck_assert(kg != NULL);
  int rc = kg(be->ops->kernel_ctx(be), &g, &g.ops[fwd], buf);
  mr_tunable_override(MR_TUNABLE_CUDA_ATTENTION, "auto");
  ck_assert_int_lt(rc, 0);
  ck_assert_msg(strstr(mr_error_message(), "MESHRUN_CUDA_ATTENTION=fast") != NULL, "%s",
                mr_error_message());
  for (int i = 0; i < 5; i++)
    be->ops->free(be, buf[i]);
  mr_backend_free(be);
  mr_graph_close(&g);
}
END_TEST

/* ---- split3 / concat3 ---- */

START_TEST(test_gpu_split3_concat3) {
  struct mr_graph g;
  mr_graph_init(&g);
  int x = input(&g, "x", MR_F32, 2, 37, 57);
  int sp = op(&g, MR_OP_SPLIT3, &x, 1, NULL);
  void *in[1] = {randf(37 * 57, 1)};
  check_op(&g, sp, in, 0, 0.0, "split3", NULL);
  int p[3] = {input(&g, "p0", MR_F32, 2, 37, 19), input(&g, "p1", MR_F32, 2, 37, 19),
              input(&g, "p2", MR_F32, 2, 37, 19)};
  int ct = op(&g, MR_OP_CONCAT3, p, 3, NULL);
  void *cin[3] = {randf(37 * 19, 1), randf(37 * 19, 1), randf(37 * 19, 1)};
  check_op(&g, ct, cin, 0, 0.0, "concat3", NULL);
  free(in[0]);
  for (int i = 0; i < 3; i++)
    free(cin[i]);
  mr_graph_close(&g);
}
END_TEST

/* ---- cross-entropy ---- */

static void xent_case(int64_t n, int64_t v, double a0, int ignore) {
  struct mr_graph g;
  mr_graph_init(&g);
  int l = input(&g, "logits", MR_F32, 2, n, v), t = input(&g, "targets", MR_I32, 1, n, 0);
  double attr[MR_OP_MAX_ATTR] = {a0};
  int lt[2] = {l, t};
  int fwd = op(&g, MR_OP_CROSS_ENTROPY, lt, 2, attr);
  void *in[2] = {randf(n * v, 6), randi(n, 0, v, ignore)};
  void *out[2] = {0};
  char what[96];
  snprintf(what, sizeof what, "cross_entropy %lldx%lld a0=%g", (long long)n,
           (long long)v, a0);
  check_op(&g, fwd, in, 0, FP32_TOL, what, out);
  int dl = input(&g, "dloss", MR_F32, 1, 1, 0);
  int bins[4] = {dl, l, t, g.ops[fwd].out[1]};
  int bwd = op(&g, MR_OP_CROSS_ENTROPY_BWD, bins, 4, attr);
  float dloss = 1024.0f;
  void *bin[4] = {&dloss, in[0], in[1], out[1]};
  snprintf(what, sizeof what, "cross_entropy_bwd %lldx%lld a0=%g", (long long)n,
           (long long)v, a0);
  check_op(&g, bwd, bin, 0, FP32_TOL, what, NULL);
  free(in[0]);
  free(in[1]);
  free(out[0]);
  free(out[1]);
  mr_graph_close(&g);
}

START_TEST(test_gpu_cross_entropy_mean_and_ignored_rows) {
  xent_case(1, 1, 0, 0);
  xent_case(37, 101, 0, 5);
  xent_case(64, 3000, 0, 0);
  xent_case(50, 257, 200, 7); /* a row shard dividing by the global rows */
}
END_TEST

/* ---- cross-entropy over a vocabulary shard ---- */

/* The steps of the vocabulary-parallel cross-entropy on a shard of v
 * columns from lo of a vocabulary of `vocab`, each fed the CPU's outputs of
 * the step before.  Row 0 is all -inf with its target ignored. */
static void xent_vocab_case(int64_t n, int64_t v, int64_t lo, int64_t vocab, double rows) {
  struct mr_graph g;
  mr_graph_init(&g);
  int l = input(&g, "logits", MR_F32, 2, n, v), t = input(&g, "targets", MR_I32, 1, n, 0);
  int dl = input(&g, "dloss", MR_F32, 1, 1, 0), dlse = input(&g, "dlse", MR_F32, 1, n, 0);
  float *logits = randf(n * v, 6), *dlse_v = randf(n, 1), dloss = 1024.0f;
  int32_t *targets = randi(n, 0, vocab, 5);
  for (int64_t j = 0; j < v; j++)
    logits[j] = -INFINITY;
  targets[0] = -100;
  dlse_v[0] = 0.0f;
  double shard[MR_OP_MAX_ATTR] = {(double)lo, (double)vocab}, ra[MR_OP_MAX_ATTR] = {rows};
  char what[128];
  int len = snprintf(what, sizeof what, "%lldx%lld from %lld of %lld, rows %g: ",
                     (long long)n, (long long)v, (long long)lo, (long long)vocab, rows);
  char *step = what + len;
  size_t room = sizeof what - (size_t)len;

  int in_max[1] = {l};
  int mx = op(&g, MR_OP_XENT_MAX, in_max, 1, NULL);
  void *m[1] = {0}, *b_max[1] = {logits};
  snprintf(step, room, "xent_max");
  check_op(&g, mx, b_max, 0, FP32_TOL, what, m);

  int in_se[3] = {l, t, g.ops[mx].out[0]};
  int se = op(&g, MR_OP_XENT_SUMEXP, in_se, 3, shard);
  void *stl[2] = {0}, *b_se[3] = {logits, targets, m[0]};
  snprintf(step, room, "xent_sumexp");
  check_op(&g, se, b_se, 0, FP32_TOL, what, stl);

  int in_fin[4] = {g.ops[se].out[0], g.ops[se].out[1], g.ops[mx].out[0], t};
  int fin = op(&g, MR_OP_XENT_FINISH, in_fin, 4, ra);
  void *b_fin[4] = {stl[0], stl[1], m[0], targets};
  snprintf(step, room, "xent_finish");
  check_op(&g, fin, b_fin, 0, FP32_TOL, what, NULL);

  int in_fb[4] = {g.ops[se].out[0], t, dl, dlse};
  int fb3 = op(&g, MR_OP_XENT_FINISH_BWD, in_fb, 3, ra);
  void *b_fb[4] = {stl[0], targets, &dloss, dlse_v};
  snprintf(step, room, "xent_finish_bwd without dlse");
  check_op(&g, fb3, b_fb, 0, FP32_TOL, what, NULL);
  int fb = op(&g, MR_OP_XENT_FINISH_BWD, in_fb, 4, ra);
  void *dsdtl[2] = {0};
  snprintf(step, room, "xent_finish_bwd");
  check_op(&g, fb, b_fb, 0, FP32_TOL, what, dsdtl);

  int in_sb[5] = {l, t, g.ops[mx].out[0], g.ops[fb].out[0], g.ops[fb].out[1]};
  void *b_sb[5] = {logits, targets, m[0], dsdtl[0], dsdtl[1]};
  for (int k = 4; k <= 5; k++) {
    int sb = op(&g, MR_OP_XENT_SUMEXP_BWD, in_sb, k, shard);
    snprintf(step, room, "xent_sumexp_bwd, %d inputs", k);
    check_op(&g, sb, b_sb, 0, FP32_TOL, what, NULL);
  }
  free(logits), free(dlse_v), free(targets);
  free(m[0]), free(stl[0]), free(stl[1]), free(dsdtl[0]), free(dsdtl[1]);
  mr_graph_close(&g);
}

START_TEST(test_gpu_cross_entropy_over_a_vocabulary_shard) {
  xent_vocab_case(1, 1, 0, 1, 0);
  xent_vocab_case(37, 101, 0, 101, 0);
  xent_vocab_case(64, 3000, 3000, 9000, 0);  /* a middle shard: most targets elsewhere */
  xent_vocab_case(50, 257, 257, 514, 200);   /* the last shard, global rows */
}
END_TEST

/* ---- errors found on the device ---- */

START_TEST(test_gpu_bad_token_id_fails_at_synchronize) {
  struct mr_graph g;
  mr_graph_init(&g);
  int ids = input(&g, "ids", MR_I32, 1, 4, 0), tab = input(&g, "table", MR_F32, 2, 10, 3);
  int ins[2] = {ids, tab};
  int id = op(&g, MR_OP_EMBEDDING, ins, 2, NULL);
  struct mr_backend *be = NULL;
  ck_assert_int_eq(mr_device_open("cuda", 0, 0, 0, &be), 0);
  int32_t hid[4] = {1, 2, 12, 3};
  void *b[3];
  ck_assert_int_eq(be->ops->alloc(be, sizeof hid, &b[0]), 0);
  ck_assert_int_eq(be->ops->alloc(be, 30 * sizeof(float), &b[1]), 0);
  ck_assert_int_eq(be->ops->alloc(be, 12 * sizeof(float), &b[2]), 0);
  ck_assert_int_eq(be->ops->copy(be, NULL, b[0], hid, sizeof hid, MR_COPY_HOST_TO_DEVICE), 0);
  ck_assert_int_eq(mr_op_kernel(MR_OP_EMBEDDING, MR_BACKEND_CUDA)(be->ops->kernel_ctx(be),
                                                                  &g, &g.ops[id], b), 0);
  ck_assert_int_eq(be->ops->synchronize(be, NULL), MR_ERANGE);
  ck_assert_msg(strstr(mr_error_message(), "id 12 at row 2") != NULL, "message: %s",
                mr_error_message());
  ck_assert_int_eq(be->ops->synchronize(be, NULL), 0); /* reported once */
  for (int i = 0; i < 3; i++)
    be->ops->free(be, b[i]);
  mr_backend_free(be);
  mr_graph_close(&g);
}
END_TEST

static Suite *gpu_kernels_suite(void) {
  Suite *s = suite_create("gpu_kernels");
  TCase *tc = tcase_create("kernels");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_gpu_matmul_fp32_every_transpose);
  tcase_add_test(tc, test_gpu_matmul_bf16_and_fp16_operands);
  tcase_add_test(tc, test_gpu_embedding_and_its_gradient);
  tcase_add_test(tc, test_gpu_elementwise_ops);
  tcase_add_test(tc, test_gpu_norms_and_bias_grad);
  tcase_add_test(tc, test_gpu_parameter_gradients_add_into_their_buffers);
  tcase_add_test(tc, test_gpu_rope_forward_and_inverse);
  tcase_add_test(tc, test_gpu_attention_fp32_gqa_odd_lengths);
  tcase_add_test(tc, test_gpu_attention_bf16_and_fp16);
  tcase_add_test(tc, test_gpu_attention_bf16_tensor_cores);
  tcase_add_test(tc, test_gpu_attention_kernel_choice_is_checked);
  tcase_add_test(tc, test_gpu_split3_concat3);
  tcase_add_test(tc, test_gpu_cross_entropy_mean_and_ignored_rows);
  tcase_add_test(tc, test_gpu_cross_entropy_over_a_vocabulary_shard);
  tcase_add_test(tc, test_gpu_bad_token_id_fails_at_synchronize);
  suite_add_tcase(s, tc);
  return s;
}

MR_GPU_TEST_MAIN(gpu_kernels_suite)
