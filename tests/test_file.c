/* test_file.c - mr_file_write_text: the text as given (or with one final
 * newline), a replace that keeps what was there when it fails and leaves
 * no temporary behind, errors naming the file; a failure's message bound
 * to its code. */
#include <check.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "check_main.h"
#include "common/error.h"
#include "common/file.h"
#include "testutil.h"

static char *slurp(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f == NULL)
    return NULL;
  static char buf[4096];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  return buf;
}

/* files in dir other than . and .. */
static int entries(const char *dir) {
  DIR *d = opendir(dir);
  int n = 0;
  for (struct dirent *e; d != NULL && (e = readdir(d)) != NULL;)
    n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
  if (d != NULL)
    closedir(d);
  return n;
}

/* The text byte for byte, or with one final newline under
 * MR_FILE_NEWLINE, in every mode; the atomic modes leave no temporary. */
START_TEST(test_file_text_as_given_or_with_one_final_newline) {
  char dir[64], path[128];
  mr_t_tmpdir(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/a.json", dir);
  const int modes[] = {0, MR_FILE_ATOMIC, MR_FILE_DURABLE, MR_FILE_ATOMIC | MR_FILE_DURABLE};
  for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
    ck_assert_int_eq(mr_file_write_text(path, "{\"a\": 1}", modes[i]), 0);
    ck_assert_str_eq(slurp(path), "{\"a\": 1}");
    ck_assert_int_eq(mr_file_write_text(path, "{\"a\": 1}", modes[i] | MR_FILE_NEWLINE), 0);
    ck_assert_str_eq(slurp(path), "{\"a\": 1}\n");
    ck_assert_int_eq(mr_file_write_text(path, "x\ny\n", modes[i] | MR_FILE_NEWLINE), 0);
    ck_assert_str_eq(slurp(path), "x\ny\n");
    ck_assert_int_eq(mr_file_write_text(path, "", modes[i] | MR_FILE_NEWLINE), 0);
    ck_assert_str_eq(slurp(path), "\n");
    ck_assert_int_eq(entries(dir), 1); /* no temporary left */
  }
}
END_TEST

/* Failures name the file and leave nothing half done: a replace whose
 * rename cannot be made (the name is a folder that is not empty) keeps
 * what was there and removes its temporary; a write that runs out of space
 * (/dev/full) is an error, not a short file. */
START_TEST(test_file_failures_name_the_file_and_leave_no_temporary) {
  char dir[64], sub[128], inner[160];
  mr_t_tmpdir(dir, sizeof dir);
  snprintf(sub, sizeof sub, "%s/spec.json", dir);
  ck_assert_int_eq(mkdir(sub, 0700), 0);
  snprintf(inner, sizeof inner, "%s/keep", sub);
  ck_assert_int_eq(mr_file_write_text(inner, "kept", 0), 0);
  ck_assert_int_eq(mr_file_write_text(sub, "new", MR_FILE_ATOMIC | MR_FILE_DURABLE), MR_EIO);
  ck_assert_msg(strstr(mr_error_message(), sub) != NULL, "%s", mr_error_message());
  ck_assert_str_eq(slurp(inner), "kept");
  ck_assert_int_eq(entries(dir), 1); /* the folder, and no temporary */
  ck_assert_int_eq(mr_file_write_text("/dev/full", "x", 0), MR_EIO);
  ck_assert_msg(strstr(mr_error_message(), "/dev/full") != NULL, "%s", mr_error_message());
  char missing[160];
  snprintf(missing, sizeof missing, "%s/no/such/spec.json", dir);
  ck_assert_int_eq(mr_file_write_text(missing, "new", MR_FILE_ATOMIC), MR_EIO);
  ck_assert_msg(strstr(mr_error_message(), "no/such/spec.json") != NULL, "%s",
                mr_error_message());
}
END_TEST

/* A failure's message is the one recorded with its code: a bare code
 * after an earlier failure (or a warning) of another code reads as that
 * code's description, not as the earlier message. */
START_TEST(test_error_message_bound_to_its_code) {
  mr_error_set(MR_ENOENT, "warning: cache.json: no such file");
  ck_assert_str_eq(mr_error_of(MR_ENOENT), "warning: cache.json: no such file");
  ck_assert_str_eq(mr_error_of(MR_ENOMEM), mr_strerror(MR_ENOMEM));
  ck_assert_str_eq(mr_error_of(MR_ENOMEM), "out of memory");
  mr_error_set(MR_EJOB, "job.json: train.steps: expected a positive integer");
  ck_assert_str_eq(mr_error_of(MR_EJOB), "job.json: train.steps: expected a positive integer");
  mr_error_clear();
  ck_assert_str_eq(mr_error_of(MR_EJOB), "invalid job file");
}
END_TEST

static Suite *file_suite(void) {
  Suite *s = suite_create("file");
  TCase *tc = tcase_create("file");
  tcase_add_test(tc, test_file_text_as_given_or_with_one_final_newline);
  tcase_add_test(tc, test_file_failures_name_the_file_and_leave_no_temporary);
  tcase_add_test(tc, test_error_message_bound_to_its_code);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(file_suite)
