/* test_trace.c - a rank's timeline and the merged file: the clock offset
 * from probe round trips against a clock skewed by a known amount, the
 * traced steps, the file read back (slices, async operations, the
 * bound on its size), a folder that cannot be made, and the merge that
 * leaves out what is not a rank's trace.  (Whole runs, traced on every
 * rank, are checked in tests/data/check_trace.py.) */
#include <cjson/cJSON.h>
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check_main.h"
#include "common/error.h"
#include "common/job.h"
#include "launcher/trace_merge.h"
#include "testutil.h"
#include "worker/comm/comm.h"
#include "worker/trace.h"

/* A peer whose clock runs `skew` ns ahead, answering after a one-way delay
 * out and back that differ: the offset is found within half the shortest
 * round trip, from the sample that had it. */
START_TEST(test_trace_clock_offset_within_half_the_best_round_trip) {
  const int64_t skew = 1000000000000LL; /* 1000 s */
  const int64_t out[] = {900000, 40000, 7000, 250000, 12000};
  const int64_t back[] = {100000, 300000, 3000, 5000, 12000};
  struct mr_clock_sample s[5];
  int64_t now = 5000000;
  for (int i = 0; i < 5; i++) {
    s[i].t0 = now;
    s[i].peer = now + out[i] + skew;
    s[i].t1 = now + out[i] + back[i];
    now += 1000000;
  }
  int64_t off;
  uint64_t err;
  ck_assert_int_eq(mr_clock_offset(s, 5, &off, &err), 0);
  ck_assert_uint_eq(err, 5000); /* sample 2: 10 us round trip */
  ck_assert_int_le(llabs(off - skew), (long long)err);
  ck_assert_int_eq(off - skew, (7000 - 3000) / 2); /* the asymmetry is the error */
  s[0].t1 = s[0].t0 - 1; /* an answer to another probe: unusable */
  ck_assert_int_eq(mr_clock_offset(s, 1, &off, &err), -1);
}
END_TEST

START_TEST(test_trace_steps_default_after_warm_up_and_bounded) {
  int64_t a, b;
  ck_assert_int_eq(mr_trace_steps_for(0, 0, 0, 100, &a, &b), 1);
  ck_assert_int_eq(a, 3);
  ck_assert_int_eq(b, 2 + MR_TRACE_DEFAULT_STEPS);
  ck_assert_int_eq(mr_trace_steps_for(0, 0, 40, 100, &a, &b), 1); /* resumed after 40 */
  ck_assert_int_eq(a, 43);
  ck_assert_int_eq(mr_trace_steps_for(0, 0, 0, 2, &a, &b), 1); /* a short run: all of it */
  ck_assert_int_eq(a, 1);
  ck_assert_int_eq(b, 2);
  ck_assert_int_eq(mr_trace_steps_for(5, 9, 6, 20, &a, &b), 1); /* resumed inside: the rest */
  ck_assert_int_eq(a, 7);
  ck_assert_int_eq(b, 9);
  ck_assert_int_eq(mr_trace_steps_for(5, 9, 9, 20, &a, &b), 0); /* resumed after it */
  ck_assert_int_eq(mr_trace_steps_for(0, 0, 20, 20, &a, &b), 0);
  ck_assert_int_eq(mr_job_steps_range("--trace-steps", "4:6", 10, &a, &b), 0);
  ck_assert_int_eq(a * 10 + b, 46);
  ck_assert_int_eq(mr_job_steps_range("--trace-steps", "7", 10, &a, &b), 0);
  ck_assert_int_eq(a * 10 + b, 77);
  static const char *const bad[] = {"0:2", "5:4", "9:11", "x", "3:", "3:4:5", ""};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    ck_assert_int_eq(mr_job_steps_range("--trace-steps", bad[i], 10, &a, &b), MR_EINVAL);
    ck_assert_msg(strncmp(mr_error_message(), "--trace-steps: ", 15) == 0, "%s",
                  mr_error_message());
  }
}
END_TEST

/* The stand-in operations the comm tracer is told about. */
static struct mr_comm_group test_group = {.label = "data{0,1}"};
static struct mr_comm_req req_a, req_b;

static struct mr_trace *open_trace(const char *dir, int rank, int max_mb) {
  struct mr_trace_opts o = {.dir = dir, .rank = rank, .world_size = 2, .first = 2, .last = 3,
                            .clock_offset_ns = 5000, .clock_error_ns = 10, .host = "h\"ost",
                            .max_mb = max_mb};
  return mr_trace_new(&o);
}

static cJSON *read_json(const char *path) {
  char *text = mr_t_slurp(path);
  ck_assert_ptr_nonnull(text);
  cJSON *j = cJSON_Parse(text);
  ck_assert_msg(j != NULL, "%s is not JSON", path);
  free(text);
  return j;
}

/* Events of phase ph named name (NULL: any) in a trace. */
static int count(cJSON *trace, const char *ph, const char *name) {
  int n = 0;
  cJSON *e;
  cJSON_ArrayForEach(e, cJSON_GetObjectItem(trace, "traceEvents")) {
    const char *p = cJSON_GetObjectItem(e, "ph")->valuestring;
    cJSON *nm = cJSON_GetObjectItem(e, "name");
    if (strcmp(p, ph) == 0 && (name == NULL || (nm && strcmp(nm->valuestring, name) == 0)))
      n++;
  }
  return n;
}

/* Steps 1..4 with steps 2..3 chosen: what happened in them, and only
 * that, on the coordinator's clock, the operations begun and ended. */
START_TEST(test_trace_file_holds_the_chosen_steps) {
  char dir[256], path[300];
  mr_t_tmpdir(dir, sizeof dir);
  struct mr_trace *t = open_trace(dir, 1, 64);
  ck_assert_ptr_nonnull(t);
  for (int64_t s = 1; s <= 4; s++) {
    mr_trace_step_begin(t, s);
    ck_assert_int_eq(mr_trace_recording(t), s == 2 || s == 3);
    int64_t t0 = mr_trace_now();
    mr_trace_slice(t, MR_TRACE_COMPUTE, "forward", "matmul", t0, t0 + 2000, "\"micro\": 0");
    /* an operation through the dispatchers' tracer, as a backend sees it */
    if (mr__comm_tracer != NULL) {
      mr__comm_tracer->start(mr__comm_tracer->ctx, &test_group, "AllReduce", 4096, -1,
                             (uint64_t)s, &req_a, mr_clock_ns());
      mr__comm_tracer->start(mr__comm_tracer->ctx, &test_group, "AllGather", 64, -1,
                             (uint64_t)s + 100, &req_b, mr_clock_ns());
      mr__comm_tracer->end(mr__comm_tracer->ctx, &req_a, 0);
      mr__comm_tracer->end(mr__comm_tracer->ctx, &req_b, 0);
    }
    mr_trace_step_end(t, s);
    snprintf(path, sizeof path, "%s/rank-1.json", dir);
    ck_assert_int_eq(access(path, F_OK) == 0, s >= 3); /* written as the range ends */
  }
  ck_assert_ptr_null(mr__comm_tracer);
  mr_trace_free(t);
  cJSON *j = read_json(path);
  ck_assert_int_eq(count(j, "X", "matmul"), 2);
  ck_assert_int_eq(count(j, "X", "step 2") + count(j, "X", "step 3"), 2);
  ck_assert_int_eq(count(j, "X", "step 1") + count(j, "X", "step 4"), 0);
  ck_assert_int_eq(count(j, "b", "AllReduce"), 2);
  ck_assert_int_eq(count(j, "b", "AllGather"), 2);
  ck_assert_int_eq(count(j, "e", NULL), 4);
  cJSON *e;
  cJSON_ArrayForEach(e, cJSON_GetObjectItem(j, "traceEvents")) {
    ck_assert_int_eq(cJSON_GetObjectItem(e, "pid")->valueint, 1);
    const char *ph = cJSON_GetObjectItem(e, "ph")->valuestring;
    if (strcmp(ph, "b") == 0) {
      cJSON *a = cJSON_GetObjectItem(e, "args");
      ck_assert_str_eq(cJSON_GetObjectItem(a, "group")->valuestring, "data{0,1}");
      int64_t seq = (int64_t)cJSON_GetObjectItem(a, "seq")->valuedouble;
      ck_assert(seq == 2 || seq == 3 || seq == 102 || seq == 103);
    }
    if (strcmp(ph, "X") == 0 && strcmp(cJSON_GetObjectItem(e, "name")->valuestring, "matmul") == 0)
      ck_assert_double_eq_tol(cJSON_GetObjectItem(e, "dur")->valuedouble, 2.0, 1e-9);
    if (strcmp(ph, "M") == 0 && strcmp(cJSON_GetObjectItem(e, "name")->valuestring,
                                       "process_name") == 0) /* the host made safe */
      ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(e, "args"), "name")->valuestring,
                       "rank 1 on h_ost");
  }
  cJSON *od = cJSON_GetObjectItem(j, "otherData");
  ck_assert_int_eq(cJSON_GetObjectItem(od, "clock_offset_ns")->valueint, 5000);
  ck_assert_int_eq(cJSON_GetObjectItem(od, "dropped_events")->valueint, 0);
  cJSON_Delete(j);
}
END_TEST

/* A trace with no room: kept to its bound, the rest counted; a checkpoint
 * write begun in the range and ended after it is waited for. */
START_TEST(test_trace_bounded_and_waits_for_a_held_write) {
  char dir[256], path[300];
  mr_t_tmpdir(dir, sizeof dir);
  struct mr_trace *t = open_trace(dir, 0, 1);
  mr_trace_step_begin(t, 2);
  int64_t t0 = mr_trace_now();
  for (int i = 0; i < 20000; i++) /* ~150 bytes each: 3 MB against 1 MiB */
    mr_trace_slice(t, MR_TRACE_COMPUTE, "forward", "matmul", t0, t0 + 1, "");
  mr_trace_step_end(t, 2);
  mr_trace_step_begin(t, 3);
  ck_assert_int_eq(mr_trace_hold(t), 1);
  mr_trace_step_end(t, 3);
  snprintf(path, sizeof path, "%s/rank-0.json", dir);
  ck_assert_int_ne(access(path, F_OK), 0); /* waiting for the write */
  mr_trace_slice(t, MR_TRACE_CHECKPOINT, "checkpoint", "checkpoint write", t0, t0 + 5, "");
  mr_trace_release(t);
  ck_assert_int_eq(access(path, F_OK), 0);
  ck_assert_int_eq(mr_trace_hold(t), 0); /* nothing recorded now */
  mr_trace_free(t);
  char *text = mr_t_slurp(path);
  ck_assert_int_lt(strlen(text), (1 << 20) + 4096);
  free(text);
  cJSON *j = read_json(path);
  int kept = count(j, "X", "matmul");
  int dropped = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "otherData"),
                                    "dropped_events")->valueint;
  ck_assert_int_gt(kept, 1000);
  ck_assert_int_eq(kept + dropped, 20000 + 3); /* and the two steps, the write */
  cJSON_Delete(j);
}
END_TEST

START_TEST(test_trace_unmakeable_folder_gives_no_trace) {
  struct mr_trace *t = open_trace("/proc/self/no-trace", 0, 1);
  ck_assert_ptr_null(t);
  mr_trace_step_begin(t, 2); /* NULL: every call a no-op */
  mr_trace_slice(t, MR_TRACE_COMPUTE, "x", "y", 0, 1, "");
  mr_trace_step_end(t, 2);
  mr_trace_free(t);
}
END_TEST

/* Two ranks' files and one that is not a trace: the merge holds the two,
 * every event once, and says which it left out. */
START_TEST(test_trace_merge_the_ranks_files) {
  char dir[256], path[300];
  mr_t_tmpdir(dir, sizeof dir);
  for (int r = 0; r < 2; r++) {
    struct mr_trace *t = open_trace(dir, r, 8);
    for (int64_t s = 2; s <= 3; s++) {
      mr_trace_step_begin(t, s);
      int64_t t0 = mr_trace_now();
      mr_trace_slice(t, MR_TRACE_COMPUTE, "forward", "matmul", t0, t0 + 10, "");
      mr_trace_step_end(t, s);
    }
    mr_trace_free(t);
  }
  snprintf(path, sizeof path, "%s/rank-7.json", dir);
  FILE *f = fopen(path, "w");
  fputs("{\"something\": \"else\"}\n", f);
  fclose(f);
  ck_assert_int_eq(mr_trace_merge(dir), 2);
  snprintf(path, sizeof path, "%s/trace.json", dir);
  cJSON *j = read_json(path);
  ck_assert_int_eq(count(j, "X", "matmul"), 4);
  ck_assert_int_eq(count(j, "M", "process_name"), 2);
  ck_assert_int_eq(cJSON_GetArraySize(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "otherData"),
                                                          "ranks")), 2);
  cJSON_Delete(j);
  mr_trace_clear(dir);
  ck_assert_int_ne(access(path, F_OK), 0);
  ck_assert_int_eq(mr_trace_merge(dir), 0); /* nothing left to merge */
}
END_TEST

static Suite *trace_suite(void) {
  Suite *s = suite_create("trace");
  TCase *tc = tcase_create("trace");
  tcase_add_test(tc, test_trace_clock_offset_within_half_the_best_round_trip);
  tcase_add_test(tc, test_trace_steps_default_after_warm_up_and_bounded);
  tcase_add_test(tc, test_trace_file_holds_the_chosen_steps);
  tcase_add_test(tc, test_trace_bounded_and_waits_for_a_held_write);
  tcase_add_test(tc, test_trace_unmakeable_folder_gives_no_trace);
  tcase_add_test(tc, test_trace_merge_the_ranks_files);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(trace_suite)
