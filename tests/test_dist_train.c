/* test_dist_train.c - `meshrun launch` training across ranks gives the
 * numbers of one rank: a tiny LLaMA (grouped-query attention) trained for a
 * few steps on 1, 2 and 4 data-parallel ranks; every step's loss and the
 * final weights must match the single-rank run within 1e-4 relative.  The
 * reference is the single-rank run of the same binary, whose own
 * correctness the gradient checks of the model suites establish. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "common/safetensors.h"
#include "testutil.h"

#define STEPS 4

static void write_job_named(const char *dir, const char *name, const char *strategy) {
  char path[160];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  fprintf(f,
          "{\"model\": {\"model_type\": \"llama\", \"vocab_size\": 128, \"hidden_size\": 32,"
          " \"intermediate_size\": 56, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
          " \"num_key_value_heads\": 2, \"max_position_embeddings\": 64},"
          " \"data\": {\"train\": \"train.bin\", \"val\": \"train.bin\"},"
          " \"train\": {\"steps\": %d, \"global_batch\": 8, \"seq_len\": 16, \"lr\": 0.01,"
          " \"seed\": 3, \"eval_interval_steps\": 2, \"eval_batches\": 1},"
          " \"strategy\": {%s}}\n",
          STEPS, strategy);
  fclose(f);
}

static void write_job(const char *dir) { write_job_named(dir, "job.json", ""); }

/* Runs job file `name` on nproc ranks into dir/RUN; returns the exit code. */
static int run_named(const char *dir, const char *name, const char *run_dir, int nproc) {
  char job[160], logdir[160], n[8];
  snprintf(job, sizeof job, "%s/%s", dir, name);
  snprintf(logdir, sizeof logdir, "%s/%s", dir, run_dir);
  snprintf(n, sizeof n, "%d", nproc);
  char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", n, "--threads", "1",
                  "--log-dir", logdir, job, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, NULL);
  int code = mr_t_wait(&p, 120);
  if (code != 0) {
    char *err = mr_t_slurp(p.err_path);
    fprintf(stderr, "run on %d ranks failed (%d):\n%s\n", nproc, code, err);
    free(err);
  }
  return code;
}

static int run(const char *dir, int nproc) {
  char rd[16];
  snprintf(rd, sizeof rd, "run%d", nproc);
  return run_named(dir, "job.json", rd, nproc);
}

/* Reads every step's "loss" (and val_loss where present) from metrics.jsonl. */
static int read_losses(const char *dir, int nproc, double *loss, double *val) {
  char path[200];
  snprintf(path, sizeof path, "%s/run%d/metrics.jsonl", dir, nproc);
  char *s = mr_t_slurp(path);
  int n = 0;
  for (char *line = strtok(s, "\n"); line != NULL && n < STEPS; line = strtok(NULL, "\n")) {
    char *l = strstr(line, "\"loss\": ");
    char *v = strstr(line, "\"val_loss\": ");
    ck_assert_ptr_nonnull(l);
    loss[n] = atof(l + 8);
    val[n] = v != NULL ? atof(v + 12) : NAN;
    n++;
  }
  free(s);
  return n;
}

/* Every tensor of RUN_A/model.safetensors equals RUN_B's within tol in
 * relative L2 norm (||b - a|| <= tol ||a||).  Elementwise, AdamW divides by
 * the root of the second moment, so an element whose gradient is nearly
 * zero moves by about lr whatever the rounding of its sum: the norm is the
 * meaningful measure. */
static void same_weights(const char *dir, const char *run_a, const char *run_b, double tol) {
  struct mr_st_file *ref, *got;
  char path[200];
  snprintf(path, sizeof path, "%s/%s/model.safetensors", dir, run_a);
  ck_assert_int_eq(mr_st_open(path, &ref), 0);
  snprintf(path, sizeof path, "%s/%s/model.safetensors", dir, run_b);
  ck_assert_int_eq(mr_st_open(path, &got), 0);
  ck_assert_int_eq(mr_st_count(got), mr_st_count(ref));
  for (int i = 0; i < mr_st_count(ref); i++) {
    const struct mr_st_tensor *a = mr_st_tensor_at(ref, i);
    const struct mr_st_tensor *b = mr_st_find(got, a->name);
    ck_assert_ptr_nonnull(b);
    ck_assert_int_eq(a->numel, b->numel);
    float *x = malloc((size_t)a->numel * 4), *y = malloc((size_t)a->numel * 4);
    ck_assert_int_eq(mr_st_read(ref, a, MR_F32, x), 0);
    ck_assert_int_eq(mr_st_read(got, b, MR_F32, y), 0);
    double diff = 0, norm = 0;
    for (int64_t e = 0; e < a->numel; e++) {
      diff += ((double)x[e] - y[e]) * ((double)x[e] - y[e]);
      norm += (double)x[e] * x[e];
    }
    ck_assert_msg(sqrt(diff) <= tol * sqrt(norm), "%s vs %s: %s: relative difference %.3g",
                  run_b, run_a, a->name, sqrt(diff / norm));
    free(x);
    free(y);
  }
  mr_st_free(got);
  mr_st_free(ref);
}

static int close_rel(double a, double b, double tol) {
  return fabs(a - b) <= tol * fmax(fabs(a), fabs(b)) + 1e-7;
}

START_TEST(test_dist_train_data_parallel_matches_one_rank) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  char data[160];
  snprintf(data, sizeof data, "%s/train.bin", dir);
  mr_t_write_tokens(data, 20000);
  write_job(dir);
  const int ranks[] = {1, 2, 4};
  double loss[3][STEPS], val[3][STEPS];
  for (int k = 0; k < 3; k++) {
    ck_assert_int_eq(run(dir, ranks[k]), 0);
    ck_assert_int_eq(read_losses(dir, ranks[k], loss[k], val[k]), STEPS);
  }
  ck_assert_msg(loss[0][STEPS - 1] < loss[0][0] - 0.1, "the model did not learn: %g -> %g",
                loss[0][0], loss[0][STEPS - 1]);
  for (int k = 1; k < 3; k++)
    for (int s = 0; s < STEPS; s++) {
      ck_assert_msg(close_rel(loss[k][s], loss[0][s], 1e-4),
                    "dp%d step %d: loss %.7f vs one rank %.7f", ranks[k], s + 1, loss[k][s],
                    loss[0][s]);
      if (!isnan(val[0][s]))
        ck_assert_msg(close_rel(val[k][s], val[0][s], 1e-4), "dp%d step %d: val loss %.7f vs %.7f",
                      ranks[k], s + 1, val[k][s], val[0][s]);
    }
  for (int k = 1; k < 3; k++) {
    char ref[32], got[32];
    snprintf(got, sizeof got, "run%d", ranks[k]);
    snprintf(ref, sizeof ref, "run1");
    same_weights(dir, ref, got, 1e-4);
  }
}
END_TEST

START_TEST(test_dist_train_batch_not_divisible_is_a_clear_error) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  char data[160];
  snprintf(data, sizeof data, "%s/train.bin", dir);
  mr_t_write_tokens(data, 5000);
  write_job(dir);
  char job[160], logdir[160];
  snprintf(job, sizeof job, "%s/job.json", dir);
  snprintf(logdir, sizeof logdir, "%s/run3", dir);
  char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", "3", "--log-dir", logdir, job, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, NULL);
  /* refused before any worker starts, naming the fields */
  ck_assert_int_eq(mr_t_wait(&p, 60), 2);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(strstr(err, "data_parallel.degree 3") != NULL &&
                    strstr(err, "does not divide train.global_batch 8") != NULL,
                "%s", err);
  free(err);
}
END_TEST

/* Peak memory of the last step of a run, from its metrics. */
static double last_peak(const char *dir, const char *run_dir) {
  char path[200];
  snprintf(path, sizeof path, "%s/%s/metrics.jsonl", dir, run_dir);
  char *s = mr_t_slurp(path);
  char *last = NULL;
  for (char *p = strstr(s, "\"peak_memory_bytes\": "); p != NULL;
       p = strstr(p + 1, "\"peak_memory_bytes\": "))
    last = p;
  ck_assert_ptr_nonnull(last);
  double v = atof(last + strlen("\"peak_memory_bytes\": "));
  free(s);
  return v;
}

START_TEST(test_dist_train_accumulation_and_zero1_match_one_rank) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  char data[160];
  snprintf(data, sizeof data, "%s/train.bin", dir);
  mr_t_write_tokens(data, 20000);
  write_job_named(dir, "ref.json", "");
  write_job_named(dir, "acc4.json", "\"gradient_accumulation_steps\": 4");
  write_job_named(dir, "dp2acc2.json", "\"gradient_accumulation_steps\": 2");
  write_job_named(dir, "zero1.json", "\"sharding\": {\"stage\": 1}");
  write_job_named(dir, "dp4.json", "\"sharding\": {\"stage\": 0}");
  struct {
    const char *job, *run;
    int nproc;
  } runs[] = {{"ref.json", "ref", 1},       {"acc4.json", "acc4", 1},
              {"dp2acc2.json", "dp2acc2", 2}, {"zero1.json", "zero1", 4},
              {"dp4.json", "dp4", 4}};
  double ref[STEPS], val[STEPS];
  ck_assert_int_eq(run_named(dir, "ref.json", "ref", 1), 0);
  char m[200];
  snprintf(m, sizeof m, "%s/ref/metrics.jsonl", dir);
  ck_assert_int_eq(mr_t_read_losses(m, ref, STEPS), STEPS);
  (void)val;
  for (size_t k = 1; k < sizeof runs / sizeof runs[0]; k++) {
    ck_assert_int_eq(run_named(dir, runs[k].job, runs[k].run, runs[k].nproc), 0);
    double got[STEPS];
    snprintf(m, sizeof m, "%s/%s/metrics.jsonl", dir, runs[k].run);
    ck_assert_int_eq(mr_t_read_losses(m, got, STEPS), STEPS);
    for (int st = 0; st < STEPS; st++)
      ck_assert_msg(close_rel(got[st], ref[st], 1e-4), "%s step %d: %.7f vs one rank %.7f",
                    runs[k].run, st + 1, got[st], ref[st]);
    same_weights(dir, "ref", runs[k].run, 1e-4);
  }
  /* ZeRO-1 over 4 ranks keeps a quarter of the AdamW moments per rank:
   * psi parameters, 2 moments of 4 bytes, 3/4 of them gone, less the
   * all-gather scratch (at most 1.25 times the largest parameter) */
  /* embed + 2 layers (q, o: 32x32; k, v: 16x32 with 2 kv heads of 8; gate,
   * up, down: 32x56; two norms) + final norm + untied head */
  double psi = 128 * 32 + 2 * (2 * 32 * 32 + 2 * 16 * 32 + 3 * 32 * 56 + 2 * 32) + 32 + 128 * 32;
  double largest = 128 * 32;
  double saved = last_peak(dir, "dp4") - last_peak(dir, "zero1");
  double expect = 8 * psi * 3 / 4 - 4 * (1.25 * largest + 1);
  ck_assert_msg(saved >= 0.98 * expect && saved <= 1.02 * 8 * psi * 3 / 4,
                "ZeRO-1 saved %.0f bytes per rank; expected about %.0f", saved, expect);
}
END_TEST

static Suite *dist_train_suite(void) {
  Suite *s = suite_create("dist_train");
  TCase *tc = tcase_create("dp");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_dist_train_data_parallel_matches_one_rank);
  tcase_add_test(tc, test_dist_train_batch_not_divisible_is_a_clear_error);
  tcase_add_test(tc, test_dist_train_accumulation_and_zero1_match_one_rank);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(dist_train_suite)
