/* test_rebalance.c - a pipeline stage that runs slow has layers moved off
 * it: the split at measured speeds worked by hand, the plan with another
 * split, and a real run whose second stage is made four times slower
 * (MESHRUN_TEST_SLOW=1:x4), which the launcher re-balances from a
 * checkpoint to a faster step and the losses of a run never slowed.  A
 * data-parallel rank that runs slow gets fewer micro-batches, the same
 * way: by hand, the plan, and a real run, without a pipeline and as a
 * slow replica of one. */
#include <check.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check_main.h"
#include "common/error.h"
#include "common/job.h"
#include "launcher/rebalance.h"
#include "launcher/strategy_choice.h"
#include "testutil.h"

#define NEAR(a, b)                                                                     \
  ck_assert_msg(fabs((double)(a) - (b)) < 1e-9, "%s = %g, expected %g", #a, (double)(a), \
                (double)(b))

/* By hand.  Two stages of 4 unit layers, the second measured 4x slower
 * for its work: split a + (8 - a) costs max(a, 4(8 - a)), least at a = 7
 * (7 against 4; a = 6 costs 8), where 4 + 4 cost 16: 1 - 7/16 saved. */
START_TEST(test_rebalance_by_hand) {
  int now[4] = {4, 4}, to[4];
  double busy[2] = {4, 16}, slow[2];
  struct mr_rebalance_in in = {2, 1, 8, now, 1, 0, 0, busy};
  struct mr_rebalance_out out = {slow, to, 0, 0, 0};
  ck_assert_int_eq(mr_rebalance(&in, &out), 0);
  NEAR(slow[0], 1);
  NEAR(slow[1], 4);
  ck_assert_int_eq(to[0], 7);
  ck_assert_int_eq(to[1], 1);
  NEAR(out.now, 16);
  NEAR(out.then, 7);
  NEAR(out.gain, 1 - 7.0 / 16);
  /* Equal speeds with an embedding of 0.5 and a head of 1.5 layers: 2 + 2
   * measures 2.5 and 3.5, the same speed, and no split beats its 3.5. */
  double busy2[2] = {2.5 * 3, 3.5 * 3};
  struct mr_rebalance_in in2 = {2, 1, 4, (int[]){2, 2}, 1, 0.5, 1.5, busy2};
  ck_assert_int_eq(mr_rebalance(&in2, &out), 0);
  NEAR(slow[0], 1);
  NEAR(slow[1], 1);
  NEAR(out.now, 3.5);
  NEAR(out.then, 3.5);
  NEAR(out.gain, 0);
  /* Interleaved, 2 stages x 2 chunks of 2 layers, stage 1 twice as slow
   * (it measures 8 for 4 layers): chunks cost a, 2b, c, 2d; 3 + 1 + 3 + 1
   * holds 8 layers at 3, nothing below 3 does, and 2 each paces at 4. */
  int four[4] = {2, 2, 2, 2};
  double busy3[2] = {4, 8};
  struct mr_rebalance_in in3 = {2, 2, 8, four, 1, 0, 0, busy3};
  ck_assert_int_eq(mr_rebalance(&in3, &out), 0);
  ck_assert_int_eq(to[0], 3);
  ck_assert_int_eq(to[1], 1);
  ck_assert_int_eq(to[2], 3);
  ck_assert_int_eq(to[3], 1);
  NEAR(out.now, 4);
  NEAR(out.then, 3);
  NEAR(out.gain, 0.25);
  /* a stage with no measured work cannot be weighed */
  double none[2] = {4, 0};
  in.busy = none;
  ck_assert_int_eq(mr_rebalance(&in, &out), MR_EINVAL);
}
END_TEST

/* By hand.  Two data ranks of one micro-batch of 4 sequences each (batch
 * 8), rank 1 measured 4x slower: 0.25 and 1 a sequence.  One slice a rank
 * leaves nothing to move, so the count is open: at 1 micro-batch a step
 * the split stays 1 + 1, pace 4; at 2 (slices of 2 sequences) the
 * slices go 2 + 1, 3 + 1: pace max(3 x 2 x 0.25, 1 x 2 x 1) = 2; at 4
 * (slices of 1) rank 0 takes every slice while (k + 1) x 0.25 < 2 x 1:
 * 7 + 1, pace max(1.75, 1) = 1.75, the best, saving 2.25 of 4; 2 saves
 * 2, at least 80% of that (1.8), with fewer micro-batches: 2, 3 + 1. */
START_TEST(test_rebalance_data_parallel_by_hand) {
  int to[4];
  double busy[2] = {1, 4};
  struct mr_dp_rebalance_in in = {2, 1, NULL, busy, NULL, 8, 0, 0, 0};
  struct mr_dp_rebalance_out out = {0, to, 0, 0};
  ck_assert_int_eq(mr_dp_rebalance(&in, &out), 0);
  ck_assert_int_eq(out.n_micro, 2);
  ck_assert_int_eq(to[0], 3);
  ck_assert_int_eq(to[1], 1);
  NEAR(out.now, 4);
  NEAR(out.then, 2);
  /* 6x slower (now 6): at 2, 3 + 1 paces at max(1.5, 2 x 1.5) = 3; at 4
   * rank 0 takes slices while (k + 1) x 0.25 < 2 x 1.5: 7 + 1,
   * max(1.75, 1.5), saving 4.25; 2 saves 3, less than 80% of it (3.4), so
   * 4 micro-batches, 7 + 1 */
  busy[1] = 6;
  ck_assert_int_eq(mr_dp_rebalance(&in, &out), 0);
  ck_assert_int_eq(out.n_micro, 4);
  ck_assert_int_eq(to[0], 7);
  ck_assert_int_eq(to[1], 1);
  NEAR(out.then, 1.75);
  busy[1] = 4;
  /* the job fixes 2 micro-batches a step: 3 + 1, pace 2 */
  in.fixed_micro = 1;
  in.n_micro = 2;
  ck_assert_int_eq(mr_dp_rebalance(&in, &out), 0);
  ck_assert_int_eq(out.n_micro, 2);
  ck_assert_int_eq(to[0], 3);
  ck_assert_int_eq(to[1], 1);
  NEAR(out.then, 2);
  /* measured under 3 + 1 of 2 (6 and 2 sequences), 1.5 and 2: 0.25 and 1
   * a sequence again; equal speeds keep an even split */
  in.counts = (int[]){3, 1};
  busy[0] = 1.5, busy[1] = 2;
  ck_assert_int_eq(mr_dp_rebalance(&in, &out), 0);
  ck_assert_int_eq(to[0], 3);
  NEAR(out.now, 2);
  NEAR(out.then, 2);
  /* equal speeds: 2 + 2 of 2 a step, the count kept (there are slices to
   * move, and the job leaves it open) */
  in.counts = NULL;
  busy[0] = busy[1] = 3;
  in.fixed_micro = 0;
  ck_assert_int_eq(mr_dp_rebalance(&in, &out), 0);
  ck_assert_int_eq(out.n_micro, 2);
  ck_assert_int_eq(to[0], 2);
  ck_assert_int_eq(to[1], 2);
  NEAR(out.then, 3);
  /* the per-step part stays: busy 1 and 4 of which the micro-batches' 0.5
   * and 2 (0.125 and 0.5 a sequence, 2 sequences a slice): 3 + 1 paces at
   * max(0.5 + 3 x 0.25, 2 + 1 x 1) = 3, not the 2 of all-micro-batch work */
  busy[0] = 1, busy[1] = 4;
  in.micro = (double[]){0.5, 2};
  ck_assert_int_eq(mr_dp_rebalance(&in, &out), 0);
  ck_assert_int_eq(to[0], 3);
  ck_assert_int_eq(to[1], 1);
  NEAR(out.now, 4);
  NEAR(out.then, 3);
  in.micro = NULL;
  /* counts that do not add up, a rank with no work: refused */
  in.counts = (int[]){3, 3};
  ck_assert_int_eq(mr_dp_rebalance(&in, &out), MR_EINVAL);
  in.counts = NULL;
  busy[1] = 0;
  ck_assert_int_eq(mr_dp_rebalance(&in, &out), MR_EINVAL);
}
END_TEST

/* By hand, over a pipeline.  Two replicas of 4 stages under 1F1B (3
 * slots of fill and drain), 4 micro-batches of 1 sequence each, replica 1
 * measured 1.7x slower: 1 and 1.7 a micro-batch, now max(4 + 3, 6.8 +
 * 3 x 1.7) = 11.9.  A replica with k finishes at (k + 3) x its slot: its
 * fill and drain grow with its slowness, so replica 0 takes slices while
 * (k + 4) x 1 < (k1 + 4) x 1.7: to 5 (9 > 8.5), replica 1 a second one,
 * then replica 0 its sixth (9 < 10.2): 6 + 2, pace max(9, 8.5) = 9.  Without
 * the pipeline (bubble 0) the same speeds deal 5 + 3 (pace max(5, 5.1)).
 * Interleaved (v 2: half a slot each end; micro-batches 2 at a time), 2
 * stages, replica 1 4x slow (1 and 4 a micro-batch, now max(4.5, 18)):
 * replica 0 takes 2 at a time while (k + 2.5) < (2 + 2.5) x 4: 6 + 2,
 * pace max(6.5, 10) = 10 (one at a time would have given 7 + 1). */
START_TEST(test_rebalance_data_parallel_pipeline_by_hand) {
  int to[2];
  double busy[2] = {4, 6.8};
  struct mr_dp_rebalance_in in = {2, 4, NULL, busy, NULL, 8, 1, 3, 1};
  struct mr_dp_rebalance_out out = {0, to, 0, 0};
  ck_assert_int_eq(mr_dp_rebalance(&in, &out), 0);
  ck_assert_int_eq(out.n_micro, 4);
  ck_assert_int_eq(to[0], 6);
  ck_assert_int_eq(to[1], 2);
  NEAR(out.now, 11.9);
  NEAR(out.then, 9);
  in.bubble = 0;
  ck_assert_int_eq(mr_dp_rebalance(&in, &out), 0);
  ck_assert_int_eq(to[0], 5);
  ck_assert_int_eq(to[1], 3);
  NEAR(out.then, 5.1);
  in.bubble = 0.5, in.unit = 2;
  busy[1] = 16;
  ck_assert_int_eq(mr_dp_rebalance(&in, &out), 0);
  ck_assert_int_eq(to[0], 6);
  ck_assert_int_eq(to[1], 2);
  NEAR(out.now, 18);
  NEAR(out.then, 10);
  /* a count the rounds do not divide: refused */
  in.n_micro = 3, in.global_batch = 6;
  ck_assert_int_eq(mr_dp_rebalance(&in, &out), MR_EINVAL);
}
END_TEST

/* The 8-layer LLaMA under strategy (JSON members), checkpoints every 10
 * into dir/ckpt-NAME; written to dir/NAME. */
static void write_job_with(const char *dir, const char *name, int steps, const char *strategy) {
  char ckpt[300];
  snprintf(ckpt, sizeof ckpt, "%s/ckpt-%s", dir, name);
  mr_t_write_llama8_job(dir, name, steps, ckpt, strategy);
}

/* Over a 2-stage pipeline of 4 micro-batches, with `layers` (or none). */
static void write_job(const char *dir, const char *name, int steps, const char *layers) {
  char st[200];
  snprintf(st, sizeof st, "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 4%s%s}",
           layers ? ", \"layers\": " : "", layers ? layers : "");
  write_job_with(dir, name, steps, st);
}

/* On 2 data-parallel ranks. */
static void write_dp_job(const char *dir, const char *name, int steps) {
  write_job_with(dir, name, steps, "\"data_parallel\": {\"degree\": 2}");
}

START_TEST(test_rebalance_plan_with_dp_split) {
  char dir[64], path[300];
  mr_t_tmpdir(dir, sizeof dir);
  write_dp_job(dir, "job.json", 4);
  snprintf(path, sizeof path, "%s/job.json", dir);
  struct mr_job job;
  ck_assert_msg(mr_job_load(path, &job) == 0, "%s", mr_error_message());
  struct mr_split s;
  ck_assert_msg(mr_split_of_plan(&job, job.text, 2, &s) == 0, "%s", mr_error_message());
  ck_assert_int_eq(s.pp, 1);
  ck_assert_int_eq(s.dp, 2);
  ck_assert_int_eq(s.n_micro, 1);
  ck_assert_int_eq((int)s.global_batch, 8);
  ck_assert_ptr_null(s.dp_micro);
  mr_split_close(&s);
  uint64_t digests[2] = {0, 0};
  char *text = mr_plan_with_dp_split(&job, job.text, 2, 4, (int[]){7, 1}, 2, digests, NULL);
  ck_assert_msg(text != NULL, "%s", mr_error_message());
  ck_assert(digests[0] != 0 && digests[1] != 0 && digests[0] != digests[1]);
  ck_assert_int_eq(mr_split_of_plan(&job, text, 2, &s), 0);
  ck_assert_int_eq(s.n_micro, 4);
  ck_assert_ptr_nonnull(s.dp_micro);
  ck_assert_int_eq(s.dp_micro[0], 7);
  ck_assert_int_eq(s.dp_micro[1], 1);
  mr_split_close(&s);
  free(text);
  /* counts that do not add up to 2 x 4 are refused, naming the field */
  ck_assert_ptr_null(mr_plan_with_dp_split(&job, job.text, 2, 4, (int[]){7, 2}, 2, digests,
                                           NULL));
  ck_assert_msg(strstr(mr_error_message(), "data_parallel.micro_batches") != NULL, "%s",
                mr_error_message());
  mr_job_close(&job);
  /* over a 2-stage pipeline of 4 micro-batches a replica: the data
   * coordinate runs after the model's (1 here), before the pipeline's, so
   * ranks 1 and 3 are data rank 1; the count is kept (0) */
  write_job_with(dir, "pipe.json", 4,
                 "\"data_parallel\": {\"degree\": 2}, "
                 "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 4}");
  snprintf(path, sizeof path, "%s/pipe.json", dir);
  ck_assert_msg(mr_job_load(path, &job) == 0, "%s", mr_error_message());
  ck_assert_int_eq(mr_split_of_plan(&job, job.text, 4, &s), 0);
  ck_assert_int_eq(s.pp, 2);
  ck_assert_int_eq(s.n_micro, 4);
  for (int r = 0; r < 4; r++)
    ck_assert_int_eq(s.data_of[r], r % 2);
  mr_split_close(&s);
  uint64_t four[4] = {0};
  text = mr_plan_with_dp_split(&job, job.text, 4, 0, (int[]){6, 2}, 2, four, NULL);
  ck_assert_msg(text != NULL, "%s", mr_error_message());
  ck_assert_int_eq(mr_split_of_plan(&job, text, 4, &s), 0);
  ck_assert_int_eq(s.pp, 2);
  ck_assert_int_eq(s.n_micro, 4);
  ck_assert_int_eq(s.dp_micro[0], 6);
  ck_assert_int_eq(s.dp_micro[1], 2);
  mr_split_close(&s);
  free(text);
  mr_job_close(&job);
}
END_TEST

START_TEST(test_rebalance_plan_with_split) {
  char dir[64], path[300];
  mr_t_tmpdir(dir, sizeof dir);
  write_job(dir, "job.json", 4, NULL);
  snprintf(path, sizeof path, "%s/job.json", dir);
  struct mr_job job;
  ck_assert_msg(mr_job_load(path, &job) == 0, "%s", mr_error_message());
  struct mr_split s;
  ck_assert_msg(mr_split_of_plan(&job, job.text, 2, &s) == 0, "%s", mr_error_message());
  ck_assert_int_eq(s.pp, 2);
  ck_assert_int_eq(s.vp, 1);
  ck_assert_int_eq(s.n_layers, 8);
  ck_assert_int_eq(s.counts[0] + s.counts[1], 8);
  ck_assert(s.layer > 0 && s.last > 0);
  mr_split_close(&s);
  uint64_t digests[2] = {0, 0};
  char *text = mr_plan_with_split(&job, job.text, 2, (int[]){7, 1}, 2, digests, NULL);
  ck_assert_msg(text != NULL, "%s", mr_error_message());
  ck_assert(digests[0] != 0 && digests[1] != 0 && digests[0] != digests[1]);
  ck_assert_int_eq(mr_split_of_plan(&job, text, 2, &s), 0);
  ck_assert_int_eq(s.counts[0], 7);
  ck_assert_int_eq(s.counts[1], 1);
  mr_split_close(&s);
  /* a split the plan cannot run is refused, naming the field */
  free(text);
  text = mr_plan_with_split(&job, job.text, 2, (int[]){8, 0}, 2, digests, NULL);
  ck_assert_ptr_null(text);
  ck_assert_msg(strstr(mr_error_message(), "pipeline_parallel.layers") != NULL, "%s",
                mr_error_message());
  mr_job_close(&job);
}
END_TEST

/* Per-rank memory the planner predicts for the job at dir/NAME. */
static double predicted_memory(const char *dir, const char *name) {
  char path[300];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  struct mr_job job;
  ck_assert_msg(mr_job_load(path, &job) == 0, "%s", mr_error_message());
  struct mr_strategy_choice c;
  ck_assert_msg(mr_strategy_choose(&job, 2, &c) == 0, "%s", mr_error_message());
  double total = c.chosen.cost.mem.total;
  mr_strategy_choice_close(&c);
  mr_job_close(&job);
  return total;
}

/* Layers moved must still fit: on devices that hold the 4 + 4 split's
 * predicted memory but not 7 + 1's (stage 0 then holds 7 layers), the plan
 * with 7 + 1 is refused, naming the memory, and 4 + 4 is not. */
START_TEST(test_rebalance_split_must_fit) {
  char dir[64], path[300];
  mr_t_tmpdir(dir, sizeof dir);
  write_job(dir, "even.json", 4, "[4, 4]");
  write_job(dir, "moved.json", 4, "[7, 1]");
  double even = predicted_memory(dir, "even.json"), moved = predicted_memory(dir, "moved.json");
  ck_assert_msg(moved > even, "7 + 1: %.0f bytes, 4 + 4: %.0f", moved, even);
  snprintf(path, sizeof path, "%s/configs/clusters/cpu-local.json", getenv("MESHRUN_SOURCE_DIR"));
  char *spec = mr_t_slurp(path);
  cJSON *o = cJSON_Parse(spec);
  ck_assert_ptr_nonnull(o);
  cJSON_SetNumberValue(cJSON_GetObjectItem(cJSON_GetObjectItem(o, "device"), "memory_bytes"),
                       0.5 * (even + moved));
  char *text = cJSON_Print(o);
  snprintf(path, sizeof path, "%s/small.json", dir);
  FILE *f = fopen(path, "w");
  fputs(text, f);
  fclose(f);
  free(text), free(spec);
  cJSON_Delete(o);
  write_job(dir, "job.json", 4, NULL);
  snprintf(path, sizeof path, "%s/job.json", dir);
  char *job_text = mr_t_slurp(path);
  cJSON *j = cJSON_Parse(job_text);
  cJSON_AddStringToObject(j, "cluster", "small.json");
  text = cJSON_Print(j);
  f = fopen(path, "w");
  fputs(text, f);
  fclose(f);
  free(text), free(job_text);
  cJSON_Delete(j);
  struct mr_job job;
  ck_assert_msg(mr_job_load(path, &job) == 0, "%s", mr_error_message());
  uint64_t digests[2];
  char *ok = mr_plan_with_split(&job, job.text, 2, (int[]){4, 4}, 2, digests, NULL);
  ck_assert_msg(ok != NULL, "%s", mr_error_message());
  free(ok);
  ck_assert_ptr_null(mr_plan_with_split(&job, job.text, 2, (int[]){7, 1}, 2, digests, NULL));
  ck_assert_msg(strstr(mr_error_message(), "GiB per device") != NULL, "%s", mr_error_message());
  mr_job_close(&job);
}
END_TEST

struct step_line {
  double loss, time;
  int restart, seen;
};

/* metrics.jsonl by step (a step run twice, before and after a restart:
 * the later line) into at[1..max]. */
static void read_steps(const char *path, struct step_line *at, int max) {
  char *s = mr_t_slurp(path), *save = NULL;
  for (char *line = strtok_r(s, "\n", &save); line != NULL; line = strtok_r(NULL, "\n", &save)) {
    char *st = strstr(line, "\"step\": "), *l = strstr(line, "\"loss\": ");
    char *t = strstr(line, "\"step_time_s\": "), *r = strstr(line, "\"restart\": ");
    if (st == NULL || l == NULL || t == NULL || r == NULL)
      continue;
    int step = atoi(st + 8);
    if (step < 1 || step > max)
      continue;
    at[step] = (struct step_line){atof(l + 8), atof(t + 15), atoi(r + 11), 1};
  }
  free(s);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The median step time of steps [from, to] run by group `restart`. */
static double median_time(const struct step_line *at, int from, int to, int restart) {
  double v[128];
  int n = 0;
  for (int s = from; s <= to && n < 128; s++)
    if (at[s].seen && at[s].restart == restart)
      v[n++] = at[s].time;
  ck_assert_int_gt(n, 4);
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return v[n / 2];
}

/* Launches dir/name on nproc ranks with env (NULL-ended) and the launch
 * flags in flags (NULL-ended, or NULL); its stderr, its exit code in *code. */
static char *launch_job(const char *dir, const char *name, const char *nproc, char *const env[],
                        char *const flags[], int *code) {
  char logdir[300], jobf[300];
  snprintf(logdir, sizeof logdir, "%s/logs-%s", dir, name);
  snprintf(jobf, sizeof jobf, "%s/%s", dir, name);
  char *argv[24] = {(char *)mr_t_meshrun(), "launch", "--nproc", (char *)nproc, "--threads",
                    "1", "--log-dir", logdir};
  int n = 8;
  for (int i = 0; flags != NULL && flags[i] != NULL && n < 22; i++)
    argv[n++] = flags[i];
  argv[n++] = jobf;
  argv[n] = NULL;
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, env);
  *code = mr_t_wait(&p, 240);
  return mr_t_slurp(p.err_path);
}

static char *run(const char *dir, const char *name, const char *slow, const char *nproc,
                 int *code) {
  static char hook[64];
  snprintf(hook, sizeof hook, "MESHRUN_TEST_SLOW=%s", slow ? slow : "");
  /* re-balancing only for the slowed run: the reference is the run never
   * re-planned (on a busy machine its stages may well run unevenly) */
  char *env[] = {hook, slow ? "MESHRUN_REBALANCE_GAIN=0.15" : "MESHRUN_REBALANCE_GAIN=0", NULL};
  return launch_job(dir, name, nproc, env, NULL, code);
}

enum { STEPS = 60 };

/* Runs dir/ref.json on nproc ranks never slowed nor re-planned, then
 * dir/slow.json with ranks slowed (`slow`: MESHRUN_TEST_SLOW); the slowed
 * run's stderr (for its messages), once its every step's loss is the
 * reference's within tol, its group started again once (once its messages
 * say so) and its steps after run faster than before. */
static char *slowed_and_rebalanced(const char *dir, const char *slow_hook, const char *nproc,
                                   double tol, const char *again) {
  int code;
  char *err = run(dir, "ref.json", NULL, nproc, &code);
  ck_assert_msg(code == 0, "reference: exit %d\n%s", code, err);
  free(err);
  err = run(dir, "slow.json", slow_hook, nproc, &code);
  ck_assert_msg(code == 0, "slowed: exit %d\n%s", code, err);
  ck_assert_msg(strstr(err, again) != NULL, "%s", err);
  const char *once = strstr(err, "unbalanced");
  ck_assert_msg(once != NULL && strstr(once + 1, "unbalanced") == NULL,
                "not re-balanced once:\n%s", err);
  static struct step_line ref[STEPS + 1], slow[STEPS + 1];
  char path[300];
  snprintf(path, sizeof path, "%s/logs-ref.json/metrics.jsonl", dir);
  read_steps(path, ref, STEPS);
  snprintf(path, sizeof path, "%s/logs-slow.json/metrics.jsonl", dir);
  read_steps(path, slow, STEPS);
  for (int s = 1; s <= STEPS; s++) {
    ck_assert_msg(ref[s].seen && slow[s].seen, "step %d missing", s);
    ck_assert_msg(fabs(ref[s].loss - slow[s].loss) <= tol * fabs(ref[s].loss),
                  "step %d: loss %.7f re-balanced, %.7f never slowed", s, slow[s].loss,
                  ref[s].loss);
  }
  ck_assert_int_eq(slow[5].restart, 0);
  ck_assert_int_eq(slow[STEPS].restart, 1);
  double before = median_time(slow, 5, 20, 0), after = median_time(slow, 35, STEPS, 1);
  ck_assert_msg(after < 0.8 * before, "step %.1f ms after re-balancing, %.1f ms before",
                after * 1e3, before * 1e3);
  return err;
}

/* Stage 1 made 4x slower: the launcher moves its layers to stage 0 from a
 * checkpoint, once; the steps after run faster than before, and every
 * step's loss is the loss of the same job never slowed nor re-planned. */
START_TEST(test_rebalance_slow_stage_gets_fewer_layers) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  write_job(dir, "ref.json", STEPS, NULL);
  write_job(dir, "slow.json", STEPS, NULL);
  char *err = slowed_and_rebalanced(dir, "1:x4", "2", 1e-5,
                                    "starting the group again with the pipeline re-balanced");
  /* 7 + 1 at 4x; a slowness measured lower (a sanitized build slows the
   * rest of the step too) moves fewer */
  const char *moved = strstr(err, "moving layers 4,4 -> ");
  int a = 0, b = 0;
  ck_assert_msg(moved != NULL && sscanf(moved, "moving layers 4,4 -> %d,%d", &a, &b) == 2 &&
                    a > 4 && a + b == 8, "%s", err);
  free(err);
}
END_TEST

/* Planning runs off the launcher's loop: a re-plan that takes 3 s while
 * the ranks train on, with a 1 s heartbeat timeout, blames no rank, and
 * the loop never stalls (the launcher would say so) while it is made.
 * The run is long enough (480 steps, about 25 ms each on a fast machine)
 * for the plan to land before the last step. */
START_TEST(test_rebalance_slow_plan_blames_no_rank) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  write_job(dir, "slow.json", 8 * STEPS, NULL);
  char *env[] = {"MESHRUN_TEST_SLOW=1:x4", "MESHRUN_REBALANCE_GAIN=0.15",
                 "MESHRUN_TEST_PLAN_DELAY_MS=3000", NULL};
  char *flags[] = {"--heartbeat-timeout", "1", "--max-restarts", "0", NULL};
  int code;
  char *err = launch_job(dir, "slow.json", "2", env, flags, &code);
  ck_assert_msg(code == 0, "exit %d\n%s", code, err);
  ck_assert_msg(strstr(err, "starting the group again with the pipeline re-balanced") != NULL,
                "the plan never landed:\n%s", err);
  ck_assert_msg(strstr(err, "sent no heartbeat") == NULL, "%s", err);
  ck_assert_msg(strstr(err, "the launcher did not run for") == NULL, "%s", err);
  free(err);
}
END_TEST

#define DP_AGAIN "starting the group again with the data-parallel ranks' micro-batches re-balanced"

/* The launcher's message says data rank 1 runs fewer micro-batches. */
static void fewer_for_data_rank_1(const char *err) {
  const char *said = strstr(err, "the data-parallel ranks run unbalanced");
  ck_assert_msg(said != NULL, "%s", err);
  int fast, slow_k, total;
  const char *run_at = strstr(said, "running ");
  ck_assert_ptr_nonnull(run_at);
  ck_assert_int_eq(sscanf(run_at, "running %d,%d of %d micro-batches", &fast, &slow_k, &total),
                   3);
  ck_assert_msg(fast > slow_k && fast + slow_k == total, "%s", said);
}

/* The job under `strategy` (JSON members) on nproc ranks, the ranks in
 * `slow_hook` slowed: re-balanced once to one rank's losses and faster
 * steps (slowed_and_rebalanced), data rank 1 given fewer micro-batches;
 * the slowed run's stderr. */
static char *data_rank_1_rebalanced(const char *strategy, const char *slow_hook,
                                    const char *nproc) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  write_job_with(dir, "ref.json", STEPS, strategy);
  write_job_with(dir, "slow.json", STEPS, strategy);
  char *err = slowed_and_rebalanced(dir, slow_hook, nproc, 1e-4, DP_AGAIN);
  fewer_for_data_rank_1(err);
  return err;
}

#ifndef __SANITIZE_ADDRESS__ /* sanitized: the ZeRO-2 run below only */
/* Rank 1 of two data-parallel ranks made 8x slower (its kernels: the step's
 * per-step part and, in a sanitized build, everything around the kernels
 * are not slowed, so a 4x device would leave less to gain than the test
 * can tell from noise): the launcher gives it
 * fewer micro-batches from a checkpoint, once; the steps after run faster
 * than before, and every step's loss is the loss of the same job never
 * slowed nor re-planned (within float rounding: the gradients are summed
 * in other groups). */
START_TEST(test_rebalance_slow_data_rank_gets_fewer_micro_batches) {
  free(data_rank_1_rebalanced("\"data_parallel\": {\"degree\": 2}", "1:x8", "2"));
}
END_TEST
#endif

/* The same under ZeRO-2 (two micro-batches a step to deal): the slow rank
 * runs fewer and joins the other's reduce-scatters with zeros. */
START_TEST(test_rebalance_slow_data_rank_under_zero2) {
  free(data_rank_1_rebalanced("\"data_parallel\": {\"degree\": 2}, \"sharding\": "
                              "{\"stage\": 2}, \"gradient_accumulation_steps\": 2",
                              "1:x8", "2"));
}
END_TEST

#ifndef __SANITIZE_ADDRESS__
/* Over a 2-stage pipeline (dp 2 x pp 2, 4 micro-batches a replica), data
 * rank 1 (ranks 1 and 3: the data coordinate runs fastest after the
 * model's) made 8x slower at both stages: every stage is as slow as the
 * others of its replica, so no layers move; the slow replica gets fewer
 * micro-batches, the same checks. */
START_TEST(test_rebalance_slow_pipeline_replica_gets_fewer_micro_batches) {
  char *err = data_rank_1_rebalanced("\"data_parallel\": {\"degree\": 2}, "
                                     "\"pipeline_parallel\": {\"degree\": 2, "
                                     "\"micro_batches\": 4}", "1:x8,3:x8", "4");
  ck_assert_msg(strstr(err, "moving layers") == NULL, "%s", err);
  free(err);
}
END_TEST
#endif

static Suite *rebalance_suite(void) {
  Suite *s = suite_create("rebalance");
  TCase *tc = mr_t_tcase("rebalance");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, test_rebalance_by_hand);
  tcase_add_test(tc, test_rebalance_plan_with_split);
  tcase_add_test(tc, test_rebalance_split_must_fit);
  tcase_add_test(tc, test_rebalance_slow_stage_gets_fewer_layers);
  tcase_add_test(tc, test_rebalance_slow_plan_blames_no_rank);
  tcase_add_test(tc, test_rebalance_data_parallel_by_hand);
  tcase_add_test(tc, test_rebalance_data_parallel_pipeline_by_hand);
  tcase_add_test(tc, test_rebalance_plan_with_dp_split);
  tcase_add_test(tc, test_rebalance_slow_data_rank_under_zero2);
#ifndef __SANITIZE_ADDRESS__
  /* their paths are the ZeRO-2 run's and the slow stage's, which the
   * sanitized build runs; there each pair of 60-step runs takes half a
   * minute in which nothing else may run */
  tcase_add_test(tc, test_rebalance_slow_data_rank_gets_fewer_micro_batches);
  tcase_add_test(tc, test_rebalance_slow_pipeline_replica_gets_fewer_micro_batches);
#endif
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(rebalance_suite)
