/* test_report.c - `meshrun report`'s reading of a run folder: run.jsonl as
 * launcher/run_log.c writes it read back, each step once as its last
 * record holds it, MFU and the predicted step time from the plan of the
 * step's group, running / finished / vanished runs told apart, bad input
 * named (file, line, field, what was expected); the Markdown tables
 * against the metrics written; the HTML escaped and every chart holding
 * points.  (Chromium renders a real run's page in
 * tests/data/check_report.py.) */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_main.h"
#include "common/error.h"
#include "common/text.h"
#include "launcher/report.h"
#include "launcher/run_log.h"
#include "testutil.h"

#define WORLD 2
#define PEAK_DEVICE_S 0.05 // a step at peak FLOP/s on one device
#define PREDICTED_S 0.2

static void write_file(const char *dir, const char *name, const char *text, const char *mode) {
  char path[256];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, mode);
  ck_assert_ptr_nonnull(f);
  fputs(text, f);
  fclose(f);
}

static long file_size(const char *dir, const char *name) {
  char path[256];
  struct stat sb;
  snprintf(path, sizeof path, "%s/%s", dir, name);
  return stat(path, &sb) == 0 ? (long)sb.st_size : 0;
}

/* The loss and step time metrics.jsonl records for step s of group g. */
static double loss_of(int s, int g) { return 5.0 / (s + 1) + 0.001 * g; }
static double time_of(int s, int g) { return 0.25 + 0.01 * s + 0.1 * g; }

static void metric(const char *dir, int s, int g, int eval) {
  char line[512];
  snprintf(line, sizeof line,
           "{\"step\": %d, \"loss\": %.9g, \"lr\": 0.001, \"grad_norm\": null, "
           "\"tokens_per_s\": %.6g, \"step_time_s\": %.6g, \"comm_wait_s\": 0.01, "
           "\"peak_memory_bytes\": 1048576, \"skipped\": false%s, \"restart\": %d}\n",
           s, loss_of(s, g), 1000 / time_of(s, g), time_of(s, g),
           eval ? ", \"val_loss\": 3.5" : "", g);
  write_file(dir, "metrics.jsonl", line, "a");
}

static void plan(struct mr_run_log *l, const char *dir, int restart) {
  static const char text[] =
      "{\"train\": {\"steps\": 8}, \"strategy\": {\"data_parallel\": {\"degree\": 2}, "
      "\"tensor_parallel\": {\"degree\": 1}, \"pipeline_parallel\": {\"degree\": 1, "
      "\"schedule\": \"1f1b\", \"micro_batches\": 2}, \"sharding\": {\"stage\": 1}, "
      "\"amp\": {\"dtype\": \"bf16\"}}}";
  struct mr_run_log_plan p = {.restart = restart, .world = WORLD, .nodes = 1, .plan_text = text,
                              .predicted_s = PREDICTED_S, .peak_device_s = PEAK_DEVICE_S,
                              .metrics_at = file_size(dir, "metrics.jsonl")};
  mr_run_log_plan(l, &p);
}

/* A run of 8 steps: group 0 trains 1..6 and rank 1 fails, group 1 resumes
 * at step 5 and trains to 8; coordinator.json names launcher `pid`. */
static void make_run(const char *dir, int pid, int ended) {
  struct mr_run_log *l;
  ck_assert_int_eq(mr_run_log_open(dir, &l), 0);
  mr_run_log_start(l, "abc123", WORLD, 1, 1);
  plan(l, dir, 0);
  uint64_t peak[WORLD] = {100 << 20, 120 << 20}, rss[WORLD] = {200 << 20, 210 << 20};
  for (int s = 1; s <= 6; s++)
    metric(dir, s, 0, s == 4);
  mr_run_log_memory(l, 0, 6, peak, rss, WORLD);
  mr_run_log_memory(l, 0, 6, peak, rss, WORLD); /* unmoved: not written again */
  mr_run_log_failure(l, 0, 1, "rank 1 <pid 9> was killed by signal 9\nlast line", 1, 0, 9);
  mr_run_log_restart(l, 1, "failure", 1, 1, 0.5);
  plan(l, dir, 1);
  for (int s = 5; s <= 8; s++)
    metric(dir, s, 1, s == 8);
  peak[1] = 130 << 20;
  mr_run_log_memory(l, 1, 8, peak, rss, WORLD);
  if (ended)
    mr_run_log_end(l, 0, 1, 1, "");
  mr_run_log_close(l);
  char text[256];
  snprintf(text, sizeof text, "{\"job_id\": \"abc123\", \"pid\": %d, \"unix\": \"unix:/x\", "
           "\"tcp\": \"tcp:127.0.0.1:1\", \"world_size\": 2, \"nodes\": 1}\n", pid);
  write_file(dir, "coordinator.json", text, "w");
}

/* A pid that ran and is gone. */
static int dead_pid(void) {
  pid_t p = fork();
  if (p == 0)
    _exit(0);
  waitpid(p, NULL, 0);
  return (int)p;
}

START_TEST(test_report_reads_each_step_once_with_its_plan) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  make_run(dir, dead_pid(), 1);
  struct mr_run run;
  ck_assert_int_eq(mr_run_read(dir, &run), 0);
  ck_assert_int_eq(run.state, MR_RUN_DONE);
  ck_assert_int_eq(run.n_records, 10);
  ck_assert_int_eq(run.n_steps, 8);
  ck_assert_int_eq(run.n_groups, 2);
  ck_assert_int_eq(run.groups[0].first_step, 1);
  ck_assert_int_eq(run.groups[1].first_step, 5);
  ck_assert_int_eq(run.groups[1].steps, 8);
  ck_assert_str_eq(run.groups[1].mesh, "data 2 x model 1 x pipeline 1 (order tp,dp,pp)");
  ck_assert_msg(strstr(run.groups[1].schedule, "2 micro-batches") != NULL &&
                strstr(run.groups[1].schedule, "ZeRO-1") != NULL &&
                strstr(run.groups[1].schedule, "bf16") != NULL, "%s", run.groups[1].schedule);
  ck_assert_int_eq(run.groups[1].n_placements, 1);
  ck_assert_msg(strstr(run.groups[1].placements[0], "optimizer state Shard(0)") != NULL, "%s",
                run.groups[1].placements[0]);
  for (int i = 0; i < run.n_steps; i++) {
    const struct mr_run_step *s = &run.steps[i];
    int g = s->step >= 5; /* steps 5 and 6 as the group that trained them again has them */
    ck_assert_int_eq(s->step, i + 1);
    ck_assert_int_eq(s->group, g);
    ck_assert_int_eq(s->restart, g);
    ck_assert_double_eq_tol(s->loss, loss_of(i + 1, g), 1e-8 * loss_of(i + 1, g)); /* %.9g */
    ck_assert_double_eq_tol(s->step_time_s, time_of(i + 1, g), 1e-6 * time_of(i + 1, g));
    ck_assert_double_eq_tol(s->mfu, PEAK_DEVICE_S / (s->step_time_s * WORLD), 1e-12);
    ck_assert(s->predicted_s == PREDICTED_S);
    ck_assert(isnan(s->grad_norm)); /* null */
    ck_assert(s->step == 4 || s->step == 8 ? s->val_loss == 3.5 : isnan(s->val_loss));
  }
  ck_assert_int_eq(run.n_ranks, WORLD);
  ck_assert_int_eq(run.memory_step, 8);
  ck_assert_uint_eq(run.rank_peak[1], 130u << 20);
  ck_assert_uint_eq(run.rank_rss[0], 200u << 20);
  /* the launch, the failure, the restart, the end */
  ck_assert_int_eq(run.n_events, 4);
  ck_assert_int_eq(run.n_failures, 1);
  ck_assert_int_eq(run.n_restarts, 1);
  ck_assert_int_eq(run.events[1].kind, MR_RUN_EV_FAILURE);
  ck_assert_int_eq(run.events[1].rank, 1);
  ck_assert_str_eq(run.events[1].text, "rank 1 <pid 9> was killed by signal 9\nlast line");
  ck_assert_int_eq(run.events[2].kind, MR_RUN_EV_RESTART);
  ck_assert_int_eq(run.events[2].restart, 1);
  ck_assert_msg(strstr(run.events[2].text, "after a failure (1 of 1 allowed") != NULL, "%s",
                run.events[2].text);
  ck_assert_int_eq(run.events[3].kind, MR_RUN_EV_END);
  ck_assert_str_eq(run.events[3].text, "done");
  mr_run_close(&run);
}
END_TEST

/* No end yet: running while coordinator.json's launcher lives (the line
 * being written left out), ended without a record once it is gone. */
START_TEST(test_report_running_and_vanished_runs) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  make_run(dir, (int)getpid(), 0);
  write_file(dir, "metrics.jsonl", "{\"step\": 9, \"lo", "a");
  struct mr_run run;
  ck_assert_int_eq(mr_run_read(dir, &run), 0);
  ck_assert_int_eq(run.state, MR_RUN_RUNNING);
  ck_assert_int_eq(run.n_steps, 8);
  mr_run_close(&run);
  mr_t_tmpdir(dir, sizeof dir);
  make_run(dir, dead_pid(), 0);
  ck_assert_int_eq(mr_run_read(dir, &run), 0);
  ck_assert_int_eq(run.state, MR_RUN_VANISHED);
  ck_assert_str_eq(mr_run_state_name(run.state), "ended without a record");
  mr_run_close(&run);
}
END_TEST

/* What is not a run, and records that are not what they should be: an
 * error naming the file (and line), the field and what was expected. */
START_TEST(test_report_bad_input_named) {
  char dir[64], file[100];
  struct mr_run run;
  mr_t_tmpdir(dir, sizeof dir);
  ck_assert_int_eq(mr_run_read(dir, &run), MR_ENOENT);
  ck_assert_msg(strstr(mr_error_message(), "not a run folder") != NULL, "%s", mr_error_message());
  mr_run_close(&run);
  snprintf(file, sizeof file, "%s/metrics.jsonl", dir);
  ck_assert_int_eq(mr_run_read(file, &run), MR_ENOENT); /* not a folder */
  mr_run_close(&run);
  write_file(dir, "metrics.jsonl", "{\"step\": 1, \"loss\": 2}\n{\"step\": 2, \"loss\": \"x\"}\n",
             "w");
  ck_assert_int_eq(mr_run_read(dir, &run), MR_EFORMAT);
  ck_assert_msg(strstr(mr_error_message(), "metrics.jsonl:2: loss: expected a number") != NULL,
                "%s", mr_error_message());
  mr_run_close(&run);
  write_file(dir, "metrics.jsonl", "not json\n", "w");
  ck_assert_int_eq(mr_run_read(dir, &run), MR_EFORMAT);
  ck_assert_msg(strstr(mr_error_message(), "metrics.jsonl:1: expected a JSON object") != NULL,
                "%s", mr_error_message());
  mr_run_close(&run);
  write_file(dir, "metrics.jsonl", "", "w");
  write_file(dir, "run.jsonl", "{\"event\": \"start\", \"time\": 1, \"job_id\": \"a\", "
             "\"world\": 1, \"nodes\": 1, \"max_restarts\": 0}\n"
             "{\"event\": \"failure\", \"time\": 2, \"restart\": 0, \"rank\": \"one\", "
             "\"reason\": \"\"}\n", "w");
  ck_assert_int_eq(mr_run_read(dir, &run), MR_EFORMAT);
  ck_assert_msg(strstr(mr_error_message(), "run.jsonl:2: rank: expected an integer") != NULL,
                "%s", mr_error_message());
  mr_run_close(&run);
  write_file(dir, "run.jsonl", "{\"event\": \"party\", \"time\": 1}\n", "w");
  ck_assert_int_eq(mr_run_read(dir, &run), MR_EFORMAT);
  ck_assert_msg(strstr(mr_error_message(), "run.jsonl:1: event: expected \"start\"") != NULL, "%s",
                mr_error_message());
  mr_run_close(&run);
  /* the command: exit 2 for each, and for an output it cannot write */
  char *bad_dir[] = {"report", dir, NULL};
  ck_assert_int_eq(mr_cmd_report(2, bad_dir), 2);
  mr_t_tmpdir(dir, sizeof dir);
  make_run(dir, dead_pid(), 1);
  char *fmt[] = {"report", "--format", "pdf", dir, NULL};
  ck_assert_int_eq(mr_cmd_report(4, fmt), 2);
  char *out[] = {"report", "--out", "/proc/self/no/report.html", dir, NULL};
  ck_assert_int_eq(mr_cmd_report(4, out), 2);
  char *ok[] = {"report", "--format", "md", "--out", file, dir, NULL};
  snprintf(file, sizeof file, "%s/r.md", dir);
  ck_assert_int_eq(mr_cmd_report(6, ok), 0);
  ck_assert_int_gt(file_size(dir, "r.md"), 1000);
}
END_TEST

/* The value in the Markdown table under heading `head`, row `row`, column
 * `col` (0: the row's name). */
static double md_cell(const char *md, const char *head, const char *row, int col) {
  const char *t = strstr(md, head);
  ck_assert_msg(t != NULL, "no %s in\n%s", head, md);
  char want[64];
  snprintf(want, sizeof want, "\n| %s |", row);
  const char *r = strstr(t, want);
  ck_assert_msg(r != NULL, "no row %s under %s", row, head);
  r += 3;
  for (int c = 0; c < col; c++)
    r = strchr(r, '|') + 1;
  return strtod(r, NULL);
}

START_TEST(test_report_md_numbers_are_the_metrics) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  make_run(dir, dead_pid(), 1);
  struct mr_run run;
  ck_assert_int_eq(mr_run_read(dir, &run), 0);
  struct mr_text t = {0};
  mr_report_md(&run, &t);
  char *md = mr_text_take(&t);
  for (int s = 1; s <= 8; s++) {
    char row[16];
    snprintf(row, sizeof row, "%d", s);
    int g = s >= 5;
    double loss = loss_of(s, g), time = time_of(s, g);
    ck_assert_double_eq_tol(md_cell(md, "## Loss", row, 1), loss, 1e-5 * loss);
    ck_assert_double_eq_tol(md_cell(md, "## Throughput", row, 1), 1000 / time, 1e-5 * 1000 / time);
    double mfu = 100 * PEAK_DEVICE_S / (time * WORLD);
    ck_assert_double_eq_tol(md_cell(md, "## Model FLOPs", row, 1), mfu, 1e-3 * mfu);
    ck_assert_double_eq_tol(md_cell(md, "## Step time", row, 1), time, 1e-5 * time);
    ck_assert_double_eq_tol(md_cell(md, "## Step time", row, 2), PREDICTED_S, 1e-9);
  }
  ck_assert_double_eq_tol(md_cell(md, "## Loss", "8", 2), 3.5, 1e-9);
  ck_assert_double_eq_tol(md_cell(md, "## Memory", "rank 1", 1), 130.0, 0.05);
  ck_assert_double_eq_tol(md_cell(md, "## Memory", "rank 0", 2), 200.0, 0.05);
  ck_assert_msg(strstr(md, "| failure | 1 | rank 1 <pid 9> was killed by signal 9<br>last "
                           "line |") != NULL, "%s", md);
  ck_assert_msg(strstr(md, "done (exit 0); step 8 of 8; 10 records of steps (2 trained again)") !=
                    NULL, "%s", md);
  free(md);
  mr_run_close(&run);
}
END_TEST

/* Every chart has its points; text from the records is escaped. */
START_TEST(test_report_html_charts_hold_points) {
  char dir[64];
  mr_t_tmpdir(dir, sizeof dir);
  make_run(dir, dead_pid(), 1);
  struct mr_run run;
  ck_assert_int_eq(mr_run_read(dir, &run), 0);
  struct mr_text t = {0};
  mr_report_html(&run, &t);
  char *html = mr_text_take(&t);
  static const char *const ids[] = {"loss", "throughput", "mfu", "step_time", "memory"};
  static const int points[] = {8 + 2, 8, 8, 3 * 8, 2 * WORLD};
  for (int i = 0; i < 5; i++) {
    char want[64];
    snprintf(want, sizeof want, "id=\"plot-%s\"", ids[i]);
    const char *svg = strstr(html, want);
    ck_assert_msg(svg != NULL, "no %s chart", ids[i]);
    const char *n = strstr(svg, "data-points=\"");
    ck_assert_int_eq(atoi(n + 13), points[i]);
  }
  ck_assert_ptr_nonnull(strstr(html, "rank 1 &lt;pid 9&gt; was killed"));
  ck_assert_ptr_null(strstr(html, "<pid"));
  ck_assert_ptr_null(strstr(html, "<script"));
  free(html);
  mr_run_close(&run);
}
END_TEST

static Suite *report_suite(void) {
  Suite *s = suite_create("report");
  TCase *tc = mr_t_tcase("report");
  tcase_add_test(tc, test_report_reads_each_step_once_with_its_plan);
  tcase_add_test(tc, test_report_running_and_vanished_runs);
  tcase_add_test(tc, test_report_bad_input_named);
  tcase_add_test(tc, test_report_md_numbers_are_the_metrics);
  tcase_add_test(tc, test_report_html_charts_hold_points);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(report_suite)
