/* test_tokens.c - token files built byte by byte in the test (not by the
 * writer under test), each malformed case, and the row formulas worked out
 * from the header's definition with the raw Philox block. */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check_main.h"
#include "common/error.h"
#include "common/rng.h"
#include "common/tokens.h"
#include "testutil.h"

static char dir[] = "/tmp/mr-test-tokens-XXXXXX";

static void setup(void) { ck_assert_ptr_nonnull(mkdtemp(dir)); }

static void teardown(void) {
  char cmd[256];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  ck_assert_int_eq(system(cmd), 0);
  strcpy(dir, "/tmp/mr-test-tokens-XXXXXX");
}

static const char *path_of(const char *name) {
  static char p[512];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  return p;
}

static void put_le(uint8_t *p, uint32_t v, int bytes) {
  for (int i = 0; i < bytes; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

/* An llm.c file: header words given, then n tokens of elem bytes each. */
static const char *write_llmc(const char *name, uint32_t magic,
                              uint32_t version, uint32_t count,
                              const uint32_t *tok, size_t n, int elem) {
  const char *p = path_of(name);
  FILE *f = fopen(p, "wb");
  ck_assert_ptr_nonnull(f);
  uint8_t h[1024] = {0};
  put_le(h, magic, 4);
  put_le(h + 4, version, 4);
  put_le(h + 8, count, 4);
  ck_assert_uint_eq(fwrite(h, 1, sizeof h, f), sizeof h);
  for (size_t i = 0; i < n; i++) {
    uint8_t b[4];
    put_le(b, tok[i], elem);
    ck_assert_uint_eq(fwrite(b, 1, (size_t)elem, f), (size_t)elem);
  }
  fclose(f);
  return p;
}

static const char *write_bytes(const char *name, const void *data, size_t n) {
  const char *p = path_of(name);
  FILE *f = fopen(p, "wb");
  ck_assert_ptr_nonnull(f);
  ck_assert_uint_eq(fwrite(data, 1, n, f), n);
  fclose(f);
  return p;
}

static uint32_t tok_fn(size_t i) { return (uint32_t)((i * 2654435761u) % 50257); }

START_TEST(test_tokens_llmc_u16_read) {
  uint32_t tok[300];
  for (size_t i = 0; i < 300; i++)
    tok[i] = tok_fn(i);
  const char *p = write_llmc("a.bin", 20240520, 1, 300, tok, 300, 2);
  struct mr_tokens t;
  ck_assert_int_eq(mr_tokens_open(&t, p, 50257), 0);
  ck_assert_int_eq(t.format, MR_TOKENS_LLMC_U16);
  ck_assert_int_eq(t.n_tokens, 300);
  for (int64_t i = 0; i < 300; i++)
    ck_assert_uint_eq(mr_tokens_at(&t, i), tok[i]);
  uint32_t mx = 0;
  for (size_t i = 0; i < 300; i++)
    mx = tok[i] > mx ? tok[i] : mx;
  ck_assert_int_eq(t.max_token, mx);
  mr_tokens_close(&t);
  mr_tokens_close(&t); /* twice is harmless */
}
END_TEST

START_TEST(test_tokens_llmc_u32_read) {
  uint32_t tok[5] = {0, 70000, 128255, 1, 99999};
  const char *p = write_llmc("b.bin", 20240801, 7, 5, tok, 5, 4);
  struct mr_tokens t;
  ck_assert_int_eq(mr_tokens_open(&t, p, 128256), 0);
  ck_assert_int_eq(t.format, MR_TOKENS_LLMC_U32);
  ck_assert_int_eq(t.n_tokens, 5);
  for (int i = 0; i < 5; i++)
    ck_assert_uint_eq(mr_tokens_at(&t, i), tok[i]);
  mr_tokens_close(&t);
}
END_TEST

START_TEST(test_tokens_raw_u16_by_extension_and_by_missing_magic) {
  uint16_t raw[6] = {0xd888, 0x0134, 5, 6, 7, 65535}; /* starts like a magic */
  const char *p = write_bytes("c.u16", raw, sizeof raw);
  struct mr_tokens t;
  ck_assert_int_eq(mr_tokens_open(&t, p, 0), 0);
  ck_assert_int_eq(t.format, MR_TOKENS_RAW_U16);
  ck_assert_int_eq(t.n_tokens, 6);
  ck_assert_uint_eq(mr_tokens_at(&t, 0), 0xd888);
  ck_assert_uint_eq(mr_tokens_at(&t, 5), 65535);
  ck_assert_int_eq(t.max_token, -1); /* not scanned without a vocab */
  mr_tokens_close(&t);
  uint16_t plain[4] = {1, 2, 3, 4};
  p = write_bytes("d.bin", plain, sizeof plain);
  ck_assert_int_eq(mr_tokens_open(&t, p, 10), 0);
  ck_assert_int_eq(t.format, MR_TOKENS_RAW_U16);
  ck_assert_int_eq(t.n_tokens, 4);
  ck_assert_uint_eq(mr_tokens_at(&t, 3), 4);
  mr_tokens_close(&t);
}
END_TEST

static void expect_open_error(const char *p, int64_t vocab, int code,
                              const char *needle) {
  struct mr_tokens t;
  mr_error_clear();
  int rc = mr_tokens_open(&t, p, vocab);
  ck_assert_msg(rc == code, "%s: rc %d, want %d (%s)", p, rc, code,
                mr_error_message());
  ck_assert_msg(strstr(mr_error_message(), needle) != NULL,
                "message \"%s\" lacks \"%s\"", mr_error_message(), needle);
  ck_assert_msg(strstr(mr_error_message(), p) != NULL,
                "message \"%s\" does not name the file", mr_error_message());
  ck_assert_ptr_null(t.map);
}

START_TEST(test_tokens_rejects_truncated) {
  uint32_t tok[10] = {0};
  expect_open_error(write_llmc("t.bin", 20240520, 1, 11, tok, 10, 2), 0,
                    MR_EFORMAT, "truncated");
  /* shorter than the header itself */
  uint8_t h[100] = {0};
  put_le(h, 20240520, 4);
  expect_open_error(write_bytes("h.bin", h, sizeof h), 0, MR_EFORMAT,
                    "truncated");
}
END_TEST

START_TEST(test_tokens_rejects_wrong_count) {
  uint32_t tok[10] = {0};
  expect_open_error(write_llmc("w.bin", 20240520, 1, 9, tok, 10, 2), 0,
                    MR_EFORMAT, "wrong count");
  uint32_t neg = 0x80000000u;
  expect_open_error(write_llmc("n.bin", 20240520, 1, neg, tok, 10, 2), 0,
                    MR_EFORMAT, "count");
}
END_TEST

START_TEST(test_tokens_rejects_bad_version_odd_raw_empty_missing) {
  uint32_t tok[4] = {0};
  expect_open_error(write_llmc("v.bin", 20240520, 2, 4, tok, 4, 2), 0,
                    MR_EFORMAT, "version");
  expect_open_error(write_llmc("v7.bin", 20240801, 1, 4, tok, 4, 4), 0,
                    MR_EFORMAT, "expected 7");
  uint8_t odd[3] = {1, 2, 3};
  expect_open_error(write_bytes("o.bin", odd, 3), 0, MR_EFORMAT, "odd");
  expect_open_error(write_bytes("e.bin", odd, 0), 0, MR_EFORMAT, "empty");
  expect_open_error(path_of("nope.bin"), 0, MR_ENOENT, "cannot open");
}
END_TEST

START_TEST(test_tokens_rejects_token_beyond_vocab) {
  uint32_t tok[8] = {1, 2, 3, 255, 256, 4, 5, 6};
  const char *p = write_llmc("x.bin", 20240520, 1, 8, tok, 8, 2);
  expect_open_error(p, 256, MR_ERANGE, "token 4 is 256");
  /* unchecked at open: the row read still refuses it, not UB */
  struct mr_tokens t;
  ck_assert_int_eq(mr_tokens_open(&t, p, 0), 0);
  t.vocab_size = 256;
  int32_t in[7], tg[7];
  ck_assert_int_eq(mr_tokens_eval_row(&t, 0, 0, 1, 7, in, tg), MR_ERANGE);
  mr_tokens_close(&t);
}
END_TEST

/* The header's formula, from the Philox block directly. */
static int64_t formula_offset(uint64_t seed, int64_t step, int64_t row,
                              int64_t n, int64_t T) {
  uint64_t k = seed ^ 0x64617461746f6b73ull;
  uint32_t ctr[4] = {(uint32_t)row, (uint32_t)((uint64_t)row >> 32),
                     (uint32_t)step, (uint32_t)((uint64_t)step >> 32)};
  uint32_t key[2] = {(uint32_t)k, (uint32_t)(k >> 32)}, w[4];
  mr_philox4x32_10(ctr, key, w);
  uint64_t h = (uint64_t)w[0] | (uint64_t)w[1] << 32;
  return (int64_t)(h % (uint64_t)(n - T));
}

START_TEST(test_tokens_batch_row_formula) {
  enum { N = 5000, T = 64 };
  uint32_t *tok = malloc(sizeof *tok * N);
  for (size_t i = 0; i < N; i++)
    tok[i] = tok_fn(i);
  const char *p = write_llmc("r.bin", 20240520, 1, N, tok, N, 2);
  struct mr_tokens t;
  ck_assert_int_eq(mr_tokens_open(&t, p, 50257), 0);
  int32_t in[T], tg[T];
  int64_t lo = N, hi = -1;
  for (int64_t step = 0; step < 50; step++)
    for (int64_t row = 0; row < 8; row++) {
      int64_t off = formula_offset(1234, step, row, N, T);
      ck_assert_int_eq(mr_tokens_batch_offset(&t, 1234, step, row, T), off);
      ck_assert_int_eq(mr_tokens_batch_row(&t, 1234, step, row, T, in, tg), 0);
      for (int k = 0; k < T; k++) {
        ck_assert_int_eq(in[k], (int32_t)tok[off + k]);
        ck_assert_int_eq(tg[k], (int32_t)tok[off + k + 1]);
      }
      lo = off < lo ? off : lo;
      hi = off > hi ? off : hi;
    }
  ck_assert_int_ge(lo, 0);
  ck_assert_int_le(hi, N - T - 1);
  ck_assert_int_lt(lo, N / 10); /* 400 draws spread over the file */
  ck_assert_int_gt(hi, N - T - 1 - N / 10);
  /* big step and row numbers use all 64 counter bits */
  int64_t big = (int64_t)1 << 40;
  ck_assert_int_eq(mr_tokens_batch_offset(&t, 9, big, big + 3, T),
                   formula_offset(9, big, big + 3, N, T));
  /* a different seed moves the rows */
  int same = 0;
  for (int64_t row = 0; row < 16; row++)
    same += mr_tokens_batch_offset(&t, 1, 0, row, T) ==
            mr_tokens_batch_offset(&t, 2, 0, row, T);
  ck_assert_int_lt(same, 3);
  mr_tokens_close(&t);
  free(tok);
}
END_TEST

/* Rank d of dp computing rows [d*B/dp, (d+1)*B/dp) sees the same global
 * batch as one rank computing all B rows, in any order. */
START_TEST(test_tokens_batch_same_under_any_data_parallel_split) {
  enum { N = 3000, T = 16, B = 12 };
  uint32_t tok[N];
  for (size_t i = 0; i < N; i++)
    tok[i] = tok_fn(i) % 1000;
  const char *p = write_llmc("dp.bin", 20240520, 1, N, tok, N, 2);
  struct mr_tokens one, other;
  ck_assert_int_eq(mr_tokens_open(&one, p, 1000), 0);
  ck_assert_int_eq(mr_tokens_open(&other, p, 1000), 0);
  int32_t ref[B][T], in[T], tg[T];
  for (int r = 0; r < B; r++)
    ck_assert_int_eq(mr_tokens_batch_row(&one, 5, 17, r, T, ref[r], tg), 0);
  const int dps[] = {2, 3, 4, 6};
  for (size_t k = 0; k < 4; k++)
    for (int d = dps[k] - 1; d >= 0; d--) /* ranks in reverse order */
      for (int r = d * B / dps[k]; r < (d + 1) * B / dps[k]; r++) {
        ck_assert_int_eq(mr_tokens_batch_row(&other, 5, 17, r, T, in, tg), 0);
        ck_assert_int_eq(memcmp(in, ref[r], sizeof in), 0);
      }
  mr_tokens_close(&one);
  mr_tokens_close(&other);
}
END_TEST

START_TEST(test_tokens_batch_row_edge_cases) {
  uint32_t tok[9] = {10, 11, 12, 13, 14, 15, 16, 17, 18};
  const char *p = write_llmc("s.bin", 20240520, 1, 9, tok, 9, 2);
  struct mr_tokens t;
  ck_assert_int_eq(mr_tokens_open(&t, p, 0), 0);
  int32_t in[9], tg[9];
  /* n = T + 1: the only row is offset 0 */
  for (int s = 0; s < 5; s++) {
    ck_assert_int_eq(mr_tokens_batch_row(&t, 3, s, 0, 8, in, tg), 0);
    ck_assert_int_eq(in[0], 10);
    ck_assert_int_eq(tg[7], 18);
  }
  mr_error_clear();
  ck_assert_int_eq(mr_tokens_batch_row(&t, 3, 0, 0, 9, in, tg), MR_ERANGE);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "at least seq_len + 1"));
  ck_assert_int_eq(mr_tokens_batch_row(&t, 3, -1, 0, 4, in, tg), MR_EINVAL);
  ck_assert_int_eq(mr_tokens_batch_row(&t, 3, 0, -1, 4, in, tg), MR_EINVAL);
  ck_assert_int_eq(mr_tokens_batch_row(&t, 3, 0, 0, 0, in, tg), MR_EINVAL);
  mr_tokens_close(&t);
}
END_TEST

START_TEST(test_tokens_eval_row_formula) {
  enum { N = 1000, T = 32, R = 3 };
  uint32_t tok[N];
  for (size_t i = 0; i < N; i++)
    tok[i] = (uint32_t)i;
  const char *p = write_llmc("ev.bin", 20240520, 1, N, tok, N, 2);
  struct mr_tokens t;
  ck_assert_int_eq(mr_tokens_open(&t, p, 1000), 0);
  int64_t W = (N - 1) / T; /* 31 windows */
  ck_assert_int_eq(mr_tokens_eval_windows(&t, T), W);
  int32_t in[T], tg[T];
  for (int64_t b = 0; b < 25; b++)
    for (int64_t r = 0; r < R; r++) {
      ck_assert_int_eq(mr_tokens_eval_row(&t, b, r, R, T, in, tg), 0);
      int64_t off = ((b * R + r) % W) * T;
      ck_assert_int_eq(in[0], off); /* token value == position */
      ck_assert_int_eq(in[T - 1], off + T - 1);
      ck_assert_int_eq(tg[T - 1], off + T);
    }
  /* huge batch numbers wrap without overflow */
  int64_t b = INT64_MAX / 2;
  ck_assert_int_eq(mr_tokens_eval_row(&t, b, 2, R, T, in, tg), 0);
  __extension__ typedef __int128 i128;
  i128 w = ((i128)b * R + 2) % W;
  ck_assert_int_eq(in[0], (int64_t)w * T);
  ck_assert_int_eq(mr_tokens_eval_row(&t, 0, 3, R, T, in, tg), MR_EINVAL);
  mr_tokens_close(&t);
}
END_TEST

/* The writer's bytes checked against the layout, then read back. */
START_TEST(test_tokens_writer_layout) {
  const char *p = path_of("out.bin");
  struct mr_tokens_writer w;
  ck_assert_int_eq(mr_tokens_writer_open(&w, p, MR_TOKENS_LLMC_U16), 0);
  uint32_t chunk[1000];
  for (int c = 0; c < 3000; c++) { /* 3M tokens: several buffer flushes */
    for (int i = 0; i < 1000; i++)
      chunk[i] = (uint32_t)((c * 1000 + i) % 65536);
    ck_assert_int_eq(mr_tokens_writer_append(&w, chunk, 1000), 0);
  }
  ck_assert_int_eq(mr_tokens_writer_close(&w), 0);
  FILE *f = fopen(p, "rb");
  ck_assert_ptr_nonnull(f);
  uint8_t h[12];
  ck_assert_uint_eq(fread(h, 1, 12, f), 12);
  ck_assert_uint_eq(h[0] | h[1] << 8 | h[2] << 16 | (uint32_t)h[3] << 24,
                    20240520);
  ck_assert_uint_eq(h[4] | h[5] << 8, 1);
  ck_assert_uint_eq(h[8] | h[9] << 8 | h[10] << 16 | (uint32_t)h[11] << 24,
                    3000000);
  fseek(f, 0, SEEK_END);
  ck_assert_int_eq(ftell(f), 1024 + 2 * 3000000);
  fclose(f);
  struct mr_tokens t;
  ck_assert_int_eq(mr_tokens_open(&t, p, 65536), 0);
  for (int64_t i = 0; i < 3000000; i += 997)
    ck_assert_uint_eq(mr_tokens_at(&t, i), (uint32_t)(i % 65536));
  mr_tokens_close(&t);
}
END_TEST

START_TEST(test_tokens_writer_u32_and_limits) {
  const char *p = path_of("w32.bin");
  struct mr_tokens_writer w;
  ck_assert_int_eq(mr_tokens_writer_open(&w, p, MR_TOKENS_LLMC_U32), 0);
  uint32_t tok[3] = {70000, 0, 128000};
  ck_assert_int_eq(mr_tokens_writer_append(&w, tok, 3), 0);
  ck_assert_int_eq(mr_tokens_writer_close(&w), 0);
  struct mr_tokens t;
  ck_assert_int_eq(mr_tokens_open(&t, p, 128256), 0);
  ck_assert_int_eq(t.format, MR_TOKENS_LLMC_U32);
  ck_assert_uint_eq(mr_tokens_at(&t, 0), 70000);
  ck_assert_uint_eq(mr_tokens_at(&t, 2), 128000);
  mr_tokens_close(&t);
  /* a token that does not fit uint16 */
  p = path_of("w16.bin");
  ck_assert_int_eq(mr_tokens_writer_open(&w, p, MR_TOKENS_LLMC_U16), 0);
  ck_assert_int_eq(mr_tokens_writer_append(&w, tok, 3), MR_ERANGE);
  mr_tokens_writer_abort(&w);
  ck_assert_int_ne(access(p, F_OK), 0); /* removed */
  /* raw: no header */
  p = path_of("raw.u16");
  ck_assert_int_eq(mr_tokens_writer_open(&w, p, MR_TOKENS_RAW_U16), 0);
  tok[0] = 7;
  ck_assert_int_eq(mr_tokens_writer_append(&w, tok, 2), 0);
  ck_assert_int_eq(mr_tokens_writer_close(&w), 0);
  ck_assert_int_eq(mr_tokens_open(&t, p, 0), 0);
  ck_assert_int_eq(t.map_bytes, 4);
  ck_assert_uint_eq(mr_tokens_at(&t, 0), 7);
  mr_tokens_close(&t);
}
END_TEST

/* Writes n tokens v(i) = (i * mul) % 65536 to path with a writer. */
static void write_seq(const char *p, int n, uint32_t mul) {
  struct mr_tokens_writer w;
  ck_assert_int_eq(mr_tokens_writer_open(&w, p, MR_TOKENS_LLMC_U16), 0);
  for (int i = 0; i < n; i++) {
    uint32_t v = ((uint32_t)i * mul) % 65536;
    ck_assert_int_eq(mr_tokens_writer_append(&w, &v, 1), 0);
  }
  ck_assert_int_eq(mr_tokens_writer_close(&w), 0);
}

/* Writing over a file replaces it only when whole: a job that has it
 * mapped reads the old tokens to the end (the file was not truncated
 * under it), the next open the new ones, and a write that fails leaves
 * the file there as it was and nothing beside it. */
START_TEST(test_tokens_writer_replaces_whole_files_only) {
  const char *p = path_of("data.bin");
  write_seq(p, 200000, 3);
  struct mr_tokens old;
  ck_assert_int_eq(mr_tokens_open(&old, p, 65536), 0);
  write_seq(p, 1000, 7); /* shorter: truncating in place would cut the map */
  for (int64_t i = 0; i < 200000; i += 101)
    ck_assert_uint_eq(mr_tokens_at(&old, i), (uint32_t)((i * 3) % 65536));
  ck_assert_uint_eq(mr_tokens_at(&old, 199999), (uint32_t)((199999 * 3) % 65536));
  mr_tokens_close(&old);
  struct mr_tokens now;
  ck_assert_int_eq(mr_tokens_open(&now, p, 65536), 0);
  ck_assert_int_eq(now.n_tokens, 1000);
  ck_assert_uint_eq(mr_tokens_at(&now, 999), (999u * 7) % 65536);
  mr_tokens_close(&now);
  /* a failing write: a token past uint16 */
  struct mr_tokens_writer w;
  ck_assert_int_eq(mr_tokens_writer_open(&w, p, MR_TOKENS_LLMC_U16), 0);
  uint32_t big = 70000;
  ck_assert_int_eq(mr_tokens_writer_append(&w, &big, 1), MR_ERANGE);
  mr_tokens_writer_abort(&w);
  ck_assert_int_eq(mr_tokens_open(&now, p, 65536), 0);
  ck_assert_int_eq(now.n_tokens, 1000);
  mr_tokens_close(&now);
  ck_assert_int_eq(mr_t_count_files(dir), 1);
}
END_TEST

static Suite *tokens_suite(void) {
  Suite *s = suite_create("tokens");
  TCase *tc = tcase_create("tokens");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, test_tokens_llmc_u16_read);
  tcase_add_test(tc, test_tokens_llmc_u32_read);
  tcase_add_test(tc, test_tokens_raw_u16_by_extension_and_by_missing_magic);
  tcase_add_test(tc, test_tokens_rejects_truncated);
  tcase_add_test(tc, test_tokens_rejects_wrong_count);
  tcase_add_test(tc, test_tokens_rejects_bad_version_odd_raw_empty_missing);
  tcase_add_test(tc, test_tokens_rejects_token_beyond_vocab);
  tcase_add_test(tc, test_tokens_batch_row_formula);
  tcase_add_test(tc, test_tokens_batch_same_under_any_data_parallel_split);
  tcase_add_test(tc, test_tokens_batch_row_edge_cases);
  tcase_add_test(tc, test_tokens_eval_row_formula);
  tcase_add_test(tc, test_tokens_writer_layout);
  tcase_add_test(tc, test_tokens_writer_u32_and_limits);
  tcase_add_test(tc, test_tokens_writer_replaces_whole_files_only);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(tokens_suite)
