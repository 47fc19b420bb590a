/* test_graph_ref.c - every differentiable op against a reference forward
 * written here in double precision, independently of the kernels: the
 * op's float output must match the reference, and the gradient its
 * registry builder emits (run by the executor) must match central finite
 * differences of the reference objective L = sum(ref(x) * R), taken in
 * double with h = 1e-6 (truncation ~1e-12, rounding ~1e-10).  What is left
 * is the float error of the analytic gradient, ~1e-6 relative; the
 * tolerance 2e-4 (absolute + relative) is far below any real mistake. */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "compiler/autodiff.h"
#include "common/error.h"
#include "compiler/ops.h"
#include "grad_check.h"

#define MAXIN 4

/* dims shared by the reference functions of the current case */
static int64_t N, C, T, H, KH, D, V;
static double ATTR[MR_OP_MAX_ATTR];
static const int32_t *IDS;

typedef void (*ref_fn)(double *const *in, double *out);

struct ref_case {
  const char *name;
  int kind;
  int n_in;
  int64_t shape[MAXIN][2];     // [rows, cols]; cols 0: 1-D
  int is_ids[MAXIN];           // int32 input (not differentiated)
  double scale;                // inputs U(-scale, scale)
  double attr[MR_OP_MAX_ATTR];
  ref_fn ref;
};

/* What some cases set beyond the defaults (all zero). */
struct ref_more {
  int out_index;               // the output differentiated and compared
  int no_grad[MAXIN];          // held fixed: the op passes no gradient
  int positive[MAXIN];         // drawn in [0.5, 0.5 + scale)
  int64_t id_range;            // ids in [0, id_range) (0: V)
  int ignore;                  // row 1's id is -1 (ignored)
};

static int64_t numel(const int64_t *s) { return s[0] * (s[1] ? s[1] : 1); }

static void ref_matmul_nt(double *const *in, double *out) { /* x W^T + b */
  for (int64_t i = 0; i < N; i++)
    for (int64_t o = 0; o < V; o++) {
      double s = in[2] ? in[2][o] : 0;
      for (int64_t k = 0; k < C; k++)
        s += in[0][i * C + k] * in[1][o * C + k];
      out[i * V + o] = s;
    }
}

static void ref_matmul_tn(double *const *in, double *out) { /* A^T B */
  for (int64_t i = 0; i < C; i++)
    for (int64_t o = 0; o < V; o++) {
      double s = 0;
      for (int64_t k = 0; k < N; k++)
        s += in[0][k * C + i] * in[1][k * V + o];
      out[i * V + o] = s;
    }
}

static void ref_rmsnorm(double *const *in, double *out) {
  for (int64_t i = 0; i < N; i++) {
    double ss = 0;
    for (int64_t k = 0; k < C; k++)
      ss += in[0][i * C + k] * in[0][i * C + k];
    double r = 1 / sqrt(ss / (double)C + ATTR[0]);
    for (int64_t k = 0; k < C; k++)
      out[i * C + k] = in[0][i * C + k] * r * in[1][k];
  }
}

static void ref_layernorm(double *const *in, double *out) {
  for (int64_t i = 0; i < N; i++) {
    double mu = 0, var = 0;
    for (int64_t k = 0; k < C; k++)
      mu += in[0][i * C + k] / (double)C;
    for (int64_t k = 0; k < C; k++)
      var += (in[0][i * C + k] - mu) * (in[0][i * C + k] - mu) / (double)C;
    for (int64_t k = 0; k < C; k++)
      out[i * C + k] = (in[0][i * C + k] - mu) / sqrt(var + ATTR[0]) * in[1][k] + in[2][k];
  }
}

static void ref_rope(double *const *in, double *out) {
  for (int64_t r = 0; r < N; r++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t i = 0; i < D / 2; i++) {
        double ang = (double)(r % T) * pow(ATTR[2], -2.0 * (double)i / (double)D);
        const double *x = in[0] + r * H * D + h * D;
        double *y = out + r * H * D + h * D;
        y[i] = x[i] * cos(ang) - x[i + D / 2] * sin(ang);
        y[i + D / 2] = x[i + D / 2] * cos(ang) + x[i] * sin(ang);
      }
}

static void ref_swiglu(double *const *in, double *out) {
  for (int64_t i = 0; i < N * C; i++)
    out[i] = in[0][i] / (1 + exp(-in[0][i])) * in[1][i];
}

static void ref_gelu(double *const *in, double *out) {
  for (int64_t i = 0; i < N * C; i++) {
    double x = in[0][i];
    out[i] = 0.5 * x * (1 + tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
  }
}

static void ref_add(double *const *in, double *out) {
  for (int64_t i = 0; i < N * C; i++)
    out[i] = in[0][i] + in[1][i];
}

/* causal softmax attention, query head h reads kv head h / (H / KH) */
static void ref_attention(double *const *in, double *out) {
  int64_t B = N / T;
  double p[64];
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      int64_t kv = h / (H / KH);
      for (int64_t i = 0; i < T; i++) {
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j <= i; j++) {
          double s = 0;
          for (int64_t d = 0; d < D; d++)
            s += in[0][(b * T + i) * H * D + h * D + d] *
                 in[1][(b * T + j) * KH * D + kv * D + d];
          p[j] = s / sqrt((double)D);
          mx = p[j] > mx ? p[j] : mx;
        }
        for (int64_t j = 0; j <= i; j++)
          sum += (p[j] = exp(p[j] - mx));
        for (int64_t d = 0; d < D; d++) {
          double o = 0;
          for (int64_t j = 0; j <= i; j++)
            o += p[j] / sum * in[2][(b * T + j) * KH * D + kv * D + d];
          out[(b * T + i) * H * D + h * D + d] = o;
        }
      }
    }
}

static void ref_embedding(double *const *in, double *out) {
  for (int64_t i = 0; i < N; i++)
    for (int64_t k = 0; k < C; k++)
      out[i * C + k] = in[1][IDS[i] * C + k];
}

static void ref_xent(double *const *in, double *out) {
  double total = 0;
  for (int64_t i = 0; i < N; i++) {
    double mx = -INFINITY, s = 0;
    for (int64_t v = 0; v < V; v++)
      mx = in[0][i * V + v] > mx ? in[0][i * V + v] : mx;
    for (int64_t v = 0; v < V; v++)
      s += exp(in[0][i * V + v] - mx);
    total += mx + log(s) - in[0][i * V + IDS[i]];
  }
  out[0] = total / (double)N;
}

/* the column of row i's target in the vocabulary shard [ATTR[0],
 * ATTR[0] + V), or -1 (outside it, or ignored) */
static int64_t shard_col(int64_t i) {
  int64_t c = (int64_t)IDS[i] - (int64_t)ATTR[0];
  return IDS[i] >= 0 && c >= 0 && c < V ? c : -1;
}

/* xent_sumexp: logits, targets, m -> s */
static void ref_sumexp_s(double *const *in, double *out) {
  for (int64_t i = 0; i < N; i++) {
    double s = 0;
    for (int64_t v = 0; v < V; v++)
      s += exp(in[0][i * V + v] - in[2][i]);
    out[i] = s;
  }
}

/* xent_sumexp -> tl */
static void ref_sumexp_tl(double *const *in, double *out) {
  for (int64_t i = 0; i < N; i++) {
    int64_t c = shard_col(i);
    out[i] = c >= 0 ? in[0][i * V + c] : 0;
  }
}

static double ref_divisor(void) {
  if (ATTR[0] > 0)
    return ATTR[0];
  double n = 0;
  for (int64_t i = 0; i < N; i++)
    n += IDS[i] >= 0;
  return n;
}

/* xent_finish: s, tl, m, targets -> loss */
static void ref_finish_loss(double *const *in, double *out) {
  double total = 0;
  for (int64_t i = 0; i < N; i++)
    if (IDS[i] >= 0)
      total += in[2][i] + log(in[0][i]) - in[1][i];
  out[0] = total / ref_divisor();
}

/* xent_finish -> lse */
static void ref_finish_lse(double *const *in, double *out) {
  for (int64_t i = 0; i < N; i++)
    out[i] = in[2][i] + log(in[0][i]);
}

static void run_case_more(const struct ref_case *c, const struct ref_more *mo) {
  struct mr_graph g;
  struct mr_exec x;
  mr_graph_init(&g);
  int in[MAXIN], out[MR_OP_MAX_OUT], seed;
  for (int i = 0; i < c->n_in; i++) {
    char nm[8] = {(char)('a' + i), 0};
    int nd = c->shape[i][1] ? 2 : 1;
    in[i] = c->is_ids[i] ? mr_graph_tensor(&g, nm, MR_I32, MR_ROLE_INPUT, 1, c->shape[i])
                         : mr_graph_param(&g, nm, MR_INIT_NONE, nd, c->shape[i]);
  }
  ck_assert_int_ge(mr_graph_op(&g, c->kind, "y", in, c->n_in, c->attr, out), 0);
  int yo = out[mo->out_index];
  ck_assert_int_eq(mr_autodiff(&g, yo, &seed), 0);
  ck_assert_int_eq(mr_exec_init(&x, &g, 2, MR_AMP_NONE), 0);
  memcpy(ATTR, c->attr, sizeof ATTR);
  double *din[MAXIN] = {NULL};
  int32_t ids[64];
  for (int i = 0; i < c->n_in; i++) {
    int64_t n = numel(c->shape[i]);
    if (c->is_ids[i]) {
      for (int64_t k = 0; k < n; k++)
        ids[k] = (int32_t)((k * 5 + 3) % (mo->id_range ? mo->id_range : V));
      if (mo->ignore && n > 1)
        ids[1] = -1;
      memcpy(mr_exec_buf(&x, in[i]), ids, (size_t)n * sizeof *ids);
      IDS = mr_exec_buf(&x, in[i]);
      continue;
    }
    float *p = mr_exec_buf(&x, in[i]);
    gc_fill(p, n, c->scale);
    for (int64_t k = 0; mo->positive[i] && k < n; k++)
      p[k] = 0.5f + fabsf(p[k]);
    din[i] = malloc((size_t)n * sizeof(double));
    for (int64_t k = 0; k < n; k++)
      din[i][k] = p[k];
  }
  int64_t no = mr_tensor_numel(&g.tensors[yo]);
  double *ref = malloc((size_t)no * sizeof *ref), *r = malloc((size_t)no * sizeof *r);
  float *seedv = mr_exec_buf(&x, seed);
  for (int64_t k = 0; k < no; k++)
    r[k] = seedv[k] = (float)gc_uniform();
  ck_assert_int_eq(mr_exec_run(&x, 0, g.n_ops), 0);
  c->ref(din, ref);
  const float *y = mr_exec_buf(&x, yo);
  for (int64_t k = 0; k < no; k++)
    ck_assert_msg(fabs(y[k] - ref[k]) < 1e-5 * (1 + fabs(ref[k])),
                  "%s: output %lld: %.8g, reference %.8g", c->name, (long long)k,
                  y[k], ref[k]);
  for (int i = 0; i < c->n_in; i++) {
    if (!din[i])
      continue;
    if (mo->no_grad[i]) {
      ck_assert_int_lt(g.tensors[in[i]].grad, 0);
      continue;
    }
    const float *gr = mr_exec_buf(&x, g.tensors[in[i]].grad);
    for (int64_t k = 0; k < numel(c->shape[i]); k++) {
      double keep = din[i][k], h = 1e-6, lp = 0, lm = 0;
      din[i][k] = keep + h;
      c->ref(din, ref);
      for (int64_t m = 0; m < no; m++)
        lp += ref[m] * r[m];
      din[i][k] = keep - h;
      c->ref(din, ref);
      for (int64_t m = 0; m < no; m++)
        lm += ref[m] * r[m];
      din[i][k] = keep;
      double fd = (lp - lm) / (2 * h);
      ck_assert_msg(fabs(gr[k] - fd) < 2e-4 * (1 + fabs(fd)),
                    "%s: d/d input %d [%lld]: autodiff %.8g, finite difference %.8g",
                    c->name, i, (long long)k, gr[k], fd);
    }
  }
  for (int i = 0; i < c->n_in; i++)
    free(din[i]);
  free(ref);
  free(r);
  mr_exec_close(&x);
  mr_graph_close(&g);
}

static void run_case(const struct ref_case *c) {
  static const struct ref_more none;
  run_case_more(c, &none);
}

START_TEST(test_graph_ref_ops) {
  /* rows 6, features 8, seq 3 (two sequences), heads 2 of dim 4 */
  N = 6, C = 8, T = 3, H = 2, KH = 2, D = 4, V = 5;
  struct ref_case lin = {"linear", MR_OP_MATMUL, 3, {{6, 8}, {5, 8}, {5, 0}},
                         {0}, 1.0, {0, 1}, ref_matmul_nt};
  run_case(&lin);
  struct ref_case mtn = {"matmul A^T B", MR_OP_MATMUL, 2, {{6, 8}, {6, 5}},
                         {0}, 1.0, {1, 0}, ref_matmul_tn};
  run_case(&mtn);
  struct ref_case rms = {"rmsnorm", MR_OP_RMSNORM, 2, {{6, 8}, {8, 0}}, {0}, 1.0,
                         {1e-5}, ref_rmsnorm};
  run_case(&rms);
  struct ref_case ln = {"layernorm", MR_OP_LAYERNORM, 3, {{6, 8}, {8, 0}, {8, 0}},
                        {0}, 1.0, {1e-5}, ref_layernorm};
  run_case(&ln);
  struct ref_case rope = {"rope", MR_OP_ROPE, 1, {{6, 8}}, {0}, 1.0,
                          {3, 2, 10000.0, 1}, ref_rope};
  run_case(&rope);
  struct ref_case sw = {"swiglu", MR_OP_SWIGLU, 2, {{6, 8}, {6, 8}}, {0}, 2.0,
                        {0}, ref_swiglu};
  run_case(&sw);
  struct ref_case ge = {"gelu", MR_OP_GELU, 1, {{6, 8}}, {0}, 3.0, {0}, ref_gelu};
  run_case(&ge);
  struct ref_case ad = {"add", MR_OP_ADD, 2, {{6, 8}, {6, 8}}, {0}, 1.0, {0}, ref_add};
  run_case(&ad);
  struct ref_case em = {"embedding", MR_OP_EMBEDDING, 2, {{6, 0}, {5, 8}}, {1, 0},
                        1.0, {0}, ref_embedding};
  run_case(&em);
}
END_TEST

START_TEST(test_graph_ref_attention_gqa) {
  N = 8, T = 4, H = 4, KH = 2, D = 4;
  struct ref_case at = {"attention", MR_OP_ATTENTION, 3, {{8, 16}, {8, 8}, {8, 8}},
                        {0}, 1.5, {4, 4, 2}, ref_attention};
  run_case(&at);
}
END_TEST

START_TEST(test_graph_ref_cross_entropy) {
  N = 6, V = 7;
  struct ref_case xe = {"cross_entropy", MR_OP_CROSS_ENTROPY, 2, {{6, 7}, {6, 0}},
                        {0, 1}, 3.0, {0}, ref_xent};
  run_case(&xe);
}
END_TEST

/* Each step of the vocabulary-parallel cross-entropy alone, at odd and
 * uneven shapes, on a vocabulary shard (columns lo.. of a larger
 * vocabulary, so some targets fall outside) and whole, with an ignored
 * row: its outputs against the double reference, and the gradients its
 * builder emits (for each output alone: the other's is absent) against
 * finite differences.  m is an input the steps pass no gradient to. */
START_TEST(test_graph_ref_vocab_parallel_steps) {
  static const int64_t shapes[][4] = {/* N, V, lo, vocab */
                                      {1, 1, 0, 0},   {3, 7, 0, 0},
                                      {5, 13, 4, 23}, {7, 20, 0, 0},
                                      {2, 33, 30, 70}, {6, 9, 3, 12}};
  for (size_t k = 0; k < MR_ARRAY_LEN(shapes); k++) {
    int64_t n = shapes[k][0], v = shapes[k][1];
    N = n, V = v;
    double lo = (double)shapes[k][2], vocab = (double)shapes[k][3];
    int64_t range = shapes[k][3] ? shapes[k][3] : v;
    for (int o = 0; o < 2; o++) {
      struct ref_case se = {o ? "xent_sumexp tl" : "xent_sumexp s",
                            MR_OP_XENT_SUMEXP, 3, {{n, v}, {n, 0}, {n, 0}},
                            {0, 1, 0}, 2.0, {lo, vocab},
                            o ? ref_sumexp_tl : ref_sumexp_s};
      struct ref_more sm = {.out_index = o, .no_grad = {0, 0, 1},
                            .id_range = range, .ignore = 1};
      run_case_more(&se, &sm);
      /* the mean over the valid rows, and over a given row count */
      for (int given = 0; given < 2; given++) {
        struct ref_case fi = {o ? "xent_finish lse" : "xent_finish loss",
                              MR_OP_XENT_FINISH, 4, {{n, 0}, {n, 0}, {n, 0}, {n, 0}},
                              {0, 0, 0, 1}, 1.0, {given ? 2.0 * (double)n : 0},
                              o ? ref_finish_lse : ref_finish_loss};
        struct ref_more fm = {.out_index = o, .no_grad = {0, 0, 1},
                              .positive = {1}, .ignore = 1};
        run_case_more(&fi, &fm);
      }
    }
  }
}
END_TEST

/* mean cross-entropy over the non-ignored rows, from the logits */
static void ref_xent_mean(const double *x, double *loss, double *lse) {
  double total = 0, valid = 0;
  for (int64_t i = 0; i < N; i++) {
    double mx = -INFINITY, s = 0;
    for (int64_t v = 0; v < V; v++)
      mx = fmax(mx, x[i * V + v]);
    for (int64_t v = 0; v < V; v++)
      s += exp(x[i * V + v] - mx);
    lse[i] = mx + log(s);
    if (IDS[i] >= 0) {
      total += lse[i] - x[i * V + IDS[i]];
      valid++;
    }
  }
  *loss = total / valid;
}

/* The three steps chained as the model chains them: loss and lse equal
 * the fused definition, and the gradient over the logits — which drops m's
 * path — equals finite differences of the whole function, m recomputed. */
static void run_vocab_loss(int64_t n, int64_t v, int out_index) {
  N = n, V = v;
  memset(ATTR, 0, sizeof ATTR);
  struct mr_graph g;
  struct mr_exec x;
  mr_graph_init(&g);
  int64_t ls[2] = {n, v};
  int lg = mr_graph_param(&g, "logits", MR_INIT_NONE, 2, ls);
  int ys = mr_graph_tensor(&g, "targets", MR_I32, MR_ROLE_INPUT, 1, ls);
  int m, se[MR_OP_MAX_OUT], fo[MR_OP_MAX_OUT], seed;
  int in1[1] = {lg};
  ck_assert_int_ge(mr_graph_op(&g, MR_OP_XENT_MAX, "m", in1, 1, NULL, &m), 0);
  int in2[3] = {lg, ys, m};
  ck_assert_int_ge(mr_graph_op(&g, MR_OP_XENT_SUMEXP, "s", in2, 3, NULL, se), 0);
  int in3[4] = {se[0], se[1], m, ys};
  ck_assert_int_ge(mr_graph_op(&g, MR_OP_XENT_FINISH, "loss", in3, 4, NULL, fo), 0);
  ck_assert_int_eq(mr_autodiff(&g, fo[out_index], &seed), 0);
  ck_assert_int_eq(mr_exec_init(&x, &g, 2, MR_AMP_NONE), 0);
  int32_t *ids = mr_exec_buf(&x, ys);
  for (int64_t k = 0; k < n; k++)
    ids[k] = (int32_t)((k * 7 + 2) % v);
  if (n > 2)
    ids[2] = -1;
  IDS = ids;
  float *p = mr_exec_buf(&x, lg);
  gc_fill(p, n * v, 3.0);
  p[0] = 40.0f; /* a dominant logit: the shift by m matters */
  double *d = malloc(sizeof(double) * (size_t)(n * v));
  for (int64_t k = 0; k < n * v; k++)
    d[k] = p[k];
  int64_t no = out_index ? n : 1;
  double *r = malloc(sizeof(double) * (size_t)no);
  float *sv = mr_exec_buf(&x, seed);
  for (int64_t k = 0; k < no; k++)
    r[k] = sv[k] = (float)gc_uniform();
  ck_assert_int_eq(mr_exec_run(&x, 0, g.n_ops), 0);
  double loss, *lse = malloc(sizeof(double) * (size_t)n);
  ref_xent_mean(d, &loss, lse);
  const float *y = mr_exec_buf(&x, fo[out_index]);
  for (int64_t k = 0; k < no; k++) {
    double want = out_index ? lse[k] : loss;
    ck_assert_msg(fabs(y[k] - want) < 1e-5 * (1 + fabs(want)),
                  "vocab loss %lldx%lld output %d[%lld]: %.8g, reference %.8g",
                  (long long)n, (long long)v, out_index, (long long)k, y[k], want);
  }
  const float *mv = mr_exec_buf(&x, m);
  for (int64_t i = 0; i < n; i++) {
    float mx = -INFINITY;
    for (int64_t k = 0; k < v; k++)
      mx = fmaxf(mx, p[i * v + k]);
    ck_assert_float_eq(mv[i], mx);
  }
  const float *gr = mr_exec_buf(&x, g.tensors[lg].grad);
  for (int64_t k = 0; k < n * v; k++) {
    double keep = d[k], h = 1e-6, lp = 0, lm = 0;
    d[k] = keep + h;
    ref_xent_mean(d, &loss, lse);
    for (int64_t j = 0; j < no; j++)
      lp += (out_index ? lse[j] : loss) * r[j];
    d[k] = keep - h;
    ref_xent_mean(d, &loss, lse);
    for (int64_t j = 0; j < no; j++)
      lm += (out_index ? lse[j] : loss) * r[j];
    d[k] = keep;
    double fd = (lp - lm) / (2 * h);
    ck_assert_msg(fabs(gr[k] - fd) < 2e-4 * (1 + fabs(fd)),
                  "vocab loss %lldx%lld output %d: d/d logits[%lld]: autodiff "
                  "%.8g, finite difference %.8g", (long long)n, (long long)v,
                  out_index, (long long)k, gr[k], fd);
  }
  free(d);
  free(r);
  free(lse);
  mr_exec_close(&x);
  mr_graph_close(&g);
}

START_TEST(test_graph_ref_vocab_parallel_loss_chained) {
  static const int64_t shapes[][2] = {{1, 1}, {1, 5}, {4, 3}, {5, 17}, {9, 41}};
  for (size_t k = 0; k < MR_ARRAY_LEN(shapes); k++)
    for (int o = 0; o < 2; o++)
      run_vocab_loss(shapes[k][0], shapes[k][1], o);
}
END_TEST

Suite *graph_ref_suite(void);
Suite *graph_ref_suite(void) {
  Suite *s = suite_create("graph_ref");
  TCase *tc = tcase_create("reference");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_graph_ref_ops);
  tcase_add_test(tc, test_graph_ref_attention_gqa);
  tcase_add_test(tc, test_graph_ref_cross_entropy);
  tcase_add_test(tc, test_graph_ref_vocab_parallel_steps);
  tcase_add_test(tc, test_graph_ref_vocab_parallel_loss_chained);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(graph_ref_suite)
