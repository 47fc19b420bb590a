/* test_plan_cli.c - `meshrun plan` end to end: the real binary, text and
 * JSON output, and bad input exiting 2 with the file and field named. */
#include <check.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "launcher/planner/cluster.h"
#include "testutil.h"

static char dir[256];

static int run_plan(const char *const *args, char **out, char **err) {
  char *argv[16];
  int n = 0;
  argv[n++] = (char *)mr_t_meshrun();
  argv[n++] = (char *)"plan";
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
  ck_assert(atof(in + 5) < 1.0);
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
  ck_assert_ptr_nonnull(strstr(err, "no-such-cluster.json"));
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

static Suite *plan_cli_suite(void) {
  Suite *s = suite_create("plan_cli");
  TCase *tc = tcase_create("cli");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_plan_cli_json_has_the_job_field_names);
  tcase_add_test(tc, test_plan_cli_text_explains_and_times_itself);
  tcase_add_test(tc, test_plan_cli_does_not_fit);
  tcase_add_test(tc, test_plan_cli_bad_input_exits_2_naming_it);
  tcase_add_test(tc, test_plan_cli_calibrate_writes_a_spec_plan_accepts);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(plan_cli_suite)
