/* test_model.c - whole-model checks: the gradient of the loss of a tiny
 * LLaMA (grouped-query attention, untied head) and a tiny GPT-2 (tied
 * head, biases, learned positions) with respect to a sample of every
 * parameter against central finite differences of the loss; the
 * parameter names and shapes against transformers' layout; the config
 * parser's defaults and errors. */
#include <check.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "compiler/autodiff.h"
#include "common/error.h"
#include "compiler/model.h"
#include "grad_check.h"

static struct mr_model_config tiny_llama(void) {
  struct mr_model_config c = {0};
  c.family = MR_MODEL_LLAMA;
  c.vocab_size = 16, c.hidden_size = 16, c.intermediate_size = 24;
  c.num_hidden_layers = 2, c.num_attention_heads = 4, c.num_key_value_heads = 2;
  c.max_position_embeddings = 32, c.rms_norm_eps = 1e-5, c.rope_theta = 10000;
  c.initializer_range = 0.02;
  return c;
}

static struct mr_model_config tiny_gpt2(void) {
  struct mr_model_config c = {0};
  c.family = MR_MODEL_GPT2;
  c.vocab_size = 16, c.hidden_size = 12, c.intermediate_size = 48;
  c.num_hidden_layers = 2, c.num_attention_heads = 3, c.num_key_value_heads = 3;
  c.max_position_embeddings = 8, c.layer_norm_epsilon = 1e-5;
  c.initializer_range = 0.02, c.tie_word_embeddings = 1;
  return c;
}

/* Builds, differentiates and checks the loss gradient of cfg's model.
 * Parameters are U(-0.5, 0.5) (norm weights 1 + that) so every path
 * carries signal well above float noise; see grad_check.h: the loss is
 * O(1) and its float error a few 1e-6, so with h = 1e-2 the difference
 * quotient is good to ~3e-4, and 1e-3 + 3% catches any wrong term. */
static void check_model(struct mr_model_config cfg) {
  struct mr_model m;
  struct mr_exec x;
  int seed;
  ck_assert_int_eq(mr_model_build(&cfg, 2, 6, &m), 0);
  ck_assert_int_eq(mr_autodiff(&m.graph, m.loss, &seed), 0);
  ck_assert_int_eq(mr_exec_init(&x, &m.graph, 1, MR_AMP_NONE), 0);
  for (int i = 0; i < m.graph.n_tensors; i++) {
    const struct mr_tensor *t = &m.graph.tensors[i];
    if (t->role != MR_ROLE_PARAM)
      continue;
    float *p = mr_exec_buf(&x, i);
    gc_fill(p, mr_tensor_numel(t), 0.5);
    if (t->init == MR_INIT_ONES)
      for (int64_t k = 0; k < mr_tensor_numel(t); k++)
        p[k] += 1.0f;
    /* every parameter must receive a gradient */
    ck_assert_msg(t->grad >= 0, "%s has no gradient", t->name);
  }
  int32_t *ids = mr_exec_buf(&x, m.input_ids), *lab = mr_exec_buf(&x, m.labels);
  for (int i = 0; i < 12; i++) {
    ids[i] = (i * 7 + 3) % 16;
    lab[i] = (i * 5 + 1) % 16;
  }
  if (m.position_ids >= 0) {
    int32_t *pos = mr_exec_buf(&x, m.position_ids);
    for (int i = 0; i < 12; i++)
      pos[i] = i % 6;
  }
  ((float *)mr_exec_buf(&x, seed))[0] = 1.0f;
  double max_err;
  int bad = gc_check_params(&x, m.loss, NULL, 1e-2, 1e-3, 3e-2, 12, &max_err);
  ck_assert_msg(bad == 0, "%d loss-gradient elements off (max error %g)", bad,
                max_err);
  mr_exec_close(&x);
  mr_model_close(&m);
}

START_TEST(test_model_llama_gqa_loss_gradient) { check_model(tiny_llama()); }
END_TEST

START_TEST(test_model_llama_tied_loss_gradient) {
  struct mr_model_config c = tiny_llama();
  c.tie_word_embeddings = 1;
  check_model(c);
}
END_TEST

START_TEST(test_model_gpt2_loss_gradient) { check_model(tiny_gpt2()); }
END_TEST

static void expect_param(const struct mr_graph *g, const char *name, int64_t a,
                         int64_t b) {
  int id = mr_graph_find(g, name);
  ck_assert_msg(id >= 0, "no parameter %s", name);
  const struct mr_tensor *t = &g->tensors[id];
  ck_assert_int_eq(t->role, MR_ROLE_PARAM);
  int64_t shape[MR_MAX_DIMS]; /* as Hugging Face files hold it */
  int nd = mr_tensor_file_shape(t, shape);
  ck_assert_int_eq(shape[0], a);
  if (b)
    ck_assert_int_eq(shape[1], b);
  ck_assert_int_eq(nd, b ? 2 : 1);
}

START_TEST(test_model_parameter_names_match_transformers) {
  struct mr_model m;
  struct mr_model_config c = tiny_llama();
  ck_assert_int_eq(mr_model_build(&c, 1, 4, &m), 0);
  expect_param(&m.graph, "model.embed_tokens.weight", 16, 16);
  expect_param(&m.graph, "model.layers.1.self_attn.q_proj.weight", 16, 16);
  expect_param(&m.graph, "model.layers.1.self_attn.k_proj.weight", 8, 16);
  expect_param(&m.graph, "model.layers.0.self_attn.o_proj.weight", 16, 16);
  expect_param(&m.graph, "model.layers.0.mlp.gate_proj.weight", 24, 16);
  expect_param(&m.graph, "model.layers.0.mlp.down_proj.weight", 16, 24);
  expect_param(&m.graph, "model.layers.0.post_attention_layernorm.weight", 16, 0);
  expect_param(&m.graph, "model.norm.weight", 16, 0);
  expect_param(&m.graph, "lm_head.weight", 16, 16);
  int n = 0;
  int64_t total = 0;
  for (int i = 0; i < m.graph.n_tensors; i++)
    if (m.graph.tensors[i].role == MR_ROLE_PARAM) {
      n++;
      total += mr_tensor_numel(&m.graph.tensors[i]);
    }
  ck_assert_int_eq(n, 2 + 2 * 9 + 1);
  ck_assert_int_eq(total, mr_model_param_count(&c));
  mr_model_close(&m);
  c = tiny_gpt2();
  ck_assert_int_eq(mr_model_build(&c, 1, 4, &m), 0);
  expect_param(&m.graph, "transformer.wte.weight", 16, 12);
  expect_param(&m.graph, "transformer.wpe.weight", 8, 12);
  expect_param(&m.graph, "transformer.h.1.attn.c_attn.weight", 12, 36); /* Conv1D [in, out] */
  expect_param(&m.graph, "transformer.h.1.attn.c_attn.bias", 36, 0);
  /* held as [C, 3, C] and [3, C]: q | k | v along the middle dim */
  const struct mr_tensor *qkv = &m.graph.tensors[mr_graph_find(&m.graph,
                                                               "transformer.h.1.attn.c_attn.weight")];
  ck_assert_int_eq(qkv->ndim, 3);
  ck_assert(qkv->shape[0] == 12 && qkv->shape[1] == 3 && qkv->shape[2] == 12);
  expect_param(&m.graph, "transformer.h.0.mlp.c_fc.weight", 12, 48);
  expect_param(&m.graph, "transformer.h.0.mlp.c_proj.weight", 48, 12);
  expect_param(&m.graph, "transformer.ln_f.bias", 12, 0);
  ck_assert_int_eq(mr_graph_find(&m.graph, "lm_head.weight"), -1);
  total = 0;
  for (int i = 0; i < m.graph.n_tensors; i++)
    if (m.graph.tensors[i].role == MR_ROLE_PARAM)
      total += mr_tensor_numel(&m.graph.tensors[i]);
  ck_assert_int_eq(total, mr_model_param_count(&c));
  /* too long a sequence for the learned positions */
  mr_model_close(&m);
  ck_assert_int_eq(mr_model_build(&c, 1, 9, &m), MR_EINVAL);
  mr_model_close(&m);
}
END_TEST

static int parse(const char *text, struct mr_model_config *c) {
  cJSON *o = cJSON_Parse(text);
  int rc = mr_model_config_parse(o, "config.json", c);
  cJSON_Delete(o);
  return rc;
}

START_TEST(test_model_config_defaults_and_errors) {
  struct mr_model_config c;
  ck_assert_int_eq(parse("{\"architectures\":[\"LlamaForCausalLM\"],"
                         "\"hidden_size\":256,\"num_attention_heads\":8,"
                         "\"intermediate_size\":688,\"num_hidden_layers\":4,"
                         "\"vocab_size\":256,\"unknown_key\":1}", &c), 0);
  ck_assert_int_eq(c.family, MR_MODEL_LLAMA);
  ck_assert_int_eq(c.num_key_value_heads, 8); /* defaults to the heads */
  ck_assert_double_eq(c.rms_norm_eps, 1e-6);
  ck_assert_double_eq(c.rope_theta, 10000.0);
  ck_assert_int_eq(c.max_position_embeddings, 2048);
  ck_assert_int_eq(c.tie_word_embeddings, 0);
  ck_assert_int_eq(parse("{\"model_type\":\"gpt2\",\"n_embd\":64,\"n_head\":4,"
                         "\"n_layer\":2,\"vocab_size\":300}", &c), 0);
  ck_assert_int_eq(c.family, MR_MODEL_GPT2);
  ck_assert_int_eq(c.intermediate_size, 256);
  ck_assert_int_eq(c.vocab_size, 300);
  ck_assert_int_eq(c.max_position_embeddings, 1024);
  ck_assert_double_eq(c.layer_norm_epsilon, 1e-5);
  ck_assert_int_eq(parse("{\"architectures\":[\"LlamaForCausalLM\"],\"vocab_size\":8,"
                         "\"intermediate_size\":8,\"num_hidden_layers\":1,"
                         "\"hidden_size\":100,\"num_attention_heads\":8}", &c),
                   MR_EJOB);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "num_attention_heads"));
  ck_assert_int_eq(parse("{\"architectures\":[\"LlamaForCausalLM\"],\"vocab_size\":8,"
                         "\"intermediate_size\":8,\"num_hidden_layers\":1,\"hidden_size\":64,"
                         "\"num_attention_heads\":8,\"num_key_value_heads\":5}", &c), MR_EJOB);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "num_key_value_heads"));
  ck_assert_int_eq(parse("{\"architectures\":[\"LlamaForCausalLM\"],"
                         "\"hidden_size\":\"big\"}", &c), MR_EJOB);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "config.json: hidden_size"));
  ck_assert_int_eq(parse("{\"architectures\":[\"BertModel\"]}", &c), MR_EJOB);
  /* the JSON written back parses to the same config */
  struct mr_model_config a = tiny_llama(), b;
  char *js = mr_model_config_to_json(&a);
  ck_assert_int_eq(parse(js, &b), 0);
  free(js);
  ck_assert_int_eq(b.num_key_value_heads, 2);
  ck_assert_int_eq(b.intermediate_size, 24);
  ck_assert_double_eq(b.rms_norm_eps, 1e-5);
}
END_TEST

Suite *model_suite(void);
Suite *model_suite(void) {
  Suite *s = suite_create("model");
  TCase *tc = tcase_create("model");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_model_llama_gqa_loss_gradient);
  tcase_add_test(tc, test_model_llama_tied_loss_gradient);
  tcase_add_test(tc, test_model_gpt2_loss_gradient);
  tcase_add_test(tc, test_model_parameter_names_match_transformers);
  tcase_add_test(tc, test_model_config_defaults_and_errors);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(model_suite)
