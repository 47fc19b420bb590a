/* test_rng.c - Philox4x32-10 against the known-answer vectors published
 * with Random123 (kat_vectors, philox4x32 10), FNV-1a against the published
 * FNV test vectors, the documented Box-Muller formula worked out here, the
 * statistics of the normals, and the independence of an element's value from
 * the range it is generated in. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "check_main.h"
#include "common/rng.h"

struct kat {
  uint32_t ctr[4], key[2], out[4];
};

static const struct kat kats[] = {
    {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
     {0xffffffff, 0xffffffff},
     {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
     {0xa4093822, 0x299f31d0},
     {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
};

START_TEST(test_rng_philox_known_answers) {
  for (size_t i = 0; i < sizeof kats / sizeof kats[0]; i++) {
    uint32_t out[4];
    mr_philox4x32_10(kats[i].ctr, kats[i].key, out);
    for (int j = 0; j < 4; j++)
      ck_assert_msg(out[j] == kats[i].out[j], "vector %zu word %d: %08x != %08x",
                    i, j, out[j], kats[i].out[j]);
  }
}
END_TEST

START_TEST(test_rng_philox_output_may_alias_counter) {
  uint32_t buf[4] = {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344};
  mr_philox4x32_10(buf, kats[2].key, buf);
  for (int j = 0; j < 4; j++)
    ck_assert_uint_eq(buf[j], kats[2].out[j]);
}
END_TEST

START_TEST(test_rng_fnv1a_known_answers) {
  ck_assert_uint_eq(mr_hash_str(""), 0xcbf29ce484222325ull);
  ck_assert_uint_eq(mr_hash_str("a"), 0xaf63dc4c8601ec8cull);
  ck_assert_uint_eq(mr_hash_str("foobar"), 0x85944171f73967e8ull);
}
END_TEST

/* The documented counter/key layout, worked out from a raw Philox call. */
START_TEST(test_rng_u64_layout) {
  uint64_t seed = 0x0123456789abcdefull, stream = 0xfedcba9876543210ull;
  uint64_t idx = 0x1122334455667788ull;
  uint32_t ctr[4] = {0x55667788, 0x11223344, 0x76543210, 0xfedcba98};
  uint32_t key[2] = {0x89abcdef, 0x01234567}, w[4];
  mr_philox4x32_10(ctr, key, w);
  ck_assert_uint_eq(mr_rng_u64(seed, stream, idx),
                    (uint64_t)w[0] | (uint64_t)w[1] << 32);
  double u = mr_rng_uniform(seed, stream, idx);
  ck_assert(u >= 0.0 && u < 1.0);
  ck_assert(u == (double)(((uint64_t)w[0] | (uint64_t)w[1] << 32) >> 11) /
                     9007199254740992.0);
}
END_TEST

/* Box-Muller written out from the header's formula. */
START_TEST(test_rng_normal_formula) {
  uint64_t seed = 7, stream = mr_hash_str("model.layers.0.mlp.up_proj.weight");
  for (uint64_t i = 0; i < 64; i++) {
    uint64_t c = i / 2;
    uint32_t ctr[4] = {(uint32_t)c, (uint32_t)(c >> 32), (uint32_t)stream,
                       (uint32_t)(stream >> 32)};
    uint32_t key[2] = {7, 0}, w[4];
    mr_philox4x32_10(ctr, key, w);
    uint64_t a = (uint64_t)w[0] | (uint64_t)w[1] << 32;
    uint64_t b = (uint64_t)w[2] | (uint64_t)w[3] << 32;
    double u1 = ldexp((double)((a >> 11) + 1), -53);
    double u2 = ldexp((double)(b >> 11), -53);
    double r = sqrt(-2 * log(u1)), th = 2 * M_PI * u2;
    double want = i % 2 ? r * sin(th) : r * cos(th);
    ck_assert_double_eq_tol(mr_rng_normal(seed, stream, i), want, 1e-15);
  }
}
END_TEST

START_TEST(test_rng_normal_statistics) {
  const int n = 100000;
  double s = 0, s2 = 0, s4 = 0, corr = 0, prev = 0;
  int inside1 = 0;
  float *buf = malloc(sizeof(float) * (size_t)n);
  ck_assert_ptr_nonnull(buf);
  mr_rng_normal_fill(12345, mr_hash_str("w"), 0, (size_t)n, 0.0f, 1.0f, buf);
  for (int i = 0; i < n; i++) {
    double z = buf[i];
    ck_assert(isfinite(z) && fabs(z) < 8.6);
    s += z;
    s2 += z * z;
    s4 += z * z * z * z;
    inside1 += fabs(z) < 1.0;
    if (i % 2 == 1)
      corr += z * prev; /* the two halves of one Box-Muller pair */
    prev = z;
  }
  free(buf);
  double mean = s / n, var = s2 / n - mean * mean, kurt = s4 / n;
  /* bounds at about 5 standard errors of each estimator */
  ck_assert_msg(fabs(mean) < 5.0 / sqrt(n), "mean %g", mean);
  ck_assert_msg(fabs(var - 1.0) < 5.0 * sqrt(2.0 / n), "variance %g", var);
  ck_assert_msg(fabs(kurt - 3.0) < 5.0 * sqrt(96.0 / n), "4th moment %g", kurt);
  double p1 = (double)inside1 / n; /* P(|Z| < 1) = erf(1/sqrt 2) */
  ck_assert_msg(fabs(p1 - erf(M_SQRT1_2)) < 5.0 * sqrt(0.2166 / n),
                "P(|z|<1) %g", p1);
  ck_assert_msg(fabs(corr / (n / 2)) < 5.0 / sqrt(n / 2), "pair corr %g",
                corr / (n / 2));
}
END_TEST

/* Element i's value is the same whichever range it is generated in: the
 * property sharded initialisation depends on. */
START_TEST(test_rng_normal_range_independent) {
  enum { N = 1001 };
  float whole[N], part[N];
  uint64_t stream = mr_hash_str("lm_head.weight");
  mr_rng_normal_fill(3, stream, 0, N, 0.5f, 0.02f, whole);
  for (int i = 0; i < N; i++)
    ck_assert(whole[i] == (float)((double)0.5f + (double)0.02f *
                                      mr_rng_normal(3, stream, (uint64_t)i)));
  /* shards of uneven sizes, odd and even starts */
  const int cuts[] = {0, 1, 2, 7, 64, 333, 334, 1000, N};
  for (size_t c = 0; c + 1 < sizeof cuts / sizeof cuts[0]; c++)
    mr_rng_normal_fill(3, stream, (uint64_t)cuts[c],
                       (size_t)(cuts[c + 1] - cuts[c]), 0.5f, 0.02f,
                       part + cuts[c]);
  for (int i = 0; i < N; i++)
    ck_assert_msg(part[i] == whole[i], "element %d", i);
  /* a far index: the counter is 64-bit */
  uint64_t far = 0x7fffffffffffffffull;
  float one;
  mr_rng_normal_fill(3, stream, far, 1, 0.0f, 1.0f, &one);
  ck_assert(one == (float)mr_rng_normal(3, stream, far));
}
END_TEST

/* A rank draws its first weights over several threads when a tensor is
 * large: the values are still, element by element, the seeded normal of
 * its index (an odd start, uneven last task). */
START_TEST(test_rng_normal_fill_threads_draws_the_serial_values) {
  int64_t n = 5 * ((int64_t)1 << 20) + 7;
  uint64_t first = 3, stream = mr_hash_str("model.layers.0.mlp.up_proj.weight");
  float *w = malloc((size_t)n * sizeof *w);
  ck_assert_ptr_nonnull(w);
  mr_rng_normal_fill_threads(3, 11, stream, first, n, 0.5f, 0.02f, w);
  int64_t bad = -1;
  for (int64_t i = 0; i < n && bad < 0; i++)
    if (w[i] != (float)((double)0.5f + (double)0.02f * mr_rng_normal(11, stream, first + i)))
      bad = i;
  ck_assert_msg(bad < 0, "element %lld differs from the serial draw", (long long)bad);
  free(w);
}
END_TEST

/* A shard of columns (tensor parallelism's column split) and a box of a
 * 3-D tensor: element by element the seeded normal of the index in the
 * whole tensor, the columns dealt to three threads. */
static void check_box(int ndim, const int64_t *shape, const int64_t *off, const int64_t *len) {
  uint64_t stream = mr_hash_str("model.layers.0.self_attn.q_proj.weight");
  int64_t n = 1;
  for (int d = 0; d < ndim; d++)
    n *= len[d];
  float *w = malloc((size_t)n * sizeof *w);
  ck_assert_ptr_nonnull(w);
  mr_rng_normal_fill_box(3, 11, stream, ndim, shape, off, len, 0.0f, 0.02f, w);
  int64_t idx[3] = {0, 0, 0}, bad = -1;
  uint64_t bad_at = 0;
  float want = 0;
  for (int64_t k = 0; k < n && bad < 0; k++) { /* one assertion: Check marks each */
    uint64_t at = 0;
    for (int d = 0; d < ndim; d++)
      at = at * (uint64_t)shape[d] + (uint64_t)(off[d] + idx[d]);
    want = (float)((double)0.02f * mr_rng_normal(11, stream, at));
    if (w[k] != want) {
      bad = k;
      bad_at = at;
    }
    for (int d = ndim - 1; d >= 0 && ++idx[d] == len[d]; d--)
      idx[d] = 0;
  }
  ck_assert_msg(bad < 0, "box element %lld (index %llu): %.9g, the whole draws %.9g",
                (long long)bad, (unsigned long long)bad_at, bad >= 0 ? (double)w[bad] : 0.0,
                (double)want);
  free(w);
}

START_TEST(test_rng_normal_fill_box_draws_the_whole_tensors_values) {
  int64_t shape2[2] = {2048, 4096}, off2[2] = {0, 1001}, len2[2] = {2048, 1536};
  check_box(2, shape2, off2, len2);
  int64_t rows_off[2] = {7, 0}, rows_len[2] = {3, 4096}; /* whole rows: one run */
  check_box(2, shape2, rows_off, rows_len);
  int64_t shape3[3] = {5, 6, 7}, off3[3] = {1, 2, 3}, len3[3] = {3, 4, 2};
  check_box(3, shape3, off3, len3);
}
END_TEST

START_TEST(test_rng_streams_and_seeds_differ) {
  uint64_t a = mr_hash_str("a.weight"), b = mr_hash_str("b.weight");
  int same_stream = 0, same_seed = 0;
  for (uint64_t i = 0; i < 100; i++) {
    same_stream += mr_rng_u64(1, a, i) == mr_rng_u64(1, b, i);
    same_seed += mr_rng_u64(1, a, i) == mr_rng_u64(2, a, i);
  }
  ck_assert_int_eq(same_stream, 0);
  ck_assert_int_eq(same_seed, 0);
}
END_TEST

static Suite *rng_suite(void) {
  Suite *s = suite_create("rng");
  TCase *tc = tcase_create("rng");
  tcase_add_test(tc, test_rng_philox_known_answers);
  tcase_add_test(tc, test_rng_philox_output_may_alias_counter);
  tcase_add_test(tc, test_rng_fnv1a_known_answers);
  tcase_add_test(tc, test_rng_u64_layout);
  tcase_add_test(tc, test_rng_normal_formula);
  tcase_add_test(tc, test_rng_normal_statistics);
  tcase_add_test(tc, test_rng_normal_range_independent);
  tcase_add_test(tc, test_rng_normal_fill_threads_draws_the_serial_values);
  tcase_add_test(tc, test_rng_normal_fill_box_draws_the_whole_tensors_values);
  tcase_add_test(tc, test_rng_streams_and_seeds_differ);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(rng_suite)
