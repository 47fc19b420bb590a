/* test_spmd.c - every SPMD rule, run by the simulated executor: for each
 * op, random shapes (uneven splits included) and every combination of
 * input placements on 1-D and 2-D meshes (a seeded sample where there are
 * too many), the op is completed (forward inference and the reshards it
 * asks for) and run per rank with the real CPU kernels; each output must
 * equal the single-rank result (exhaustive on 1-D meshes but for
 * attention_bwd's 18750 combinations).  Reverse inference is checked the same way
 * from output placements. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "compiler/ops.h"
#include "compiler/spmd/completion.h"
#include "compiler/spmd/rules.h"
#include "tests/check_main.h"
#include "tests/spmd_sim.h"

/* 1-D meshes: every combination up to EXHAUSTIVE of them, else SAMPLE;
 * 2-D meshes: SAMPLE */
#define EXHAUSTIVE 2000
#define SAMPLE 150

static uint32_t lcg(uint32_t *s) {
  *s = *s * 1664525u + 1013904223u;
  return *s >> 8;
}

static int64_t pick(uint32_t *s, int64_t lo, int64_t hi) {
  return lo + (int64_t)(lcg(s) % (uint32_t)(hi - lo + 1));
}

struct opcase {
  struct mr_graph g;
  int64_t vocab;   // range of integer inputs
  int positive[MR_OP_MAX_IN]; // inputs drawn in (0.5, 1.5)
};

static int in1(struct mr_graph *g, const char *nm, enum mr_dtype dt, int64_t a) {
  int64_t s[1] = {a};
  return mr_graph_tensor(g, nm, dt, MR_ROLE_INPUT, 1, s);
}

static int in2(struct mr_graph *g, const char *nm, int64_t a, int64_t b) {
  int64_t s[2] = {a, b};
  return mr_graph_tensor(g, nm, MR_F32, MR_ROLE_INPUT, 2, s);
}

/* One op of kind with random dims. */
static void build(int kind, uint32_t *s, struct opcase *c) {
  struct mr_graph *g = &c->g;
  mr_graph_init(g);
  memset(c->positive, 0, sizeof c->positive);
  int64_t T = pick(s, 2, 3), B = pick(s, 1, 4), N = B * T, C = pick(s, 3, 7);
  int64_t H = pick(s, 1, 2) * 2, KH = (lcg(s) & 1) ? H : H / 2, D = 4;
  int64_t V = pick(s, 5, 9);
  c->vocab = V;
  double a[MR_OP_MAX_ATTR] = {0};
  int in[MR_OP_MAX_IN], n = 0;
  switch (kind) {
  case MR_OP_EMBEDDING:
    in[n++] = in1(g, "ids", MR_I32, N);
    in[n++] = in2(g, "table", V, C);
    break;
  case MR_OP_EMBEDDING_BWD:
    in[n++] = in1(g, "ids", MR_I32, N);
    in[n++] = in2(g, "dout", N, C);
    a[0] = (double)V;
    break;
  case MR_OP_MATMUL: {
    int64_t M = pick(s, 2, 7), K = pick(s, 2, 7), NN = pick(s, 2, 7);
    a[0] = lcg(s) & 1;
    a[1] = lcg(s) & 1;
    in[n++] = a[0] ? in2(g, "A", K, M) : in2(g, "A", M, K);
    in[n++] = a[1] ? in2(g, "B", NN, K) : in2(g, "B", K, NN);
    if (lcg(s) & 1)
      in[n++] = in1(g, "bias", MR_F32, NN);
    break;
  }
  case MR_OP_BIAS_GRAD:
    in[n++] = in2(g, "dy", N, C);
    break;
  case MR_OP_ADD:
    if (lcg(s) % 3 == 0) {
      in[n++] = in1(g, "a", MR_F32, N);
      in[n++] = in1(g, "b", MR_F32, N);
    } else {
      in[n++] = in2(g, "a", N, C);
      in[n++] = in2(g, "b", N, C);
    }
    break;
  case MR_OP_RMSNORM:
  case MR_OP_LAYERNORM:
    a[0] = 1e-5;
    in[n++] = in2(g, "x", N, C);
    in[n++] = in1(g, "w", MR_F32, C);
    if (kind == MR_OP_LAYERNORM)
      in[n++] = in1(g, "b", MR_F32, C);
    break;
  case MR_OP_RMSNORM_BWD:
  case MR_OP_LAYERNORM_BWD:
    in[n++] = in2(g, "dy", N, C);
    in[n++] = in2(g, "x", N, C);
    in[n++] = in1(g, "w", MR_F32, C);
    if (kind == MR_OP_LAYERNORM_BWD)
      in[n++] = in1(g, "mean", MR_F32, N);
    c->positive[n] = 1;
    in[n++] = in1(g, "rstd", MR_F32, N);
    break;
  case MR_OP_ROPE:
    a[0] = (double)T, a[1] = (double)H, a[2] = 10000, a[3] = (lcg(s) & 1) ? 1 : -1;
    in[n++] = in2(g, "x", N, H * D);
    break;
  case MR_OP_SWIGLU:
  case MR_OP_GELU_BWD:
    in[n++] = in2(g, "a", N, C);
    in[n++] = in2(g, "b", N, C);
    break;
  case MR_OP_SWIGLU_BWD:
    in[n++] = in2(g, "dy", N, C);
    in[n++] = in2(g, "gate", N, C);
    in[n++] = in2(g, "up", N, C);
    break;
  case MR_OP_GELU:
    in[n++] = in2(g, "x", N, C);
    break;
  case MR_OP_ATTENTION:
    a[0] = (double)T, a[1] = (double)H, a[2] = (double)KH;
    in[n++] = in2(g, "q", N, H * D);
    in[n++] = in2(g, "k", N, KH * D);
    in[n++] = in2(g, "v", N, KH * D);
    break;
  case MR_OP_ATTENTION_BWD:
    a[0] = (double)T, a[1] = (double)H, a[2] = (double)KH;
    in[n++] = in2(g, "do", N, H * D);
    in[n++] = in2(g, "q", N, H * D);
    in[n++] = in2(g, "k", N, KH * D);
    in[n++] = in2(g, "v", N, KH * D);
    in[n++] = in2(g, "o", N, H * D);
    {
      int64_t ls[3] = {B, H, T};
      in[n++] = mr_graph_tensor(g, "lse", MR_F32, MR_ROLE_INPUT, 3, ls);
    }
    break;
  case MR_OP_SPLIT3:
    in[n++] = in2(g, "x", N, 3 * C);
    break;
  case MR_OP_CONCAT3:
    in[n++] = in2(g, "x0", N, C);
    in[n++] = in2(g, "x1", N, C);
    in[n++] = in2(g, "x2", N, C);
    break;
  case MR_OP_CROSS_ENTROPY:
    in[n++] = in2(g, "logits", N, V);
    in[n++] = in1(g, "targets", MR_I32, N);
    break;
  case MR_OP_CROSS_ENTROPY_BWD:
    in[n++] = in1(g, "dloss", MR_F32, 1);
    in[n++] = in2(g, "logits", N, V);
    in[n++] = in1(g, "targets", MR_I32, N);
    c->positive[n] = 1;
    in[n++] = in1(g, "lse", MR_F32, N);
    break;
  case MR_OP_XENT_MAX:
    in[n++] = in2(g, "logits", N, V);
    break;
  case MR_OP_XENT_SUMEXP:
  case MR_OP_XENT_SUMEXP_BWD:
    in[n++] = in2(g, "logits", N, V);
    in[n++] = in1(g, "targets", MR_I32, N);
    in[n++] = in1(g, "m", MR_F32, N);
    if (kind == MR_OP_XENT_SUMEXP_BWD) {
      in[n++] = in1(g, "ds", MR_F32, N);
      if (lcg(s) & 1) /* dtl absent: zero */
        in[n++] = in1(g, "dtl", MR_F32, N);
    }
    break;
  case MR_OP_XENT_FINISH:
    c->positive[n] = 1;
    in[n++] = in1(g, "s", MR_F32, N);
    in[n++] = in1(g, "tl", MR_F32, N);
    in[n++] = in1(g, "m", MR_F32, N);
    in[n++] = in1(g, "targets", MR_I32, N);
    break;
  case MR_OP_XENT_FINISH_BWD:
    c->positive[n] = 1;
    in[n++] = in1(g, "s", MR_F32, N);
    in[n++] = in1(g, "targets", MR_I32, N);
    in[n++] = in1(g, "dloss", MR_F32, 1);
    if (lcg(s) & 1)
      in[n++] = in1(g, "dlse", MR_F32, N);
    break;
  default:
    ck_abort_msg("no case for op %d", kind);
  }
  ck_assert_msg(mr_graph_op(g, kind, "y", in, n, a, NULL) >= 0, "%s",
                mr_error_message());
}

static float **values(const struct opcase *c, uint32_t seed) {
  const struct mr_graph *g = &c->g;
  float **v = calloc((size_t)g->n_tensors, sizeof *v);
  for (int t = 0; t < g->n_tensors; t++) {
    if (g->tensors[t].producer >= 0)
      continue;
    int64_t n = mr_tensor_numel(&g->tensors[t]);
    v[t] = malloc(sizeof(float) * (size_t)n);
    for (int64_t e = 0; e < n; e++) {
      if (g->tensors[t].dtype == MR_I32)
        v[t][e] = (float)(lcg(&seed) % (uint32_t)c->vocab);
      else if (c->positive[t])
        v[t][e] = 0.5f + (float)(lcg(&seed) % 1000) / 1000.0f;
      else
        v[t][e] = (float)(lcg(&seed) % 2001) / 1000.0f - 1.0f;
    }
  }
  return v;
}

static void free_all(float **v, int n) {
  for (int i = 0; i < n; i++)
    free(v[i]);
  free(v);
}

/* Placement option o of a tensor: R, Shard(0..ndim-1), Partial sum/avg
 * (float only). */
static int n_options(const struct mr_tensor *t) {
  return 1 + t->ndim + (t->dtype == MR_I32 ? 0 : 2);
}

static struct mr_placement option(const struct mr_tensor *t, int o) {
  if (o == 0)
    return mr_replicate();
  if (o <= t->ndim)
    return mr_shard(o - 1);
  return mr_partial(o == t->ndim + 1 ? MR_REDUCE_SUM : MR_REDUCE_AVG);
}

/* Completes the op with inputs seeded, simulates and compares outputs.
 * Returns 1 when no reshard was needed (the rule took the placements). */
static int run_case(const struct opcase *c, const struct mr_mesh *m,
                    const struct mr_dist_attr *seeds, const char *what) {
  const struct mr_graph *g = &c->g;
  struct mr_completion_opts o;
  memset(&o, 0, sizeof o);
  o.data_dim = o.seq_dim = -1;
  o.seed = seeds;
  struct mr_dist_graph dg;
  /* heads sharded over a degree that does not divide them: an error */
  const struct mr_op *op0 = &g->ops[0];
  int strict = op0->kind == MR_OP_ROPE || op0->kind == MR_OP_ATTENTION ||
               op0->kind == MR_OP_ATTENTION_BWD, bad = 0;
  for (int i = 0; strict && i < op0->n_in; i++) {
    int64_t hd = op0->kind == MR_OP_ROPE ? (int64_t)op0->attr[1]
                 : (op0->kind == MR_OP_ATTENTION ? (i == 0) : (i <= 1 || i >= 4))
                     ? (int64_t)op0->attr[1] : (int64_t)op0->attr[2];
    int64_t hmin = op0->kind == MR_OP_ROPE ? hd : (int64_t)op0->attr[2];
    /* the columns may be split by every mesh dim some input splits them
     * on */
    int64_t deg = 1, any = 0;
    for (int md = 0; md < m->ndim; md++) {
      int on = 0;
      for (int j = 0; j < op0->n_in; j++)
        on |= seeds[op0->in[j]].p[md].kind == MR_SHARD &&
              seeds[op0->in[j]].p[md].dim == 1;
      deg *= on ? m->shape[md] : 1;
      any |= seeds[op0->in[i]].p[md].kind == MR_SHARD &&
             seeds[op0->in[i]].p[md].dim == 1;
    }
    if (any && (hd % deg || hmin % deg))
      bad = 1;
  }
  int rc = mr_spmd_complete(g, m, &o, &dg);
  if (bad && rc == MR_EINVAL && strstr(mr_error_message(), "heads"))
    return 0;
  ck_assert_msg(rc == 0, "%s: %s", what, mr_error_message());
  float **in = values(c, 77);
  float **ref = calloc((size_t)g->n_tensors, sizeof *ref);
  float **got = calloc((size_t)g->n_tensors, sizeof *got);
  ck_assert_int_eq(sim_run_reference(g, in, ref), 0);
  ck_assert_msg(sim_run_graph(&dg, in, got) == 0, "%s: simulation failed: %s",
                what, mr_error_message());
  const struct mr_op *op = &g->ops[0];
  for (int j = 0; j < op->n_out; j++) {
    int t = op->out[j];
    double e = sim_rel_err(got[t], ref[t], mr_tensor_numel(&g->tensors[t]));
    char pl[128];
    mr_dist_format(&dg.tensor[t], pl, sizeof pl);
    ck_assert_msg(e <= 1e-5, "%s: output %d as %s off by %g", what, j, pl, e);
  }
  int taken = dg.n_edges == 0;
  free_all(in, g->n_tensors);
  free_all(ref, g->n_tensors);
  free_all(got, g->n_tensors);
  mr_dist_graph_close(&dg);
  return taken;
}

static void describe(const struct mr_graph *g, const struct mr_dist_attr *d,
                     const char *mesh, char *buf, size_t n) {
  const struct mr_op *op = &g->ops[0];
  int len = snprintf(buf, n, "%s on %s:", mr_op_def(op->kind)->name, mesh);
  for (int i = 0; i < op->n_in && len < (int)n - 40; i++) {
    char pl[96];
    mr_dist_format(&d[op->in[i]], pl, sizeof pl);
    len += snprintf(buf + len, n - (size_t)len, " %s", pl);
  }
}

static void forward_all(int kind, const char *mesh, uint32_t seed) {
  struct mr_mesh m;
  ck_assert_int_eq(mr_mesh_parse(mesh, &m), 0);
  int taken_sharded = 0, cases = 0;
  for (int shape_try = 0; shape_try < 3; shape_try++) {
    struct opcase c;
    build(kind, &seed, &c);
    const struct mr_graph *g = &c.g;
    const struct mr_op *op = &g->ops[0];
    /* options per (input, mesh dim), mixed radix */
    int radix[MR_OP_MAX_IN * MR_MESH_MAX_DIMS], nr = 0;
    double total = 1;
    for (int i = 0; i < op->n_in; i++)
      for (int md = 0; md < m.ndim; md++) {
        radix[nr++] = n_options(&g->tensors[op->in[i]]);
        total *= radix[nr - 1];
      }
    int all = total <= (m.ndim == 1 ? EXHAUSTIVE : SAMPLE);
    int count = all ? (int)total : SAMPLE;
    for (int k = 0; k < count; k++) {
      uint64_t code = all ? (uint64_t)k : lcg(&seed) * 4099u + lcg(&seed);
      struct mr_dist_attr *d = calloc((size_t)g->n_tensors, sizeof *d);
      int r = 0, sharded = 0;
      for (int i = 0; i < op->n_in; i++) {
        const struct mr_tensor *t = &g->tensors[op->in[i]];
        d[op->in[i]] = mr_dist_replicated(m.ndim);
        for (int md = 0; md < m.ndim; md++, r++) {
          d[op->in[i]].p[md] = option(t, (int)(code % (uint64_t)radix[r]));
          code /= (uint64_t)radix[r];
          sharded |= d[op->in[i]].p[md].kind != MR_REPLICATE;
        }
      }
      int valid = 1;
      for (int i = 0; i < op->n_in; i++)
        valid &= mr_dist_check(&d[op->in[i]], g->tensors[op->in[i]].ndim) == 0;
      if (valid) {
        char what[512];
        describe(g, d, mesh, what, sizeof what);
        taken_sharded += run_case(&c, &m, d, what) && sharded;
        cases++;
      }
      free(d);
    }
    mr_graph_close(&c.g);
  }
  ck_assert_int_gt(cases, 0);
  (void)taken_sharded;
}

/* From output placements: reverse inference's input needs must forward-
 * infer the same outputs, and run correctly. */
static int reverse_all(int kind, const char *mesh, uint32_t seed) {
  struct mr_mesh m;
  ck_assert_int_eq(mr_mesh_parse(mesh, &m), 0);
  struct opcase c;
  build(kind, &seed, &c);
  const struct mr_graph *g = &c.g;
  const struct mr_op *op = &g->ops[0];
  const struct mr_spmd_rule *r = mr_spmd_rule_find(mr_op_def(kind)->name);
  ck_assert_ptr_nonnull(r);
  const struct mr_tensor *t0 = &g->tensors[op->out[0]];
  int no = 1 + t0->ndim + 1;
  int total = 1, sharded = 0;
  for (int md = 0; md < m.ndim; md++)
    total *= no;
  for (int k = 0; k < total; k++) {
    struct mr_dist_attr out[MR_OP_MAX_OUT], need[MR_OP_MAX_IN], fixed[MR_OP_MAX_OUT];
    for (int j = 0; j < op->n_out; j++)
      memset(&out[j], 0, sizeof out[j]);
    out[0] = mr_dist_replicated(m.ndim);
    int code = k;
    for (int md = 0; md < m.ndim; md++) {
      out[0].p[md] = option(t0, code % no);
      code /= no;
    }
    ck_assert_int_eq(mr_spmd_infer_reverse(r, g, op, &m, out, need, fixed), 0);
    struct mr_dist_attr fwd_need[MR_OP_MAX_IN], fwd_out[MR_OP_MAX_OUT];
    ck_assert_int_eq(mr_spmd_infer(r, g, op, &m, need, 0, NULL, fwd_need, fwd_out), 0);
    for (int j = 0; j < op->n_out; j++)
      ck_assert_msg(mr_dist_eq(&fwd_out[j], &fixed[j]), "%s: reverse and "
                    "forward disagree", mr_op_def(kind)->name);
    struct mr_dist_attr *d = calloc((size_t)g->n_tensors, sizeof *d);
    for (int i = 0; i < op->n_in; i++)
      d[op->in[i]] = need[i];
    char what[512];
    describe(g, d, mesh, what, sizeof what);
    ck_assert_msg(run_case(&c, &m, d, what), "%s: needs of reverse inference "
                  "are resharded again", what);
    for (int i = 0; i < op->n_in; i++)
      for (int md = 0; md < m.ndim; md++)
        sharded += need[i].p[md].kind == MR_SHARD;
    free(d);
  }
  mr_graph_close(&c.g);
  return sharded;
}

START_TEST(test_spmd_rule_forward_every_placement) {
  int kind = _i;
  forward_all(kind, "x=2", 11u + (uint32_t)kind);
  forward_all(kind, "x=3", 23u + (uint32_t)kind);
  forward_all(kind, "data=2,model=2", 37u + (uint32_t)kind);
}
END_TEST

START_TEST(test_spmd_rule_reverse_every_output_placement) {
  int kind = _i;
  int sharded = 0;
  for (uint32_t k = 0; k < 3; k++) {
    sharded += reverse_all(kind, "x=2", 5u + 100 * k + (uint32_t)kind);
    sharded += reverse_all(kind, "data=2,model=2", 7u + 100 * k + (uint32_t)kind);
  }
  /* every rule takes some sharded inputs as they are */
  ck_assert_msg(sharded > 0, "%s never shards", mr_op_def(kind)->name);
}
END_TEST

START_TEST(test_spmd_every_op_has_a_rule) {
  /* in its row, named for it; one registered by name takes its place */
  for (int k = 0; k < MR_OP_COUNT; k++) {
    const struct mr_op_def *d = mr_op_def(k);
    ck_assert_msg(d->spmd != NULL && strcmp(d->spmd->op, d->name) == 0, "%s", d->name);
    ck_assert_ptr_eq(mr_spmd_rule_find(d->name), d->spmd);
    ck_assert_ptr_eq(mr_spmd_rule_of(k), d->spmd);
  }
  ck_assert_ptr_null(mr_spmd_rule_find("no_such_op"));
  ck_assert_ptr_null(mr_spmd_rule_of(MR_OP_MAX_KINDS));
  static const struct mr_spmd_rule other = {"gelu", NULL, NULL};
  ck_assert_int_eq(mr_spmd_rule_register(&other), 0);
  ck_assert_ptr_eq(mr_spmd_rule_of(MR_OP_GELU), &other);
  ck_assert_ptr_eq(mr_op_def(MR_OP_GELU)->spmd, &mr_spmd_rule_gelu);
}
END_TEST

START_TEST(test_spmd_matmul_column_and_row_parallel) {
  /* x[8,6] W^T with W[4,6]: W Shard(0) -> y Shard(1); W Shard(1) -> x
   * needs Shard(1) and y is Partial(sum) */
  struct mr_graph g;
  mr_graph_init(&g);
  int64_t xs[2] = {8, 6}, ws[2] = {4, 6};
  int x = mr_graph_tensor(&g, "x", MR_F32, MR_ROLE_INPUT, 2, xs);
  int w = mr_graph_tensor(&g, "w", MR_F32, MR_ROLE_PARAM, 2, ws);
  double a[MR_OP_MAX_ATTR] = {0, 1};
  int in[2] = {x, w};
  ck_assert_int_ge(mr_graph_op(&g, MR_OP_MATMUL, "y", in, 2, a, NULL), 0);
  struct mr_mesh m;
  ck_assert_int_eq(mr_mesh_parse("model=2", &m), 0);
  const struct mr_spmd_rule *r = mr_spmd_rule_find("matmul");
  struct mr_dist_attr d[2] = {mr_dist_replicated(1), mr_dist_replicated(1)};
  struct mr_dist_attr need[2], out[1];
  d[1].p[0] = mr_shard(0);
  ck_assert_int_eq(mr_spmd_infer(r, &g, &g.ops[0], &m, d, 2u, NULL, need, out), 0);
  ck_assert(out[0].p[0].kind == MR_SHARD && out[0].p[0].dim == 1);
  ck_assert(need[0].p[0].kind == MR_REPLICATE);
  d[1].p[0] = mr_shard(1);
  d[0].p[0] = mr_shard(0); /* the hint wins over the activation's rows */
  ck_assert_int_eq(mr_spmd_infer(r, &g, &g.ops[0], &m, d, 2u, NULL, need, out), 0);
  ck_assert(out[0].p[0].kind == MR_PARTIAL && out[0].p[0].reduce == MR_REDUCE_SUM);
  ck_assert(need[0].p[0].kind == MR_SHARD && need[0].p[0].dim == 1);
  mr_graph_close(&g);
}
END_TEST

static Suite *spmd_suite(void) {
  Suite *s = suite_create("spmd");
  TCase *tc = tcase_create("rules");
  tcase_set_timeout(tc, 120);
  tcase_add_loop_test(tc, test_spmd_rule_forward_every_placement, 0, MR_OP_COUNT);
  tcase_add_loop_test(tc, test_spmd_rule_reverse_every_output_placement, 0,
                      MR_OP_COUNT);
  tcase_add_test(tc, test_spmd_every_op_has_a_rule);
  tcase_add_test(tc, test_spmd_matmul_column_and_row_parallel);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(spmd_suite)
