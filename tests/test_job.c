/* test_job.c - the job file and model configs: what parses, what is
 * rejected and how the message names the file and field; and the CLI's
 * exit code 2 on bad input. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "common/error.h"
#include "common/job.h"
#include "common/model_config.h"
#include "testutil.h"

static const char *llama_inline =
    "{\"model_type\": \"llama\", \"vocab_size\": 256, \"hidden_size\": 64, "
    "\"intermediate_size\": 172, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
    "\"num_key_value_heads\": 2, \"max_position_embeddings\": 128}";

static int parse(const char *fmt, const char *inner, struct mr_job *job) {
  char text[4096];
  snprintf(text, sizeof text, fmt, llama_inline, inner);
  return mr_job_parse(text, "job.json", "/jobs", job);
}

START_TEST(test_job_smallest_job_gets_defaults) {
  struct mr_job job;
  ck_assert_int_eq(parse("{\"model\": %s, \"data\": {\"train\": \"d/train.bin\"}%s}", "", &job), 0);
  ck_assert_str_eq(job.data_train, "/jobs/d/train.bin");
  ck_assert_ptr_null(job.data_val);
  ck_assert_int_eq(job.train.steps, 200);
  ck_assert_int_eq(job.train.global_batch, 8);
  ck_assert_int_eq(job.train.seq_len, 256);
  ck_assert(job.train.lr == 1e-3 && job.train.beta1 == 0.9 && job.train.beta2 == 0.999);
  ck_assert(job.train.eps == 1e-8 && job.train.weight_decay == 0.01);
  ck_assert_int_eq(job.strategy.auto_mode, MR_AUTO_FULL);
  ck_assert_int_eq(job.strategy.dp, 0);
  ck_assert_int_eq(job.strategy.zero_stage, -1);
  ck_assert_int_eq(job.strategy.sequence_parallel, -1);
  ck_assert_int_eq(job.strategy.mapping, -1);
  ck_assert_int_eq(job.model.family, MR_MODEL_LLAMA);
  ck_assert_int_eq(job.model.num_key_value_heads, 2);
  ck_assert(job.model.rms_norm_eps == 1e-6 && job.model.rope_theta == 10000.0);
  ck_assert_int_eq(job.model.tie_word_embeddings, 0);
  ck_assert_ptr_nonnull(job.text);
  /* the canonical text re-parses to the same job, model inline */
  struct mr_job again;
  ck_assert_int_eq(mr_job_parse(job.text, "canon", "/elsewhere", &again), 0);
  ck_assert_str_eq(again.data_train, "/jobs/d/train.bin");
  ck_assert_int_eq(again.model.hidden_size, 64);
  ck_assert_int_eq(again.model.intermediate_size, 172);
  mr_job_close(&again);
  mr_job_close(&job);
}
END_TEST

START_TEST(test_job_full_example_parses) {
  const char *full =
      ", \"train\": {\"steps\": 20, \"global_batch\": 16, \"seq_len\": 64, \"lr\": 3e-4,"
      " \"schedule\": \"cosine\", \"warmup_steps\": 2, \"min_lr\": 1e-5,"
      " \"weight_decay\": 0.1, \"betas\": [0.9, 0.95], \"eps\": 1e-6, \"grad_clip\": 0.5,"
      " \"seed\": 7, \"init\": \"random\", \"eval_interval_steps\": 5, \"eval_batches\": 2,"
      " \"log_interval_steps\": 10},"
      " \"strategy\": {\"auto_mode\": \"semi\", \"data_parallel\": {\"degree\": 2},"
      " \"tensor_parallel\": {\"degree\": 2}, \"pipeline_parallel\": {\"degree\": 2,"
      " \"schedule\": \"interleaved\", \"micro_batches\": 4, \"virtual_stages\": 2},"
      " \"sequence_parallel\": {\"enable\": true}, \"sharding\": {\"stage\": 2, \"offload\": true},"
      " \"recompute\": {\"enable\": true, \"granularity\": \"selective\","
      " \"checkpoint_every_n_layers\": 2}, \"amp\": {\"dtype\": \"bf16\", \"init_loss_scaling\": 512},"
      " \"gradient_accumulation_steps\": 2, \"mesh_mapping\": \"tp,pp,dp\"},"
      " \"shard_rules\": [{\"match\": \"q_proj|k_proj\", \"placements\": {\"model\": \"Shard(0)\"}},"
      " {\"match\": \"o_proj\", \"placements\": {\"model\": \"Shard(1)\", \"data\": \"Replicate()\"}}],"
      " \"checkpoint\": {\"dir\": \"ck\", \"save_interval_steps\": 10, \"keep_last\": 2},"
      " \"cluster\": \"/c/cpu.json\", \"plugins\": [\"p/fused.so\", \"/abs/q.so\"]";
  struct mr_job job;
  int rc = parse("{\"model\": %s, \"data\": {\"train\": \"t.bin\", \"val\": \"/abs/v.bin\"}%s}",
                 full, &job);
  ck_assert_msg(rc == 0, "%s", mr_error_message());
  ck_assert_str_eq(job.data_val, "/abs/v.bin");
  ck_assert_int_eq(job.train.schedule, MR_SCHEDULE_COSINE);
  ck_assert(job.train.beta2 == 0.95 && job.train.grad_clip == 0.5);
  ck_assert_int_eq(job.train.seed, 7);
  ck_assert_ptr_null(job.train.init);
  ck_assert_int_eq(job.strategy.auto_mode, MR_AUTO_SEMI);
  ck_assert_int_eq(job.strategy.dp * job.strategy.tp * job.strategy.pp, 8);
  ck_assert_int_eq(job.strategy.pp_schedule, MR_PP_INTERLEAVED);
  ck_assert_int_eq(job.strategy.virtual_stages, 2);
  ck_assert_int_eq(job.strategy.micro_batches, 4);
  ck_assert_int_eq(job.strategy.sequence_parallel, 1);
  ck_assert_int_eq(job.strategy.zero_stage, 2);
  ck_assert_int_eq(job.strategy.offload, 1);
  ck_assert_int_eq(job.strategy.recompute_granularity, MR_RECOMPUTE_SELECTIVE);
  ck_assert_int_eq(job.strategy.amp_dtype, MR_AMP_BF16);
  ck_assert(job.strategy.init_loss_scaling == 512);
  ck_assert_int_eq(job.strategy.mapping, MR_MAP_TP_PP_DP);
  ck_assert_int_eq(job.n_shard_rules, 2);
  ck_assert_str_eq(job.shard_rules[1].match, "o_proj");
  ck_assert_int_eq(job.shard_rules[1].n_placements, 2);
  ck_assert_str_eq(job.shard_rules[1].placements[0].mesh_dim, "model");
  ck_assert_str_eq(job.shard_rules[1].placements[0].placement, "Shard(1)");
  ck_assert_str_eq(job.checkpoint.dir, "/jobs/ck");
  ck_assert_str_eq(job.cluster, "/c/cpu.json");
  ck_assert_int_eq(job.n_plugins, 2);
  ck_assert_str_eq(job.plugins[0], "/jobs/p/fused.so");
  ck_assert_str_eq(job.plugins[1], "/abs/q.so");
  /* the canonical text a worker gets holds them resolved */
  struct mr_job again;
  ck_assert_int_eq(mr_job_parse(job.text, "plan", "/elsewhere", &again), 0);
  ck_assert_int_eq(again.n_plugins, 2);
  ck_assert_str_eq(again.plugins[0], "/jobs/p/fused.so");
  mr_job_close(&again);
  mr_job_close(&job);
}
END_TEST

/* Parses and expects MR_EJOB with every listed fragment in the message. */
static void expect_error(const char *body, const char *const *fragments) {
  struct mr_job job;
  int rc = parse(body, "", &job);
  ck_assert_msg(rc == MR_EJOB, "accepted: %s", body);
  const char *msg = mr_error_message();
  for (int i = 0; fragments[i] != NULL; i++)
    ck_assert_msg(strstr(msg, fragments[i]) != NULL, "message lacks \"%s\":\n%s",
                  fragments[i], msg);
}

START_TEST(test_job_wrong_type_names_field_path) {
  const char *want[] = {"job.json: strategy.pipeline_parallel.degree: expected a positive integer, got \"two\"",
                        NULL};
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"strategy\": "
               "{\"pipeline_parallel\": {\"degree\": \"two\"}}}",
               want);
}
END_TEST

START_TEST(test_job_unknown_fields_all_reported) {
  const char *want[] = {"job.json: trian: unknown field", "job.json: train.stpes: unknown field",
                        "job.json: strategy.sharding.stag: unknown field", NULL};
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"trian\": 1,"
               " \"train\": {\"stpes\": 3}, \"strategy\": {\"sharding\": {\"stag\": 1}}}",
               want);
}
END_TEST

START_TEST(test_job_out_of_range_and_inconsistent_values) {
  const char *w1[] = {"strategy.sharding.stage: expected an integer in [0, 3], got 4", NULL};
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"strategy\": {\"sharding\": {\"stage\": 4}}}", w1);
  const char *w2[] = {"train.steps: expected a positive integer, got 2.5", NULL};
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"train\": {\"steps\": 2.5}}", w2);
  const char *w3[] = {"virtual_stages: more than one virtual stage needs schedule \"interleaved\"", NULL};
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"strategy\": {\"pipeline_parallel\":"
               " {\"degree\": 2, \"schedule\": \"1f1b\", \"virtual_stages\": 2}}}", w3);
  const char *w4[] = {"sequence_parallel.enable: sequence parallelism shards along the tensor-parallel group", NULL};
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"strategy\": {\"tensor_parallel\":"
               " {\"degree\": 1}, \"sequence_parallel\": {\"enable\": true}}}", w4);
  const char *w5[] = {"train.schedule: expected \"constant\" or \"cosine\", got \"linear\"", NULL};
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"train\": {\"schedule\": \"linear\"}}", w5);
  const char *w6[] = {"shard_rules[0].placements.model: expected \"Shard(d)\"", "got \"Shard(x)\"", NULL};
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"shard_rules\": [{\"match\": \"q\","
               " \"placements\": {\"model\": \"Shard(x)\"}}]}", w6);
  const char *w7[] = {"shard_rules[0].match: expected a POSIX extended regex", NULL};
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"shard_rules\": [{\"match\": \"q(\","
               " \"placements\": {\"model\": \"Shard(0)\"}}]}", w7);
  const char *w11[] = {"job.json: model: /dev/zero: expected a JSON file of at most 64 MiB", NULL};
  expect_error("{\"model\": \"/dev/zero\", \"data\": {\"train\": \"t\"}}", w11);
  /* repetitions regcomp expands by copying (exponential when stacked) */
  const char *w12[] = {"shard_rules[0].match: expected a regex of at most 1024 characters and "
                       "4096 atoms with its repetitions expanded", "got about 2.097e+06", NULL};
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"shard_rules\": [{\"match\": "
               "\"k_((((((((((((((((((((o+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+\", \"placements\": {\"model\": \"Shard(0)\"}}]}", w12);
  const char *w13[] = {"shard_rules[0].match: expected a regex of at most 1024 characters", NULL};
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"shard_rules\": [{\"match\": "
               "\"((q{100}){100})\", \"placements\": {\"model\": \"Shard(0)\"}}]}", w13);
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"shard_rules\": [{\"match\": "
               "\"q***\", \"placements\": {\"model\": \"Shard(0)\"}}]}", w13);
  /* a key given twice: cJSON would read the first, a rewritten job the other */
  const char *w14[] = {"job.json: strategy.pipeline_parallel.degree: given twice; expected each "
                       "key once", NULL};
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"strategy\": "
               "{\"pipeline_parallel\": {\"degree\": 2, \"degree\": 1}}}", w14);
  const char *w15[] = {"job.json: plugins: expected an array of at most 16 shared-object "
                       "paths, got \"fused.so\"", NULL};
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"plugins\": \"fused.so\"}", w15);
  const char *w16[] = {"job.json: plugins[1]: expected a shared-object path, got 3", NULL};
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"plugins\": [\"a.so\", 3]}",
               w16);
  const char *w8[] = {"job.json: data: missing", NULL};
  expect_error("{\"model\": %s%s}", w8);
  const char *w9[] = {"train.betas: expected each in [0, 1)", NULL};
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"train\": {\"betas\": [0.9, 1.5]}}", w9);
  const char *w10[] = {"job.json: strategy.mesh_mapping: expected \"tp,dp,pp\" or \"tp,pp,dp\", "
                       "got \"pp,dp,tp\"", NULL};
  expect_error("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"strategy\": "
               "{\"mesh_mapping\": \"pp,dp,tp\"}}", w10);
}
END_TEST

/* pipeline_parallel.layers: one positive count per chunk (degree x virtual
 * stages) adding up to the model's layers (2 here). */
/* A job whose strategy holds `members` is refused, saying `says`. */
static void expect_strategy_error(const char *members, const char *says) {
  char body[512];
  snprintf(body, sizeof body, "{\"model\": %%s%%s, \"data\": {\"train\": \"t\"}, "
           "\"strategy\": {%s}}", members);
  const char *want[] = {says, NULL};
  expect_error(body, want);
}

START_TEST(test_job_pipeline_layers) {
  struct mr_job job;
  int rc = parse("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"strategy\": "
                 "{\"pipeline_parallel\": {\"degree\": 2, \"layers\": [1, 1]}}}", "", &job);
  ck_assert_msg(rc == 0, "%s", mr_error_message());
  ck_assert_int_eq(job.strategy.n_chunk_layers, 2);
  ck_assert_int_eq(job.strategy.chunk_layers[0] + job.strategy.chunk_layers[1], 2);
  ck_assert_int_eq(job.strategy.virtual_stages, 1); /* the count fixes it */
  ck_assert_msg(strstr(job.text, "\"layers\":[1,1]") != NULL, "%s", job.text);
  mr_job_close(&job);
  static const struct {
    const char *pp, *says;
  } bad[] = {
      {"\"degree\": 2, \"layers\": [2]", "strategy.pipeline_parallel.layers: expected 2 entries "
                                         "(degree 2 x virtual_stages 1), got 1"},
      {"\"degree\": 2, \"layers\": [1, 2]", "strategy.pipeline_parallel.layers: expected counts "
                                            "adding up to the model's 2 layers, got 3"},
      {"\"degree\": 2, \"layers\": [0, 2]", "strategy.pipeline_parallel.layers[0]: expected a "
                                            "positive layer count, got 0"},
      {"\"degree\": 2, \"layers\": [1, 1.5]", "layers[1]: expected a positive layer count"},
      {"\"layers\": [1, 1]", "strategy.pipeline_parallel.layers: the layers of each chunk need "
                             "a fixed degree"},
      {"\"degree\": 2, \"layers\": \"1,1\"", "strategy.pipeline_parallel.layers: expected an "
                                             "array of layer counts"},
  };
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    char st[256];
    snprintf(st, sizeof st, "\"pipeline_parallel\": {%s}", bad[k].pp);
    expect_strategy_error(st, bad[k].says);
  }
}
END_TEST

START_TEST(test_job_data_parallel_micro_batches) {
  struct mr_job job;
  int rc = parse("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"strategy\": "
                 "{\"data_parallel\": {\"degree\": 3, \"micro_batches\": [4, 1, 1]}}}", "",
                 &job);
  ck_assert_msg(rc == 0, "%s", mr_error_message());
  ck_assert_int_eq(job.strategy.n_dp_micro, 3);
  ck_assert_int_eq(job.strategy.dp_micro[0], 4);
  ck_assert_int_eq(job.strategy.dp_micro[2], 1);
  ck_assert_msg(strstr(job.text, "\"micro_batches\":[4,1,1]") != NULL, "%s", job.text);
  mr_job_close(&job);
  static const struct {
    const char *st, *says;
  } bad[] = {
      {"\"data_parallel\": {\"degree\": 2, \"micro_batches\": [3]}",
       "strategy.data_parallel.micro_batches: expected 2 entries (one per data-parallel rank), "
       "got 1"},
      {"\"data_parallel\": {\"degree\": 2, \"micro_batches\": [3, 0]}",
       "strategy.data_parallel.micro_batches[1]: expected a positive micro-batch count, got 0"},
      {"\"data_parallel\": {\"micro_batches\": [3, 1]}",
       "strategy.data_parallel.micro_batches: the micro-batches of each rank need a fixed degree"},
      {"\"data_parallel\": {\"degree\": 2, \"micro_batches\": {\"a\": 1}}",
       "strategy.data_parallel.micro_batches: expected an array of micro-batch counts, one per "
       "data-parallel rank"},
  };
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++)
    expect_strategy_error(bad[k].st, bad[k].says);
  /* with ZeRO-2/3 too (the ranks with fewer join the others' collectives) */
  rc = parse("{\"model\": %s%s, \"data\": {\"train\": \"t\"}, \"strategy\": "
             "{\"data_parallel\": {\"degree\": 2, \"micro_batches\": [3, 1]}, "
             "\"sharding\": {\"stage\": 2}}}", "", &job);
  ck_assert_msg(rc == 0, "%s", mr_error_message());
  ck_assert_int_eq(job.strategy.zero_stage, 2);
  ck_assert_int_eq(job.strategy.dp_micro[0], 3);
  mr_job_close(&job);
}
END_TEST

/* A LLaMA config of the shape fields, with `extra` members after them. */
static const char *llama_with(const char *extra) {
  static char buf[500];
  snprintf(buf, sizeof buf, "{\"model_type\": \"llama\", \"vocab_size\": 256, \"hidden_size\": 64,"
           " \"intermediate_size\": 128, \"num_hidden_layers\": 2, \"num_attention_heads\": 4%s%s}",
           extra[0] ? ", " : "", extra);
  return buf;
}

/* Every refusal names the file, the field, its value and what is built. */
START_TEST(test_model_config_errors_name_key) {
  struct mr_model_config c;
  char cases[][2][512] = {
      {"{\"model_type\": \"llama\", \"vocab_size\": 8, \"hidden_size\": 64, \"intermediate_size\": 8,"
       " \"num_hidden_layers\": 1, \"num_attention_heads\": 5}",
       "num_attention_heads: expected a divisor of the hidden size (64), got 5"},
      {"", "num_key_value_heads: expected a divisor of num_attention_heads (4), got 3"},
      {"{\"model_type\": \"bert\"}", "model_type: unknown model \"bert\"; supported: model_type "
       "\"llama\" (LlamaForCausalLM), \"qwen2\" (Qwen2ForCausalLM), \"mistral\" "
       "(MistralForCausalLM), \"gpt2\" (GPT2LMHeadModel)"},
      {"{\"model_type\": \"bert\", \"architectures\": [\"LlamaForCausalLM\"]}",
       "model_type: \"bert\" does not go with architectures \"LlamaForCausalLM\" (expected \"llama\")"},
      {"{\"model_type\": \"gemma\", \"architectures\": [\"GemmaForCausalLM\"]}",
       "model_type: \"gemma\" (GemmaForCausalLM) is not built in meshrun; supported:"},
      {"{\"architectures\": [\"MixtralForCausalLM\"]}",
       "architectures: \"MixtralForCausalLM\" (MixtralForCausalLM) is not built"},
      {"", "hidden_act: only \"silu\" is supported, got \"gelu\""},
      {"{\"model_type\": \"gpt2\", \"n_embd\": \"big\"}", "n_embd: expected a positive integer, got \"big\""},
      {"{\"model_type\": \"llama\", \"num_attention_heads\": 4}",
       "hidden_size: missing (the model's shape is not assumed)"},
      {"{\"model_type\": \"gpt2\", \"n_embd\": 64, \"n_head\": 4, \"vocab_size\": 9}",
       "n_layer: missing (the model's shape is not assumed)"},
      {"", "rope_scaling.low_freq_factor: missing (rope_type \"llama3\" needs it)"},
      {"", "rope_scaling.type: \"yarn\" is not built (supported: \"default\", \"linear\", "
       "\"dynamic\", \"llama3\")"},
      {"", "rope_parameters.factor: missing (rope_type \"dynamic\" needs it)"},
      {"", "rope_parameters.rope_theta: 500000, but the top-level rope_theta is 10000"},
      {"", "attention_dropout: dropout is not built, got 0.1 (0 or 0.0 trains without it)"},
      {"{\"model_type\": \"gpt2\", \"n_embd\": 64, \"n_head\": 4, \"n_layer\": 1, \"vocab_size\": 9,"
       " \"attn_pdrop\": 0.1, \"resid_pdrop\": 0.0, \"embd_pdrop\": 0.2}",
       "embd_pdrop: dropout is not built, got 0.2"},
  };
  const char *extras[] = {"", "\"num_key_value_heads\": 3", "", "", "", "", "\"hidden_act\": \"gelu\"",
                          "", "", "", "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0}",
                          "\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 2.0}",
                          "\"rope_parameters\": {\"rope_type\": \"dynamic\", \"rope_theta\": 10000}",
                          "\"rope_theta\": 10000, \"rope_parameters\": {\"rope_type\": \"default\","
                          " \"rope_theta\": 500000}",
                          "\"attention_dropout\": 0.1", ""};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    if (cases[i][0][0] == '\0')
      snprintf(cases[i][0], sizeof cases[i][0], "%s", llama_with(extras[i]));
    struct mr_job job;
    char text[1024];
    snprintf(text, sizeof text, "{\"model\": %.900s, \"data\": {\"train\": \"t\"}}",
             cases[i][0]);
    ck_assert_int_eq(mr_job_parse(text, "j.json", ".", &job), MR_EJOB);
    ck_assert_msg(strstr(mr_error_message(), "j.json: model: ") != NULL &&
                      strstr(mr_error_message(), cases[i][1]) != NULL,
                  "case %zu: %s", i, mr_error_message());
  }
  /* RoPE's base in either form: transformers 4.x's top level, 5.x's
   * rope_parameters; the plain kind either way */
  static const char *const forms[] = {
      "\"rope_theta\": 500000.0",
      "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 500000.0}",
      "\"rope_theta\": 500000.0, \"rope_scaling\": {\"rope_type\": \"default\"}",
      "\"rope_theta\": 500000.0, \"rope_scaling\": null, \"attention_dropout\": 0.0"};
  for (size_t i = 0; i < sizeof forms / sizeof *forms; i++) {
    struct mr_job job;
    char text[1024];
    snprintf(text, sizeof text, "{\"model\": %s, \"data\": {\"train\": \"t\"}}",
             llama_with(forms[i]));
    ck_assert_msg(mr_job_parse(text, "j.json", ".", &job) == 0, "%s: %s", forms[i],
                  mr_error_message());
    ck_assert_double_eq(job.model.rope_theta, 500000.0);
    mr_job_close(&job);
  }
  /* GPT-2 small: the shape given, the rest as transformers' GPT2Config */
  struct mr_job job;
  ck_assert_int_eq(mr_job_parse("{\"model\": {\"architectures\": [\"GPT2LMHeadModel\"],"
                                " \"vocab_size\": 50257, \"n_embd\": 768, \"n_layer\": 12,"
                                " \"n_head\": 12, \"attn_pdrop\": 0.0},"
                                " \"data\": {\"train\": \"t\"}, \"train\": {\"seq_len\": 1024}}",
                                "j.json", ".", &job), 0);
  c = job.model;
  ck_assert_int_eq(c.family, MR_MODEL_GPT2);
  ck_assert_int_eq(c.vocab_size, 50257);
  ck_assert_int_eq(c.hidden_size, 768);
  ck_assert_int_eq(c.intermediate_size, 3072);
  ck_assert_int_eq(c.num_hidden_layers, 12);
  ck_assert_int_eq(c.max_position_embeddings, 1024);
  ck_assert(c.layer_norm_epsilon == 1e-5 && c.tie_word_embeddings == 1);
  /* 124,439,808: GPT-2 small's published parameter count */
  ck_assert_int_eq(mr_model_param_count(&c), 124439808);
  mr_job_close(&job);
  /* seq_len beyond GPT-2's positions is caught */
  ck_assert_int_eq(mr_job_parse("{\"model\": {\"model_type\": \"gpt2\", \"n_positions\": 64,"
                                " \"vocab_size\": 9, \"n_embd\": 8, \"n_layer\": 1, \"n_head\": 2},"
                                " \"data\": {\"train\": \"t\"}, \"train\": {\"seq_len\": 65}}",
                                "j.json", ".", &job), MR_EJOB);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "train.seq_len: expected at most the model's n_positions (64)"));
}
END_TEST

START_TEST(test_model_config_llama_param_count) {
  /* Llama-2-7B's config gives its published 6,738,415,616 parameters */
  struct mr_job job;
  ck_assert_int_eq(mr_job_parse("{\"model\": {\"architectures\": [\"LlamaForCausalLM\"],"
                                " \"vocab_size\": 32000, \"hidden_size\": 4096,"
                                " \"intermediate_size\": 11008, \"num_hidden_layers\": 32,"
                                " \"num_attention_heads\": 32, \"num_key_value_heads\": 32,"
                                " \"rms_norm_eps\": 1e-05, \"tie_word_embeddings\": false,"
                                " \"torch_dtype\": \"float16\", \"bos_token_id\": 1},"
                                " \"data\": {\"train\": \"t\"}}", "j.json", ".", &job), 0);
  ck_assert_int_eq(mr_model_param_count(&job.model), 6738415616LL);
  mr_job_close(&job);
}
END_TEST

/* configs/models/hub: the configs of public models, each read as its
 * class and giving the parameter count published for it (SmolLM2-135M's
 * 134,515,008; Llama-3.2-1B's 1,235,814,400, RoPE scaled "llama3";
 * Qwen2.5-0.5B's 494,032,768, its q/k/v biases included; Mistral-7B's
 * 7,241,732,096; GPT-2's 124,439,808). */
START_TEST(test_model_config_hub_configs) {
  static const struct {
    const char *file;
    enum mr_model_arch arch;
    int64_t params;
    int qkv_bias;
    int64_t window;
  } hub[] = {{"smollm2-135m.json", MR_ARCH_LLAMA, 134515008LL, 0, 0},
             {"llama-3.2-1b.json", MR_ARCH_LLAMA, 1235814400LL, 0, 0},
             {"qwen2.5-0.5b.json", MR_ARCH_QWEN2, 494032768LL, 1, 0},
             {"mistral-7b-v0.1.json", MR_ARCH_MISTRAL, 7241732096LL, 0, 4096},
             {"gpt2-124m.json", MR_ARCH_GPT2, 124439808LL, 0, 0}};
  for (size_t i = 0; i < sizeof hub / sizeof *hub; i++) {
    char path[1024];
    snprintf(path, sizeof path, "%s/configs/models/hub/%s", getenv("MESHRUN_SOURCE_DIR"),
             hub[i].file);
    struct mr_model_config c;
    ck_assert_msg(mr_model_config_load(path, &c) == 0, "%s", mr_error_message());
    ck_assert_int_eq(c.arch, hub[i].arch);
    ck_assert_int_eq(c.qkv_bias, hub[i].qkv_bias);
    ck_assert_int_eq(c.o_bias, 0);
    ck_assert_int_eq(c.sliding_window, hub[i].window);
    ck_assert_msg(mr_model_param_count(&c) == hub[i].params, "%s: %lld parameters", hub[i].file,
                  (long long)mr_model_param_count(&c));
    if (i == 1) /* Llama 3.2's RoPE: llama3, factor 32, bands 1..4 of 8192 */
      ck_assert(c.rope.kind == MR_ROPE_LLAMA3 && c.rope.factor == 32 && c.rope.theta == 500000 &&
                c.rope.low_freq_factor == 1 && c.rope.high_freq_factor == 4 &&
                c.rope.original_max_positions == 8192);
  }
  /* Mistral's window, every layer's, is built: a longer sequence slides */
  char text[1024];
  snprintf(text, sizeof text,
           "{\"model\": \"%s/configs/models/hub/mistral-7b-v0.1.json\", \"data\": {\"train\": "
           "\"t\"}, \"train\": {\"seq_len\": 8192}}", getenv("MESHRUN_SOURCE_DIR"));
  struct mr_job job;
  ck_assert_msg(mr_job_parse(text, "j.json", ".", &job) == 0, "%s", mr_error_message());
  mr_job_close(&job);
  /* Qwen2's, which spares the layers below max_window_layers, is not: a
   * longer sequence is refused at the job, naming both */
  ck_assert_int_eq(mr_job_parse("{\"model\": {\"model_type\": \"qwen2\", \"vocab_size\": 8,"
                                " \"hidden_size\": 8, \"intermediate_size\": 8,"
                                " \"num_hidden_layers\": 1, \"num_attention_heads\": 2,"
                                " \"max_position_embeddings\": 64, \"use_sliding_window\": true,"
                                " \"sliding_window\": 16}, \"data\": {\"train\": \"t\"},"
                                " \"train\": {\"seq_len\": 32}}", "j.json", ".", &job),
                   MR_EJOB);
  ck_assert_msg(strstr(mr_error_message(), "j.json: train.seq_len: 32: the model's "
                                           "sliding_window: 16") != NULL,
                "%s", mr_error_message());
  /* an explicit head_dim other than hidden / heads: q and o are heads x
   * head_dim wide (8 x 64 x 2 + 64 x 96 + 2 x 64 x 48 + 96 x 64 + 3 x 64 x
   * 8 + 2 x 64 + 64 = 21184) */
  ck_assert_int_eq(mr_job_parse("{\"model\": {\"model_type\": \"llama\", \"vocab_size\": 8,"
                                " \"hidden_size\": 64, \"intermediate_size\": 8,"
                                " \"num_hidden_layers\": 1, \"num_attention_heads\": 4,"
                                " \"num_key_value_heads\": 2, \"head_dim\": 24},"
                                " \"data\": {\"train\": \"t\"}}", "j.json", ".", &job), 0);
  ck_assert_int_eq(mr_model_head_dim(&job.model), 24);
  ck_assert_int_eq(mr_model_param_count(&job.model), 21184);
  mr_job_close(&job);
  /* LLaMA's attention_bias: q, k, v and o; mlp_bias is refused */
  ck_assert_int_eq(mr_job_parse("{\"model\": {\"model_type\": \"llama\", \"vocab_size\": 8,"
                                " \"hidden_size\": 8, \"intermediate_size\": 8,"
                                " \"num_hidden_layers\": 1, \"num_attention_heads\": 2,"
                                " \"attention_bias\": true}, \"data\": {\"train\": \"t\"}}",
                                "j.json", ".", &job), 0);
  ck_assert(job.model.qkv_bias == 1 && job.model.o_bias == 1);
  ck_assert_int_eq(mr_model_param_count(&job.model),
                   8 * 8 * 2 + (8 * 8 * 4 + 3 * 8 * 8 + 2 * 8 + 4 * 8) + 8);
  mr_job_close(&job);
  ck_assert_int_eq(mr_job_parse("{\"model\": {\"model_type\": \"qwen2\", \"vocab_size\": 8,"
                                " \"hidden_size\": 8, \"intermediate_size\": 8,"
                                " \"num_hidden_layers\": 1, \"num_attention_heads\": 2,"
                                " \"mlp_bias\": true}, \"data\": {\"train\": \"t\"}}",
                                "j.json", ".", &job), MR_EJOB);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "mlp_bias: not supported"));
}
END_TEST

/* Runs `meshrun launch` on a job file and returns the exit code; the
 * stderr text is left in *err (caller frees). */
static int launch_job(const char *dir, const char *job_text, char **err) {
  char path[128];
  snprintf(path, sizeof path, "%s/job.json", dir);
  if (job_text != NULL) {
    FILE *f = fopen(path, "w");
    fputs(job_text, f);
    fclose(f);
  } else {
    snprintf(path, sizeof path, "%s/missing.json", dir);
  }
  char logdir[160];
  snprintf(logdir, sizeof logdir, "%s/logs", dir);
  char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", "1", "--log-dir", logdir, path, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, NULL);
  int code = mr_t_wait(&p, 20);
  *err = mr_t_slurp(p.err_path);
  return code;
}

START_TEST(test_cli_bad_job_files_exit_2_naming_file_and_field) {
  char dir[64], *err;
  mr_t_tmpdir(dir, sizeof dir);
  ck_assert_int_eq(launch_job(dir, NULL, &err), 2);
  ck_assert_msg(strstr(err, "missing.json: No such file or directory") != NULL, "%s", err);
  free(err);
  ck_assert_int_eq(launch_job(dir, "{\"model\": {\n  \"model_type\": \"llama\",,\n}", &err), 2);
  ck_assert_msg(strstr(err, "job.json: not valid JSON: line 2") != NULL, "%s", err);
  free(err);
  ck_assert_int_eq(launch_job(dir, "{\"model\": {\"model_type\": \"llama\"}, \"data\": {\"train\": \"t\"},"
                                   " \"strategy\": {\"pipeline_parallel\": {\"degree\": \"two\"}}}", &err), 2);
  ck_assert_msg(strstr(err, "job.json: strategy.pipeline_parallel.degree: expected a positive integer, got \"two\"") != NULL, "%s", err);
  free(err);
  ck_assert_int_eq(launch_job(dir, "{\"model\": {\"model_type\": \"llama\"}, \"data\": {\"train\": \"t\"},"
                                   " \"optimizer\": {}}", &err), 2);
  ck_assert_msg(strstr(err, "job.json: optimizer: unknown field") != NULL, "%s", err);
  free(err);
  /* a config.json whose RoPE scaling is not built (YaRN): exit 2 naming
   * the file, the field and its value */
  char cfg[160];
  snprintf(cfg, sizeof cfg, "%s/config.json", dir);
  FILE *cf = fopen(cfg, "w");
  fprintf(cf, "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", "
          "\"vocab_size\": 256, \"hidden_size\": 64, \"intermediate_size\": 128, "
          "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"rope_theta\": 500000.0, "
          "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 32.0}}");
  fclose(cf);
  ck_assert_int_eq(launch_job(dir, "{\"model\": \"config.json\", \"data\": {\"train\": \"t\"}}", &err), 2);
  ck_assert_msg(strstr(err, "config.json: rope_scaling.rope_type: \"yarn\" is not built "
                            "(supported: \"default\", \"linear\", \"dynamic\", \"llama3\")") != NULL,
                "%s", err);
  free(err);
  ck_assert_int_eq(launch_job(dir, "{\"model\": \"nope/config.json\", \"data\": {\"train\": \"t\"}}", &err), 2);
  ck_assert_msg(strstr(err, "nope/config.json: No such file or directory") != NULL, "%s", err);
  free(err);
  /* a folder given as the job (fopen opens one; its read fails) */
  char logdir[160];
  snprintf(logdir, sizeof logdir, "%s/logs", dir);
  char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", "1", "--log-dir", logdir, dir, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, NULL);
  ck_assert_int_eq(mr_t_wait(&p, 20), 2);
  err = mr_t_slurp(p.err_path);
  ck_assert_msg(strstr(err, "is a folder; expected a JSON file") != NULL, "%s", err);
  free(err);
}
END_TEST

START_TEST(test_cli_bad_flags_exit_2) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  struct {
    char *args[6];
    const char *want;
  } cases[] = {
      {{"launch", "--nproc", "zero", "--selfcheck", NULL}, "--nproc: expected an integer in [1, 100000], got \"zero\""},
      {{"launch", "--heartbeat-timeout", "-1", "--selfcheck", NULL}, "--heartbeat-timeout: expected a number"},
      {{"launch", "--frobnicate", "--selfcheck", NULL}, "unknown or incomplete option \"--frobnicate\""},
      {{"launch", NULL}, "missing JOB.json"},
      {{"teleport", NULL}, "unknown command \"teleport\""},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char *argv[8] = {(char *)mr_t_meshrun()};
    int n = 1;
    for (int k = 0; cases[i].args[k] != NULL; k++)
      argv[n++] = cases[i].args[k];
    argv[n] = NULL;
    struct mr_tproc p;
    mr_t_spawn(&p, dir, argv, NULL);
    ck_assert_int_eq(mr_t_wait(&p, 10), 2);
    char *err = mr_t_slurp(p.err_path);
    ck_assert_msg(strstr(err, cases[i].want) != NULL, "case %zu: %s", i, err);
    free(err);
  }
}
END_TEST

/* An error message may wrap the one before it (the file, then the
 * field, then what was wrong), as the parsers' callers do. */
START_TEST(test_job_error_message_wraps_the_last) {
  mr_error_set(MR_EINVAL, "expected a positive integer, got %d", -3);
  mr_error_set(MR_EINVAL, "%s: %s", "strategy.pipeline_parallel.degree", mr_error_message());
  ck_assert_int_eq(mr_error_set(MR_EFORMAT, "job.json: %s", mr_error_message()), MR_EFORMAT);
  ck_assert_str_eq(mr_error_message(),
                   "job.json: strategy.pipeline_parallel.degree: expected a positive integer, "
                   "got -3");
}
END_TEST

static Suite *job_suite(void) {
  Suite *s = suite_create("job");
  TCase *tc = mr_t_tcase("parse");
  tcase_add_test(tc, test_job_smallest_job_gets_defaults);
  tcase_add_test(tc, test_job_error_message_wraps_the_last);
  tcase_add_test(tc, test_job_full_example_parses);
  tcase_add_test(tc, test_job_wrong_type_names_field_path);
  tcase_add_test(tc, test_job_unknown_fields_all_reported);
  tcase_add_test(tc, test_job_out_of_range_and_inconsistent_values);
  tcase_add_test(tc, test_job_pipeline_layers);
  tcase_add_test(tc, test_job_data_parallel_micro_batches);
  tcase_add_test(tc, test_model_config_errors_name_key);
  tcase_add_test(tc, test_model_config_llama_param_count);
  tcase_add_test(tc, test_model_config_hub_configs);
  suite_add_tcase(s, tc);
  TCase *cli = mr_t_tcase("cli");
  tcase_set_timeout(cli, 60);
  tcase_add_test(cli, test_cli_bad_job_files_exit_2_naming_file_and_field);
  tcase_add_test(cli, test_cli_bad_flags_exit_2);
  suite_add_tcase(s, cli);
  return s;
}

MR_TEST_MAIN(job_suite)
