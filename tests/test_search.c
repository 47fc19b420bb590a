/* test_search.c - the strategy search: it finds the fastest strategy an
 * independent enumeration finds, keeps what a hint fixes, names bad
 * hints, says what would make a model fit, reproduces Narayanan et al.
 * 2021 Table 1, and plans a 1T model on 3072 GPUs in well under a second. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check_main.h"
#include "common/error.h"
#include "compiler/planner/search.h"
#include "launcher/cli.h"

static struct mr_cluster a100(void) {
  /* configs/clusters/a100-80g-node.json, read from the source tree */
  struct mr_cluster c;
  const char *src = getenv("MESHRUN_SOURCE_DIR");
  char path[1024];
  snprintf(path, sizeof path, "%s/configs/clusters/a100-80g-node.json", src ? src : ".");
  ck_assert_msg(mr_cluster_load(path, &c) == 0, "%s", mr_error_message());
  return c;
}

static struct mr_model_config gpt(int64_t h, int64_t a, int64_t l) {
  struct mr_model_config m;
  memset(&m, 0, sizeof m);
  m.family = MR_MODEL_GPT2;
  m.hidden_size = h, m.intermediate_size = 4 * h;
  m.num_attention_heads = a, m.num_key_value_heads = a, m.num_hidden_layers = l;
  m.vocab_size = 51200, m.max_position_embeddings = 2048, m.tie_word_embeddings = 1;
  return m;
}

static struct mr_strategy_hint open_hint(void) {
  struct mr_strategy_hint h;
  memset(&h, 0, sizeof h);
  h.auto_mode = MR_AUTO_FULL;
  h.zero_stage = h.offload = h.recompute = h.sequence_parallel = -1;
  h.mapping = -1;
  h.amp_dtype = MR_AMP_FP16;
  return h;
}

/* What Megatron-LM had in 2021: full recompute, no sequence parallelism,
 * no distributed optimizer. */
static struct mr_strategy_hint paper_hint(void) {
  struct mr_strategy_hint h = open_hint();
  h.auto_mode = MR_AUTO_SEMI;
  h.sequence_parallel = 0, h.zero_stage = 0, h.offload = 0;
  h.recompute = 1, h.recompute_granularity = MR_RECOMPUTE_FULL;
  return h;
}

START_TEST(test_search_finds_what_enumeration_finds) {
  /* A small model on 16 devices: enumerate every strategy here and keep
   * the fastest that fits; the search must report the same time. */
  struct mr_cluster c = a100();
  c.nodes = 2;
  c.memory_bytes = 8e9; // tight, so memory prunes
  struct mr_model_config m = gpt(2048, 16, 8);
  struct mr_train_config tr = {.global_batch = 32, .seq_len = 1024};
  struct mr_strategy_hint h = open_hint();
  struct mr_plan_request req = {&m, &tr, &h, &c, 16, 8};
  struct mr_plan_result *r = calloc(1, sizeof *r);
  ck_assert_int_eq(mr_plan_search(&req, r), 0);
  struct mr_workload w = {.model = &m, .global_batch = 32, .seq_len = 1024};
  double best = INFINITY;
  int64_t valid = 0;
  for (int t = 1; t <= 16; t *= 2)
    for (int p = 1; t * p <= 16; p *= 2) {
      int d = 16 / t / p;
      for (int b = 1; b <= 32; b++) {
        if (32 % (d * b) != 0)
          continue;
        for (int sc = 0; sc < 3; sc++)
          for (int v = 1; v <= 8; v++)
            for (int sp = 0; sp < 2; sp++)
              for (int rc = 0; rc < 3; rc++)
                for (int z = 0; z < 4; z++)
                  for (int off = 0; off < 2; off++)
                    for (int map = 0; map < 2; map++) {
                      struct mr_strategy s = {d, t, p, (enum mr_mesh_mapping)map, sp, z, off,
                                              (enum mr_recompute_mode)rc, 1, b, 32 / d / b, 1,
                                              v, (enum mr_pp_schedule)sc, MR_AMP_FP16};
                      if (p == 1 && (sc != MR_PP_1F1B || v != 1))
                        continue;
                      if (v == 5 || v == 7 || (d == 1 && z > 0))
                        continue;
                      if (mr_cost_check(&w, &c, &s) != 0)
                        continue;
                      struct mr_cost k;
                      mr_cost_evaluate(&w, &c, &s, &k);
                      valid++;
                      if (k.fits && k.step_time_s < best)
                        best = k.step_time_s;
                    }
      }
    }
  ck_assert(valid > 100);
  ck_assert(r->pruned_memory > 0);
  ck_assert_msg(fabs(r->top[0].cost.step_time_s - best) < 1e-12 * best, "search %.9g, "
                "enumeration %.9g", r->top[0].cost.step_time_s, best);
  for (int i = 1; i < r->n_top; i++)
    ck_assert(r->top[i - 1].cost.step_time_s <= r->top[i].cost.step_time_s);
  for (int i = 0; i < r->n_top; i++)
    ck_assert(r->top[i].cost.fits && r->top[i].cost.mem.total <= c.memory_bytes);
  free(r);
}
END_TEST

START_TEST(test_search_keeps_what_the_hint_fixes) {
  struct mr_cluster c = a100();
  c.nodes = 4;
  struct mr_model_config m = gpt(4096, 32, 32);
  struct mr_train_config tr = {.global_batch = 64, .seq_len = 2048};
  struct mr_strategy_hint h = open_hint();
  h.auto_mode = MR_AUTO_SEMI;
  h.tp = 4, h.zero_stage = 2, h.sequence_parallel = 1, h.micro_batches = 8;
  struct mr_plan_request req = {&m, &tr, &h, &c, 32, 10};
  struct mr_plan_result *r = calloc(1, sizeof *r);
  ck_assert_int_eq(mr_plan_search(&req, r), 0);
  ck_assert(r->n_top > 1);
  for (int i = 0; i < r->n_top; i++) {
    const struct mr_strategy *s = &r->top[i].strategy;
    ck_assert_int_eq(s->tp, 4);
    ck_assert_int_eq(s->zero_stage, 2);
    ck_assert_int_eq(s->sequence_parallel, 1);
    ck_assert_int_eq(s->micro_batches, 8);
    ck_assert_int_eq(s->dp * s->tp * s->pp, 32);
    ck_assert_int_eq(s->dp * s->micro_batch_size * s->micro_batches, 64);
  }
  /* a fixed mesh mapping is kept, also where the other one would be as
   * fast (one data-parallel rank) */
  h.mapping = MR_MAP_TP_PP_DP;
  ck_assert_int_eq(mr_plan_search(&req, r), 0);
  ck_assert(r->n_top > 1);
  for (int i = 0; i < r->n_top; i++)
    ck_assert_int_eq(r->top[i].strategy.mapping, MR_MAP_TP_PP_DP);
  h.auto_mode = MR_AUTO_MANUAL;
  h.pp = 2;
  struct mr_strategy man;
  ck_assert_int_eq(mr_plan_manual(&req, &man), 0);
  ck_assert_int_eq(man.mapping, MR_MAP_TP_PP_DP);
  free(r);
}
END_TEST

START_TEST(test_search_bad_hints_name_the_field) {
  struct mr_cluster c = a100();
  c.nodes = 2;
  struct mr_model_config m = gpt(1024, 16, 4);
  struct mr_train_config tr = {.global_batch = 16, .seq_len = 512};
  struct mr_plan_result *r = calloc(1, sizeof *r);
  struct mr_strategy_hint h = open_hint();
  h.dp = 2, h.tp = 2, h.pp = 2;                       // 8, world 16
  struct mr_plan_request req = {&m, &tr, &h, &c, 16, 3};
  ck_assert_int_eq(mr_plan_search(&req, r), MR_EINVAL);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "world size 16"));
  h = open_hint();
  h.tp = 3;
  req.world = 12;
  ck_assert_int_eq(mr_plan_search(&req, r), MR_EINVAL);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "strategy.tensor_parallel.degree 3"));
  h = open_hint();
  h.pp = 1, h.virtual_stages = 2;
  req.world = 16;
  ck_assert_int_eq(mr_plan_search(&req, r), MR_EINVAL);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "virtual_stages"));
  /* a world no split fits: 4 layers, 16 heads, batch 16, 7 ranks */
  h = open_hint();
  req.world = 7;
  ck_assert_int_eq(mr_plan_search(&req, r), MR_EINVAL);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "world size 7 cannot be split"));
  free(r);
}
END_TEST

START_TEST(test_search_does_not_fit_says_what_would) {
  /* 18.4B with Megatron's 2021 techniques on 8 GPUs: 20 bytes per
   * parameter over t·p <= 8 is 46 GB per GPU at best, plus activations,
   * with a full node: it fits.  On 2 GPUs it cannot (185 GB of states). */
  struct mr_cluster c = a100();
  struct mr_model_config m = gpt(6144, 48, 40);
  struct mr_train_config tr = {.global_batch = 16, .seq_len = 2048};
  struct mr_strategy_hint h = paper_hint();
  struct mr_plan_request req = {&m, &tr, &h, &c, 2, 3};
  struct mr_plan_result *r = calloc(1, sizeof *r);
  ck_assert_int_eq(mr_plan_search(&req, r), MR_ENOFIT);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "no strategy fits"));
  ck_assert_int_eq(r->n_top, 0);
  double states = 20.0 * (double)mr_model_param_count(&m) / 2;
  ck_assert(r->least_memory.cost.mem.total > states);
  ck_assert(r->least_memory.cost.mem.total > c.memory_bytes);
  ck_assert_int_eq(r->fits_with_offload, 1);   // ZeRO 0 fixed: offload needs a stage
  ck_assert(r->devices_to_fit >= 4 && r->devices_to_fit <= 8);
  /* the same devices with their host as their memory (as CPU ranks have
   * it): offloading frees nothing, so it is not what would make it fit */
  c.host_is_device = 1;
  memset(r, 0, sizeof *r);
  ck_assert_int_eq(mr_plan_search(&req, r), MR_ENOFIT);
  ck_assert_int_eq(r->fits_with_offload, 0);
  free(r);
}
END_TEST

/* A row of Narayanan et al. 2021, Table 1, run as its authors ran it:
 * micro-batch size and virtual stages from their scripts (Megatron-LM,
 * examples/sc21/run_table_1.sh). */
struct table1_row {
  const char *name;
  int64_t h, a, l;
  int t, p, gpus;
  int64_t batch;
  double tflops;   // per GPU, Table 1
  int mbs, v;      // micro-batch size; virtual stages (1: plain 1F1B)
  int disagrees;   // the planner prefers another t × p (docs/PLANNER.md)
};

static const struct table1_row rows[] = {
    {"18.4B", 6144, 48, 40, 8, 1, 256, 1024, 135, 8, 1, 1},
    {"145.6B", 12288, 96, 80, 8, 8, 1536, 2304, 148, 2, 2, 0},
    {"529.6B", 20480, 128, 105, 8, 35, 2520, 2520, 163, 1, 3, 0},
    {"1T", 25600, 160, 128, 8, 64, 3072, 3072, 163, 1, 1, 0},
};

/* The published step time: the paper's FLOPs per iteration (the 96 form)
 * over its TF/s per GPU × GPUs. */
static double published_step(const struct table1_row *row) {
  double B = (double)row->batch, s = 2048, l = (double)row->l, hd = (double)row->h;
  double F = 96 * B * s * l * hd * hd * (1 + s / (6 * hd) + 51200 / (16 * l * hd));
  return F / (row->tflops * 1e12 * row->gpus);
}

/* The planner's prediction for the row's published configuration: its t,
 * p, micro-batch size, schedule and full recompute fixed. */
static double predict_published(const struct table1_row *row) {
  struct mr_cluster c = a100();
  c.nodes = row->gpus / 8;
  struct mr_model_config m = gpt(row->h, row->a, row->l);
  struct mr_train_config tr = {.global_batch = row->batch, .seq_len = 2048};
  struct mr_strategy_hint h = paper_hint();
  h.tp = row->t, h.pp = row->p;
  h.micro_batches = (int)(row->batch / (row->gpus / (row->t * row->p)) / row->mbs);
  if (row->p > 1) {
    h.pp_schedule_set = 1;
    h.pp_schedule = row->v > 1 ? MR_PP_INTERLEAVED : MR_PP_1F1B;
    h.virtual_stages = row->v;
  }
  struct mr_plan_request req = {&m, &tr, &h, &c, row->gpus, 1};
  struct mr_plan_result *r = calloc(1, sizeof *r);
  ck_assert_msg(mr_plan_search(&req, r) == 0, "%s: %s", row->name, mr_error_message());
  ck_assert_int_eq(r->top[0].strategy.micro_batch_size, row->mbs);
  double got = r->top[0].cost.step_time_s;
  free(r);
  return got;
}

START_TEST(test_search_megatron_published_step_time_within_15_percent) {
  const struct table1_row *row = &rows[_i];
  double got = predict_published(row), published = published_step(row);
  ck_assert_msg(fabs(got / published - 1) < 0.15, "%s: predicted %.2f s, published %.2f s",
                row->name, got, published);
}
END_TEST

START_TEST(test_search_megatron_choice_matches_or_within_5_percent) {
  /* The search with the paper's techniques picks the published t and p,
   * or a plan it predicts within 5% of its best plan with the published t
   * and p.  18.4B is the exception docs/PLANNER.md argues: the model
   * prefers t 4 × p 2 (the same model-parallel size) because it halves
   * the tensor-parallel traffic per rank, a configuration the paper did
   * not measure; there the prediction for the published configuration
   * must be within 5% of the published step time instead, and the
   * disagreement below 10%. */
  const struct table1_row *row = &rows[_i];
  struct mr_cluster c = a100();
  c.nodes = row->gpus / 8;
  struct mr_model_config m = gpt(row->h, row->a, row->l);
  struct mr_train_config tr = {.global_batch = row->batch, .seq_len = 2048};
  struct mr_strategy_hint h = paper_hint();
  struct mr_plan_request req = {&m, &tr, &h, &c, row->gpus, 3};
  struct mr_plan_result *r = calloc(1, sizeof *r);
  ck_assert_int_eq(mr_plan_search(&req, r), 0);
  double chosen = r->top[0].cost.step_time_s;
  int t = r->top[0].strategy.tp, p = r->top[0].strategy.pp;
  h.tp = row->t, h.pp = row->p;
  ck_assert_int_eq(mr_plan_search(&req, r), 0);
  double pub = r->top[0].cost.step_time_s;
  free(r);
  ck_assert(chosen <= pub * (1 + 1e-12));
  int agrees = (t == row->t && p == row->p) || chosen >= 0.95 * pub;
  if (!row->disagrees) {
    ck_assert_msg(agrees, "%s: chose t %d p %d at %.2f s, published t %d p %d at %.2f s",
                  row->name, t, p, chosen, row->t, row->p, pub);
    return;
  }
  double got = predict_published(row), published = published_step(row);
  ck_assert_msg(!agrees, "%s: the planner now agrees with the paper (t %d p %d at %.2f s, "
                "published t×p at %.2f s): update rows[] and docs/PLANNER.md", row->name, t,
                p, chosen, pub);
  ck_assert_int_eq(t * p, row->t * row->p);
  ck_assert_msg(chosen >= 0.90 * pub, "%s: chose t %d p %d at %.2f s, %.1f%% faster than "
                "the published t×p at %.2f s", row->name, t, p, chosen,
                100 * (1 - chosen / pub), pub);
  ck_assert_msg(fabs(got / published - 1) < 0.05, "%s: published configuration predicted "
                "%.2f s, published %.2f s", row->name, got, published);
}
END_TEST

START_TEST(test_search_megatron_39b_with_allreduce_after_the_flush) {
  /* The 39.1B row (h 8192, a 64, l 48, t 8, p 2, 512 GPUs, batch 1536,
   * 138 TF/s per GPU) calibrated gemm_half_dim.  Its authors ran it with
   * micro-batch 4, the plain 1F1B schedule and Megatron's "local" DDP,
   * which all-reduces the gradients after the pipeline flush instead of
   * behind the backward (Megatron-LM, examples/sc21/run_table_1.sh and
   * megatron/training.py).  That run, predicted as the model predicts it
   * plus the all-reduce of the fuller stage's fp16 gradients over the 32
   * data-parallel ranks (stride 8: one per node), is the published
   * 14.45 s within 1%. */
  struct mr_cluster c = a100();
  c.nodes = 64;
  struct mr_model_config m = gpt(8192, 64, 48);
  struct mr_workload w = {.model = &m, .global_batch = 1536, .seq_len = 2048};
  struct mr_strategy s;
  memset(&s, 0, sizeof s);
  s.dp = 32, s.tp = 8, s.pp = 2, s.mapping = MR_MAP_TP_DP_PP;
  s.micro_batch_size = 4, s.micro_batches = 12, s.grad_accum_steps = 1;
  s.virtual_stages = 1, s.schedule = MR_PP_1F1B, s.amp_dtype = MR_AMP_FP16;
  s.recompute = MR_RECOMPUTE_MODE_FULL, s.recompute_every_n = 1;
  ck_assert_int_eq(mr_cost_check(&w, &c, &s), 0);
  struct mr_cost k;
  mr_cost_evaluate(&w, &c, &s, &k);
  struct mr_link dl = mr_cost_group_link(&c, 8, 32);
  double ar = mr_cost_collective_time(MR_COLL_ALLREDUCE, 32, k.mem.grads, &dl);
  const struct table1_row r39 = {"39.1B", 8192, 64, 48, 8, 2, 512, 1536, 138, 4, 1, 0};
  double published = published_step(&r39);
  ck_assert_msg(fabs((k.step_time_s + ar) / published - 1) < 0.01, "predicted %.3f s + "
                "all-reduce %.3f s, published %.3f s", k.step_time_s, ar, published);
}
END_TEST

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

START_TEST(test_search_1t_on_3072_gpus_under_a_second) {
  /* Everything open: factorizations × micro-batches × schedules × ZeRO ×
   * offload × recompute × sequence parallel × mapping. */
  struct mr_cluster c = a100();
  c.nodes = 384;
  struct mr_model_config m = gpt(25600, 160, 128);
  struct mr_train_config tr = {.global_batch = 3072, .seq_len = 2048};
  struct mr_strategy_hint h = open_hint();
  struct mr_plan_request req = {&m, &tr, &h, &c, 3072, 5};
  struct mr_plan_result *r = calloc(1, sizeof *r);
  double t0 = now_s();
  ck_assert_int_eq(mr_plan_search(&req, r), 0);
  double took = now_s() - t0;
  ck_assert(r->considered > 100000);
  ck_assert_msg(took < 1.0, "search took %.3f s", took);
  ck_assert(r->top[0].cost.fits);
  free(r);
}
END_TEST

START_TEST(test_search_choose_manual_is_the_job_strategy) {
  struct mr_cluster c = a100();
  c.nodes = 2;
  struct mr_model_config m = gpt(2048, 16, 8);
  struct mr_train_config tr = {.global_batch = 32, .seq_len = 1024};
  struct mr_strategy_hint h = open_hint();
  h.auto_mode = MR_AUTO_MANUAL;
  h.tp = 2, h.pp = 2, h.micro_batches = 4, h.zero_stage = 1;
  struct mr_plan_request req = {&m, &tr, &h, &c, 16, 1};
  struct mr_plan_candidate got;
  ck_assert_int_eq(mr_plan_choose(&req, &got), 0);
  /* unset degrees: dp fills the world; micro-batch size = 32 / (4 × 4) */
  ck_assert_int_eq(got.strategy.dp, 4);
  ck_assert_int_eq(got.strategy.micro_batch_size, 2);
  ck_assert_int_eq(got.strategy.zero_stage, 1);
  ck_assert_int_eq(got.strategy.recompute, MR_RECOMPUTE_NONE);
  struct mr_workload w = {.model = &m, .global_batch = 32, .seq_len = 1024};
  struct mr_cost k;
  mr_cost_evaluate(&w, &c, &got.strategy, &k);
  ck_assert(k.step_time_s == got.cost.step_time_s);
  /* full mode returns the search's best */
  h.auto_mode = MR_AUTO_FULL;
  struct mr_plan_result *r = calloc(1, sizeof *r);
  ck_assert_int_eq(mr_plan_search(&req, r), 0);
  ck_assert_int_eq(mr_plan_choose(&req, &got), 0);
  ck_assert(got.cost.step_time_s == r->top[0].cost.step_time_s);
  free(r);
}
END_TEST

/* Where the shapes cost the GEMMs nothing (a flat efficiency curve, as a
 * CPU core can measure), every micro-batch size predicts the same step;
 * the search then ranks fewer, larger micro-batches first (each pays fixed
 * costs the model does not count).  One device (no gradient sync for the
 * last micro-batch's backward to hide), 4 sequences: micro-batches of 4, 2
 * and 1, found tied by hand, ranked 1, 2, 4 micro-batches — against the
 * order enumerated, smallest first. */
START_TEST(test_search_equal_steps_prefer_fewer_micro_batches) {
  struct mr_cluster c = a100();
  c.gemm_half_dim = 0;
  struct mr_model_config m = gpt(1024, 16, 4);
  struct mr_train_config tr = {.global_batch = 4, .seq_len = 512};
  struct mr_strategy_hint h = open_hint();
  h.auto_mode = MR_AUTO_SEMI;
  h.dp = 1, h.tp = 1, h.pp = 1;
  h.sequence_parallel = 0, h.zero_stage = 0, h.offload = 0, h.recompute = 0, h.mapping = 0;
  c.nodes = 1, c.devices_per_node = 1;
  struct mr_plan_request req = {&m, &tr, &h, &c, 1, 8};
  struct mr_plan_result *r = calloc(1, sizeof *r);
  ck_assert_int_eq(mr_plan_search(&req, r), 0);
  ck_assert_int_eq(r->n_top, 3);
  struct mr_workload w = {.model = &m, .global_batch = 4, .seq_len = 512};
  double t[3];
  for (int i = 0; i < 3; i++) {
    struct mr_strategy s = r->top[i].strategy;
    ck_assert_int_eq(s.micro_batches, 1 << i);
    ck_assert_int_eq(s.micro_batch_size, 4 >> i);
    struct mr_cost k;
    mr_cost_evaluate(&w, &c, &s, &k);
    t[i] = k.step_time_s;
  }
  ck_assert_msg(fabs(t[1] - t[0]) <= 1e-9 * t[0] && fabs(t[2] - t[0]) <= 1e-9 * t[0],
                "not tied: %.12g %.12g %.12g", t[0], t[1], t[2]);
  free(r);
}
END_TEST

static Suite *search_suite(void) {
  Suite *s = suite_create("search");
  TCase *tc = tcase_create("search");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_search_finds_what_enumeration_finds);
  tcase_add_test(tc, test_search_equal_steps_prefer_fewer_micro_batches);
  tcase_add_test(tc, test_search_keeps_what_the_hint_fixes);
  tcase_add_test(tc, test_search_bad_hints_name_the_field);
  tcase_add_test(tc, test_search_does_not_fit_says_what_would);
  tcase_add_loop_test(tc, test_search_megatron_published_step_time_within_15_percent, 0, 4);
  tcase_add_loop_test(tc, test_search_megatron_choice_matches_or_within_5_percent, 0, 4);
  tcase_add_test(tc, test_search_megatron_39b_with_allreduce_after_the_flush);
  tcase_add_test(tc, test_search_1t_on_3072_gpus_under_a_second);
  tcase_add_test(tc, test_search_choose_manual_is_the_job_strategy);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(search_suite)
