/* test_spmd_plugin.c - the example plugin (examples/plugins/add_rmsnorm.c)
 * loaded, its op used inside a small tensor-parallel model, completed with
 * its SPMD rule and simulated against the single-rank run; loading errors
 * named. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compiler/autodiff.h"
#include "common/error.h"
#include "compiler/ops.h"
#include "compiler/plugin.h"
#include "compiler/spmd/completion.h"
#include "compiler/spmd/rules.h"
#include "tests/check_main.h"
#include "tests/spmd_sim.h"

static int load(void) {
  static int kind = -2;
  if (kind != -2)
    return kind;
  char path[1024];
  const char *b = getenv("MESHRUN_BUILD_DIR");
  snprintf(path, sizeof path, "%s/examples/plugins/add_rmsnorm.so", b ? b : "build");
  struct mr_plugin_api api;
  mr_plugin_api_init(&api);
  ck_assert_msg(mr_plugin_load(path, &api) == 0, "%s", mr_error_message());
  kind = mr_op_kind_by_name("add_rmsnorm");
  ck_assert_int_ge(kind, MR_OP_COUNT);
  return kind;
}

struct net {
  struct mr_graph g;
  int seed;
};

static int param(struct mr_graph *g, const char *nm, int64_t a, int64_t b) {
  int64_t s[2] = {a, b};
  return mr_graph_param(g, nm, MR_INIT_NORMAL, b ? 2 : 1, s);
}

/* x -> column-parallel w1 -> row-parallel w2 -> add_rmsnorm(x, .) ->
 * logits from both of its outputs -> cross-entropy */
static void build(struct net *n, int64_t N, int64_t C, int64_t I, int64_t V) {
  struct mr_graph *g = &n->g;
  mr_graph_init(g);
  int64_t xs[2] = {N, C}, ls[1] = {N};
  int x = mr_graph_tensor(g, "x", MR_F32, MR_ROLE_INPUT, 2, xs);
  int y = mr_graph_tensor(g, "labels", MR_I32, MR_ROLE_INPUT, 1, ls);
  int w1 = param(g, "mlp.up_proj.weight", I, C);
  int w2 = param(g, "mlp.down_proj.weight", C, I);
  int wn = param(g, "norm.weight", C, 0);
  int wh = param(g, "head.weight", V, C);
  int w3 = param(g, "skip.weight", V, C);
  double tb[MR_OP_MAX_ATTR] = {0, 1}, eps[MR_OP_MAX_ATTR] = {1e-5};
  int a, b, o[3], l1, l2, lg, out[2];
  int in[3] = {x, w1};
  ck_assert_int_ge(mr_graph_op(g, MR_OP_MATMUL, "a", in, 2, tb, &a), 0);
  in[0] = a, in[1] = w2;
  ck_assert_int_ge(mr_graph_op(g, MR_OP_MATMUL, "b", in, 2, tb, &b), 0);
  in[0] = x, in[1] = b, in[2] = wn;
  ck_assert_msg(mr_graph_op(g, load(), "n", in, 3, eps, o) >= 0, "%s",
                mr_error_message());
  in[0] = o[1], in[1] = wh;
  ck_assert_int_ge(mr_graph_op(g, MR_OP_MATMUL, "l1", in, 2, tb, &l1), 0);
  in[0] = o[0], in[1] = w3;
  ck_assert_int_ge(mr_graph_op(g, MR_OP_MATMUL, "l2", in, 2, tb, &l2), 0);
  in[0] = l1, in[1] = l2;
  ck_assert_int_ge(mr_graph_op(g, MR_OP_ADD, "logits", in, 2, NULL, &lg), 0);
  in[0] = lg, in[1] = y;
  ck_assert_int_ge(mr_graph_op(g, MR_OP_CROSS_ENTROPY, "loss", in, 2, NULL, out), 0);
  g->loss = out[0];
  ck_assert_int_eq(mr_autodiff(g, out[0], &n->seed), 0);
}

static float **inputs(const struct net *n, uint32_t s) {
  const struct mr_graph *g = &n->g;
  float **in = calloc((size_t)g->n_tensors, sizeof *in);
  for (int t = 0; t < g->n_tensors; t++) {
    const struct mr_tensor *tt = &g->tensors[t];
    if (tt->producer >= 0)
      continue;
    int64_t k = mr_tensor_numel(tt);
    in[t] = malloc(sizeof(float) * (size_t)k);
    for (int64_t e = 0; e < k; e++) {
      s = s * 1664525u + 1013904223u;
      in[t][e] = tt->dtype == MR_I32 ? (float)((s >> 8) % 11u)
                 : t == n->seed      ? 1.0f
                                     : (float)((s >> 8) % 2001) / 2000.0f - 0.5f;
    }
  }
  return in;
}

static struct mr_shard_rule_placement col = {"model", "Shard(0)"};
static struct mr_shard_rule_placement row = {"model", "Shard(1)"};
static struct mr_shard_rule rules[] = {{"up_proj", &col, 1},
                                       {"down_proj", &row, 1}};

static void run(const char *mesh, int sp, enum mr_reshard_kind expect) {
  struct net n;
  build(&n, 12, 8, 12, 11);
  const struct mr_graph *g = &n.g;
  struct mr_mesh m;
  ck_assert_int_eq(mr_mesh_parse(mesh, &m), 0);
  struct mr_dist_attr *seed = calloc((size_t)g->n_tensors, sizeof *seed);
  int x = mr_graph_find(g, "x"), md = mr_mesh_dim(&m, "model");
  int dd = mr_mesh_dim(&m, "data");
  seed[x] = mr_dist_replicated(m.ndim);
  if (dd >= 0)
    seed[x].p[dd] = mr_shard(0);
  if (sp)
    seed[x].p[md] = mr_shard(0);
  struct mr_completion_opts o;
  memset(&o, 0, sizeof o);
  o.rules = rules;
  o.n_rules = 2;
  o.data_dim = dd;
  o.seq_dim = sp ? md : -1;
  o.seed = seed;
  struct mr_dist_graph dg;
  ck_assert_msg(mr_spmd_complete(g, &m, &o, &dg) == 0, "%s", mr_error_message());
  /* the row-parallel output reaches the fused op through one collective */
  int op = g->tensors[mr_graph_find(g, "n")].producer;
  int e = dg.edge_of[op * MR_OP_MAX_IN + 1];
  ck_assert_int_ge(e, 0);
  ck_assert_int_eq(dg.edges[e].plan.n_steps, 1);
  ck_assert_int_eq(dg.edges[e].plan.steps[0].kind, expect);
  ck_assert_int_eq(dg.edges[e].plan.steps[0].mesh_dim, md);
  float **in = inputs(&n, 99);
  float **ref = calloc((size_t)g->n_tensors, sizeof *ref);
  float **got = calloc((size_t)g->n_tensors, sizeof *got);
  ck_assert_int_eq(sim_run_reference(g, in, ref), 0);
  ck_assert_msg(sim_run_graph(&dg, in, got) == 0, "%s", mr_error_message());
  int checked = 0;
  for (int t = 0; t < g->n_tensors; t++) {
    const struct mr_tensor *tt = &g->tensors[t];
    if (t != g->loss && tt->role != MR_ROLE_GRAD)
      continue;
    double err = sim_rel_err(got[t], ref[t], mr_tensor_numel(tt));
    ck_assert_msg(err <= 1e-5, "%s off by %g", tt->name, err);
    checked++;
  }
  ck_assert_int_ge(checked, 6); /* loss and five parameter gradients */
  for (int t = 0; t < g->n_tensors; t++) {
    free(in[t]);
    free(ref[t]);
    free(got[t]);
  }
  free(in);
  free(ref);
  free(got);
  free(seed);
  mr_dist_graph_close(&dg);
  mr_graph_close(&n.g);
}

START_TEST(test_plugin_op_in_tensor_parallel_model) {
  run("data=2,model=2", 0, MR_RS_ALL_REDUCE);
}
END_TEST

START_TEST(test_plugin_op_sequence_parallel) {
  run("model=4", 1, MR_RS_REDUCE_SCATTER);
}
END_TEST

START_TEST(test_plugin_load_errors_name_the_file) {
  struct mr_plugin_api api;
  mr_plugin_api_init(&api);
  ck_assert_int_eq(mr_plugin_load("/nonexistent/p.so", &api), MR_ENOENT);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "/nonexistent/p.so"));
  ck_assert_int_eq(mr_plugin_load("libm.so.6", &api), MR_EINVAL);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "meshrun_plugin_init"));
  /* a name taken cannot be registered twice */
  struct mr_op_def d = *mr_op_def(MR_OP_ADD);
  ck_assert_int_eq(mr_op_register(&d), MR_EINVAL);
}
END_TEST

static Suite *spmd_plugin_suite(void) {
  Suite *s = suite_create("spmd_plugin");
  TCase *tc = tcase_create("plugin");
  tcase_add_test(tc, test_plugin_op_in_tensor_parallel_model);
  tcase_add_test(tc, test_plugin_op_sequence_parallel);
  tcase_add_test(tc, test_plugin_load_errors_name_the_file);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(spmd_plugin_suite)
