/* test_prepare_data.c - the prepare-data command run in-process on text
 * written here: the token files hold exactly the input bytes, split where
 * the documented rule (worked out here by scanning lines) says, and bad
 * flags exit 2 with a message. */
#include <check.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check_main.h"
#include "common/tokens.h"
#include "launcher/prepare_data.h"

static char dir[] = "/tmp/mr-test-prep-XXXXXX";

static void setup(void) { ck_assert_ptr_nonnull(mkdtemp(dir)); }

static void teardown(void) {
  char cmd[256];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  ck_assert_int_eq(system(cmd), 0);
  strcpy(dir, "/tmp/mr-test-prep-XXXXXX");
}

static char *path_of(const char *name) {
  static char p[4][512];
  static int k;
  k = (k + 1) % 4;
  snprintf(p[k], sizeof p[k], "%s/%s", dir, name);
  return p[k];
}

static void write_text(const char *path, const char *s) {
  FILE *f = fopen(path, "wb");
  ck_assert_ptr_nonnull(f);
  fputs(s, f);
  fclose(f);
}

static int run(int n, const char **args) {
  char *argv[16];
  argv[0] = "prepare-data";
  for (int i = 0; i < n; i++)
    argv[i + 1] = (char *)args[i];
  /* the command's summary lines would mix into the TAP stream */
  fflush(stdout);
  int saved = dup(STDOUT_FILENO), null = open("/dev/null", O_WRONLY);
  ck_assert(saved >= 0 && null >= 0 && dup2(null, STDOUT_FILENO) >= 0);
  int rc = mr_cmd_prepare_data(n + 1, argv);
  fflush(stdout);
  ck_assert(dup2(saved, STDOUT_FILENO) >= 0);
  close(saved), close(null);
  return rc;
}

/* The cut by its definition: the first line start at or after
 * floor((1 - f) n), else that byte. */
static int64_t reference_cut(const char *s, double f) {
  int64_t n = (int64_t)strlen(s);
  int64_t nominal = (int64_t)((1.0 - f) * (double)n);
  int64_t best = -1;
  for (int64_t i = n - 1; i >= nominal; i--) /* scan from the end */
    if (i == 0 || s[i - 1] == '\n')
      best = i;
  return best >= 0 ? best : nominal;
}

START_TEST(test_prepare_data_cut_rule) {
  const char *texts[] = {"abc\ndef\nghi\njkl\n", "no newline at all",
                         "\n\n\n\n\n\n\n\n\n\n", "one\ntwo", "x"};
  const double fr[] = {0.05, 0.1, 0.25, 0.5, 0.9};
  for (size_t t = 0; t < 5; t++)
    for (size_t k = 0; k < 5; k++) {
      const char *s = texts[t];
      ck_assert_int_eq(mr_prepare_data_cut((const uint8_t *)s,
                                           (int64_t)strlen(s), fr[k]),
                       reference_cut(s, fr[k]));
    }
  ck_assert_int_eq(mr_prepare_data_cut((const uint8_t *)"abc", 3, 0.0), 3);
}
END_TEST

static void expect_tokens(const char *path, const char *bytes, int64_t n) {
  struct mr_tokens t;
  ck_assert_int_eq(mr_tokens_open(&t, path, 256), 0);
  ck_assert_int_eq(t.format, MR_TOKENS_LLMC_U16);
  ck_assert_int_eq(t.n_tokens, n);
  for (int64_t i = 0; i < n; i++)
    ck_assert_uint_eq(mr_tokens_at(&t, i), (uint8_t)bytes[i]);
  mr_tokens_close(&t);
}

START_TEST(test_prepare_data_split_and_concatenation) {
  /* two files, UTF-8 included; 20 lines of 11 bytes each */
  char a[256] = "", b[256] = "";
  for (int i = 0; i < 10; i++)
    snprintf(a + strlen(a), sizeof a - strlen(a), "line %02d \xc3\xa9\n", i);
  for (int i = 10; i < 20; i++)
    snprintf(b + strlen(b), sizeof b - strlen(b), "line %02d \xc3\xa9\n", i);
  write_text(path_of("a.txt"), a);
  write_text(path_of("b.txt"), b);
  char all[512];
  snprintf(all, sizeof all, "%s%s", a, b);
  const char *args[] = {path_of("a.txt"), path_of("b.txt"), "--out",
                        path_of("d.bin"), "--val-fraction", "0.12"};
  ck_assert_int_eq(run(6, args), 0);
  int64_t n = (int64_t)strlen(all), cut = reference_cut(all, 0.12);
  ck_assert_int_eq(n, 220);
  ck_assert_int_eq(cut, 198); /* floor(0.88 * 220) = 193 -> line 18 at 198 */
  expect_tokens(path_of("d.bin"), all, cut);
  expect_tokens(path_of("d-val.bin"), all + cut, n - cut); /* default name */
}
END_TEST

START_TEST(test_prepare_data_val_out_and_no_val) {
  write_text(path_of("t.txt"), "alpha\nbeta\ngamma\ndelta\n");
  const char *args[] = {path_of("t.txt"), "--val-out", path_of("v.bin"),
                        "--out", path_of("tr.bin"), "--val-fraction", "0.3"};
  ck_assert_int_eq(run(7, args), 0);
  const char *s = "alpha\nbeta\ngamma\ndelta\n";
  int64_t cut = reference_cut(s, 0.3);
  expect_tokens(path_of("tr.bin"), s, cut);
  expect_tokens(path_of("v.bin"), s + cut, (int64_t)strlen(s) - cut);
  const char *args0[] = {path_of("t.txt"), "--out", path_of("all.bin"),
                         "--val-fraction", "0"};
  ck_assert_int_eq(run(5, args0), 0);
  expect_tokens(path_of("all.bin"), s, (int64_t)strlen(s));
  ck_assert_int_ne(access(path_of("all-val.bin"), F_OK), 0);
}
END_TEST

START_TEST(test_prepare_data_flag_errors_exit_2) {
  write_text(path_of("t.txt"), "hello\nworld\n");
  const char *no_out[] = {path_of("t.txt")};
  ck_assert_int_eq(run(1, no_out), 2);
  const char *no_in[] = {"--out", path_of("x.bin")};
  ck_assert_int_eq(run(2, no_in), 2);
  const char *bad_frac[] = {path_of("t.txt"), "--out", path_of("x.bin"),
                            "--val-fraction", "1.5"};
  ck_assert_int_eq(run(5, bad_frac), 2);
  const char *junk_frac[] = {path_of("t.txt"), "--out", path_of("x.bin"),
                             "--val-fraction", "0.1x"};
  ck_assert_int_eq(run(5, junk_frac), 2);
  const char *unknown[] = {path_of("t.txt"), "--out", path_of("x.bin"),
                           "--shuffle"};
  ck_assert_int_eq(run(4, unknown), 2);
  const char *dangling[] = {path_of("t.txt"), "--out"};
  ck_assert_int_eq(run(2, dangling), 2);
  ck_assert_int_ne(access(path_of("x.bin"), F_OK), 0);
}
END_TEST

START_TEST(test_prepare_data_missing_input_exits_1) {
  const char *args[] = {path_of("missing.txt"), "--out", path_of("x.bin")};
  ck_assert_int_eq(run(3, args), 1);
  ck_assert_int_ne(access(path_of("x.bin"), F_OK), 0);
  /* too little text for a validation split */
  write_text(path_of("tiny.txt"), "a"); /* the cut lands at 0 */
  const char *tiny[] = {path_of("tiny.txt"), "--out", path_of("y.bin")};
  ck_assert_int_eq(run(3, tiny), 1);
}
END_TEST

static Suite *prepare_data_suite(void) {
  Suite *s = suite_create("prepare_data");
  TCase *tc = tcase_create("prepare_data");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, test_prepare_data_cut_rule);
  tcase_add_test(tc, test_prepare_data_split_and_concatenation);
  tcase_add_test(tc, test_prepare_data_val_out_and_no_val);
  tcase_add_test(tc, test_prepare_data_flag_errors_exit_2);
  tcase_add_test(tc, test_prepare_data_missing_input_exits_1);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(prepare_data_suite)
