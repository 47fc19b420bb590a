/* test_train_sample.c - generation: a model trained on a repeated sentence
 * continues it greedily; sampling is a function of the seed; bad input is
 * an error naming what was wrong. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check_main.h"
#include "common/error.h"
#include "common/job.h"
#include "common/tokens.h"
#include "worker/sample.h"
#include "worker/train.h"
#include "worker/weights.h"

static const char *sentence = "the quick brown fox jumps over the lazy dog. ";
static char dir[256], data[300], weights[300];

static void trained(enum mr_model_family fam) {
  snprintf(dir, sizeof dir, "/tmp/mr-test-sample-%d", (int)getpid());
  mkdir(dir, 0700);
  snprintf(data, sizeof data, "%s/fox.bin", dir);
  snprintf(weights, sizeof weights, "%s/fox.safetensors", dir);
  struct mr_tokens_writer w;
  ck_assert_int_eq(mr_tokens_writer_open(&w, data, MR_TOKENS_LLMC_U16), 0);
  size_t n = strlen(sentence);
  uint32_t tok[64];
  for (size_t i = 0; i < n; i++)
    tok[i] = (uint8_t)sentence[i];
  for (int r = 0; r < 400; r++)
    ck_assert_int_eq(mr_tokens_writer_append(&w, tok, n), 0);
  ck_assert_int_eq(mr_tokens_writer_close(&w), 0);
  struct mr_job job;
  memset(&job, 0, sizeof job);
  struct mr_model_config *c = &job.model;
  c->family = fam;
  c->vocab_size = 256, c->hidden_size = 64, c->intermediate_size = 128;
  c->num_hidden_layers = 2, c->num_attention_heads = 4;
  c->num_key_value_heads = fam == MR_MODEL_GPT2 ? 4 : 2;
  c->max_position_embeddings = 64, c->rms_norm_eps = 1e-6, c->rope_theta = 10000;
  c->layer_norm_epsilon = 1e-5, c->initializer_range = 0.02;
  c->tie_word_embeddings = fam == MR_MODEL_GPT2;
  job.train.steps = 120, job.train.global_batch = 8, job.train.seq_len = 64;
  job.train.lr = 3e-3, job.train.beta1 = 0.9, job.train.beta2 = 0.999;
  job.train.eps = 1e-8, job.train.grad_clip = 1.0, job.train.seed = 3;
  job.data_train = data;
  struct mr_reporter rep = {0};
  struct mr_run_env env = {0};
  env.threads = 2;
  env.log_dir = dir;
  env.weights_out = weights;
  env.reporter = &rep;
  ck_assert_msg(mr_train_run(&job, &env) == 0, "%s", mr_error_message());
}

static void cleanup(void) {
  unlink(data);
  unlink(weights);
  rmdir(dir);
}

static void greedy_continues(void) {
  uint8_t out[32];
  ck_assert_int_eq(mr_sample_generate(weights, NULL, "the quick brown", 20, 0, 0, out), 20);
  ck_assert_msg(memcmp(out, " fox jumps over the ", 20) == 0, "got \"%.20s\"", out);
  /* from the middle of the sentence, across its end */
  ck_assert_int_eq(mr_sample_generate(weights, NULL, "lazy", 12, 0, 0, out), 12);
  ck_assert_msg(memcmp(out, " dog. the qu", 12) == 0, "got \"%.12s\"", out);
}

/* the LLaMA is trained once for the whole case (an unchecked fixture) */
static void trained_llama(void) { trained(MR_MODEL_LLAMA); }

START_TEST(test_sample_llama_greedy_continues_training_text) {
  greedy_continues();
}
END_TEST

START_TEST(test_sample_gpt2_greedy_continues_training_text) {
  trained(MR_MODEL_GPT2);
  greedy_continues();
  cleanup(); /* this (forked) test's own folder: trained() names it by pid */
}
END_TEST

START_TEST(test_sample_seeded_and_bad_input) {
  uint8_t a[40], b[40], c[40];
  ck_assert_int_eq(mr_sample_generate(weights, NULL, "x", 40, 5.0, 7, a), 40);
  ck_assert_int_eq(mr_sample_generate(weights, NULL, "x", 40, 5.0, 7, b), 40);
  ck_assert_int_eq(mr_sample_generate(weights, NULL, "x", 40, 5.0, 8, c), 40);
  ck_assert_mem_eq(a, b, 40);
  ck_assert(memcmp(a, c, 40) != 0); /* at temperature 5 the seed matters */
  ck_assert_int_lt(mr_sample_generate("/nonexistent.safetensors", NULL, "x", 4, 0, 0, a), 0);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "/nonexistent.safetensors"));
  ck_assert_int_lt(mr_sample_generate(weights, NULL, "", 4, 0, 0, a), 0);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "--prompt"));
  char *bad[] = {"sample", weights, "--prompt", "x", "--tokens", "many", NULL};
  ck_assert_int_eq(mr_sample_main(6, bad), 2);
  char *none[] = {"sample", "--prompt", "x", NULL};
  ck_assert_int_eq(mr_sample_main(3, none), 2);
  char *help[] = {"sample", "--help", NULL};
  ck_assert_int_eq(mr_sample_main(2, help), 0);
}
END_TEST

/* A folder as meshrun export writes it (model.safetensors, config.json) is
 * taken as it is: the same continuation as the file with its own config. */
START_TEST(test_sample_from_a_model_folder) {
  char folder[400], path[480];
  snprintf(folder, sizeof folder, "%s/exported", dir);
  ck_assert_int_eq(mkdir(folder, 0700), 0);
  snprintf(path, sizeof path, "%s/model.safetensors", folder);
  ck_assert_int_eq(link(weights, path), 0);
  struct mr_model_config cfg;
  ck_assert_int_eq(mr_weights_read_config(weights, &cfg), 0);
  char *js = mr_model_config_to_json(&cfg);
  snprintf(path, sizeof path, "%s/config.json", folder);
  FILE *f = fopen(path, "w");
  fputs(js, f);
  fclose(f);
  free(js);
  uint8_t a[24], b[24];
  ck_assert_int_eq(mr_sample_generate(weights, NULL, "the quick", 24, 0, 0, a), 24);
  ck_assert_msg(mr_sample_generate(folder, NULL, "the quick", 24, 0, 0, b) == 24, "%s",
                mr_error_message());
  ck_assert_mem_eq(a, b, 24);
  unlink(path);
  ck_assert_int_lt(mr_sample_generate(folder, NULL, "the quick", 4, 0, 0, b), 0);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "exported/config.json"));
  snprintf(path, sizeof path, "%s/model.safetensors", folder);
  unlink(path);
  rmdir(folder);
}
END_TEST

Suite *train_sample_suite(void);
Suite *train_sample_suite(void) {
  Suite *s = suite_create("train_sample");
  TCase *tc = tcase_create("sample");
  tcase_set_timeout(tc, 300);
  tcase_add_unchecked_fixture(tc, trained_llama, cleanup);
  tcase_add_test(tc, test_sample_llama_greedy_continues_training_text);
  tcase_add_test(tc, test_sample_from_a_model_folder);
  tcase_add_test(tc, test_sample_gpt2_greedy_continues_training_text);
  tcase_add_test(tc, test_sample_seeded_and_bad_input);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(train_sample_suite)
