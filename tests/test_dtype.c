/* test_dtype.c - bf16/fp16 conversions against an independent reference:
 * the correctly rounded value is found by exhaustive search over every
 * representable 16-bit pattern, decoded in double precision. */
#include <check.h>
#include <math.h>
#include <stdint.h>

#include "check_main.h"
#include "common/dtype.h"

static double f16_value(uint16_t h) { /* direct formula, no shared code */
  int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 0)
    v = ldexp(m, -24);
  else if (e == 31)
    v = m ? NAN : INFINITY;
  else
    v = ldexp(1024 + m, e - 25);
  return s ? -v : v;
}

static double bf16_value(uint16_t h) {
  int s = h >> 15, e = (h >> 7) & 255, m = h & 127;
  double v;
  if (e == 0)
    v = ldexp(m, -133);
  else if (e == 255)
    v = m ? NAN : INFINITY;
  else
    v = ldexp(128 + m, e - 134);
  return s ? -v : v;
}

/* nearest finite-or-inf pattern, ties to even mantissa, by brute force */
static uint16_t nearest(double x, double (*val)(uint16_t), uint16_t maxfinite,
                        uint16_t inf) {
  uint16_t sign = x < 0 ? 0x8000 : 0;
  double ax = fabs(x);
  uint16_t best = 0;
  double bestd = INFINITY;
  for (uint32_t p = 0; p <= maxfinite; p++) {
    double d = fabs(val((uint16_t)p) - ax);
    if (d < bestd || (d == bestd && (p & 1) == 0 && (best & 1))) {
      best = (uint16_t)p;
      bestd = d;
    }
  }
  /* beyond the largest finite by at least half an ulp: inf */
  double top = val(maxfinite), ulp = top - val((uint16_t)(maxfinite - 1));
  if (ax >= top + ulp / 2)
    best = inf;
  return (uint16_t)(sign | best);
}

START_TEST(test_dtype_f16_round_to_nearest_even) {
  uint32_t x = 99;
  for (int i = 0; i < 3000; i++) {
    x = x * 1664525u + 1013904223u;
    /* spread over the half range, subnormals and overflow included */
    float f = (float)ldexp((double)(x >> 8) / (1 << 24) * 2 - 1, (int)(x % 44) - 28);
    uint16_t want = nearest(f, f16_value, 0x7bff, 0x7c00);
    ck_assert_msg(mr_f32_to_f16(f) == want, "f=%a got %04x want %04x", (double)f,
                  mr_f32_to_f16(f), want);
  }
  /* exact ties: 1 + 2^-11 lies between 1 and 1+2^-10: goes to even (1) */
  ck_assert_uint_eq(mr_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);
  ck_assert_uint_eq(mr_f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);
  ck_assert_uint_eq(mr_f32_to_f16(65520.0f), 0x7c00);
  ck_assert_uint_eq(mr_f32_to_f16(65519.0f), 0x7bff);
  ck_assert(isnan(mr_f16_to_f32(mr_f32_to_f16(NAN))));
}
END_TEST

START_TEST(test_dtype_f16_decode_all_patterns) {
  for (uint32_t p = 0; p < 65536; p++) {
    double want = f16_value((uint16_t)p);
    float got = mr_f16_to_f32((uint16_t)p);
    if (isnan(want))
      ck_assert(isnan(got));
    else
      ck_assert_msg((double)got == want, "pattern %04x", p);
    if (!isnan(want)) /* every half survives a round trip */
      ck_assert_uint_eq(mr_f32_to_f16(got), p);
  }
}
END_TEST

START_TEST(test_dtype_bf16_round_to_nearest_even) {
  uint32_t x = 7;
  for (int i = 0; i < 300; i++) {
    x = x * 1664525u + 1013904223u;
    float f = (float)ldexp((double)(x >> 8) / (1 << 24) * 2 - 1, (int)(x % 60) - 30);
    uint16_t want = nearest(f, bf16_value, 0x7f7f, 0x7f80);
    ck_assert_msg(mr_f32_to_bf16(f) == want, "f=%a got %04x want %04x", (double)f,
                  mr_f32_to_bf16(f), want);
  }
  for (uint32_t p = 0; p < 65536; p++) {
    double want = bf16_value((uint16_t)p);
    float got = mr_bf16_to_f32((uint16_t)p);
    if (isnan(want))
      ck_assert(isnan(got) && isnan(mr_bf16_to_f32(mr_f32_to_bf16(got))));
    else
      ck_assert((double)got == want && mr_f32_to_bf16(got) == p);
  }
}
END_TEST

static Suite *dtype_suite(void) {
  Suite *s = suite_create("dtype");
  TCase *tc = tcase_create("convert");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_dtype_f16_round_to_nearest_even);
  tcase_add_test(tc, test_dtype_f16_decode_all_patterns);
  tcase_add_test(tc, test_dtype_bf16_round_to_nearest_even);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(dtype_suite)
