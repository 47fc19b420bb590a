/* test_cli.c - the command line's value parsers against values worked by
 * hand: byte sizes as transformers writes max_shard_size. */
#include <check.h>
#include <stdint.h>

#include "check_main.h"
#include "common/error.h"
#include "launcher/cli.h"

START_TEST(test_cli_bytes) {
  static const struct {
    const char *text;
    uint64_t want;
  } ok[] = {{"5GB", 5000000000ull},    {"500MB", 500000000ull}, {"100KB", 100000ull},
            {"2GiB", 2147483648ull},   {"512MiB", 536870912ull}, {"64KiB", 65536ull},
            {"1000000", 1000000ull},   {"7B", 7ull},             {"1.5GB", 1500000000ull},
            {"3gb", 3000000000ull},    {"1TB", 1000000000000ull}};
  for (size_t i = 0; i < sizeof ok / sizeof *ok; i++) {
    uint64_t got = 0;
    ck_assert_msg(mr_parse_bytes(ok[i].text, &got) == 0, "%s refused", ok[i].text);
    ck_assert_msg(got == ok[i].want, "%s: got %llu", ok[i].text, (unsigned long long)got);
  }
  static const char *const bad[] = {"", "GB", "5 GB", "5GBs", "-1MB", "5PB", "1e30", "nan"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    uint64_t got = 42;
    ck_assert_msg(mr_parse_bytes(bad[i], &got) == MR_EINVAL, "\"%s\" accepted", bad[i]);
    ck_assert_int_eq(got, 42);
  }
}
END_TEST

static Suite *cli_suite(void) {
  Suite *s = suite_create("cli");
  TCase *tc = tcase_create("cli");
  tcase_add_test(tc, test_cli_bytes);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(cli_suite)
