/* test_dist_train.c - `meshrun launch` trains across ranks and gives the
 * numbers of one rank.  A tiny LLaMA (grouped-query attention, 4 layers,
 * fp32, fixed seed) trains 20 steps on one rank and under every strategy the
 * runtime executes — data parallelism over 8 ranks; tensor x data;
 * pipelines (1F1B over 4 stages, interleaved, GPipe); data x tensor x
 * pipeline with sequence parallelism; ZeRO-1, -2, -3 (and offload);
 * recomputation, full and selective; gradient accumulation against the
 * whole batch at once.  Every step's loss must equal the one-rank loss
 * within 1e-4 relative and every final weight within 1e-4 (relative L2
 * norm).  The one-rank reference is itself checked against the
 * executor-based trainer (worker/train.h), a separate code path whose
 * gradients the model suites check by finite differences. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "common/error.h"
#include "common/job.h"
#include "common/safetensors.h"
#include "compiler/spmd/lower.h"
#include "testutil.h"
#include "worker/train.h"

#define STEPS 20

#define TINY_LLAMA                                                                   \
  "{\"model_type\": \"llama\", \"vocab_size\": 128, \"hidden_size\": 64,"                 \
  " \"intermediate_size\": 96, \"num_hidden_layers\": 4, \"num_attention_heads\": 8,"       \
  " \"num_key_value_heads\": 4, \"max_position_embeddings\": 64}"
#define TINY_LLAMA_TIED                                                              \
  "{\"model_type\": \"llama\", \"vocab_size\": 128, \"hidden_size\": 64,"                 \
  " \"intermediate_size\": 96, \"num_hidden_layers\": 4, \"num_attention_heads\": 8,"       \
  " \"num_key_value_heads\": 4, \"max_position_embeddings\": 64, \"tie_word_embeddings\": true}"
#define TINY_GPT2                                                                    \
  "{\"model_type\": \"gpt2\", \"vocab_size\": 128, \"n_embd\": 64, \"n_layer\": 4,"        \
  " \"n_head\": 8, \"n_positions\": 64}"

static const char *model_json = TINY_LLAMA;
static int job_steps = STEPS;
static const char *job_plugin = NULL; /* a shared object the jobs name */
static char **run_env = NULL;         /* NAME=VALUE entries for the runs */

static void write_job_named(const char *dir, const char *name, const char *strategy, int batch) {
  char path[160];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  fprintf(f,
          "{\"model\": %s,"
          " \"data\": {\"train\": \"train.bin\", \"val\": \"train.bin\"},"
          " \"train\": {\"steps\": %d, \"global_batch\": %d, \"seq_len\": 16, \"lr\": 0.002,"
          " \"seed\": 3, \"eval_interval_steps\": 10, \"eval_batches\": 1},"
          "%s%s%s"
          " \"strategy\": {\"auto_mode\": \"manual\"%s%s}}\n",
          model_json, job_steps, batch, job_plugin ? " \"plugins\": [\"" : "",
          job_plugin ? job_plugin : "", job_plugin ? "\"]," : "", strategy[0] ? ", " : "",
          strategy);
  fclose(f);
}

/* Runs job file `name` on nproc ranks into dir/RUN; returns the exit code. */
static int run_named(const char *dir, const char *name, const char *run_dir, int nproc) {
  char job[160], logdir[160], n[8];
  snprintf(job, sizeof job, "%s/%s", dir, name);
  snprintf(logdir, sizeof logdir, "%s/%s", dir, run_dir);
  snprintf(n, sizeof n, "%d", nproc);
  char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", n, "--threads", "1",
                  "--log-dir", logdir, job, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, run_env);
  int code = mr_t_wait(&p, 240);
  if (code != 0) {
    char *err = mr_t_slurp(p.err_path);
    fprintf(stderr, "run %s on %d ranks failed (%d):\n%s\n", name, nproc, code, err);
    free(err);
  }
  return code;
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
  ck_assert_msg(mr_st_open(path, &got) == 0, "%s", mr_error_message());
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

/* The whole model's weights (every tensor together) of RUN_B within tol of
 * RUN_A's in relative L2 norm.  For models with parameters whose exact
 * gradient is zero (GPT-2's key bias: softmax ignores a constant added to
 * every key), AdamW turns rounding noise into lr-sized steps of those few
 * elements, so a per-tensor comparison measures only the noise. */
static void same_model_weights(const char *dir, const char *run_a, const char *run_b,
                               double tol) {
  struct mr_st_file *ref, *got;
  char path[200];
  snprintf(path, sizeof path, "%s/%s/model.safetensors", dir, run_a);
  ck_assert_int_eq(mr_st_open(path, &ref), 0);
  snprintf(path, sizeof path, "%s/%s/model.safetensors", dir, run_b);
  ck_assert_msg(mr_st_open(path, &got) == 0, "%s", mr_error_message());
  double diff = 0, norm = 0;
  for (int i = 0; i < mr_st_count(ref); i++) {
    const struct mr_st_tensor *a = mr_st_tensor_at(ref, i);
    const struct mr_st_tensor *b = mr_st_find(got, a->name);
    ck_assert_ptr_nonnull(b);
    float *x = malloc((size_t)a->numel * 4), *y = malloc((size_t)a->numel * 4);
    ck_assert_int_eq(mr_st_read(ref, a, MR_F32, x), 0);
    ck_assert_int_eq(mr_st_read(got, b, MR_F32, y), 0);
    for (int64_t e = 0; e < a->numel; e++) {
      diff += ((double)x[e] - y[e]) * ((double)x[e] - y[e]);
      norm += (double)x[e] * x[e];
    }
    free(x);
    free(y);
  }
  ck_assert_msg(sqrt(diff) <= tol * sqrt(norm), "%s vs %s: relative difference %.3g", run_b,
                run_a, sqrt(diff / norm));
  mr_st_free(got);
  mr_st_free(ref);
}

static int close_rel(double a, double b, double tol) {
  return fabs(a - b) <= tol * fmax(fabs(a), fabs(b)) + 1e-7;
}

/* Peak memory of the last step of a run (the largest rank's), from its
 * metrics: what the runtime's allocator counted. */
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

/* The planner's memory per rank for job `name` on nproc ranks (`meshrun
 * plan --json`): field of "memory_bytes" (total: less the workspace the
 * cluster spec reserves, which the runtime does not allocate). */
static double planned(const char *dir, const char *name, int nproc, const char *field) {
  char cmd[600], out[200];
  snprintf(out, sizeof out, "%s/%s.plan.json", dir, name);
  snprintf(cmd, sizeof cmd, "cd %s && %s plan %s.json --nproc %d --json > %s", dir,
           mr_t_meshrun(), name, nproc, out);
  ck_assert_int_eq(system(cmd), 0);
  char *s = mr_t_slurp(out);
  char key[64];
  snprintf(key, sizeof key, "\"%s\":", field);
  char *mem = strstr(s, "\"memory_bytes\"");
  ck_assert_ptr_nonnull(mem);
  char *f = strstr(mem, key);
  ck_assert_ptr_nonnull(f);
  double v = atof(f + strlen(key));
  if (strcmp(field, "total") == 0) {
    char *w = strstr(mem, "\"workspace\":");
    ck_assert_ptr_nonnull(w);
    v -= atof(w + strlen("\"workspace\":"));
  }
  free(s);
  return v;
}

/* The measured peak of RUN within 15% of the planner's prediction. */
static void memory_as_planned(const char *dir, const char *name, int nproc) {
  double got = last_peak(dir, name), want = planned(dir, name, nproc, "total");
  ck_assert_msg(fabs(got - want) <= 0.15 * want,
                "%s: measured peak %.0f bytes per rank, the planner predicted %.0f (%+.1f%%)",
                name, got, want, 100 * (got - want) / want);
}

/* The last validation loss of RUN's metrics. */
static double val_loss(const char *dir, const char *run) {
  char path[200];
  snprintf(path, sizeof path, "%s/%s/metrics.jsonl", dir, run);
  char *s = mr_t_slurp(path), *last = NULL;
  for (char *p = strstr(s, "\"val_loss\": "); p != NULL; p = strstr(p + 1, "\"val_loss\": "))
    last = p;
  ck_assert_ptr_nonnull(last);
  double v = atof(last + strlen("\"val_loss\": "));
  free(s);
  return v;
}

/* The losses of RUN against the reference's, step by step, and its
 * weights. */
static void same_run(const char *dir, const double *ref, const char *run) {
  char m[200];
  double got[STEPS];
  snprintf(m, sizeof m, "%s/%s/metrics.jsonl", dir, run);
  ck_assert_int_eq(mr_t_read_losses(m, got, STEPS), STEPS);
  for (int st = 0; st < STEPS; st++)
    ck_assert_msg(close_rel(got[st], ref[st], 1e-4), "%s step %d: %.7f vs one rank %.7f", run,
                  st + 1, got[st], ref[st]);
  same_weights(dir, "ref", run, 1e-4);
}

struct fixture {
  char dir[64];
  double ref[STEPS];
};

static void reference(struct fixture *f) {
  mr_t_tmpdir(f->dir, sizeof f->dir);
  char data[160], m[200];
  snprintf(data, sizeof data, "%s/train.bin", f->dir);
  mr_t_write_tokens(data, 30000);
  write_job_named(f->dir, "ref.json", "", 16);
  ck_assert_int_eq(run_named(f->dir, "ref.json", "ref", 1), 0);
  snprintf(m, sizeof m, "%s/ref/metrics.jsonl", f->dir);
  ck_assert_int_eq(mr_t_read_losses(m, f->ref, STEPS), STEPS);
  ck_assert_msg(f->ref[STEPS - 1] < f->ref[0] - 0.3, "the model did not learn: %g -> %g",
                f->ref[0], f->ref[STEPS - 1]);
}

/* Each strategy's run against the one-rank reference: every step's loss,
 * the weights, the validation loss, and the memory the planner predicted. */
static void check_strategies(const char *const *names, const char *const *strategies,
                             const int *nproc, int n) {
  struct fixture f;
  reference(&f);
  double val = val_loss(f.dir, "ref");
  for (int i = 0; i < n; i++) {
    char job[80];
    snprintf(job, sizeof job, "%s.json", names[i]);
    write_job_named(f.dir, job, strategies[i], 16);
    ck_assert_int_eq(run_named(f.dir, job, names[i], nproc[i]), 0);
    same_run(f.dir, f.ref, names[i]);
    memory_as_planned(f.dir, names[i], nproc[i]);
    double got = val_loss(f.dir, names[i]);
    ck_assert_msg(close_rel(got, val, 1e-4), "%s: validation loss %.7f vs one rank %.7f",
                  names[i], got, val);
  }
}

START_TEST(test_dist_train_one_rank_matches_the_executor_trainer) {
  struct fixture f;
  reference(&f);
  char path[200];
  snprintf(path, sizeof path, "%s/ref.json", f.dir);
  struct mr_job job;
  ck_assert_int_eq(mr_job_load(path, &job), 0);
  struct mr_trainer *t;
  ck_assert_msg(mr_trainer_new(&job, 1, &t) == 0, "%s", mr_error_message());
  for (int s = 1; s <= STEPS; s++) {
    struct mr_step_report r;
    ck_assert_int_eq(mr_trainer_step(t, s, &r), 0);
    ck_assert_msg(close_rel(r.loss, f.ref[s - 1], 1e-5), "step %d: executor %.7f, runtime %.7f",
                  s, r.loss, f.ref[s - 1]);
  }
  snprintf(path, sizeof path, "%s/exec", f.dir);
  char cmd[300];
  snprintf(cmd, sizeof cmd, "mkdir -p %s", path);
  ck_assert_int_eq(system(cmd), 0);
  snprintf(path, sizeof path, "%s/exec/model.safetensors", f.dir);
  ck_assert_int_eq(mr_trainer_save(t, path), 0);
  same_weights(f.dir, "ref", "exec", 1e-5);
  mr_trainer_free(t);
  mr_job_close(&job);
}
END_TEST

START_TEST(test_dist_train_data_and_tensor_parallel) {
  const char *names[] = {"dp8", "tp4dp2"};
  const char *st[] = {"\"data_parallel\": {\"degree\": 8}",
                      "\"tensor_parallel\": {\"degree\": 4}, \"data_parallel\": {\"degree\": 2}"};
  const int np[] = {8, 8};
  check_strategies(names, st, np, 2);
}
END_TEST

START_TEST(test_dist_train_pipelines) {
  const char *names[] = {"pp4dp2", "pp2i", "pp2gpipe", "dp2tp2pp2sp"};
  const char *st[] = {
      "\"pipeline_parallel\": {\"degree\": 4, \"schedule\": \"1f1b\", \"micro_batches\": 4}, "
      "\"data_parallel\": {\"degree\": 2}",
      "\"pipeline_parallel\": {\"degree\": 2, \"schedule\": \"interleaved\", "
      "\"virtual_stages\": 2, \"micro_batches\": 4}",
      "\"pipeline_parallel\": {\"degree\": 2, \"schedule\": \"gpipe\", \"micro_batches\": 4}",
      "\"data_parallel\": {\"degree\": 2}, \"tensor_parallel\": {\"degree\": 2}, "
      "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}, "
      "\"sequence_parallel\": {\"enable\": true}, \"mesh_mapping\": \"tp,pp,dp\""};
  const int np[] = {8, 2, 2, 8};
  check_strategies(names, st, np, 4);
}
END_TEST

START_TEST(test_dist_train_zero_stages) {
  const char *names[] = {"zero1", "zero2", "zero3", "zero3offload", "tp2zero2acc", "tp2zero3acc"};
  const char *st[] = {
      "\"data_parallel\": {\"degree\": 4}, \"sharding\": {\"stage\": 1}",
      "\"data_parallel\": {\"degree\": 4}, \"sharding\": {\"stage\": 2}",
      "\"data_parallel\": {\"degree\": 4}, \"sharding\": {\"stage\": 3}",
      "\"data_parallel\": {\"degree\": 4}, \"sharding\": {\"stage\": 3, \"offload\": true}",
      /* with tensor parallelism and accumulation: the embedding's whole
       * gradient once overran the buffer of its shard */
      "\"data_parallel\": {\"degree\": 2}, \"tensor_parallel\": {\"degree\": 2}, "
      "\"sharding\": {\"stage\": 2}, \"gradient_accumulation_steps\": 2",
      "\"data_parallel\": {\"degree\": 2}, \"tensor_parallel\": {\"degree\": 2}, "
      "\"sharding\": {\"stage\": 3}, \"gradient_accumulation_steps\": 2"};
  const int np[] = {4, 4, 4, 4, 4, 4};
  check_strategies(names, st, np, 6);
}
END_TEST

START_TEST(test_dist_train_recompute_and_accumulation) {
  const char *names[] = {"recompute", "selective", "acc4"};
  const char *st[] = {
      "\"data_parallel\": {\"degree\": 2}, \"recompute\": {\"enable\": true, "
      "\"checkpoint_every_n_layers\": 2}",
      "\"tensor_parallel\": {\"degree\": 2}, \"recompute\": {\"enable\": true, "
      "\"granularity\": \"selective\"}",
      "\"gradient_accumulation_steps\": 4"};
  const int np[] = {2, 2, 1};
  check_strategies(names, st, np, 3);
}
END_TEST

/* Micro-batches set per data-parallel rank (a slower rank takes fewer):
 * the step reads the same rows, so the same losses and weights as one
 * rank — alone, with ZeRO-1, with tensor and sequence parallelism (the
 * loss summed over the step, then made whole over both mesh dims), and
 * in front of a pipeline. */
START_TEST(test_dist_train_uneven_micro_batches) {
  const char *names[] = {"dp2uneven", "dp2zero1uneven", "dp2tp2spuneven", "dp2pp2uneven",
                         "dp2zero2uneven", "dp2zero3uneven", "dp2tp2zero2uneven",
                         "dp2pp2zero2uneven"};
  const char *st[] = {
      "\"data_parallel\": {\"degree\": 2, \"micro_batches\": [6, 2]}, "
      "\"gradient_accumulation_steps\": 4",
      "\"data_parallel\": {\"degree\": 2, \"micro_batches\": [1, 3]}, "
      "\"sharding\": {\"stage\": 1}, \"gradient_accumulation_steps\": 2",
      "\"data_parallel\": {\"degree\": 2, \"micro_batches\": [3, 1]}, "
      "\"tensor_parallel\": {\"degree\": 2}, \"sequence_parallel\": {\"enable\": true}, "
      "\"gradient_accumulation_steps\": 2",
      "\"data_parallel\": {\"degree\": 2, \"micro_batches\": [5, 3]}, "
      "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 4}",
      /* ZeRO-2/3: the rank with fewer joins the others' collectives in
       * phantom slots, reduce-scattering zeros */
      "\"data_parallel\": {\"degree\": 2, \"micro_batches\": [3, 1]}, "
      "\"sharding\": {\"stage\": 2}, \"gradient_accumulation_steps\": 2",
      "\"data_parallel\": {\"degree\": 2, \"micro_batches\": [1, 3]}, "
      "\"sharding\": {\"stage\": 3}, \"gradient_accumulation_steps\": 2",
      "\"data_parallel\": {\"degree\": 2, \"micro_batches\": [3, 1]}, "
      "\"tensor_parallel\": {\"degree\": 2}, \"sharding\": {\"stage\": 2}, "
      "\"gradient_accumulation_steps\": 2",
      "\"data_parallel\": {\"degree\": 2, \"micro_batches\": [3, 1]}, "
      "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}, "
      "\"sharding\": {\"stage\": 2}"};
  const int np[] = {2, 2, 4, 4, 2, 2, 4, 4};
  check_strategies(names, st, np, 8); /* evaluation: even micro-batches */
}
END_TEST

/* ZeRO-3 on 8 ranks holds at most a quarter of data parallelism's
 * parameter + optimizer memory per rank (the plans, which the runs above
 * show the runtime allocates); recomputation keeps fewer activations, by
 * what the planner predicts. */
START_TEST(test_dist_train_memory_of_zero3_and_recompute) {
  struct fixture f;
  reference(&f);
  write_job_named(f.dir, "dp8.json", "\"data_parallel\": {\"degree\": 8}", 16);
  write_job_named(f.dir, "z3dp8.json",
                  "\"data_parallel\": {\"degree\": 8}, \"sharding\": {\"stage\": 3}", 16);
  double dp8 = planned(f.dir, "dp8", 8, "parameters") + planned(f.dir, "dp8", 8, "optimizer");
  double z3 = planned(f.dir, "z3dp8", 8, "parameters") + planned(f.dir, "z3dp8", 8, "optimizer");
  ck_assert_msg(4 * z3 <= dp8, "ZeRO-3: %.0f bytes of parameters + optimizer, dp8 %.0f", z3, dp8);
  ck_assert_int_eq(run_named(f.dir, "dp8.json", "dp8", 8), 0);
  ck_assert_int_eq(run_named(f.dir, "z3dp8.json", "z3dp8", 8), 0);
  same_run(f.dir, f.ref, "z3dp8");
  memory_as_planned(f.dir, "dp8", 8);
  memory_as_planned(f.dir, "z3dp8", 8);
  /* the whole peak falls by at least the state ZeRO-3 drops */
  ck_assert_msg(last_peak(f.dir, "dp8") - last_peak(f.dir, "z3dp8") >= 0.9 * (dp8 - z3),
                "peaks: dp8 %.0f, ZeRO-3 %.0f", last_peak(f.dir, "dp8"),
                last_peak(f.dir, "z3dp8"));
  /* recomputation: activations kept fall as predicted */
  write_job_named(f.dir, "rc.json", "\"recompute\": {\"enable\": true}", 16);
  ck_assert_int_eq(run_named(f.dir, "rc.json", "rc", 1), 0);
  memory_as_planned(f.dir, "rc", 1);
  double saved = last_peak(f.dir, "ref") - last_peak(f.dir, "rc");
  double saved_plan = planned(f.dir, "ref", 1, "activations") - planned(f.dir, "rc", 1, "activations");
  ck_assert_msg(saved > 0 && fabs(saved - saved_plan) <= 0.15 * saved_plan,
                "recompute saved %.0f bytes, the planner predicted %.0f", saved, saved_plan);
}
END_TEST

/* The runtime issues exactly the communication its program lists, in
 * order, on every rank: the comm backend's trace of a step of dp2 x tp2 x
 * pp2 with sequence parallelism against the lowered programs' events. */
START_TEST(test_dist_train_runtime_issues_the_programs_communication) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  char data[160], job_path[200], trace[200];
  snprintf(data, sizeof data, "%s/train.bin", dir);
  mr_t_write_tokens(data, 30000);
  const char *st = "\"data_parallel\": {\"degree\": 2}, \"tensor_parallel\": {\"degree\": 2}, "
                   "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}, "
                   "\"sequence_parallel\": {\"enable\": true}";
  char path[160];
  snprintf(path, sizeof path, "%s/one.json", dir);
  FILE *f = fopen(path, "w");
  fprintf(f,
          "{\"model\": {\"model_type\": \"llama\", \"vocab_size\": 128, \"hidden_size\": 64,"
          " \"intermediate_size\": 96, \"num_hidden_layers\": 4, \"num_attention_heads\": 8,"
          " \"num_key_value_heads\": 4, \"max_position_embeddings\": 64},"
          " \"data\": {\"train\": \"train.bin\"},"
          " \"train\": {\"steps\": 1, \"global_batch\": 16, \"seq_len\": 16, \"eval_interval_steps\": 0},"
          " \"strategy\": {\"auto_mode\": \"manual\", %s}}\n", st);
  fclose(f);
  snprintf(trace, sizeof trace, "MESHRUN_TEST_COMM_TRACE=%s/trace", dir);
  char logdir[160];
  snprintf(logdir, sizeof logdir, "%s/run", dir);
  char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", "8", "--log-dir", logdir, path,
                  NULL};
  char *env[] = {trace, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, env);
  ck_assert_int_eq(mr_t_wait(&p, 120), 0);
  snprintf(job_path, sizeof job_path, "%s/one.json", dir);
  struct mr_job job;
  ck_assert_int_eq(mr_job_load(job_path, &job), 0);
  struct mr_lowered L;
  ck_assert_msg(mr_lower_graph(&job, 8, &L) == 0, "%s", mr_error_message());
  for (int r = 0; r < 8; r++) {
    struct mr_rank_program prog;
    ck_assert_int_eq(mr_rank_program_build(&L, r, &prog), 0);
    char tp[200];
    snprintf(tp, sizeof tp, "%s/trace.%d", dir, r);
    char *text = mr_t_slurp(tp);
    char *line = text, *next;
    int e = 0;
    for (; e < prog.n_ev_step && line != NULL && *line; e++, line = next) {
      next = strchr(line, '\n');
      if (next)
        *next++ = '\0';
      char kind[32], dt[32], group[128];
      long long count;
      int peer;
      ck_assert_int_eq(sscanf(line, "%31s %lld %31s %127s %d", kind, &count, dt, group, &peer), 5);
      const struct mr_comm_event *ev = &prog.ev[e];
      ck_assert_msg(strcmp(kind, mr_comm_event_kind_name(ev->kind)) == 0 &&
                        strcmp(group, ev->group) == 0 &&
                        (ev->kind == MR_CEV_ALL_GATHER || count == ev->count) &&
                        (ev->peer < 0 || peer == ev->peer),
                    "rank %d, operation %d: issued %s, the program says %s %lld on %s (%s)", r, e,
                    line, mr_comm_event_kind_name(ev->kind), (long long)ev->count, ev->group,
                    ev->what);
    }
    ck_assert_msg(e == prog.n_ev_step, "rank %d issued %d of its program's %d operations", r, e,
                  prog.n_ev_step);
    free(text);
    mr_rank_program_close(&prog);
  }
  mr_lowered_close(&L);
  mr_job_close(&job);
}
END_TEST

/* Tied embeddings across pipeline stages (the first stage owns the table,
 * the last holds a copy it refreshes each step) and GPT-2 (tied, LayerNorm,
 * biases, learned positions) under pipelines, tensor parallelism and all
 * three with sequence parallelism. */
START_TEST(test_dist_train_tied_embeddings_and_gpt2) {
  static const char *const models[2] = {TINY_LLAMA_TIED, TINY_GPT2};
  const char *names[] = {"pp2", "tp2", "dp2tp2pp2", "dp2pp2zero3"};
  const char *st[] = {
      "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}",
      "\"tensor_parallel\": {\"degree\": 2}",
      "\"data_parallel\": {\"degree\": 2}, \"tensor_parallel\": {\"degree\": 2}, "
      "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}, "
      "\"sequence_parallel\": {\"enable\": true}",
      /* the tied embedding sharded over data on both stages it is used on */
      "\"data_parallel\": {\"degree\": 2}, \"sharding\": {\"stage\": 3}, "
      "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}"};
  const int np[] = {2, 2, 8, 4};
  for (int k = 0; k < 2; k++) {
    model_json = models[k];
    struct fixture f;
    reference(&f);
    for (int i = 0; i < 4; i++) {
      char job[80], m[200];
      snprintf(job, sizeof job, "%s.json", names[i]);
      write_job_named(f.dir, job, st[i], 16);
      ck_assert_int_eq(run_named(f.dir, job, names[i], np[i]), 0);
      double got[STEPS];
      snprintf(m, sizeof m, "%s/%s/metrics.jsonl", f.dir, names[i]);
      ck_assert_int_eq(mr_t_read_losses(m, got, STEPS), STEPS);
      for (int s2 = 0; s2 < STEPS; s2++)
        ck_assert_msg(close_rel(got[s2], f.ref[s2], 1e-4), "%s %s step %d: %.7f vs %.7f",
                      k ? "gpt2" : "tied llama", names[i], s2 + 1, got[s2], f.ref[s2]);
      same_model_weights(f.dir, "ref", names[i], 1e-4);
      if (k == 1 && i == 1) /* GPT-2's attention split as the planner counts it */
        memory_as_planned(f.dir, names[i], np[i]);
    }
  }
  model_json = TINY_LLAMA;
}
END_TEST

/* Mixed precision across ranks: bf16 under tensor parallelism stays within
 * 2% of the fp32 losses; fp16 on a pipeline survives an injected overflow:
 * that step is skipped on every rank (its norm written as null) and the
 * loss scale halves. */
START_TEST(test_dist_train_mixed_precision) {
  struct fixture f;
  reference(&f);
  write_job_named(f.dir, "bf16.json",
                  "\"tensor_parallel\": {\"degree\": 2}, \"amp\": {\"dtype\": \"bf16\"}", 16);
  ck_assert_int_eq(run_named(f.dir, "bf16.json", "bf16", 2), 0);
  char m[200];
  double got[STEPS];
  snprintf(m, sizeof m, "%s/bf16/metrics.jsonl", f.dir);
  ck_assert_int_eq(mr_t_read_losses(m, got, STEPS), STEPS);
  for (int s2 = 0; s2 < STEPS; s2++)
    ck_assert_msg(close_rel(got[s2], f.ref[s2], 0.02), "bf16 step %d: %.5f vs fp32 %.5f", s2 + 1,
                  got[s2], f.ref[s2]);
  write_job_named(f.dir, "fp16.json",
                  "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}, "
                  "\"amp\": {\"dtype\": \"fp16\"}", 16);
  setenv("MESHRUN_INJECT_OVERFLOW_STEP", "3", 1);
  int rc = run_named(f.dir, "fp16.json", "fp16", 2);
  unsetenv("MESHRUN_INJECT_OVERFLOW_STEP");
  ck_assert_int_eq(rc, 0);
  snprintf(m, sizeof m, "%s/fp16/metrics.jsonl", f.dir);
  char *text = mr_t_slurp(m);
  char *l3 = strstr(text, "{\"step\": 3,"), *l4 = strstr(text, "{\"step\": 4,");
  ck_assert_ptr_nonnull(l3);
  ck_assert_ptr_nonnull(l4);
  l4[-1] = '\0';
  ck_assert_msg(strstr(l3, "\"grad_norm\": null") != NULL && strstr(l3, "\"skipped\": true") &&
                    strstr(l3, "\"loss_scale\": 1024") != NULL,
                "%s", l3);
  ck_assert_msg(strstr(l4, "\"loss_scale\": 512") != NULL && strstr(l4, "\"skipped\": false"),
                "%s", l4);
  free(text);
}
END_TEST

START_TEST(test_dist_train_profile_accounts_for_the_step) {
  /* MESHRUN_PROFILE=1: each rank logs its time per step by instruction and
   * op kind.  The instructions make up the step, so their total is the
   * measured step time (the mean of the run's metrics) within 5%; the
   * results are those of the one-rank run (profiling only synchronizes) */
  struct fixture f;
  reference(&f);
  write_job_named(f.dir, "prof.json", "\"tensor_parallel\": {\"degree\": 2}", 16);
  char job[160], logdir[160];
  snprintf(job, sizeof job, "%s/prof.json", f.dir);
  snprintf(logdir, sizeof logdir, "%s/prof", f.dir);
  char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", "2", "--threads", "1",
                  "--log-dir", logdir, job, NULL};
  static char on[] = "MESHRUN_PROFILE=1";
  char *env[] = {on, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, f.dir, argv, env);
  ck_assert_int_eq(mr_t_wait(&p, 240), 0);
  same_run(f.dir, f.ref, "prof");
  char path[200];
  snprintf(path, sizeof path, "%s/metrics.jsonl", logdir);
  char *m = mr_t_slurp(path);
  double sum = 0;
  int n = 0;
  for (char *s = strstr(m, "\"step_time_s\": "); s != NULL; s = strstr(s + 1, "\"step_time_s\": "))
    sum += atof(s + strlen("\"step_time_s\": ")), n++;
  free(m);
  ck_assert_int_eq(n, STEPS);
  snprintf(path, sizeof path, "%s/rank-0.log", logdir);
  char *log = mr_t_slurp(path);
  char *line = strstr(log, "ms per step over ");
  ck_assert_msg(line != NULL, "%s", log);
  int steps = 0;
  double total = 0;
  ck_assert_int_eq(sscanf(line, "ms per step over %d steps: %lf in all", &steps, &total), 2);
  ck_assert_int_eq(steps, STEPS);
  double mean = 1e3 * sum / n;
  ck_assert_msg(fabs(total - mean) <= 0.05 * mean, "profiled %.2f ms a step, measured %.2f",
                total, mean);
  ck_assert_msg(strstr(line, "(kernels: ") != NULL && strstr(line, "matmul ") != NULL &&
                    strstr(line, "; reshard ") != NULL, "%s", line);
  free(log);
}
END_TEST

START_TEST(test_dist_train_a_plugin_op_under_tensor_parallelism) {
  /* A job naming the example plugin (examples/plugins/add_rmsnorm.c):
   * launch plans with it and every worker loads it, its pass fusing each
   * residual add with the rmsnorm after it.  The fused op computes what
   * the two did, so on one rank and under tensor parallelism (tp4, and
   * tp2 with sequence parallelism, where the residual reaches it through
   * a reduce-scatter) every loss and weight is the plugin-free one rank's;
   * each rank's profile shows the fused op ran.  A plugin that cannot be
   * loaded stops the launch naming the field. */
  struct fixture f;
  reference(&f);
  char so[300];
  const char *b = getenv("MESHRUN_BUILD_DIR");
  snprintf(so, sizeof so, "%s/examples/plugins/add_rmsnorm.so", b ? b : "build");
  static char on[] = "MESHRUN_PROFILE=1";
  char *env[] = {on, NULL};
  job_plugin = so;
  run_env = env;
  const char *names[] = {"plugin1", "plugin_tp4", "plugin_tp2sp"};
  const char *st[] = {"", "\"tensor_parallel\": {\"degree\": 4}",
                      "\"tensor_parallel\": {\"degree\": 2}, \"sequence_parallel\": "
                      "{\"enable\": true}"};
  const int np[] = {1, 4, 2};
  for (int i = 0; i < 3; i++) {
    char job[80], log[200];
    snprintf(job, sizeof job, "%s.json", names[i]);
    write_job_named(f.dir, job, st[i], 16);
    ck_assert_int_eq(run_named(f.dir, job, names[i], np[i]), 0);
    same_run(f.dir, f.ref, names[i]);
    snprintf(log, sizeof log, "%s/%s/rank-%d.log", f.dir, names[i], np[i] - 1);
    char *text = mr_t_slurp(log);
    ck_assert_msg(strstr(text, "kernels: ") != NULL && strstr(text, " add_rmsnorm ") != NULL,
                  "%s: no add_rmsnorm in the profile:\n%s", names[i], text);
    free(text);
  }
  job_plugin = "/nonexistent/fused.so";
  run_env = NULL;
  write_job_named(f.dir, "missing.json", "", 16);
  char job[160];
  snprintf(job, sizeof job, "%s/missing.json", f.dir);
  char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", "1", job, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, f.dir, argv, NULL);
  ck_assert_int_eq(mr_t_wait(&p, 60), 2);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(strstr(err, "missing.json: plugins[0]: ") != NULL &&
                    strstr(err, "/nonexistent/fused.so") != NULL, "%s", err);
  free(err);
  job_plugin = NULL;
}
END_TEST

START_TEST(test_dist_train_batch_not_divisible_is_a_clear_error) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  char data[160];
  snprintf(data, sizeof data, "%s/train.bin", dir);
  mr_t_write_tokens(data, 5000);
  write_job_named(dir, "job.json", "\"data_parallel\": {\"degree\": 3}", 8);
  char job[160], logdir[160];
  snprintf(job, sizeof job, "%s/job.json", dir);
  snprintf(logdir, sizeof logdir, "%s/run3", dir);
  char *argv[] = {(char *)mr_t_meshrun(), "launch", "--nproc", "3", "--log-dir", logdir, job, NULL};
  struct mr_tproc p;
  mr_t_spawn(&p, dir, argv, NULL);
  /* refused before any worker starts, naming the fields */
  ck_assert_int_eq(mr_t_wait(&p, 60), 2);
  char *err = mr_t_slurp(p.err_path);
  ck_assert_msg(strstr(err, "global_batch") != NULL && strstr(err, "8") != NULL &&
                    strstr(err, "data") != NULL,
                "%s", err);
  free(err);
}
END_TEST

/* More ranks in a group than the runtime once allowed (64): a data group
 * of 66 ranks under ZeRO-3 — every parameter gathered from 66 blocks, every
 * gradient reduce-scattered over them — gives the one-rank run's losses and
 * weights (batch 66, 4 steps: 66 processes share this machine's cores). */
START_TEST(test_dist_train_a_group_of_more_than_64_ranks) {
  enum { RANKS = 66, N = 4 };
  char dir[64], data[160], m[200];
  mr_t_tmpdir(dir, sizeof dir);
  snprintf(data, sizeof data, "%s/train.bin", dir);
  mr_t_write_tokens(data, 30000);
  job_steps = N;
  write_job_named(dir, "ref.json", "", RANKS);
  write_job_named(dir, "dp66.json",
                  "\"data_parallel\": {\"degree\": 66}, \"sharding\": {\"stage\": 3}", RANKS);
  job_steps = STEPS;
  ck_assert_int_eq(run_named(dir, "ref.json", "ref", 1), 0);
  ck_assert_int_eq(run_named(dir, "dp66.json", "dp66", RANKS), 0);
  double ref[N], got[N];
  snprintf(m, sizeof m, "%s/ref/metrics.jsonl", dir);
  ck_assert_int_eq(mr_t_read_losses(m, ref, N), N);
  snprintf(m, sizeof m, "%s/dp66/metrics.jsonl", dir);
  ck_assert_int_eq(mr_t_read_losses(m, got, N), N);
  for (int st = 0; st < N; st++)
    ck_assert_msg(close_rel(got[st], ref[st], 1e-4), "dp66 step %d: %.7f vs one rank %.7f",
                  st + 1, got[st], ref[st]);
  ck_assert_msg(ref[N - 1] < ref[0], "the model did not learn: %g -> %g", ref[0], ref[N - 1]);
  same_weights(dir, "ref", "dp66", 1e-4);
}
END_TEST

static Suite *dist_train_suite(void) {
  Suite *s = suite_create("dist_train");
  TCase *tc = mr_t_tcase("strategies");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, test_dist_train_one_rank_matches_the_executor_trainer);
  tcase_add_test(tc, test_dist_train_data_and_tensor_parallel);
  tcase_add_test(tc, test_dist_train_pipelines);
  tcase_add_test(tc, test_dist_train_zero_stages);
  tcase_add_test(tc, test_dist_train_recompute_and_accumulation);
  tcase_add_test(tc, test_dist_train_uneven_micro_batches);
  tcase_add_test(tc, test_dist_train_memory_of_zero3_and_recompute);
  tcase_add_test(tc, test_dist_train_runtime_issues_the_programs_communication);
  tcase_add_test(tc, test_dist_train_tied_embeddings_and_gpt2);
  tcase_add_test(tc, test_dist_train_mixed_precision);
  tcase_add_test(tc, test_dist_train_batch_not_divisible_is_a_clear_error);
  tcase_add_test(tc, test_dist_train_profile_accounts_for_the_step);
  tcase_add_test(tc, test_dist_train_a_plugin_op_under_tensor_parallelism);
  tcase_add_test(tc, test_dist_train_a_group_of_more_than_64_ranks);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(dist_train_suite)
