/* test_mesh.c - meshes, placements, DistAttrs and local shards. */
#include <check.h>
#include <string.h>

#include "common/error.h"
#include "compiler/mesh.h"
#include "tests/check_main.h"

START_TEST(test_mesh_parse_and_format) {
  struct mr_mesh m;
  ck_assert_int_eq(mr_mesh_parse("data=2,model=4", &m), 0);
  ck_assert_int_eq(m.ndim, 2);
  ck_assert_int_eq(mr_mesh_size(&m), 8);
  ck_assert_int_eq(mr_mesh_dim(&m, "model"), 1);
  ck_assert_int_eq(mr_mesh_dim(&m, "pipe"), -1);
  int c[2] = {1, 2};
  ck_assert_int_eq(mr_mesh_rank(&m, c), 6); /* row-major: 1*4+2 */
  mr_mesh_coord(&m, 5, c);
  ck_assert_int_eq(c[0], 1);
  ck_assert_int_eq(c[1], 1);
  char buf[64];
  mr_mesh_format(&m, buf, sizeof buf);
  ck_assert_str_eq(buf, "data=2,model=4");
}
END_TEST

START_TEST(test_mesh_parse_errors_name_the_entry) {
  struct mr_mesh m;
  const char *bad[] = {"", "data", "data=0", "data=2,", "=2", "a=2,a=3",
                       "a=x", "a=1,b=1,c=1,d=1,e=1", "a=2;b=2"};
  for (size_t i = 0; i < MR_ARRAY_LEN(bad); i++) {
    ck_assert_int_eq(mr_mesh_parse(bad[i], &m), MR_EINVAL);
    ck_assert_ptr_nonnull(strstr(mr_error_message(), "mesh"));
  }
}
END_TEST

START_TEST(test_mesh_slice_is_a_pipeline_stage) {
  struct mr_mesh m, s;
  ck_assert_int_eq(mr_mesh_parse("pipe=2,data=2,model=2", &m), 0);
  ck_assert_int_eq(mr_mesh_slice(&m, 0, 1, &s), 0);
  ck_assert_int_eq(s.ndim, 2);
  ck_assert_str_eq(s.names[0], "data");
  int c[2];
  /* stage 1 holds ranks 4..7 in order */
  for (int i = 0; i < 4; i++) {
    mr_mesh_coord(&s, i, c);
    ck_assert_int_eq(mr_mesh_rank(&s, c), 4 + i);
  }
  ck_assert_int_eq(mr_mesh_slice(&m, 3, 0, &s), MR_EINVAL);
}
END_TEST

START_TEST(test_placement_parse_roundtrip) {
  struct { const char *in, *out; } cases[] = {
      {"Shard(0)", "Shard(0)"},       {" Shard( 2 ) ", "Shard(2)"},
      {"Replicate()", "Replicate()"}, {"Partial()", "Partial(sum)"},
      {"Partial(avg)", "Partial(avg)"}, {"Partial(max)", "Partial(max)"}};
  for (size_t i = 0; i < MR_ARRAY_LEN(cases); i++) {
    struct mr_placement p;
    char buf[32];
    ck_assert_int_eq(mr_placement_parse(cases[i].in, &p), 0);
    mr_placement_format(p, buf, sizeof buf);
    ck_assert_str_eq(buf, cases[i].out);
  }
  const char *bad[] = {"Shard", "Shard(-1)", "Shard(x)", "Partial(min)",
                       "Replicate(1)", "shard(0)", "Shard(0))"};
  for (size_t i = 0; i < MR_ARRAY_LEN(bad); i++) {
    struct mr_placement p;
    ck_assert_int_eq(mr_placement_parse(bad[i], &p), MR_EINVAL);
  }
}
END_TEST

START_TEST(test_dist_attr_parse_format_check) {
  struct mr_dist_attr d;
  char buf[128];
  ck_assert_int_eq(mr_dist_parse("[Shard(0), Partial(avg)]", 2, &d), 0);
  mr_dist_format(&d, buf, sizeof buf);
  ck_assert_str_eq(buf, "[Shard(0), Partial(avg)]");
  ck_assert_int_eq(mr_dist_parse("Replicate(),Shard(1)", 2, &d), 0);
  ck_assert_int_eq(d.p[1].kind, MR_SHARD);
  ck_assert_int_eq(mr_dist_check(&d, 2), 0);
  ck_assert_int_eq(mr_dist_check(&d, 1), MR_EINVAL);
  ck_assert_int_eq(mr_dist_parse("[Shard(0)]", 2, &d), MR_EINVAL);
  ck_assert_int_eq(mr_dist_parse("[Shard(0), Shard(1), Shard(0)]", 2, &d),
                   MR_EINVAL);
  ck_assert_int_eq(mr_dist_parse("[Partial(max), Partial(sum)]", 2, &d), 0);
  ck_assert_int_eq(mr_dist_check(&d, 2), MR_EINVAL);
  struct mr_dist_attr u = {0};
  mr_dist_format(&u, buf, sizeof buf);
  ck_assert_str_eq(buf, "?");
}
END_TEST

START_TEST(test_split_uneven_first_get_one_more) {
  /* 10 rows over 4: 3,3,2,2 at 0,3,6,8 */
  int64_t len[4] = {3, 3, 2, 2}, off[4] = {0, 3, 6, 8};
  for (int i = 0; i < 4; i++) {
    ck_assert_int_eq(mr_split_len(10, 4, i), len[i]);
    ck_assert_int_eq(mr_split_off(10, 4, i), off[i]);
  }
  /* every n, k: pieces tile [0, n) in order */
  for (int64_t n = 1; n < 40; n++)
    for (int k = 1; k <= 9; k++) {
      int64_t at = 0;
      for (int i = 0; i < k; i++) {
        ck_assert_int_eq(mr_split_off(n, k, i), at);
        int64_t l = mr_split_len(n, k, i);
        ck_assert(l == n / k || l == n / k + 1);
        ck_assert(l >= mr_split_len(n, k, k - 1));
        at += l;
      }
      ck_assert_int_eq(at, n);
    }
}
END_TEST

START_TEST(test_local_shard_nested_2d) {
  struct mr_mesh m;
  ck_assert_int_eq(mr_mesh_parse("data=2,model=3", &m), 0);
  struct mr_dist_attr d;
  int64_t shape[2] = {11, 7};
  /* both mesh dims split rows: data halves 11 into 6,5; model splits each
   * half in three */
  ck_assert_int_eq(mr_dist_parse("[Shard(0), Shard(0)]", 2, &d), 0);
  int64_t want_off[6] = {0, 2, 4, 6, 8, 10}, want_len[6] = {2, 2, 2, 2, 2, 1};
  /* 6 -> 2,2,2 at 0,2,4 ; 5 -> 2,2,1 at 6,8,10 */
  for (int r = 0; r < 6; r++) {
    int c[2];
    int64_t off[2], len[2];
    mr_mesh_coord(&m, r, c);
    mr_dist_local(&m, &d, 2, shape, c, off, len);
    ck_assert_int_eq(off[0], want_off[r]);
    ck_assert_int_eq(len[0], want_len[r]);
    ck_assert_int_eq(off[1], 0);
    ck_assert_int_eq(len[1], 7);
  }
  ck_assert_int_eq(mr_dist_split_degree(&m, &d, 0), 6);
  ck_assert_int_eq(mr_dist_local_numel_max(&m, &d, 2, shape), 14);
  /* Shard(1) on model, Partial on data: columns 3,2,2 */
  ck_assert_int_eq(mr_dist_parse("[Partial(), Shard(1)]", 2, &d), 0);
  int c[2] = {1, 2};
  int64_t off[2], len[2];
  mr_dist_local(&m, &d, 2, shape, c, off, len);
  ck_assert_int_eq(off[1], 5);
  ck_assert_int_eq(len[1], 2);
  ck_assert_int_eq(len[0], 11);
}
END_TEST

START_TEST(test_mesh_rank_count_overflow_rejected) {
  /* found by fuzz_mesh: the product of the dims overflowed an int */
  struct mr_mesh m;
  int shape[2] = {122222, 61111};
  ck_assert_int_eq(mr_mesh_init(&m, 2, shape, NULL), MR_EINVAL);
  int ok[2] = {4096, 4096};
  ck_assert_int_eq(mr_mesh_init(&m, 2, ok, NULL), 0);
}
END_TEST

static Suite *mesh_suite(void) {
  Suite *s = suite_create("mesh");
  TCase *tc = tcase_create("core");
  tcase_add_test(tc, test_mesh_parse_and_format);
  tcase_add_test(tc, test_mesh_rank_count_overflow_rejected);
  tcase_add_test(tc, test_mesh_parse_errors_name_the_entry);
  tcase_add_test(tc, test_mesh_slice_is_a_pipeline_stage);
  tcase_add_test(tc, test_placement_parse_roundtrip);
  tcase_add_test(tc, test_dist_attr_parse_format_check);
  tcase_add_test(tc, test_split_uneven_first_get_one_more);
  tcase_add_test(tc, test_local_shard_nested_2d);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(mesh_suite)
