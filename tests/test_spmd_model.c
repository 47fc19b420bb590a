/* test_spmd_model.c - the tiny LLaMA's forward and backward graph completed
 * for data x tensor parallelism, tensor parallelism with sequence
 * parallelism, and a vocabulary-sharded head; Megatron's communication
 * counted; every layout run on simulated ranks and compared with the
 * single-rank executor (loss and every parameter gradient). */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compiler/autodiff.h"
#include "common/error.h"
#include "compiler/model.h"
#include "compiler/ops.h"
#include "compiler/spmd/completion.h"
#include "tests/check_main.h"
#include "tests/spmd_sim.h"

struct fx {
  struct mr_model mo;
  int seed;
  int layers;
};

/* The tiny LLaMA: 2 layers of width 32. */
static struct mr_model_config tiny_llama(int heads, int kv, int tie, int64_t vocab) {
  struct mr_model_config c;
  memset(&c, 0, sizeof c);
  c.family = MR_MODEL_LLAMA;
  c.vocab_size = vocab;
  c.hidden_size = 32;
  c.intermediate_size = 44;
  c.num_hidden_layers = 2;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000;
  c.initializer_range = 0.2;
  c.tie_word_embeddings = tie;
  return c;
}

static void build_form(struct fx *f, int heads, int kv, int64_t batch,
                       int64_t seq, int tie, int64_t vocab,
                       enum mr_loss_form form) {
  struct mr_model_config c = tiny_llama(heads, kv, tie, vocab);
  f->layers = 2;
  ck_assert_int_eq(mr_model_build_loss(&c, batch, seq, form, &f->mo), 0);
  ck_assert_int_eq(mr_autodiff(&f->mo.graph, f->mo.loss, &f->seed), 0);
}

static void build(struct fx *f, int heads, int kv, int64_t batch, int64_t seq,
                  int tie) {
  build_form(f, heads, kv, batch, seq, tie, 40, MR_LOSS_FUSED);
}

static struct mr_shard_rule_placement col = {"model", "Shard(0)"};
static struct mr_shard_rule_placement row = {"model", "Shard(1)"};
static struct mr_shard_rule megatron[] = {
    {"q_proj|k_proj|v_proj|gate_proj|up_proj", &col, 1},
    {"o_proj|down_proj", &row, 1},
};

static uint32_t lcg(uint32_t *s) {
  *s = *s * 1664525u + 1013904223u;
  return *s >> 8;
}

/* Random inputs: ids and targets in range, parameters ~ U(-0.5, 0.5), norm
 * weights near 1, the loss seed 1. */
static float **inputs(const struct fx *f, uint32_t s) {
  const struct mr_graph *g = &f->mo.graph;
  float **in = calloc((size_t)g->n_tensors, sizeof *in);
  for (int t = 0; t < g->n_tensors; t++) {
    const struct mr_tensor *tt = &g->tensors[t];
    if (tt->producer >= 0)
      continue;
    int64_t n = mr_tensor_numel(tt);
    in[t] = malloc(sizeof(float) * (size_t)n);
    for (int64_t e = 0; e < n; e++) {
      if (tt->dtype == MR_I32)
        in[t][e] = (float)(lcg(&s) % (uint32_t)f->mo.cfg.vocab_size);
      else if (t == f->seed)
        in[t][e] = 1.0f;
      else if (tt->init == MR_INIT_ONES)
        in[t][e] = 1.0f + (float)(lcg(&s) % 1000) / 5000.0f;
      else
        in[t][e] = (float)(lcg(&s) % 10001) / 10000.0f - 0.5f;
    }
  }
  return in;
}

static void free_all(float **v, int n) {
  for (int i = 0; i < n; i++)
    free(v[i]);
  free(v);
}

/* Simulates dg and checks the loss and every parameter gradient against
 * the single-rank executor running ref's graph (NULL: dg's own graph; else
 * another form of the same model, its tensors matched by name). */
static void check_against(const struct fx *f, const struct mr_dist_graph *dg,
                          const struct fx *ref_fx) {
  const struct mr_graph *g = &f->mo.graph;
  const struct mr_graph *rg = ref_fx ? &ref_fx->mo.graph : g;
  float **in = inputs(f, 12345);
  float **rin = in;
  if (ref_fx) { /* the same values for the same names */
    rin = calloc((size_t)rg->n_tensors, sizeof *rin);
    for (int t = 0; t < rg->n_tensors; t++) {
      if (rg->tensors[t].producer >= 0)
        continue;
      int u = mr_graph_find(g, rg->tensors[t].name);
      int64_t n = mr_tensor_numel(&rg->tensors[t]);
      rin[t] = malloc(sizeof(float) * (size_t)n);
      if (t == ref_fx->seed)
        u = f->seed;
      ck_assert_msg(u >= 0, "%s missing", rg->tensors[t].name);
      ck_assert_int_eq(mr_tensor_numel(&g->tensors[u]), n);
      memcpy(rin[t], in[u], sizeof(float) * (size_t)n);
    }
  }
  float **ref = calloc((size_t)rg->n_tensors, sizeof *ref);
  float **got = calloc((size_t)g->n_tensors, sizeof *got);
  ck_assert_int_eq(sim_run_reference(rg, rin, ref), 0);
  ck_assert_msg(sim_run_graph(dg, in, got) == 0, "simulation: %s",
                mr_error_message());
  int grads = 0;
  ck_assert(fabsf(ref[rg->loss][0]) > 1.0f); /* a real loss, ~log V */
  double e = sim_rel_err(got[g->loss], ref[rg->loss], 1);
  ck_assert_msg(e <= 1e-5, "loss %g vs %g", (double)got[g->loss][0],
                (double)ref[rg->loss][0]);
  for (int t = 0; t < g->n_tensors; t++) {
    const struct mr_tensor *tt = &g->tensors[t];
    if (tt->role != MR_ROLE_GRAD || tt->grad_of < 0 ||
        g->tensors[tt->grad_of].role != MR_ROLE_PARAM)
      continue;
    int rp = mr_graph_find(rg, g->tensors[tt->grad_of].name);
    ck_assert_msg(rp >= 0 && rg->tensors[rp].grad >= 0, "%s", tt->name);
    int r = rg->tensors[rp].grad;
    int64_t n = mr_tensor_numel(tt);
    double w = sim_rel_err(got[t], ref[r], n), mx = 0;
    for (int64_t i = 0; i < n; i++)
      mx = fmax(mx, fabs(ref[r][i]));
    ck_assert_msg(mx > 1e-6, "%s is all zero", tt->name);
    /* relative to the gradient's scale */
    ck_assert_msg(w <= 1e-5 * fmax(1.0, mx) || w / mx <= 1e-5, "%s: %g (max %g)",
                  tt->name, w, mx);
    grads++;
  }
  ck_assert_int_ge(grads, 9 * f->layers + 2);
  if (rin != in)
    free_all(rin, rg->n_tensors);
  free_all(in, g->n_tensors);
  free_all(ref, rg->n_tensors);
  free_all(got, g->n_tensors);
}

static void check_simulated(const struct fx *f, const struct mr_dist_graph *dg) {
  check_against(f, dg, NULL);
}

/* Completion options on mesh m: the data dim named "data", sequence
 * parallelism (sp) over "model". */
static struct mr_completion_opts opts(const struct mr_mesh *m, int sp,
                                      struct mr_shard_rule *rules, int n_rules) {
  struct mr_completion_opts o;
  memset(&o, 0, sizeof o);
  o.rules = rules;
  o.n_rules = n_rules;
  o.data_dim = mr_mesh_dim(m, "data");
  o.seq_dim = sp ? mr_mesh_dim(m, "model") : -1;
  return o;
}

/* Nothing moves on mesh dim md inside the step but slices. */
static void check_nothing_moves_on(const struct mr_dist_graph *dg, int md) {
  for (int k = 0; k < MR_RS_KIND_COUNT; k++)
    if (k != MR_RS_SLICE && k != MR_RS_ZERO_NONROOT)
      ck_assert_int_eq(mr_dist_graph_count(dg, MR_EDGE_OPERAND, k, md, -1), 0);
}

static void complete(const struct fx *f, const char *mesh, int sp,
                     struct mr_shard_rule *rules, int n_rules,
                     struct mr_dist_graph *dg) {
  struct mr_mesh m;
  ck_assert_int_eq(mr_mesh_parse(mesh, &m), 0);
  struct mr_completion_opts o = opts(&m, sp, rules, n_rules);
  ck_assert_msg(mr_spmd_complete(&f->mo.graph, &m, &o, dg) == 0, "%s",
                mr_error_message());
}

START_TEST(test_llama_dp2_tp2_megatron) {
  struct fx f;
  build(&f, 4, 2, 2, 8, 0);
  struct mr_dist_graph dg;
  complete(&f, "data=2,model=2", 0, megatron, 2, &dg);
  int md = 1, L = f.layers;
  /* one AllReduce per attention block and one per MLP block, each way */
  ck_assert_int_eq(mr_dist_graph_count(&dg, MR_EDGE_OPERAND, MR_RS_ALL_REDUCE, md, 0), 2 * L);
  ck_assert_int_eq(mr_dist_graph_count(&dg, MR_EDGE_OPERAND, MR_RS_ALL_REDUCE, md, 1), 2 * L);
  enum mr_reshard_kind other[] = {MR_RS_ALL_GATHER, MR_RS_REDUCE_SCATTER,
                                  MR_RS_ALL_TO_ALL};
  for (size_t i = 0; i < MR_ARRAY_LEN(other); i++)
    ck_assert_int_eq(mr_dist_graph_count(&dg, MR_EDGE_OPERAND, other[i], md, -1), 0);
  /* nothing moves on the data dim inside the step; every parameter's
   * gradient is all-reduced over it once */
  check_nothing_moves_on(&dg, 0);
  int params = 0;
  for (int t = 0; t < f.mo.graph.n_tensors; t++)
    params += f.mo.graph.tensors[t].role == MR_ROLE_PARAM;
  ck_assert_int_eq(mr_dist_graph_count(&dg, MR_EDGE_GRAD_SYNC, MR_RS_ALL_REDUCE, 0, 1), params);
  /* q/k/v/gate/up outputs are column-sharded, o/down outputs Partial */
  int q = mr_graph_find(&f.mo.graph, "L0.q"), o = mr_graph_find(&f.mo.graph, "L1.down");
  ck_assert_int_eq(dg.tensor[q].p[1].kind, MR_SHARD);
  ck_assert_int_eq(dg.tensor[q].p[1].dim, 1);
  ck_assert_int_eq(dg.tensor[o].p[1].kind, MR_PARTIAL);
  check_simulated(&f, &dg);
  mr_dist_graph_close(&dg);
  mr_model_close(&f.mo);
}
END_TEST

START_TEST(test_llama_tp4_sequence_parallel) {
  struct fx f;
  build(&f, 4, 4, 1, 12, 0);
  struct mr_dist_graph dg;
  complete(&f, "model=4", 1, megatron, 2, &dg);
  int L = f.layers;
  /* AllGather before each column-parallel block, ReduceScatter after each
   * row-parallel one, forward and backward, and no AllReduce in between */
  ck_assert_int_eq(mr_dist_graph_count(&dg, MR_EDGE_OPERAND, MR_RS_ALL_REDUCE, 0, -1), 0);
  ck_assert_int_eq(mr_dist_graph_count(&dg, MR_EDGE_OPERAND, MR_RS_REDUCE_SCATTER, 0, 0), 2 * L);
  ck_assert_int_eq(mr_dist_graph_count(&dg, MR_EDGE_OPERAND, MR_RS_ALL_GATHER, 0, 0), 2 * L);
  ck_assert_int_eq(mr_dist_graph_count(&dg, MR_EDGE_OPERAND, MR_RS_REDUCE_SCATTER, 0, 1), 2 * L);
  ck_assert_int_eq(mr_dist_graph_count(&dg, MR_EDGE_OPERAND, MR_RS_ALL_GATHER, 0, 1), 2 * L);
  ck_assert_int_eq(mr_dist_graph_count(&dg, MR_EDGE_OPERAND, MR_RS_ALL_TO_ALL, 0, -1), 0);
  int x = mr_graph_find(&f.mo.graph, "L0.res1");
  ck_assert_int_eq(dg.tensor[x].p[0].kind, MR_SHARD);
  ck_assert_int_eq(dg.tensor[x].p[0].dim, 0);
  check_simulated(&f, &dg);
  mr_dist_graph_close(&dg);
  mr_model_close(&f.mo);
}
END_TEST

static struct mr_shard_rule_placement vocab = {"model", "Shard(0)"};
static struct mr_shard_rule megatron_vocab[] = {
    {"q_proj|k_proj|v_proj|gate_proj|up_proj", &col, 1},
    {"o_proj|down_proj", &row, 1},
    {"embed_tokens|lm_head", &vocab, 1},
};

/* The vocabulary-parallel loss on mesh dim md: the logits stay split by
 * vocabulary and never move, nor does their gradient; what the loss steps
 * read is resharded by exactly three AllReduces of [N] values (the row
 * maxima, the sums of exponentials, the targets' logits), and nothing is
 * gathered on md anywhere in the step. */
static void check_vocab_parallel(const struct fx *f,
                                 const struct mr_dist_graph *dg, int md) {
  const struct mr_graph *g = &f->mo.graph;
  int lg = f->mo.logits, dlg = mr_graph_find(g, "grad/logits");
  int64_t N = f->mo.batch * f->mo.seq;
  ck_assert_int_eq(f->mo.loss_form, MR_LOSS_VOCAB_PARALLEL);
  ck_assert_int_ge(dlg, 0);
  ck_assert_int_eq(dg->tensor[lg].p[md].kind, MR_SHARD);
  ck_assert_int_eq(dg->tensor[lg].p[md].dim, 1);
  ck_assert_int_eq(dg->tensor[dlg].p[md].kind, MR_SHARD);
  ck_assert_int_eq(dg->tensor[dlg].p[md].dim, 1);
  int n_loss = 0, n_max = 0;
  for (int e = 0; e < dg->n_edges; e++) {
    const struct mr_reshard_edge *x = &dg->edges[e];
    ck_assert_msg(x->tensor != lg && x->tensor != dlg, "%s is resharded",
                  g->tensors[x->tensor].name);
    if (x->kind != MR_EDGE_OPERAND)
      continue;
    int k = g->ops[x->op].kind;
    if (k < MR_OP_XENT_MAX || k > MR_OP_XENT_FINISH_BWD)
      continue;
    const struct mr_tensor *t = &g->tensors[x->tensor];
    ck_assert_msg(t->ndim == 1 && t->shape[0] == N, "%s", t->name);
    ck_assert_int_eq(x->plan.n_steps, 1);
    ck_assert_int_eq(x->plan.steps[0].kind, MR_RS_ALL_REDUCE);
    ck_assert_int_eq(x->plan.steps[0].mesh_dim, md);
    ck_assert_int_eq(x->backward, 0); /* the backward reuses them */
    n_max += x->plan.steps[0].op == MR_REDUCE_MAX;
    n_loss++;
  }
  ck_assert_int_eq(n_loss, 3);
  ck_assert_int_eq(n_max, 1);
  ck_assert_int_eq(mr_dist_graph_count(dg, -1, MR_RS_ALL_GATHER, md, -1), 0);
  int L = f->layers;
  /* forward: two per layer (Megatron), the embedding lookup's Partial
   * sum, the loss's three; backward: two per layer and the head's input
   * gradient (a sum over the vocabulary shards) */
  ck_assert_int_eq(mr_dist_graph_count(dg, MR_EDGE_OPERAND, MR_RS_ALL_REDUCE, md, 0),
                   2 * L + 1 + 3);
  ck_assert_int_eq(mr_dist_graph_count(dg, MR_EDGE_OPERAND, MR_RS_ALL_REDUCE, md, 1),
                   2 * L + 1);
}

START_TEST(test_llama_vocab_parallel_loss_dp2_tp2) {
  struct fx f, ref;
  build_form(&f, 4, 2, 2, 6, _i, 40, MR_LOSS_VOCAB_PARALLEL);
  build_form(&ref, 4, 2, 2, 6, _i, 40, MR_LOSS_FUSED);
  struct mr_dist_graph dg;
  complete(&f, "data=2,model=2", 0, megatron_vocab, 3, &dg);
  /* the vocabulary-parallel lookup is a Partial(sum) all-reduced before
   * the first norm */
  int h0 = mr_graph_find(&f.mo.graph, "h0");
  ck_assert_int_eq(dg.tensor[h0].p[1].kind, MR_PARTIAL);
  check_vocab_parallel(&f, &dg, 1);
  /* the row maxima: rows split by data, a Partial(max) over model */
  int m = mr_graph_find(&f.mo.graph, "loss.max");
  ck_assert_int_eq(dg.tensor[m].p[0].kind, MR_SHARD);
  ck_assert_int_eq(dg.tensor[m].p[1].kind, MR_PARTIAL);
  ck_assert_int_eq(dg.tensor[m].p[1].reduce, MR_REDUCE_MAX);
  check_nothing_moves_on(&dg, 0); /* the data dim */
  check_against(&f, &dg, &ref);
  check_simulated(&f, &dg);
  mr_dist_graph_close(&dg);
  mr_model_close(&f.mo);
  mr_model_close(&ref.mo);
}
END_TEST

START_TEST(test_llama_vocab_parallel_loss_tp4_uneven_vocabulary) {
  /* 41 = 11 + 10 + 10 + 10 rows of the table and columns of the logits */
  struct fx f, ref;
  build_form(&f, 4, 4, 2, 5, _i, 41, MR_LOSS_VOCAB_PARALLEL);
  build_form(&ref, 4, 4, 2, 5, _i, 41, MR_LOSS_FUSED);
  struct mr_dist_graph dg;
  complete(&f, "model=4", 0, megatron_vocab, 3, &dg);
  check_vocab_parallel(&f, &dg, 0);
  check_against(&f, &dg, &ref);
  mr_dist_graph_close(&dg);
  mr_model_close(&f.mo);
  mr_model_close(&ref.mo);
}
END_TEST

/* With sequence parallelism too: the targets come split by rows over
 * model, so the finishing step takes its row statistics reduce-scattered;
 * the logits still never move. */
START_TEST(test_llama_vocab_parallel_loss_with_sequence_parallel) {
  struct fx f, ref;
  build_form(&f, 4, 4, 1, 12, 0, 41, MR_LOSS_VOCAB_PARALLEL);
  build_form(&ref, 4, 4, 1, 12, 0, 41, MR_LOSS_FUSED);
  struct mr_dist_graph dg;
  complete(&f, "model=4", 1, megatron_vocab, 3, &dg);
  int lg = f.mo.logits;
  ck_assert_int_eq(dg.tensor[lg].p[0].kind, MR_SHARD);
  ck_assert_int_eq(dg.tensor[lg].p[0].dim, 1);
  for (int e = 0; e < dg.n_edges; e++)
    ck_assert_int_ne(dg.edges[e].tensor, lg);
  check_against(&f, &dg, &ref);
  mr_dist_graph_close(&dg);
  mr_model_close(&f.mo);
  mr_model_close(&ref.mo);
}
END_TEST

/* The fused loss with a vocabulary-split head: the logits are gathered. */
START_TEST(test_llama_fused_loss_gathers_split_logits) {
  struct fx f;
  build(&f, 4, 2, 2, 6, 0);
  struct mr_dist_graph dg;
  complete(&f, "data=2,model=2", 0, megatron_vocab, 3, &dg);
  int lg = f.mo.logits;
  ck_assert_int_eq(dg.tensor[lg].p[1].kind, MR_SHARD);
  ck_assert_int_eq(dg.tensor[lg].p[1].dim, 1);
  int gathered = 0;
  for (int e = 0; e < dg.n_edges; e++)
    for (int k = 0; k < dg.edges[e].plan.n_steps; k++)
      gathered += dg.edges[e].tensor == lg &&
                  dg.edges[e].plan.steps[k].kind == MR_RS_ALL_GATHER;
  ck_assert_int_eq(gathered, 1);
  ck_assert_int_eq(mr_dist_graph_count(&dg, MR_EDGE_OPERAND, MR_RS_ALL_REDUCE, 1, 0),
                   2 * f.layers + 1);
  check_simulated(&f, &dg);
  mr_dist_graph_close(&dg);
  mr_model_close(&f.mo);
}
END_TEST

/* mr_spmd_complete_model keeps the fused loss unless the vocabulary is
 * split, and then takes the form that moves fewer bytes. */
START_TEST(test_complete_model_chooses_the_loss_form) {
  struct mr_model_config c = tiny_llama(4, 4, 0, 40);
  struct mr_mesh m;
  ck_assert_int_eq(mr_mesh_parse("data=2,model=2", &m), 0);
  struct mr_completion_opts o = opts(&m, 0, megatron, 2);
  struct mr_model mo;
  struct mr_dist_graph dg;
  ck_assert_int_eq(mr_spmd_complete_model(&c, 2, 8, &m, &o, &mo, &dg), 0);
  ck_assert_int_eq(mo.loss_form, MR_LOSS_FUSED);
  ck_assert_ptr_eq(dg.g, &mo.graph);
  mr_dist_graph_close(&dg);
  mr_model_close(&mo);
  /* vocabulary split: the fused form's bytes, then the chosen form's */
  o.rules = megatron_vocab;
  o.n_rules = 3;
  struct fx fused;
  build_form(&fused, 4, 4, 2, 8, 0, 40, MR_LOSS_FUSED);
  struct mr_dist_graph fdg;
  ck_assert_int_eq(mr_spmd_complete(&fused.mo.graph, &m, &o, &fdg), 0);
  ck_assert_int_eq(mr_spmd_complete_model(&c, 2, 8, &m, &o, &mo, &dg), 0);
  ck_assert_int_eq(mo.loss_form, MR_LOSS_VOCAB_PARALLEL);
  ck_assert_ptr_eq(dg.g, &mo.graph);
  /* per rank: the fused form gathers [N/2, 40/2] floats where the other
   * all-reduces [N/2] three times (2 ranks: the local bytes each), and it
   * computes the head's whole gradient, whose data-parallel all-reduce
   * then moves [40, 32] floats rather than the shard [20, 32] */
  int64_t rows = 2 * 8 / 2;
  ck_assert_int_eq(mr_dist_graph_bytes(&fdg) - mr_dist_graph_bytes(&dg),
                   rows * 20 * 4 - 3 * rows * 4 + 20 * 32 * 4);
  struct mr_dist_attr seeds[1];
  o.seed = seeds;
  mr_dist_graph_close(&dg);
  mr_model_close(&mo);
  ck_assert_int_eq(mr_spmd_complete_model(&c, 2, 8, &m, &o, &mo, &dg), MR_EINVAL);
  mr_dist_graph_close(&fdg);
  mr_model_close(&fused.mo);
}
END_TEST

START_TEST(test_llama_heads_not_divisible_is_an_error) {
  struct fx f;
  build(&f, 4, 2, 1, 8, 0);
  struct mr_mesh m;
  ck_assert_int_eq(mr_mesh_parse("model=4", &m), 0);
  struct mr_completion_opts o = opts(&m, 0, megatron, 2);
  struct mr_dist_graph dg;
  ck_assert_int_eq(mr_spmd_complete(&f.mo.graph, &m, &o, &dg), MR_EINVAL);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "heads"));
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "model"));
  mr_model_close(&f.mo);
}
END_TEST

static Suite *spmd_model_suite(void) {
  Suite *s = suite_create("spmd_model");
  TCase *tc = tcase_create("llama");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_llama_dp2_tp2_megatron);
  tcase_add_test(tc, test_llama_tp4_sequence_parallel);
  tcase_add_loop_test(tc, test_llama_vocab_parallel_loss_dp2_tp2, 0, 2);
  tcase_add_loop_test(tc, test_llama_vocab_parallel_loss_tp4_uneven_vocabulary, 0, 2);
  tcase_add_test(tc, test_llama_vocab_parallel_loss_with_sequence_parallel);
  tcase_add_test(tc, test_llama_fused_loss_gathers_split_logits);
  tcase_add_test(tc, test_complete_model_chooses_the_loss_form);
  tcase_add_test(tc, test_llama_heads_not_divisible_is_an_error);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(spmd_model_suite)
