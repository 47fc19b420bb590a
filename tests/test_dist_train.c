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

static void write_job(const char *dir) {
  char path[160];
  snprintf(path, sizeof path, "%s/job.json", dir);
  FILE *f = fopen(path, "w");
  fprintf(f,
          "{\"model\": {\"model_type\": \"llama\", \"vocab_size\": 128, \"hidden_size\": 32,"
          " \"intermediate_size\": 56, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
          " \"num_key_value_heads\": 2, \"max_position_embeddings\": 64},"
          " \"data\": {\"train\": \"train.bin\", \"val\": \"train.bin\"},"
          " \"train\": {\"steps\": %d, \"global_batch\": 8, \"seq_len\": 16, \"lr\": 0.01,"
          " \"seed\": 3, \"eval_interval_steps\": 2, \"eval_batches\": 1}}\n",
          STEPS);
  fclose(f);
}

/* Runs the job on nproc ranks into dir/runN; returns the exit code. */
static int run(const char *dir, int nproc) {
  char job[160], logdir[160], n[8];
  snprintf(job, sizeof job, "%s/job.json", dir);
  snprintf(logdir, sizeof logdir, "%s/run%d", dir, nproc);
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
  /* final weights, element by element */
  struct mr_st_file *ref, *got;
  char path[200];
  snprintf(path, sizeof path, "%s/run1/model.safetensors", dir);
  ck_assert_int_eq(mr_st_open(path, &ref), 0);
  for (int k = 1; k < 3; k++) {
    snprintf(path, sizeof path, "%s/run%d/model.safetensors", dir, ranks[k]);
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
      double maxabs = 0;
      for (int64_t e = 0; e < a->numel; e++)
        maxabs = fmax(maxabs, fabs(x[e]));
      for (int64_t e = 0; e < a->numel; e++)
        ck_assert_msg(fabs(x[e] - y[e]) <= 1e-4 * maxabs + 1e-7, "dp%d %s[%lld]: %g vs %g",
                      ranks[k], a->name, (long long)e, y[e], x[e]);
      free(x);
      free(y);
    }
    mr_st_free(got);
  }
  mr_st_free(ref);
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
  ck_assert_int_eq(mr_t_wait(&p, 60), 1);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(strstr(err, "train.global_batch (8) must be a multiple of the data-parallel degree (3)") != NULL,
                "%s", err);
  free(err);
}
END_TEST

static Suite *dist_train_suite(void) {
  Suite *s = suite_create("dist_train");
  TCase *tc = tcase_create("dp");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_dist_train_data_parallel_matches_one_rank);
  tcase_add_test(tc, test_dist_train_batch_not_divisible_is_a_clear_error);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(dist_train_suite)
