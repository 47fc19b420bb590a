/* test_weights.c - weights in as the hub ships them: one file, a folder,
 * a sharded folder (model.safetensors.index.json and its shards) under the
 * full names or the base model's; each loads the same values bitwise as the
 * tensors written; a shard name that leaves the folder, a shard without
 * the tensor the index promises and a missing tensor are errors naming
 * the file and the tensor. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check_main.h"
#include "common/error.h"
#include "compiler/model.h"
#include "worker/exec.h"
#include "worker/weights.h"

static char dir[128];

static void make_dir(void) {
  snprintf(dir, sizeof dir, "/tmp/mr-test-weights-%d", (int)getpid());
  ck_assert_int_eq(mkdir(dir, 0700), 0);
}

static void remove_dir(void) {
  char cmd[200];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  ck_assert_int_eq(system(cmd), 0);
}

struct built {
  struct mr_model m;
  struct mr_exec x;
};

static void build(struct built *b, enum mr_model_family fam) {
  struct mr_model_config c;
  memset(&c, 0, sizeof c);
  c.family = fam;
  c.vocab_size = 40, c.hidden_size = 16, c.intermediate_size = 24;
  c.num_hidden_layers = 2, c.num_attention_heads = 4;
  c.num_key_value_heads = fam == MR_MODEL_GPT2 ? 4 : 2;
  c.max_position_embeddings = 16, c.rms_norm_eps = 1e-6, c.rope_theta = 10000;
  c.layer_norm_epsilon = 1e-5, c.initializer_range = 0.5;
  c.tie_word_embeddings = fam == MR_MODEL_GPT2;
  memset(&b->x, 0, sizeof b->x);
  ck_assert_int_eq(mr_model_build(&c, 1, 4, &b->m), 0);
  ck_assert_int_eq(mr_exec_init(&b->x, &b->m.graph, 1, MR_AMP_NONE), 0);
}

static void unbuild(struct built *b) {
  mr_exec_close(&b->x);
  mr_model_close(&b->m);
}

/* Writes the parameters over `shards` files named model-0000k-of-0000n,
 * parameter i into shard i % shards, each under its name with `strip`
 * removed from the front (the base model's names); and the index. */
static void write_sharded(const struct built *b, const char *folder, int shards,
                          const char *strip) {
  mkdir(folder, 0700);
  struct mr_st_writer *w[4];
  struct mr_st_index *ix;
  ck_assert_int_eq(mr_st_index_new(&ix), 0);
  char path[400], file[64];
  for (int s = 0; s < shards; s++) {
    snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", s + 1, shards);
    snprintf(path, sizeof path, "%s/%s", folder, file);
    ck_assert_int_eq(mr_st_writer_new(path, 0, &w[s]), 0);
  }
  const struct mr_graph *g = &b->m.graph;
  int k = 0;
  for (int i = 0; i < g->n_tensors; i++) {
    const struct mr_tensor *t = &g->tensors[i];
    if (t->role != MR_ROLE_PARAM)
      continue;
    const char *name = t->name;
    if (strip && strncmp(name, strip, strlen(strip)) == 0)
      name += strlen(strip);
    int64_t shape[MR_MAX_DIMS];
    int s = k++ % shards;
    ck_assert_int_eq(mr_st_writer_add(w[s], name, MR_F32, mr_tensor_file_shape(t, shape), shape,
                                      mr_exec_buf((struct mr_exec *)&b->x, i)),
                     0);
    snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", s + 1, shards);
    ck_assert_int_eq(mr_st_index_add(ix, name, file), 0);
  }
  for (int s = 0; s < shards; s++) {
    ck_assert_int_eq(mr_st_writer_finish(w[s]), 0);
    mr_st_writer_free(w[s]);
  }
  snprintf(path, sizeof path, "%s/model.safetensors.index.json", folder);
  ck_assert_int_eq(mr_st_index_write(ix, path), 0);
  mr_st_index_free(ix);
}

/* Every parameter of b loaded from `path` into a fresh executor equals
 * b's bitwise. */
static void loads_the_same(const struct built *b, const char *path, enum mr_model_family fam) {
  struct built c;
  build(&c, fam);
  ck_assert_msg(mr_weights_load(&c.m, &c.x, path) == 0, "%s: %s", path, mr_error_message());
  const struct mr_graph *g = &b->m.graph;
  for (int i = 0; i < g->n_tensors; i++) {
    const struct mr_tensor *t = &g->tensors[i];
    if (t->role == MR_ROLE_PARAM)
      ck_assert_msg(memcmp(mr_exec_buf(&c.x, i), mr_exec_buf((struct mr_exec *)&b->x, i),
                           (size_t)mr_tensor_numel(t) * 4) == 0,
                    "%s: %s differs", path, t->name);
  }
  unbuild(&c);
}

START_TEST(test_weights_every_form_loads_the_same) {
  make_dir();
  for (int f = 0; f < 2; f++) {
    enum mr_model_family fam = f ? MR_MODEL_GPT2 : MR_MODEL_LLAMA;
    struct built b;
    build(&b, fam);
    mr_weights_init(&b.m, &b.x, 11 + (uint64_t)f);
    char path[300];
    snprintf(path, sizeof path, "%s/one-%d.safetensors", dir, f);
    ck_assert_int_eq(mr_weights_save(&b.m, &b.x, path), 0);
    loads_the_same(&b, path, fam);
    snprintf(path, sizeof path, "%s/sharded-%d", dir, f);
    write_sharded(&b, path, 3, NULL);
    loads_the_same(&b, path, fam);
    /* the base model's names: GPT2Model's "h.0...", LlamaModel's "layers.0..." */
    snprintf(path, sizeof path, "%s/base-%d", dir, f);
    write_sharded(&b, path, 2, fam == MR_MODEL_GPT2 ? "transformer." : "model.");
    loads_the_same(&b, path, fam);
    unbuild(&b);
  }
  remove_dir();
}
END_TEST

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fputs(text, f);
  fclose(f);
}

START_TEST(test_weights_bad_index_named) {
  make_dir();
  struct built b;
  build(&b, MR_MODEL_LLAMA);
  mr_weights_init(&b.m, &b.x, 5);
  char folder[300], path[400];
  snprintf(folder, sizeof folder, "%s/sharded", dir);
  write_sharded(&b, folder, 2, NULL);
  snprintf(path, sizeof path, "%s/model.safetensors.index.json", folder);

  /* a shard outside the folder */
  write_text(path, "{\"metadata\": {\"total_size\": 4}, \"weight_map\": "
                   "{\"model.norm.weight\": \"../model-00001-of-00002.safetensors\"}}");
  ck_assert_int_eq(mr_weights_load(&b.m, &b.x, folder), MR_EFORMAT);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "model.safetensors.index.json"));
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "weight_map.model.norm.weight"));
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "not a file name in the folder"));

  /* the index sends a tensor to a shard that does not hold it */
  write_text(path, "{\"metadata\": {\"total_size\": 4}, \"weight_map\": "
                   "{\"model.embed_tokens.weight\": \"model-00002-of-00002.safetensors\"}}");
  int rc = mr_weights_load(&b.m, &b.x, folder);
  ck_assert_int_eq(rc, MR_EFORMAT);
  ck_assert_msg(strstr(mr_error_message(), "model-00002-of-00002.safetensors: tensor "
                                           "model.embed_tokens.weight: missing (the index"),
                "%s", mr_error_message());

  /* a tensor the index does not have at all */
  write_text(path, "{\"metadata\": {\"total_size\": 4}, \"weight_map\": "
                   "{\"model.norm.weight\": \"model-00001-of-00002.safetensors\"}}");
  ck_assert_int_eq(mr_weights_load(&b.m, &b.x, folder), MR_EFORMAT);
  ck_assert_msg(strstr(mr_error_message(), "tensor model.embed_tokens.weight: missing"), "%s",
                mr_error_message());

  /* a shard the index names that is not there */
  write_text(path, "{\"metadata\": {\"total_size\": 4}, \"weight_map\": "
                   "{\"model.embed_tokens.weight\": \"gone.safetensors\"}}");
  ck_assert_int_lt(mr_weights_load(&b.m, &b.x, folder), 0);
  ck_assert_msg(strstr(mr_error_message(), "gone.safetensors"), "%s", mr_error_message());

  /* malformed JSON: the index reader's error, naming the file */
  write_text(path, "{\"weight_map\": [");
  ck_assert_int_lt(mr_weights_load(&b.m, &b.x, folder), 0);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "model.safetensors.index.json"));
  unbuild(&b);
  remove_dir();
}
END_TEST

static Suite *weights_suite(void) {
  Suite *s = suite_create("weights");
  TCase *tc = tcase_create("weights");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_weights_every_form_loads_the_same);
  tcase_add_test(tc, test_weights_bad_index_named);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(weights_suite)
