/* check_main.h - the main() every Check suite binary shares.
 *
 * Each tests/test_<module>.c defines `Suite *<name>_suite(void)` and ends
 * with MR_TEST_MAIN(<name>_suite).  Results are printed as TAP on stdout so
 * meson counts every test case; scripts/test totals them.  A suite that
 * cannot run here (no GPU) exits 77, which meson reports as skipped. */
#ifndef MR_CHECK_MAIN_H
#define MR_CHECK_MAIN_H

#include <check.h>
#include <stdlib.h>

#define MR_TEST_MAIN(suite_fn)                                               \
  int main(void) {                                                           \
    SRunner *sr = srunner_create(suite_fn());                                \
    srunner_set_tap(sr, "-");                                                \
    srunner_run_all(sr, CK_SILENT);                                          \
    int failed = srunner_ntests_failed(sr);                                  \
    srunner_free(sr);                                                        \
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;                        \
  }

#endif
