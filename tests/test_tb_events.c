/* test_tb_events.c - TensorBoard event files: the CRC32C of TFRecord
 * framing against its published check value, records read back whole,
 * each step once, a failed write reported and not fatal.  (TensorBoard's
 * own reader checks the files in tests/data/check_tensorboard.py.) */
#include <check.h>
#include <glob.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check_main.h"
#include "common/error.h"
#include "launcher/tb_events.h"
#include "testutil.h"
#include "tfevent.pb-c.h"

/* CRC32C("123456789") is 0xe3069283 (RFC 3720, B.4's check value); masked
 * as TFRecord does: rotate right 15, add 0xa282ead8. */
START_TEST(test_tb_crc32c_check_value) {
  uint32_t c = 0xe3069283u;
  ck_assert_uint_eq(mr_tb_masked_crc32c("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
  ck_assert_uint_eq(mr_tb_masked_crc32c("", 0), 0xa282ead8u); /* the empty CRC is 0 */
}
END_TEST

static uint64_t le(const uint8_t *p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; i--)
    v = v << 8 | p[i];
  return v;
}

/* The file's events, each record's CRCs checked; returns their count. */
static int read_events(const char *path, Meshrun__Tb__Event **ev, int max) {
  FILE *f = fopen(path, "rb");
  ck_assert_ptr_nonnull(f);
  uint8_t *b = malloc(1 << 16);
  size_t n = fread(b, 1, 1 << 16, f);
  fclose(f);
  int k = 0;
  for (size_t i = 0; i < n; k++) {
    ck_assert_int_lt(k, max);
    ck_assert_uint_ge(n - i, 16);
    uint64_t len = le(b + i, 8);
    ck_assert_uint_eq(le(b + i + 8, 4), mr_tb_masked_crc32c(b + i, 8));
    ck_assert_uint_ge(n - i - 16, len);
    ck_assert_uint_eq(le(b + i + 12 + len, 4), mr_tb_masked_crc32c(b + i + 12, len));
    ev[k] = meshrun__tb__event__unpack(NULL, len, b + i + 12);
    ck_assert_ptr_nonnull(ev[k]);
    i += 16 + len;
  }
  free(b);
  return k;
}

START_TEST(test_tb_records_read_back_each_step_once) {
  char dir[64], pattern[100];
  mr_t_tmpdir(dir, sizeof dir);
  struct mr_tb_writer *w;
  ck_assert_int_eq(mr_tb_open(dir, 2, &w), 0); /* steps 1 and 2 written before */
  const char *tags[] = {"train/loss", "perf/mfu"};
  for (int step = 1; step <= 5; step++) {
    double v[] = {10.0 - step, 0.0};
    ck_assert_int_eq(mr_tb_scalars(w, step, 1000.0 + step, tags, v, 2), 0);
  }
  double again[] = {99.0, 99.0}; /* a restarted group's step 4 again */
  ck_assert_int_eq(mr_tb_scalars(w, 4, 2000.0, tags, again, 2), 0);
  mr_tb_close(w);
  snprintf(pattern, sizeof pattern, "%s/events.out.tfevents.*.meshrun", dir);
  glob_t g;
  ck_assert_int_eq(glob(pattern, 0, NULL, &g), 0);
  ck_assert_uint_eq(g.gl_pathc, 1);
  Meshrun__Tb__Event *ev[16];
  int n = read_events(g.gl_pathv[0], ev, 16);
  globfree(&g);
  ck_assert_int_eq(n, 4); /* the version, steps 3..5 */
  ck_assert_int_eq(ev[0]->what_case, MESHRUN__TB__EVENT__WHAT_FILE_VERSION);
  ck_assert_str_eq(ev[0]->file_version, "brain.Event:2");
  for (int i = 1; i < n; i++) {
    ck_assert_int_eq(ev[i]->step, i + 2);
    ck_assert(ev[i]->wall_time == 1000.0 + (double)(i + 2));
    ck_assert_int_eq(ev[i]->what_case, MESHRUN__TB__EVENT__WHAT_SUMMARY);
    ck_assert_uint_eq(ev[i]->summary->n_value, 2);
    Meshrun__Tb__Summary__Value *loss = ev[i]->summary->value[0], *mfu = ev[i]->summary->value[1];
    ck_assert_str_eq(loss->tag, "train/loss");
    ck_assert(loss->simple_value == (float)(10.0 - (i + 2)));
    /* a zero is written, not left out as proto3 would a plain float */
    ck_assert_int_eq(mfu->value_case, MESHRUN__TB__SUMMARY__VALUE__VALUE_SIMPLE_VALUE);
    ck_assert(mfu->simple_value == 0.0f);
  }
  for (int i = 0; i < n; i++)
    meshrun__tb__event__free_unpacked(ev[i], NULL);
}
END_TEST

/* The steps an earlier launch wrote, from the run's metrics, once the
 * folder holds an event file; none without one. */
START_TEST(test_tb_written_is_the_metrics_last_step) {
  char dir[64], m[100], e[120];
  mr_t_tmpdir(dir, sizeof dir);
  snprintf(m, sizeof m, "%s/metrics.jsonl", dir);
  FILE *f = fopen(m, "w");
  fputs("{\"step\": 1, \"loss\": 5}\n{\"step\": 7, \"loss\": 4}\n{\"step\": 5, \"loss\": 4}\n",
        f);
  fclose(f);
  ck_assert_int_eq(mr_tb_written(dir, m), 0);
  snprintf(e, sizeof e, "%s/events.out.tfevents.1.h.2.meshrun", dir);
  fclose(fopen(e, "w"));
  ck_assert_int_eq(mr_tb_written(dir, m), 7);
}
END_TEST

/* A folder that cannot take the file: an error naming it. */
START_TEST(test_tb_unwritable_folder_named) {
  struct mr_tb_writer *w = NULL;
  int rc = mr_tb_open("/proc/self", 0, &w);
  ck_assert_int_lt(rc, 0);
  ck_assert_ptr_null(w);
  ck_assert_msg(strstr(mr_error_message(), "TensorBoard event file /proc/self/events.out") !=
                    NULL, "%s", mr_error_message());
  ck_assert_int_eq(mr_tb_scalars(NULL, 1, 0, NULL, NULL, 0), 0); /* no writer: nothing */
}
END_TEST

static Suite *tb_suite(void) {
  Suite *s = suite_create("tb_events");
  TCase *tc = tcase_create("tb_events");
  tcase_add_test(tc, test_tb_crc32c_check_value);
  tcase_add_test(tc, test_tb_records_read_back_each_step_once);
  tcase_add_test(tc, test_tb_written_is_the_metrics_last_step);
  tcase_add_test(tc, test_tb_unwritable_folder_named);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(tb_suite)
