/* test_graph.c - every registered op, forward through its CPU kernel and
 * backward through its gradient builder, against central finite
 * differences (see grad_check.h for the error budget); plus shape
 * inference errors, a forward value against a formula worked out here, and
 * the buffer plan. */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "compiler/autodiff.h"
#include "common/error.h"
#include "compiler/ops.h"
#include "grad_check.h"
#include "worker/exec_extra.h"

struct fixture {
  struct mr_graph g;
  struct mr_exec x;
  int out, seed;
  float *r;
};

static int param(struct mr_graph *g, const char *name, int64_t a, int64_t b) {
  int64_t s[2] = {a, b};
  return mr_graph_param(g, name, MR_INIT_NONE, b ? 2 : 1, s);
}

static int ids(struct mr_graph *g, const char *name, int64_t n) {
  int64_t s[1] = {n};
  return mr_graph_tensor(g, name, MR_I32, MR_ROLE_INPUT, 1, s);
}

/* Differentiates g's tensor out, fills parameters with U(-scale, scale)
 * and the seed with R, then checks every parameter. */
static void check_grads(struct fixture *f, double scale, double h) {
  ck_assert_int_eq(mr_autodiff(&f->g, f->out, &f->seed), 0);
  ck_assert_int_eq(mr_exec_init(&f->x, &f->g, 1, MR_AMP_NONE), 0);
  for (int i = 0; i < f->g.n_tensors; i++)
    if (f->g.tensors[i].role == MR_ROLE_PARAM)
      gc_fill(mr_exec_buf(&f->x, i), mr_tensor_numel(&f->g.tensors[i]), scale);
  int64_t n = mr_tensor_numel(&f->g.tensors[f->out]);
  f->r = malloc((size_t)n * sizeof *f->r);
  gc_fill(f->r, n, 1.0);
  memcpy(mr_exec_buf(&f->x, f->seed), f->r, (size_t)n * sizeof(float));
  double max_err;
  int bad = gc_check_params(&f->x, f->out, f->r, h, 1e-3, 1e-2, 400, &max_err);
  ck_assert_msg(bad == 0, "%d gradient elements off (max error %g)", bad,
                max_err);
  free(f->r);
  mr_exec_close(&f->x);
  mr_graph_close(&f->g);
}

static int op1(struct mr_graph *g, int kind, const int *in, int n,
               const double *attr) {
  int out[MR_OP_MAX_OUT];
  ck_assert_int_ge(mr_graph_op(g, kind, "y", in, n, attr, out), 0);
  return out[0];
}

static void matmul_case(int ta, int tb, int bias) {
  struct fixture f;
  mr_graph_init(&f.g);
  int64_t m = 5, k = 7, n = 3;
  int a = ta ? param(&f.g, "a", k, m) : param(&f.g, "a", m, k);
  int b = tb ? param(&f.g, "b", n, k) : param(&f.g, "b", k, n);
  int in[3] = {a, b, bias ? param(&f.g, "bias", n, 0) : -1};
  double at[MR_OP_MAX_ATTR] = {ta, tb};
  f.out = op1(&f.g, MR_OP_MATMUL, in, bias ? 3 : 2, at);
  check_grads(&f, 1.0, 1e-2);
}

START_TEST(test_graph_matmul_grad_all_transposes) {
  matmul_case(0, 0, 0);
  matmul_case(0, 1, 1);
  matmul_case(1, 0, 0);
  matmul_case(1, 1, 1);
}
END_TEST

START_TEST(test_graph_matmul_forward_matches_formula) {
  struct mr_graph g;
  struct mr_exec x;
  mr_graph_init(&g);
  int a = param(&g, "a", 2, 3), b = param(&g, "b", 2, 3), c = param(&g, "c", 2, 0);
  int in[3] = {a, b, c};
  double at[MR_OP_MAX_ATTR] = {0, 1};
  int y = op1(&g, MR_OP_MATMUL, in, 3, at);
  ck_assert_int_eq(mr_exec_init(&x, &g, 1, MR_AMP_NONE), 0);
  float av[6] = {1, 2, 3, 4, 5, 6}, bv[6] = {1, 0, -1, 2, 1, 0}, cv[2] = {10, 20};
  memcpy(mr_exec_buf(&x, a), av, sizeof av);
  memcpy(mr_exec_buf(&x, b), bv, sizeof bv);
  memcpy(mr_exec_buf(&x, c), cv, sizeof cv);
  ck_assert_int_eq(mr_exec_run(&x, 0, g.n_ops), 0);
  const float *yv = mr_exec_buf(&x, y);
  /* y = a b^T + c: rows (1,2,3),(4,5,6) against (1,0,-1),(2,1,0) */
  ck_assert_float_eq(yv[0], 1 - 3 + 10);
  ck_assert_float_eq(yv[1], 2 + 2 + 20);
  ck_assert_float_eq(yv[2], 4 - 6 + 10);
  ck_assert_float_eq(yv[3], 8 + 5 + 20);
  mr_exec_close(&x);
  mr_graph_close(&g);
}
END_TEST

START_TEST(test_graph_add_grad) {
  struct fixture f;
  mr_graph_init(&f.g);
  int a = param(&f.g, "a", 4, 6), b = param(&f.g, "b", 4, 6);
  int in[2] = {a, b};
  int s = op1(&f.g, MR_OP_ADD, in, 2, NULL);
  int in2[2] = {s, a}; /* a used twice: gradients must sum */
  f.out = op1(&f.g, MR_OP_ADD, in2, 2, NULL);
  check_grads(&f, 1.0, 1e-2);
}
END_TEST

START_TEST(test_graph_rmsnorm_grad) {
  struct fixture f;
  mr_graph_init(&f.g);
  int in[2] = {param(&f.g, "x", 4, 8), param(&f.g, "w", 8, 0)};
  double at[MR_OP_MAX_ATTR] = {1e-5};
  f.out = op1(&f.g, MR_OP_RMSNORM, in, 2, at);
  check_grads(&f, 1.0, 1e-2);
}
END_TEST

START_TEST(test_graph_layernorm_grad) {
  struct fixture f;
  mr_graph_init(&f.g);
  int in[3] = {param(&f.g, "x", 4, 8), param(&f.g, "w", 8, 0),
               param(&f.g, "b", 8, 0)};
  double at[MR_OP_MAX_ATTR] = {1e-5};
  f.out = op1(&f.g, MR_OP_LAYERNORM, in, 3, at);
  check_grads(&f, 1.0, 1e-2);
}
END_TEST

START_TEST(test_graph_rope_grad) {
  struct fixture f;
  mr_graph_init(&f.g);
  int in[1] = {param(&f.g, "x", 2 * 5, 3 * 8)};
  double at[MR_OP_MAX_ATTR] = {5, 3, 10000.0, 1};
  f.out = op1(&f.g, MR_OP_ROPE, in, 1, at);
  check_grads(&f, 1.0, 1e-2);
}
END_TEST

START_TEST(test_graph_rope_forward_matches_rotate_half) {
  struct mr_graph g;
  struct mr_exec x;
  mr_graph_init(&g);
  int xi = param(&g, "x", 3, 4); /* T = 3, one head of D = 4 */
  double at[MR_OP_MAX_ATTR] = {3, 1, 100.0, 1};
  int y = op1(&g, MR_OP_ROPE, &xi, 1, at);
  ck_assert_int_eq(mr_exec_init(&x, &g, 1, MR_AMP_NONE), 0);
  float *xv = mr_exec_buf(&x, xi);
  for (int i = 0; i < 12; i++)
    xv[i] = (float)(i + 1);
  ck_assert_int_eq(mr_exec_run(&x, 0, g.n_ops), 0);
  const float *yv = mr_exec_buf(&x, y);
  for (int p = 0; p < 3; p++)
    for (int i = 0; i < 2; i++) {
      double ang = p * pow(100.0, -2.0 * i / 4); /* inv_freq = theta^(-2i/D) */
      double a = xv[p * 4 + i], b = xv[p * 4 + i + 2];
      ck_assert_double_eq_tol(yv[p * 4 + i], a * cos(ang) - b * sin(ang), 1e-5);
      ck_assert_double_eq_tol(yv[p * 4 + i + 2], b * cos(ang) + a * sin(ang),
                              1e-5);
    }
  mr_exec_close(&x);
  mr_graph_close(&g);
}
END_TEST

START_TEST(test_graph_swiglu_gelu_grad) {
  struct fixture f;
  mr_graph_init(&f.g);
  int in[2] = {param(&f.g, "g", 3, 7), param(&f.g, "u", 3, 7)};
  f.out = op1(&f.g, MR_OP_SWIGLU, in, 2, NULL);
  check_grads(&f, 2.0, 1e-2);
  mr_graph_init(&f.g);
  int x = param(&f.g, "x", 3, 7);
  f.out = op1(&f.g, MR_OP_GELU, &x, 1, NULL);
  check_grads(&f, 3.0, 1e-2);
}
END_TEST

START_TEST(test_graph_attention_gqa_grad) {
  struct fixture f;
  mr_graph_init(&f.g);
  int64_t t = 5, b = 2, h = 4, kh = 2, d = 4;
  int in[3] = {param(&f.g, "q", b * t, h * d), param(&f.g, "k", b * t, kh * d),
               param(&f.g, "v", b * t, kh * d)};
  double at[MR_OP_MAX_ATTR] = {(double)t, (double)h, (double)kh};
  f.out = op1(&f.g, MR_OP_ATTENTION, in, 3, at);
  check_grads(&f, 1.5, 1e-2);
}
END_TEST

START_TEST(test_graph_attention_is_causal) {
  /* row 0 of each sequence attends only to itself: o[0] = v[0] */
  struct mr_graph g;
  struct mr_exec x;
  mr_graph_init(&g);
  int q = param(&g, "q", 6, 4), k = param(&g, "k", 6, 4), v = param(&g, "v", 6, 4);
  int in[3] = {q, k, v};
  double at[MR_OP_MAX_ATTR] = {3, 1, 1};
  int o = op1(&g, MR_OP_ATTENTION, in, 3, at);
  ck_assert_int_eq(mr_exec_init(&x, &g, 1, MR_AMP_NONE), 0);
  gc_fill(mr_exec_buf(&x, q), 24, 1);
  gc_fill(mr_exec_buf(&x, k), 24, 1);
  gc_fill(mr_exec_buf(&x, v), 24, 1);
  ck_assert_int_eq(mr_exec_run(&x, 0, g.n_ops), 0);
  const float *ov = mr_exec_buf(&x, o), *vv = mr_exec_buf(&x, v);
  for (int i = 0; i < 4; i++) {
    ck_assert_float_eq_tol(ov[i], vv[i], 1e-6);
    ck_assert_float_eq_tol(ov[12 + i], vv[12 + i], 1e-6);
  }
  /* row 1: softmax over two scores, written out */
  const float *qv = mr_exec_buf(&x, q), *kv = mr_exec_buf(&x, k);
  double s0 = 0, s1 = 0;
  for (int i = 0; i < 4; i++) {
    s0 += qv[4 + i] * kv[i] / 2.0;
    s1 += qv[4 + i] * kv[4 + i] / 2.0;
  }
  double p0 = exp(s0) / (exp(s0) + exp(s1));
  for (int i = 0; i < 4; i++)
    ck_assert_double_eq_tol(ov[4 + i], p0 * vv[i] + (1 - p0) * vv[4 + i], 1e-5);
  mr_exec_close(&x);
  mr_graph_close(&g);
}
END_TEST

START_TEST(test_graph_split_concat_grad) {
  struct fixture f;
  mr_graph_init(&f.g);
  int xi = param(&f.g, "x", 3, 9), parts[MR_OP_MAX_OUT], y[MR_OP_MAX_OUT];
  ck_assert_int_ge(mr_graph_op(&f.g, MR_OP_SPLIT3, "p", &xi, 1, NULL, parts), 0);
  int in[3] = {parts[2], parts[0], parts[1]};
  ck_assert_int_ge(mr_graph_op(&f.g, MR_OP_CONCAT3, "y", in, 3, NULL, y), 0);
  f.out = y[0];
  check_grads(&f, 1.0, 1e-2);
}
END_TEST

START_TEST(test_graph_embedding_grad_repeated_ids) {
  struct fixture f;
  mr_graph_init(&f.g);
  int id = ids(&f.g, "ids", 6), w = param(&f.g, "w", 5, 3);
  int in[2] = {id, w};
  f.out = op1(&f.g, MR_OP_EMBEDDING, in, 2, NULL);
  ck_assert_int_eq(mr_autodiff(&f.g, f.out, &f.seed), 0);
  ck_assert_int_eq(mr_exec_init(&f.x, &f.g, 1, MR_AMP_NONE), 0);
  int32_t iv[6] = {1, 3, 1, 0, 4, 1};
  memcpy(mr_exec_buf(&f.x, id), iv, sizeof iv);
  gc_fill(mr_exec_buf(&f.x, w), 15, 1);
  float *r = mr_exec_buf(&f.x, f.seed);
  gc_fill(r, 18, 1);
  double max_err;
  ck_assert_int_eq(gc_check_params(&f.x, f.out, r, 1e-2, 1e-3, 1e-2, 15, &max_err), 0);
  /* row 2 of the table is never looked up: zero gradient */
  const float *dw = mr_exec_buf(&f.x, f.g.tensors[w].grad);
  for (int i = 0; i < 3; i++)
    ck_assert_float_eq(dw[6 + i], 0);
  mr_exec_close(&f.x);
  mr_graph_close(&f.g);
}
END_TEST

START_TEST(test_graph_cross_entropy_grad_and_value) {
  struct fixture f;
  mr_graph_init(&f.g);
  int l = param(&f.g, "logits", 4, 6), y = ids(&f.g, "targets", 4);
  int in[2] = {l, y};
  f.out = op1(&f.g, MR_OP_CROSS_ENTROPY, in, 2, NULL);
  ck_assert_int_eq(mr_autodiff(&f.g, f.out, &f.seed), 0);
  ck_assert_int_eq(mr_exec_init(&f.x, &f.g, 1, MR_AMP_NONE), 0);
  int32_t yv[4] = {0, 5, 2, 2};
  memcpy(mr_exec_buf(&f.x, y), yv, sizeof yv);
  float *lv = mr_exec_buf(&f.x, l);
  gc_fill(lv, 24, 3);
  float *seed = mr_exec_buf(&f.x, f.seed);
  seed[0] = 1.0f;
  double max_err;
  ck_assert_int_eq(gc_check_params(&f.x, f.out, NULL, 1e-2, 1e-3, 1e-2, 24, &max_err), 0);
  double ref = 0; /* mean of log-sum-exp minus the target logit */
  for (int r = 0; r < 4; r++) {
    double s = 0;
    for (int i = 0; i < 6; i++)
      s += exp(lv[r * 6 + i]);
    ref += log(s) - lv[r * 6 + yv[r]];
  }
  ck_assert_double_eq_tol(((float *)mr_exec_buf(&f.x, f.out))[0], ref / 4, 1e-5);
  mr_exec_close(&f.x);
  mr_graph_close(&f.g);
}
END_TEST

START_TEST(test_graph_shape_mismatch_is_an_error) {
  struct mr_graph g;
  mr_graph_init(&g);
  int a = param(&g, "a", 2, 3), b = param(&g, "b", 4, 5);
  int in[2] = {a, b}, out[MR_OP_MAX_OUT];
  ck_assert_int_eq(mr_graph_op(&g, MR_OP_MATMUL, "y", in, 2, NULL, out),
                   MR_ESHAPE);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "matmul"));
  ck_assert_int_eq(mr_graph_op(&g, MR_OP_ADD, "y", in, 1, NULL, out), MR_EINVAL);
  int bad[2] = {a, 99};
  ck_assert_int_eq(mr_graph_op(&g, MR_OP_ADD, "y", bad, 2, NULL, out), MR_EINVAL);
  ck_assert_int_eq(mr_op_kind_by_name("attention"), MR_OP_ATTENTION);
  ck_assert_int_eq(mr_op_kind_by_name("nope"), MR_EINVAL);
  mr_graph_close(&g);
}
END_TEST

/* mr_graph_fuse keeps the order valid: a fused op may not read what is
 * made after its place, nor drop an output of an op it replaces, nor come
 * after autodiff; a valid one takes its place and its outputs' producer. */
START_TEST(test_graph_fuse_keeps_the_order_valid) {
  struct mr_graph g;
  mr_graph_init(&g);
  int64_t sh[2] = {3, 4};
  int x = mr_graph_tensor(&g, "x", MR_F32, MR_ROLE_INPUT, 2, sh);
  int a, b, c;
  int in[2] = {x, x};
  ck_assert_int_eq(mr_graph_op(&g, MR_OP_ADD, "a", in, 2, NULL, &a), 0);
  ck_assert_int_eq(mr_graph_op(&g, MR_OP_ADD, "b", in, 2, NULL, &b), 1);
  in[0] = a, in[1] = b;
  ck_assert_int_eq(mr_graph_op(&g, MR_OP_ADD, "c", in, 2, NULL, &c), 2);
  int ops0[1] = {0}, ops01[2] = {0, 1}, ops1[1] = {1};
  int late[2] = {b, x}, early[2] = {x, a};
  ck_assert_int_eq(mr_graph_fuse(&g, ops0, 1, MR_OP_ADD, late, 2, NULL, &a, 1), MR_EINVAL);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "input b is produced after op 0"));
  int xx[2] = {x, x};
  ck_assert_int_eq(mr_graph_fuse(&g, ops01, 2, MR_OP_ADD, xx, 2, NULL, &a, 1), MR_EINVAL);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "b, an output of a fused op"));
  int two[2] = {a, b};
  ck_assert_int_eq(mr_graph_fuse(&g, ops1, 1, MR_OP_ADD, early, 2, NULL, two, 2), MR_EINVAL);
  ck_assert_int_eq(g.n_ops, 3); /* refusals change nothing */
  ck_assert_int_eq(mr_graph_fuse(&g, ops1, 1, MR_OP_ADD, early, 2, NULL, &b, 1), 1);
  ck_assert_int_eq(g.n_ops, 3);
  ck_assert_int_eq(g.ops[1].in[1], a);
  ck_assert_int_eq(g.tensors[b].producer, 1);
  ck_assert_int_eq(g.tensors[c].producer, 2);
  g.n_forward_ops = 3; /* as autodiff leaves it */
  ck_assert_int_eq(mr_graph_fuse(&g, ops1, 1, MR_OP_ADD, early, 2, NULL, &b, 1), MR_EINVAL);
  mr_graph_close(&g);
}
END_TEST

START_TEST(test_graph_every_listed_op_is_complete) {
  /* MR_OP_LIST names each built-in kind once; the registry's row, the
   * lookup by name and the CPU kernel bound from the list agree with it */
  static const struct {
    int kind;
    const char *name;
  } list[] = {
#define ENTRY(kind, name) {MR_OP_##kind, #name},
      MR_OP_LIST(ENTRY)
#undef ENTRY
  };
  ck_assert_int_eq((int)MR_ARRAY_LEN(list), MR_OP_COUNT);
  mr_cpu_kernels_register();
  for (size_t i = 0; i < MR_ARRAY_LEN(list); i++) {
    const struct mr_op_def *d = mr_op_def(list[i].kind);
    ck_assert_int_eq(list[i].kind, (int)i);
    ck_assert_ptr_nonnull(d);
    ck_assert_str_eq(d->name, list[i].name);
    ck_assert_int_eq(mr_op_kind_by_name(list[i].name), list[i].kind);
    ck_assert(d->infer != NULL && d->flops != NULL && d->bytes != NULL);
    ck_assert(d->n_out >= 1 && d->n_in_min >= 1 && d->n_in_min <= d->n_in_max);
    ck_assert(mr_op_kernel(list[i].kind, MR_BACKEND_CPU) != NULL);
  }
}
END_TEST

START_TEST(test_graph_plan_reuses_dead_buffers) {
  /* a chain x -> y1 -> y2 -> y3 of 1 KiB tensors: at most two are live */
  struct mr_graph g;
  struct mr_exec x;
  mr_graph_init(&g);
  int t = param(&g, "x", 16, 16);
  for (int i = 0; i < 6; i++) {
    int in[1] = {t};
    t = op1(&g, MR_OP_GELU, in, 1, NULL);
  }
  ck_assert_int_eq(mr_exec_init(&x, &g, 1, MR_AMP_NONE), 0);
  ck_assert_uint_eq(x.arena_bytes, 2 * 1024);
  ck_assert_uint_eq(mr_exec_peak_bytes(&x), 3 * 1024);
  ck_assert_double_eq(mr_graph_flops(&g), 6 * 5 * 256);
  mr_exec_close(&x);
  mr_graph_close(&g);
}
END_TEST

START_TEST(test_graph_amp_f16_rounding_matches_dtype) {
  /* the executor's fast fp16 rounding against common/dtype.h's
   * conversion pair, over normal, subnormal, overflow and tie cases */
  float src[4000], got[4000];
  int n = 0;
  for (int i = 0; i < 3000; i++)
    src[n++] = (float)(gc_uniform() * pow(2.0, 40 * gc_uniform() - 15));
  float edge[] = {65504.0f, 65519.0f, 65520.0f, -65520.0f, 1e9f, 6.1035156e-05f,
                  6.0e-05f, 5.96e-08f, 2.98e-08f, 2.99e-08f, 1.0f + 0x1p-11f,
                  1.0f + 0x1.8p-11f, 0.0f, -0.0f, INFINITY, -INFINITY};
  for (size_t i = 0; i < sizeof edge / sizeof *edge; i++)
    src[n++] = edge[i];
  mr__round_f16_n(got, src, (size_t)n);
  for (int i = 0; i < n; i++) {
    float want = mr_f16_to_f32(mr_f32_to_f16(src[i]));
    ck_assert_msg(memcmp(&want, &got[i], 4) == 0, "%.9g: got %.9g, want %.9g",
                  src[i], got[i], want);
  }
  float nan = NAN;
  mr__round_f16_n(got, &nan, 1);
  ck_assert(isnan(got[0]));
}
END_TEST

/* A box of a row-major tensor, element by element as worked by hand: of
 * [2, 3, 4], the box at (1, 0, 1) of lengths (1, 3, 2) holds the elements
 * 12 + 4r + c for rows r = 0..2 and columns c = 1..2. */
START_TEST(test_graph_box_gather_and_scatter) {
  const int64_t shape[3] = {2, 3, 4}, off[3] = {1, 0, 1}, len[3] = {1, 3, 2};
  float whole[24], box[6], back[24] = {0};
  for (int i = 0; i < 24; i++)
    whole[i] = (float)i;
  mr_box_gather(3, shape, off, len, whole, box);
  const float want[6] = {13, 14, 17, 18, 21, 22};
  for (int i = 0; i < 6; i++)
    ck_assert_msg(box[i] == want[i], "box[%d] = %g, expected %g", i, box[i], want[i]);
  mr_box_scatter(3, shape, off, len, box, back);
  for (int i = 0; i < 24; i++) {
    int in = 0;
    for (int k = 0; k < 6; k++)
      in |= (int)want[k] == i;
    ck_assert_msg(back[i] == (in ? (float)i : 0.0f), "element %d: %g", i, back[i]);
  }
  /* an empty box visits nothing */
  const int64_t none[3] = {1, 0, 2};
  float untouched[1] = {-1};
  mr_box_gather(3, shape, off, none, whole, untouched);
  ck_assert(untouched[0] == -1);
}
END_TEST

Suite *graph_suite(void);
/* ---- parameter gradients added into their buffers (accum_out) ---- */

static float *filled(int64_t n, double scale) {
  float *x = malloc((size_t)(n > 0 ? n : 1) * sizeof *x);
  ck_assert_ptr_nonnull(x);
  gc_fill(x, n, scale);
  return x;
}

/* Runs op id of g on the CPU from inputs in[] twice: once overwriting its
 * outputs (R, from garbage), once with accum_out set to every output its
 * definition allows, from outputs holding O.  An output the op adds into
 * must hold O + R, within rounding (the GEMM with beta 1 adds C inside its
 * own sums, the embedding's rows add token by token); the others R,
 * bitwise. */
static void check_adds(struct mr_graph *g, int id, void *const *in, const char *what) {
  struct mr_op *o = &g->ops[id];
  unsigned mask = mr_op_def(o->kind)->accum_outs;
  ck_assert_msg(mask != 0, "%s: adds into none of its outputs", what);
  void *b[MR_OP_MAX_IN + MR_OP_MAX_OUT] = {0};
  float *r[MR_OP_MAX_OUT] = {0}, *old[MR_OP_MAX_OUT] = {0};
  for (int i = 0; i < o->n_in; i++)
    b[i] = in[i];
  struct mr_cpu_ctx cpu;
  ck_assert_int_eq(mr_cpu_ctx_init(&cpu, 2, MR_AMP_NONE), 0);
  mr_cpu_kernels_register();
  mr_kernel_fn k = mr_op_kernel(o->kind, MR_BACKEND_CPU);
  ck_assert(k != NULL);
  for (int j = 0; j < o->n_out; j++)
    b[o->n_in + j] = r[j] = filled(mr_tensor_numel(&g->tensors[o->out[j]]), 5.0);
  o->accum_out = 0;
  ck_assert_msg(k(&cpu, g, o, b) == 0, "%s: %s", what, mr_error_message());
  for (int j = 0; j < o->n_out; j++) {
    int64_t n = mr_tensor_numel(&g->tensors[o->out[j]]);
    old[j] = filled(n, 2.0);
    b[o->n_in + j] = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    memcpy(b[o->n_in + j], old[j], (size_t)n * sizeof(float));
  }
  o->accum_out = mask;
  ck_assert_msg(k(&cpu, g, o, b) == 0, "%s: %s", what, mr_error_message());
  o->accum_out = 0;
  for (int j = 0; j < o->n_out; j++) {
    int64_t n = mr_tensor_numel(&g->tensors[o->out[j]]);
    const float *got = b[o->n_in + j];
    for (int64_t i = 0; i < n; i++) {
      if (!((mask >> j) & 1u)) {
        ck_assert_msg(got[i] == r[j][i], "%s: output %d [%lld] overwritten: %.9g, alone %.9g",
                      what, j, (long long)i, (double)got[i], (double)r[j][i]);
        continue;
      }
      double want = (double)old[j][i] + (double)r[j][i];
      double tol = 1e-6 * (fabs(old[j][i]) + fabs(r[j][i]) + 1.0);
      ck_assert_msg(fabs((double)got[i] - (double)(float)want) <= tol,
                    "%s: output %d [%lld]: %.9g, expected %.9g + %.9g", what, j,
                    (long long)i, (double)got[i], (double)old[j][i], (double)r[j][i]);
    }
    free(b[o->n_in + j]);
    free(r[j]);
    free(old[j]);
  }
  mr_cpu_ctx_close(&cpu);
}

/* Runs op id of g overwriting outs[] (the forward values a backward reads). */
static void run_cpu(struct mr_graph *g, int id, void **bufs) {
  struct mr_cpu_ctx cpu;
  ck_assert_int_eq(mr_cpu_ctx_init(&cpu, 1, MR_AMP_NONE), 0);
  mr_cpu_kernels_register();
  ck_assert_int_eq(mr_op_kernel(g->ops[id].kind, MR_BACKEND_CPU)(&cpu, g, &g->ops[id], bufs), 0);
  mr_cpu_ctx_close(&cpu);
}

START_TEST(test_graph_parameter_gradients_add_into_their_buffers) {
  int covered[MR_OP_COUNT] = {0};
  struct mr_graph g;
  mr_graph_init(&g);
  /* the weight gradient of y = x W^T (dW = dy^T x) and the other transposes */
  for (int t = 0; t < 4; t++) {
    int ta = t & 1, tb = t >> 1;
    int64_t m = 37, n = 29, k = 400; /* K past one 384-deep block */
    int a = ta ? param(&g, "a", k, m) : param(&g, "a", m, k);
    int b = tb ? param(&g, "b", n, k) : param(&g, "b", k, n);
    int in[2] = {a, b};
    double at[MR_OP_MAX_ATTR] = {ta, tb};
    op1(&g, MR_OP_MATMUL, in, 2, at);
    void *h[2] = {filled(m * k, 1), filled(k * n, 1)};
    check_adds(&g, g.n_ops - 1, h, "matmul");
    free(h[0]);
    free(h[1]);
  }
  covered[MR_OP_MATMUL] = 1;
  /* the embedding's gradient, whole and a vocabulary shard (rows [8, 20)
   * of 24), ids repeated */
  int64_t nt = 50, c = 33;
  int id = ids(&g, "ids", nt), dout = param(&g, "dout", nt, c);
  int32_t idv[50];
  for (int i = 0; i < 50; i++)
    idv[i] = (i * 7) % 24;
  void *h[2] = {idv, filled(nt * c, 1)};
  int eb[2] = {id, dout};
  double whole[MR_OP_MAX_ATTR] = {24}, shard[MR_OP_MAX_ATTR] = {12, 8, 24};
  op1(&g, MR_OP_EMBEDDING_BWD, eb, 2, whole);
  check_adds(&g, g.n_ops - 1, h, "embedding_bwd");
  op1(&g, MR_OP_EMBEDDING_BWD, eb, 2, shard);
  check_adds(&g, g.n_ops - 1, h, "embedding_bwd (a vocabulary shard)");
  covered[MR_OP_EMBEDDING_BWD] = 1;
  free(h[1]);
  /* the bias's and the norms' weights: column sums */
  int64_t rows = 70;
  int dy = param(&g, "dy", rows, c), x = param(&g, "x", rows, c), w = param(&g, "w", c, 0);
  int bias = param(&g, "bias", c, 0);
  float *hdy = filled(rows * c, 1), *hx = filled(rows * c, 2), *hw = filled(c, 1);
  float *hb = filled(c, 1), *y = filled(rows * c, 1);
  float *rstd = filled(rows, 1), *mean = filled(rows, 1), *lrstd = filled(rows, 1);
  void *bin[1] = {hdy};
  op1(&g, MR_OP_BIAS_GRAD, &dy, 1, NULL);
  check_adds(&g, g.n_ops - 1, bin, "bias_grad");
  covered[MR_OP_BIAS_GRAD] = 1;
  double eps[MR_OP_MAX_ATTR] = {1e-5};
  int xw[2] = {x, w}, rms[MR_OP_MAX_OUT];
  ck_assert_int_ge(mr_graph_op(&g, MR_OP_RMSNORM, "rms", xw, 2, eps, rms), 0);
  void *rf[4] = {hx, hw, y, rstd};
  run_cpu(&g, g.n_ops - 1, rf);
  int rbi[4] = {dy, x, w, rms[1]};
  op1(&g, MR_OP_RMSNORM_BWD, rbi, 4, eps);
  void *rbin[4] = {hdy, hx, hw, rstd};
  check_adds(&g, g.n_ops - 1, rbin, "rmsnorm_bwd");
  covered[MR_OP_RMSNORM_BWD] = 1;
  int xwb[3] = {x, w, bias}, ln[MR_OP_MAX_OUT];
  ck_assert_int_ge(mr_graph_op(&g, MR_OP_LAYERNORM, "ln", xwb, 3, eps, ln), 0);
  void *lf[6] = {hx, hw, hb, y, mean, lrstd};
  run_cpu(&g, g.n_ops - 1, lf);
  int lbi[5] = {dy, x, w, ln[1], ln[2]};
  op1(&g, MR_OP_LAYERNORM_BWD, lbi, 5, eps);
  void *lbin[5] = {hdy, hx, hw, mean, lrstd};
  check_adds(&g, g.n_ops - 1, lbin, "layernorm_bwd");
  covered[MR_OP_LAYERNORM_BWD] = 1;
  float *all[] = {hdy, hx, hw, hb, y, rstd, mean, lrstd};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    free(all[i]);
  mr_graph_close(&g);
  /* every op that says it adds into an output is checked here */
  for (int kind = 0; kind < MR_OP_COUNT; kind++)
    ck_assert_msg(mr_op_def(kind)->accum_outs == 0 || covered[kind],
                  "op %s adds into outputs %#x: not checked here", mr_op_def(kind)->name,
                  mr_op_def(kind)->accum_outs);
}
END_TEST

Suite *graph_suite(void) {
  Suite *s = suite_create("graph");
  TCase *tc = tcase_create("ops");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_graph_every_listed_op_is_complete);
  tcase_add_test(tc, test_graph_fuse_keeps_the_order_valid);
  tcase_add_test(tc, test_graph_matmul_grad_all_transposes);
  tcase_add_test(tc, test_graph_matmul_forward_matches_formula);
  tcase_add_test(tc, test_graph_add_grad);
  tcase_add_test(tc, test_graph_rmsnorm_grad);
  tcase_add_test(tc, test_graph_layernorm_grad);
  tcase_add_test(tc, test_graph_rope_grad);
  tcase_add_test(tc, test_graph_rope_forward_matches_rotate_half);
  tcase_add_test(tc, test_graph_swiglu_gelu_grad);
  tcase_add_test(tc, test_graph_attention_gqa_grad);
  tcase_add_test(tc, test_graph_attention_is_causal);
  tcase_add_test(tc, test_graph_split_concat_grad);
  tcase_add_test(tc, test_graph_embedding_grad_repeated_ids);
  tcase_add_test(tc, test_graph_cross_entropy_grad_and_value);
  tcase_add_test(tc, test_graph_shape_mismatch_is_an_error);
  tcase_add_test(tc, test_graph_plan_reuses_dead_buffers);
  tcase_add_test(tc, test_graph_amp_f16_rounding_matches_dtype);
  tcase_add_test(tc, test_graph_box_gather_and_scatter);
  tcase_add_test(tc, test_graph_parameter_gradients_add_into_their_buffers);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(graph_suite)
