/* test_plan_cli.c - `meshrun plan` end to end: the real binary, text and
 * JSON output, and bad input exiting 2 with the file and field named. */
#include <check.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "compiler/planner/cluster.h"
#include "launcher/cli.h"
#include "testutil.h"

static char dir[256];

static int run_cmd(const char *cmd, const char *const *args, char **out, char **err) {
  char *argv[16];
  int n = 0;
  argv[n++] = (char *)mr_t_meshrun();
  argv[n++] = (char *)cmd;
  for (int i = 0; args[i] != NULL && n < 15; i++)
    argv[n++] = (char *)args[i];
  argv[n] = NULL;
  char cfg[600];
  snprintf(cfg, sizeof cfg, "MESHRUN_CONFIGS_DIR=%s/configs", getenv("MESHRUN_SOURCE_DIR"));
  char *env[] = {cfg, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, env);
  int rc = mr_t_wait(&p, 60);
  *out = mr_t_slurp(p.out_path);
  *err = mr_t_slurp(p.err_path);
  return rc;
}

static int run_plan(const char *const *args, char **out, char **err) {
  return run_cmd("plan", args, out, err);
}

static void write_file(const char *name, const char *text, char *path, size_t n) {
  snprintf(path, n, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fputs(text, f);
  fclose(f);
}

static void megatron(const char *name, char *path, size_t n) {
  snprintf(path, n, "%s/configs/models/megatron/%s", getenv("MESHRUN_SOURCE_DIR"), name);
}

START_TEST(test_plan_cli_json_has_the_job_field_names) {
  mr_t_tmpdir(dir, sizeof dir);
  char job[600];
  megatron("gpt-145.6b.published.job.json", job, sizeof job);
  const char *args[] = {job, "--nproc", "1536", "--json", "--top", "3", NULL};
  char *out, *err;
  ck_assert_int_eq(run_plan(args, &out, &err), 0);
  cJSON *j = cJSON_Parse(out);
  ck_assert_msg(j != NULL, "not JSON: %s", out);
  const cJSON *s = cJSON_GetObjectItem(j, "strategy");
  ck_assert_int_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(s, "tensor_parallel"), "degree")->valueint, 8);
  ck_assert_int_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(s, "pipeline_parallel"), "degree")->valueint, 8);
  ck_assert_int_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(s, "data_parallel"), "degree")->valueint, 24);
  ck_assert(cJSON_IsTrue(cJSON_GetObjectItem(cJSON_GetObjectItem(s, "recompute"), "enable")));
  double step = cJSON_GetObjectItem(j, "step_time_s")->valuedouble;
  double tps = cJSON_GetObjectItem(j, "tokens_per_s")->valuedouble;
  ck_assert(step > 0 && fabs(tps * step - 2304.0 * 2048) < 1e-6 * tps * step);
  double mtf = cJSON_GetObjectItem(j, "model_tflops_per_device")->valuedouble;
  double mfu = cJSON_GetObjectItem(j, "mfu")->valuedouble;
  ck_assert(fabs(mtf * 1e12 / 312e12 - mfu) < 1e-9);
  const cJSON *mem = cJSON_GetObjectItem(j, "memory_bytes");
  double sum = 0;
  const char *kinds[] = {"parameters", "gradients", "optimizer", "activations", "buffers",
                         "workspace"};
  for (int i = 0; i < 6; i++)
    sum += cJSON_GetObjectItem(mem, kinds[i])->valuedouble;
  ck_assert(fabs(sum - cJSON_GetObjectItem(mem, "total")->valuedouble) < 1);
  ck_assert(cJSON_GetObjectItem(j, "search_time_s")->valuedouble >= 0);
  /* 80 layers over 8 stages × virtual stages, in chunk order */
  const cJSON *lp = cJSON_GetObjectItem(j, "layers_per_chunk");
  int v = cJSON_GetObjectItem(cJSON_GetObjectItem(s, "pipeline_parallel"), "virtual_stages")->valueint;
  ck_assert_int_eq(cJSON_GetArraySize(lp), 8 * v);
  int layers = 0;
  for (int i = 0; i < cJSON_GetArraySize(lp); i++)
    layers += cJSON_GetArrayItem(lp, i)->valueint;
  ck_assert_int_eq(layers, 80);
  const cJSON *alts = cJSON_GetObjectItem(j, "alternatives");
  ck_assert_int_eq(cJSON_GetArraySize(alts), 2);
  const cJSON *a0 = cJSON_GetArrayItem(alts, 0);
  ck_assert(cJSON_GetObjectItem(a0, "step_time_s")->valuedouble >= step);
  ck_assert_ptr_nonnull(cJSON_GetObjectItem(a0, "why_slower"));
  cJSON_Delete(j);
  free(out), free(err);
}
END_TEST

/* `meshrun plan --json` of the 18.4B model on nproc A100s, global batch
 * `batch`, full recompute, fp16, with the strategy members given. */
static cJSON *plan_18b(const char *strategy, int batch, int nproc) {
  char model[600], text[1400], path[600], n[16];
  megatron("gpt-18.4b.json", model, sizeof model);
  snprintf(text, sizeof text,
           "{\"model\": \"%s\", \"data\": {\"train\": \"unused.bin\"},"
           " \"train\": {\"global_batch\": %d, \"seq_len\": 2048},"
           " \"cluster\": \"%s/configs/clusters/a100-80g-node.json\","
           " \"strategy\": {%s, \"recompute\": {\"enable\": true, \"granularity\": \"full\"},"
           " \"amp\": {\"dtype\": \"fp16\"}}}",
           model, batch, getenv("MESHRUN_SOURCE_DIR"), strategy);
  write_file("plan.json", text, path, sizeof path);
  snprintf(n, sizeof n, "%d", nproc);
  const char *args[] = {path, "--nproc", n, "--json", NULL};
  char *out, *err;
  ck_assert_msg(run_plan(args, &out, &err) == 0, "%s", err);
  cJSON *j = cJSON_Parse(out);
  ck_assert_msg(j != NULL, "not JSON: %s", out);
  free(out), free(err);
  return j;
}

/* The 18.4B model (40 layers) on t 8 x p 2: a job that fixes the split at
 * 30 + 10 layers gets it in --json (strategy and layers_per_chunk) and a
 * step paced by a 30-layer chunk, about 30/20 of the balanced split's
 * pipeline (the search, on the same degrees, splits 20 + 20). */
static double plan_18b_p2(const char *layers, int *first) {
  char st[600];
  snprintf(st, sizeof st,
           "\"auto_mode\": \"semi\", \"tensor_parallel\": {\"degree\": 8},"
           " \"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 32%s%s},"
           " \"sharding\": {\"stage\": 0}", layers ? ", \"layers\": " : "", layers ? layers : "");
  cJSON *j = plan_18b(st, 1024, 256);
  const cJSON *lp = cJSON_GetObjectItem(j, "layers_per_chunk");
  ck_assert_int_eq(cJSON_GetArraySize(lp), 2);
  *first = cJSON_GetArrayItem(lp, 0)->valueint;
  const cJSON *fixed = cJSON_GetObjectItem(
      cJSON_GetObjectItem(cJSON_GetObjectItem(j, "strategy"), "pipeline_parallel"), "layers");
  ck_assert(layers != NULL ? cJSON_GetArraySize(fixed) == 2 : fixed == NULL);
  double step = cJSON_GetObjectItem(j, "step_time_s")->valuedouble;
  cJSON_Delete(j);
  return step;
}

START_TEST(test_plan_cli_fixed_layer_split) {
  mr_t_tmpdir(dir, sizeof dir);
  int first;
  double balanced = plan_18b_p2(NULL, &first);
  ck_assert_int_eq(first, 20);
  double fixed = plan_18b_p2("[30, 10]", &first);
  ck_assert_int_eq(first, 30);
  ck_assert_msg(fixed > 1.25 * balanced && fixed < 1.5 * balanced,
                "30 + 10 layers: %.2f s a step, 20 + 20: %.2f s", fixed, balanced);
}
END_TEST

/* The 18.4B model on t 8 x d 2, 2 micro-batches a rank: a job that fixes
 * them at 3 + 1 gets them in --json, and a step paced by the rank of 3 —
 * longer than the even split's, by less than half (sync and optimizer stay
 * once a step; the formula is test_cost's).  The fixed counts into
 * counts[2] (0 when --json has none). */
static double plan_18b_dp2(const char *micro, int *counts) {
  char st[600];
  snprintf(st, sizeof st,
           "\"auto_mode\": \"manual\", \"tensor_parallel\": {\"degree\": 8},"
           " \"data_parallel\": {\"degree\": 2%s%s}, \"gradient_accumulation_steps\": 2",
           micro ? ", \"micro_batches\": " : "", micro ? micro : "");
  cJSON *j = plan_18b(st, 16, 16);
  const cJSON *fixed = cJSON_GetObjectItem(
      cJSON_GetObjectItem(cJSON_GetObjectItem(j, "strategy"), "data_parallel"), "micro_batches");
  counts[0] = counts[1] = 0;
  for (int i = 0; i < 2 && i < cJSON_GetArraySize(fixed); i++)
    counts[i] = cJSON_GetArrayItem(fixed, i)->valueint;
  double step = cJSON_GetObjectItem(j, "step_time_s")->valuedouble;
  cJSON_Delete(j);
  return step;
}

START_TEST(test_plan_cli_fixed_data_parallel_split) {
  mr_t_tmpdir(dir, sizeof dir);
  int counts[2];
  double even = plan_18b_dp2(NULL, counts);
  ck_assert_int_eq(counts[0], 0);
  double uneven = plan_18b_dp2("[3, 1]", counts);
  ck_assert_int_eq(counts[0], 3);
  ck_assert_int_eq(counts[1], 1);
  ck_assert_msg(uneven > 1.2 * even && uneven < 1.5 * even,
                "3 + 1 micro-batches: %.2f s a step, 2 + 2: %.2f s", uneven, even);
}
END_TEST

START_TEST(test_plan_cli_text_explains_and_times_itself) {
  mr_t_tmpdir(dir, sizeof dir);
  char job[600];
  megatron("gpt-1t.open.job.json", job, sizeof job);
  const char *args[] = {job, "--cluster", "384x:a100-80g-node", NULL};
  char *out, *err;
  ck_assert_int_eq(run_plan(args, &out, &err), 0);
  ck_assert_ptr_nonnull(strstr(out, "3072 ranks"));
  ck_assert_ptr_nonnull(strstr(out, "chosen:"));
  ck_assert_ptr_nonnull(strstr(out, "runners-up:"));
  ck_assert_ptr_nonnull(strstr(out, "step time:"));
  const char *t = strstr(out, "strategies (");
  ck_assert_ptr_nonnull(t);
  const char *in = strstr(t, ") in ");
  ck_assert_ptr_nonnull(in);
  /* the requirement is the optimized build's; a sanitized debug build is
   * some ten times slower, and shares 2 cores with the other suites (10 s
   * was seen exceeded), so there the bound only catches a runaway search */
#ifdef __SANITIZE_ADDRESS__
  const double limit = 60.0;
#else
  const double limit = 1.0;
#endif
  ck_assert_msg(atof(in + 5) < limit, "searched in %.3f s", atof(in + 5));
  free(out), free(err);
}
END_TEST

START_TEST(test_plan_cli_does_not_fit) {
  mr_t_tmpdir(dir, sizeof dir);
  char model[600], job[700], text[1400];
  megatron("gpt-529.6b.json", model, sizeof model);
  snprintf(text, sizeof text,
           "{\"model\": \"%s\", \"data\": {\"train\": \"none.bin\"},"
           " \"train\": {\"global_batch\": 64, \"seq_len\": 2048},"
           " \"strategy\": {\"amp\": {\"dtype\": \"bf16\"}}}", model);
  write_file("job.json", text, job, sizeof job);
  const char *args[] = {job, "--cluster", "a100-80g-node", NULL};
  char *out, *err;
  ck_assert_int_eq(run_plan(args, &out, &err), 1);
  ck_assert_ptr_nonnull(strstr(out, "does not fit"));
  ck_assert_ptr_nonnull(strstr(out, "least memory any plan needs"));
  ck_assert_ptr_nonnull(strstr(out, "devices (--nproc"));
  free(out), free(err);
}
END_TEST

START_TEST(test_plan_cli_bad_input_exits_2_naming_it) {
  mr_t_tmpdir(dir, sizeof dir);
  char model[600], job[700], text[1400], spec[700];
  megatron("gpt-18.4b.json", model, sizeof model);
  /* a cluster spec without device.memory_bytes */
  write_file("bad-cluster.json",
             "{\"name\": \"x\", \"devices_per_node\": 8, \"device\": {\"peak_flops\": "
             "{\"fp32\": 1e12, \"bf16\": 1e12, \"fp16\": 1e12}, \"matmul_efficiency\": 0.8, "
             "\"gemm_half_dim\": 100, \"memory_bandwidth\": 1e12, \"reserved_bytes\": 0}, "
             "\"intra_node\": {\"bus_bandwidth\": 1e11, \"latency\": 1e-6}, \"inter_node\": "
             "{\"bandwidth\": 1e10, \"latency\": 1e-6}, \"host\": {\"link_bandwidth\": 1e10, "
             "\"memory_bandwidth\": 1e10}}",
             spec, sizeof spec);
  snprintf(text, sizeof text,
           "{\"model\": \"%s\", \"data\": {\"train\": \"none.bin\"},"
           " \"train\": {\"global_batch\": 64, \"seq_len\": 2048}}", model);
  write_file("job.json", text, job, sizeof job);
  char *out, *err;
  const char *a1[] = {job, "--cluster", spec, NULL};
  ck_assert_int_eq(run_plan(a1, &out, &err), 2);
  ck_assert_msg(strstr(err, "bad-cluster.json: device.memory_bytes: missing") != NULL, "%s", err);
  free(out), free(err);
  /* a hint that contradicts the world size */
  snprintf(text, sizeof text,
           "{\"model\": \"%s\", \"data\": {\"train\": \"none.bin\"},"
           " \"train\": {\"global_batch\": 64, \"seq_len\": 2048},"
           " \"strategy\": {\"data_parallel\": {\"degree\": 2}, \"tensor_parallel\": "
           "{\"degree\": 8}, \"pipeline_parallel\": {\"degree\": 2}}}", model);
  write_file("job2.json", text, job, sizeof job);
  const char *a2[] = {job, "--cluster", "2x:a100-80g-node", NULL};
  ck_assert_int_eq(run_plan(a2, &out, &err), 2);
  ck_assert_msg(strstr(err, "job2.json") && strstr(err, "world size 16"), "%s", err);
  free(out), free(err);
  /* a world size the model cannot be split over: 40 layers, 48 heads, 64 sequences */
  const char *a3[] = {job, "--nproc", "41", NULL};
  snprintf(text, sizeof text,
           "{\"model\": \"%s\", \"data\": {\"train\": \"none.bin\"},"
           " \"train\": {\"global_batch\": 64, \"seq_len\": 2048}}", model);
  write_file("job3.json", text, job, sizeof job);
  ck_assert_int_eq(run_plan(a3, &out, &err), 2);
  ck_assert_msg(strstr(err, "world size 41 cannot be split") != NULL, "%s", err);
  free(out), free(err);
  /* an unknown cluster name */
  const char *a4[] = {job, "--cluster", "no-such-cluster", NULL};
  ck_assert_int_eq(run_plan(a4, &out, &err), 2);
  ck_assert_msg(strstr(err, "no-such-cluster.json") != NULL &&
                    strstr(err, "the specs there: a100-80g-node, cpu-local, h100-sxm-node") != NULL,
                "%s", err);
  free(out), free(err);
}
END_TEST

START_TEST(test_plan_cli_calibrate_writes_a_spec_plan_accepts) {
  mr_t_tmpdir(dir, sizeof dir);
  char spec[600];
  snprintf(spec, sizeof spec, "%s/calibrated.json", dir);
  char *argv[] = {(char *)mr_t_meshrun(), (char *)"calibrate", (char *)"--ranks", (char *)"2",
                  (char *)"--out", spec, NULL};
  char cfg[600];
  snprintf(cfg, sizeof cfg, "MESHRUN_CONFIGS_DIR=%s/configs", getenv("MESHRUN_SOURCE_DIR"));
  char *env[] = {cfg, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, env);
  ck_assert_int_eq(mr_t_wait(&p, 120), 0);
  struct mr_cluster c;
  ck_assert_int_eq(mr_cluster_load(spec, &c), 0);
  ck_assert_int_eq(c.devices_per_node, 2);
  ck_assert_str_eq(c.name, "calibrated");
  /* measured numbers are physical: a matmul below the FMA peak, a bus
   * below 1 TB/s, a latency above 10 ns */
  ck_assert(c.matmul_efficiency > 0 && c.matmul_efficiency <= 1);
  ck_assert(c.intra_bus_bandwidth > 1e6 && c.intra_bus_bandwidth < 1e12);
  ck_assert(c.intra_latency > 1e-8 && c.intra_latency < 1);
  char model[600], job[700], text[1400];
  megatron("gpt-1.7b.json", model, sizeof model);
  snprintf(text, sizeof text,
           "{\"model\": \"%s\", \"data\": {\"train\": \"none.bin\"},"
           " \"train\": {\"global_batch\": 8, \"seq_len\": 256}}", model);
  write_file("job.json", text, job, sizeof job);
  const char *args[] = {job, "--cluster", spec, NULL};
  char *out, *err;
  int rc = run_plan(args, &out, &err);
  ck_assert_msg(rc == 0 || rc == 1, "%s", err);
  ck_assert_ptr_nonnull(strstr(out, "on calibrated: 2 ranks"));
  free(out), free(err);
}
END_TEST

/* ---- --mesh and --explain ---- */

/* The reshards section of `--explain` output, read back. */
struct step {
  char kind[32], dim[16];
  long long bytes;
};

struct edge {
  char kind[16];               // operand, grad sync, loss
  char tensor[128];
  int backward;
  int n_steps;
  struct step steps[8];
};

static int parse_edges(const char *out, struct edge *edges, int max) {
  const char *p = strstr(out, "\nreshards (");
  ck_assert_ptr_nonnull(p);
  const char *end = strstr(p, "\ncollectives per mesh dim:");
  ck_assert_ptr_nonnull(end);
  int n = -1;
  for (p = strchr(p + 1, '\n'); p != NULL && p < end; p = strchr(p + 1, '\n')) {
    const char *line = p + 1;
    char buf[512];
    size_t len = strcspn(line, "\n");
    if (len >= sizeof buf)
      len = sizeof buf - 1;
    memcpy(buf, line, len);
    buf[len] = 0;
    if (strncmp(buf, "  #", 3) == 0) {
      ck_assert_int_lt(++n, max);
      struct edge *e = &edges[n];
      memset(e, 0, sizeof *e);
      const char *w = strchr(buf + 3, ' ') + 1; /* past "  #N " */
      if (strncmp(w, "grad sync ", 10) == 0) {
        strcpy(e->kind, "grad sync");
        w += 10;
      } else {
        sscanf(w, "%15s", e->kind);
        w += strlen(e->kind) + 1;
      }
      sscanf(w, "%127[^ :]", e->tensor);
      e->backward = strstr(buf, " (backward)") != NULL;
    } else if (strncmp(buf, "      ", 6) == 0 && n >= 0) {
      struct edge *e = &edges[n];
      ck_assert_int_lt(e->n_steps, 8);
      struct step *s = &e->steps[e->n_steps++];
      memset(s, 0, sizeof *s);
      sscanf(buf, " %31s on %15s", s->kind, s->dim);
      s->bytes = atoll(strrchr(buf, ':') + 2);
    }
  }
  return n + 1;
}

/* Steps of `kind` on mesh dim `dim` over edges of edge kind `ek`,
 * forward (0), backward (1) or both (-1). */
static int count(const struct edge *e, int n, const char *ek, int backward,
                 const char *kind, const char *dim) {
  int c = 0;
  for (int i = 0; i < n; i++) {
    if (strcmp(e[i].kind, ek) != 0 || (backward >= 0 && e[i].backward != backward))
      continue;
    for (int k = 0; k < e[i].n_steps; k++)
      c += strcmp(e[i].steps[k].kind, kind) == 0 && strcmp(e[i].steps[k].dim, dim) == 0;
  }
  return c;
}

/* A LLaMA job with `layers` layers, hidden 64, 4 heads, vocabulary 96,
 * batch 4 x 16 tokens, sequence parallelism off; shard rules: none (0),
 * Megatron's (1), and the vocabulary split too (2). */
static void llama_job(int layers, int rules, char *path, size_t n) {
  char text[2000];
  static const char *const names[] = {"llama-bare.json", "llama.json", "llama-vocab.json"};
  snprintf(text, sizeof text,
           "{\"model\": {\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\","
           " \"vocab_size\": 96, \"hidden_size\": 64, \"intermediate_size\": 128,"
           " \"num_hidden_layers\": %d, \"num_attention_heads\": 4, \"num_key_value_heads\": 4,"
           " \"max_position_embeddings\": 64, \"rms_norm_eps\": 1e-5, \"rope_theta\": 10000.0,"
           " \"tie_word_embeddings\": false},"
           " \"data\": {\"train\": \"none.bin\"},"
           " \"train\": {\"global_batch\": 4, \"seq_len\": 16},"
           " \"strategy\": {\"sequence_parallel\": {\"enable\": false}}%s%s%s}",
           layers,
           rules ? ", \"shard_rules\": ["
                   "{\"match\": \"q_proj|k_proj|v_proj|gate_proj|up_proj\", \"placements\": "
                   "{\"model\": \"Shard(0)\"}},"
                   "{\"match\": \"o_proj|down_proj\", \"placements\": {\"model\": \"Shard(1)\"}}"
                 : "",
           rules == 2 ? ",{\"match\": \"embed_tokens|lm_head\", \"placements\": "
                        "{\"model\": \"Shard(0)\"}}"
                      : "",
           rules ? "]" : "");
  write_file(names[rules], text, path, n);
}

#define MAX_EDGES 256

/* Megatron on data=2,model=4 with 3 layers: per layer one forward
 * AllReduce on model after attention and one after the MLP, each of the
 * [rows per data rank, hidden] activation; as many in the backward;
 * nothing else on model; on data, one gradient AllReduce per parameter. */
START_TEST(test_plan_cli_mesh_explain_megatron_counts) {
  mr_t_tmpdir(dir, sizeof dir);
  const int L = 3, dp = 2, tp = 4, hidden = 64;
  const long long rows = 4 * 16 / dp;
  char job[700];
  /* the job's rules, or none: the same layout by default */
  llama_job(L, _i == 0 ? 1 : 0, job, sizeof job);
  const char *args[] = {job, "--mesh", "data=2,model=4", "--explain", NULL};
  char *out, *err;
  ck_assert_msg(run_plan(args, &out, &err) == 0, "%s", err);
  ck_assert_ptr_nonnull(strstr(out, "dp 2 x tp 4 x pp 1"));
  ck_assert_ptr_nonnull(strstr(out, "placements and reshards on mesh data=2,model=4 "
                                    "(given by --mesh)"));
  ck_assert_ptr_nonnull(strstr(out, "loss: fused cross_entropy"));
  ck_assert_ptr_nonnull(strstr(out, _i == 0 ? "shard rules: the job's (2)"
                                            : "shard rules: Megatron's for LLaMA"));
  static struct edge e[MAX_EDGES];
  int n = parse_edges(out, e, MAX_EDGES);
  ck_assert_int_eq(count(e, n, "operand", 0, "AllReduce", "model"), 2 * L);
  ck_assert_int_eq(count(e, n, "operand", 1, "AllReduce", "model"), 2 * L);
  const char *other[] = {"AllGather", "ReduceScatter", "AllToAll"};
  for (int k = 0; k < 3; k++) {
    ck_assert_int_eq(count(e, n, "operand", -1, other[k], "model"), 0);
    ck_assert_int_eq(count(e, n, "operand", -1, other[k], "data"), 0);
  }
  ck_assert_int_eq(count(e, n, "operand", -1, "AllReduce", "data"), 0);
  /* per layer 2 norms, q k v o gate up down; embedding, final norm, head */
  ck_assert_int_eq(count(e, n, "grad sync", 1, "AllReduce", "data"), 9 * L + 3);
  /* ring AllReduce: 2 (k - 1) / k of the local [rows, hidden] floats */
  long long ar = 2 * (tp - 1) * rows * hidden * 4 / tp;
  for (int i = 0; i < n; i++)
    if (!strcmp(e[i].kind, "operand"))
      for (int k = 0; k < e[i].n_steps; k++)
        if (!strcmp(e[i].steps[k].kind, "AllReduce"))
          ck_assert_int_eq(e[i].steps[k].bytes, ar);
  char want[128];
  snprintf(want, sizeof want, "  model: forward %d AllReduce; backward %d AllReduce\n",
           2 * L, 2 * L);
  ck_assert_msg(strstr(out, want) != NULL, "no \"%s\" in\n%s", want, strstr(out, "collectives"));
  free(out), free(err);
}
END_TEST

/* The vocabulary split as well: the loss is vocabulary-parallel, the
 * logits are never gathered, and the loss adds three forward AllReduces
 * of [rows] floats (row max, sums of exponentials, targets' logits) to the
 * 2 per layer and the embedding's one. */
START_TEST(test_plan_cli_explain_vocab_parallel_loss) {
  mr_t_tmpdir(dir, sizeof dir);
  const int L = 2, dp = 2, tp = 2;
  const long long rows = 4 * 16 / dp;
  char job[700];
  llama_job(L, 2, job, sizeof job);
  const char *args[] = {job, "--mesh", "data=2,model=2", "--explain", NULL};
  char *out, *err;
  ck_assert_msg(run_plan(args, &out, &err) == 0, "%s", err);
  ck_assert_ptr_nonnull(strstr(out, "loss: vocabulary-parallel cross-entropy"));
  static struct edge e[MAX_EDGES];
  int n = parse_edges(out, e, MAX_EDGES);
  ck_assert_int_eq(count(e, n, "operand", 0, "AllReduce", "model"), 2 * L + 1 + 3);
  ck_assert_int_eq(count(e, n, "operand", 1, "AllReduce", "model"), 2 * L + 1);
  ck_assert_int_eq(count(e, n, "operand", -1, "AllGather", "model"), 0);
  int loss_steps = 0;
  for (int i = 0; i < n; i++) {
    ck_assert_str_ne(e[i].tensor, "logits");
    ck_assert_str_ne(e[i].tensor, "grad/logits");
    if (strncmp(e[i].tensor, "loss.", 5) != 0 || strcmp(e[i].kind, "operand") != 0)
      continue;
    ck_assert_int_eq(e[i].n_steps, 1);
    ck_assert_str_eq(e[i].steps[0].kind, "AllReduce");
    ck_assert_int_eq(e[i].steps[0].bytes, 2 * (tp - 1) * rows * 4 / tp);
    loss_steps++;
  }
  ck_assert_int_eq(loss_steps, 3);
  free(out), free(err);
}
END_TEST

/* Without --mesh, the explanation is on the chosen strategy's mesh; and
 * `meshrun explain` prints the same as `meshrun plan --explain`. */
START_TEST(test_plan_cli_explain_follows_the_search_and_the_alias) {
  mr_t_tmpdir(dir, sizeof dir);
  char job[700];
  llama_job(2, 1, job, sizeof job);
  const char *args[] = {job, "--nproc", "4", "--explain", NULL};
  char *out, *err;
  ck_assert_msg(run_plan(args, &out, &err) == 0, "%s", err);
  const char *ch = strstr(out, "chosen:\n  dp ");
  ck_assert_ptr_nonnull(ch);
  int dp = 0, tp = 0, pp = 0;
  ck_assert_int_eq(sscanf(ch, "chosen:\n  dp %d x tp %d x pp %d", &dp, &tp, &pp), 3);
  ck_assert_int_eq(dp * tp * pp, 4);
  char want[128];
  snprintf(want, sizeof want, "placements and reshards on mesh data=%d,model=%d (the "
           "chosen strategy's data x model", dp, tp);
  ck_assert_msg(strstr(out, want) != NULL, "%s", out);
  free(out), free(err);
  const char *a1[] = {job, "--mesh", "data=2,model=2", "--explain", NULL};
  const char *a2[] = {job, "--mesh", "data=2,model=2", NULL};
  char *o1, *e1, *o2, *e2;
  ck_assert_int_eq(run_plan(a1, &o1, &e1), 0);
  ck_assert_int_eq(run_cmd("explain", a2, &o2, &e2), 0);
  const char *x1 = strstr(o1, "\nreshards ("), *x2 = strstr(o2, "\nreshards (");
  ck_assert(x1 != NULL && x2 != NULL);
  ck_assert_str_eq(x1, x2);
  free(o1), free(e1), free(o2), free(e2);
}
END_TEST

/* Bad meshes and flags exit 2 naming the flag and what was expected. */
START_TEST(test_plan_cli_bad_mesh_exits_2_naming_it) {
  mr_t_tmpdir(dir, sizeof dir);
  char job[700];
  llama_job(2, 1, job, sizeof job);
  static const struct {
    const char *a[4];
    const char *say[2];
  } cases[] = {
      {{"--mesh", "x=2", NULL}, {"--mesh \"x=2\": dim \"x\"", "expected the dims data and model"}},
      {{"--mesh", "data=two", NULL}, {"--mesh \"data=two\"", "expected a positive integer"}},
      {{"--mesh", "data=2model=2", NULL}, {"--mesh \"data=2model=2\"", "expected"}},
      {{"--mesh", "data=2,model=2", "--nproc", "8"}, {"has 4 ranks but --nproc is 8", "expected"}},
      {{"--mesh", "data=1,model=3", NULL}, {"--mesh \"data=1,model=3\"", "heads"}},
      {{"--explain", "--json", NULL}, {"--explain", "expected it without --json"}},
      {{"--mesh", NULL}, {"--mesh", "requires an argument"}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const char *args[8];
    int n = 0;
    args[n++] = job;
    for (int k = 0; k < 4 && cases[i].a[k] != NULL; k++)
      args[n++] = cases[i].a[k];
    args[n] = NULL;
    char *out, *err;
    ck_assert_int_eq(run_plan(args, &out, &err), 2);
    for (int k = 0; k < 2; k++)
      ck_assert_msg(strstr(err, cases[i].say[k]) != NULL, "case %zu: no \"%s\" in: %s", i,
                    cases[i].say[k], err);
    free(out), free(err);
  }
  /* the job fixes another degree */
  char text[1200], job2[700];
  char *src = mr_t_slurp(job);
  const char *at = strstr(src, "\"strategy\": {");
  ck_assert_ptr_nonnull(at);
  snprintf(text, sizeof text, "%.*s\"strategy\": {\"tensor_parallel\": {\"degree\": 2}, %s",
           (int)(at - src), src, at + strlen("\"strategy\": {"));
  write_file("fixed.json", text, job2, sizeof job2);
  free(src);
  const char *args[] = {job2, "--mesh", "data=1,model=4", NULL};
  char *out, *err;
  ck_assert_int_eq(run_plan(args, &out, &err), 2);
  ck_assert_msg(strstr(err, "strategy.tensor_parallel.degree 4 but the job fixes it to 2"),
                "%s", err);
  free(out), free(err);
}
END_TEST

/* The digest on a --dump's "program digest: " line (16 hex digits). */
static unsigned long long dumped_digest(const char *out) {
  const char *d = strstr(out, "program digest: ");
  ck_assert_msg(d != NULL, "%s", out);
  char hex[17] = {0};
  memcpy(hex, d + strlen("program digest: "), 16);
  ck_assert_int_eq(strspn(hex, "0123456789abcdef"), 16);
  return strtoull(hex, NULL, 16);
}

START_TEST(test_plan_cli_dump_shows_a_rank_program) {
  /* dp 2 x tp 2 x pp 2 with ranks numbered "tp,pp,dp": rank 3 = (data 0,
   * pipe 1, model 1); its groups pipe {1,3}, data {3,7}, model {2,3}; each
   * rank's program its own digest; a rank past the world is bad usage */
  mr_t_tmpdir(dir, sizeof dir);
  char job[400];
  write_file("d.json",
             "{\"model\": {\"model_type\": \"llama\", \"vocab_size\": 128, \"hidden_size\": 32,"
             " \"intermediate_size\": 56, \"num_hidden_layers\": 4, \"num_attention_heads\": 8,"
             " \"num_key_value_heads\": 4, \"max_position_embeddings\": 64},"
             " \"data\": {\"train\": \"train.bin\"},"
             " \"train\": {\"steps\": 4, \"global_batch\": 16, \"seq_len\": 16},"
             " \"strategy\": {\"auto_mode\": \"manual\", \"data_parallel\": {\"degree\": 2},"
             " \"tensor_parallel\": {\"degree\": 2}, \"pipeline_parallel\": {\"degree\": 2,"
             " \"micro_batches\": 2}, \"mesh_mapping\": \"tp,pp,dp\"}}",
             job, sizeof job);
  char *out, *err;
  const char *a3[] = {job, "--nproc", "8", "--dump", "--rank", "3", NULL};
  ck_assert_msg(run_plan(a3, &out, &err) == 0, "%s", err);
  ck_assert_msg(strstr(out, "rank 3 of 8: pipeline stage 1, data 0, model 1") != NULL, "%s", out);
  ck_assert_msg(strstr(out, "groups: pipe{1,3} data{3,7} model{2,3}") != NULL, "%s", out);
  ck_assert_msg(strstr(out, "mesh tp,pp,dp") != NULL, "%s", out);
  unsigned long long d3 = dumped_digest(out);
  free(out), free(err);
  const char *a2[] = {job, "--nproc", "8", "--dump", "--rank", "2", NULL};
  ck_assert_int_eq(run_plan(a2, &out, &err), 0);
  ck_assert(dumped_digest(out) != d3);
  free(out), free(err);
  const char *a8[] = {job, "--nproc", "8", "--dump", "--rank", "8", NULL};
  ck_assert_int_eq(run_plan(a8, &out, &err), 2);
  ck_assert_msg(strstr(err, "--rank 8: expected a rank below the world size 8") != NULL, "%s",
                err);
  free(out), free(err);
}
END_TEST

static Suite *plan_cli_suite(void) {
  Suite *s = suite_create("plan_cli");
  TCase *tc = mr_t_tcase("cli");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_plan_cli_json_has_the_job_field_names);
  tcase_add_test(tc, test_plan_cli_fixed_layer_split);
  tcase_add_test(tc, test_plan_cli_fixed_data_parallel_split);
  tcase_add_test(tc, test_plan_cli_text_explains_and_times_itself);
  tcase_add_test(tc, test_plan_cli_does_not_fit);
  tcase_add_test(tc, test_plan_cli_bad_input_exits_2_naming_it);
  tcase_add_test(tc, test_plan_cli_calibrate_writes_a_spec_plan_accepts);
  tcase_add_loop_test(tc, test_plan_cli_mesh_explain_megatron_counts, 0, 2);
  tcase_add_test(tc, test_plan_cli_explain_vocab_parallel_loss);
  tcase_add_test(tc, test_plan_cli_explain_follows_the_search_and_the_alias);
  tcase_add_test(tc, test_plan_cli_bad_mesh_exits_2_naming_it);
  tcase_add_test(tc, test_plan_cli_dump_shows_a_rank_program);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(plan_cli_suite)
