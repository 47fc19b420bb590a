/* test_safetensors.c - safetensors against independent references: a file
 * written by tests/data/st_reference.py (json + struct only) is read here,
 * a file written here is checked by that script, every malformed case is
 * built byte by byte, and slices are compared with indexing worked out in
 * the test. */
#include <check.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "check_main.h"
#include "common/ckpt.h"
#include "common/ckpt_read.h"
#include "common/error.h"
#include "common/safetensors.h"
#include "common/checksum.h"
#include "testutil.h"
#include <xxhash.h>

static char dir[] = "/tmp/mr-test-st-XXXXXX";

static void setup(void) { ck_assert_ptr_nonnull(mkdtemp(dir)); }

static void teardown(void) {
  char cmd[256];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  ck_assert_int_eq(system(cmd), 0);
  strcpy(dir, "/tmp/mr-test-st-XXXXXX");
}

static const char *path_of(const char *name) {
  static char p[4][512];
  static int k;
  k = (k + 1) % 4;
  snprintf(p[k], sizeof p[k], "%s/%s", dir, name);
  return p[k];
}

static int run_reference(const char *mode, const char *file) {
  const char *src = getenv("MESHRUN_SOURCE_DIR");
  char cmd[2048];
  snprintf(cmd, sizeof cmd, "python3 %s/tests/data/st_reference.py %s %s",
           src != NULL ? src : ".", mode, file);
  return system(cmd);
}

static float f32_at(const void *p, size_t i) {
  float v;
  memcpy(&v, (const uint8_t *)p + 4 * i, 4);
  return v;
}

/* ---- reading a file from the independent writer ---- */

START_TEST(test_safetensors_reads_reference_file) {
  const char *p = path_of("ref.safetensors");
  ck_assert_int_eq(run_reference("write", p), 0);
  struct mr_st_file *f;
  ck_assert_msg(mr_st_open(p, &f) == 0, "%s", mr_error_message());
  ck_assert_int_eq(mr_st_count(f), 6);
  ck_assert_str_eq(mr_st_metadata(f, "format"), "pt");
  ck_assert_str_eq(mr_st_metadata(f, "note"), "reference");
  ck_assert_ptr_null(mr_st_metadata(f, "absent"));

  const struct mr_st_tensor *t = mr_st_find(f, "f32");
  ck_assert_ptr_nonnull(t);
  ck_assert_int_eq(t->dtype, MR_F32);
  ck_assert_int_eq(t->rank, 2);
  ck_assert_int_eq(t->shape[0], 3);
  ck_assert_int_eq(t->shape[1], 4);
  float v[30];
  ck_assert_int_eq(mr_st_read(f, t, MR_F32, v), 0);
  for (int i = 0; i < 12; i++)
    ck_assert(v[i] == i * 0.5f - 2);

  t = mr_st_find(f, "bf16");
  ck_assert_int_eq(t->dtype, MR_BF16);
  ck_assert_int_eq(t->numel, 30);
  ck_assert_int_eq(mr_st_read(f, t, MR_F32, v), 0);
  for (int i = 0; i < 30; i++)
    ck_assert(v[i] == (i - 15) * 0.25f);
  uint16_t raw[30];
  ck_assert_int_eq(mr_st_read(f, t, MR_BF16, raw), 0);
  ck_assert_uint_eq(raw[0], 0xc070); /* -3.75 in bfloat16 */

  t = mr_st_find(f, "f16");
  ck_assert_int_eq(t->dtype, MR_F16);
  ck_assert_int_eq(mr_st_read(f, t, MR_F32, v), 0);
  for (int i = 0; i < 8; i++)
    ck_assert(v[i] == (i - 7) / 8.0f);
  ck_assert_int_eq(mr_st_read(f, t, MR_F16, raw), 0);
  ck_assert_uint_eq(raw[0], 0xbb00); /* -0.875 in half: 1 01110 1100000000 */

  t = mr_st_find(f, "i64");
  int64_t iv[3];
  ck_assert_int_eq(mr_st_read(f, t, MR_I64, iv), 0);
  for (int i = 0; i < 3; i++)
    ck_assert_int_eq(iv[i], i * 1000000000000LL - 7);
  ck_assert_int_eq(mr_st_read(f, t, MR_F32, v), MR_ENOTSUP);

  t = mr_st_find(f, "u8");
  uint8_t u[5];
  ck_assert_int_eq(mr_st_read(f, t, MR_U8, u), 0);
  for (int i = 0; i < 5; i++)
    ck_assert_uint_eq(u[i], 250 + i);

  t = mr_st_find(f, "scalar");
  ck_assert_int_eq(t->rank, 0);
  ck_assert_int_eq(t->numel, 1);
  ck_assert_int_eq(mr_st_read(f, t, MR_F32, v), 0);
  ck_assert(v[0] == 3.25f);
  ck_assert(f32_at(mr_st_data(f, t), 0) == 3.25f);
  ck_assert_ptr_null(mr_st_find(f, "nope"));
  mr_st_free(f);
}
END_TEST

/* ---- writing, checked by the independent script and read back ---- */

START_TEST(test_safetensors_written_file_passes_reference_check) {
  float f32[12], scalar = 3.25f;
  uint16_t bf16[30];
  float bf16_src[30], f16_src[8];
  int64_t i64[3];
  uint8_t u8[5];
  for (int i = 0; i < 12; i++)
    f32[i] = i * 0.5f - 2;
  for (int i = 0; i < 30; i++)
    bf16_src[i] = (i - 15) * 0.25f;
  for (int i = 0; i < 8; i++)
    f16_src[i] = (i - 7) / 8.0f;
  for (int i = 0; i < 3; i++)
    i64[i] = i * 1000000000000LL - 7;
  for (int i = 0; i < 5; i++)
    u8[i] = (uint8_t)(250 + i);
  mr_f32_to_bf16_n(bf16, bf16_src, 30);
  const char *p = path_of("c.safetensors");
  struct mr_st_writer *w;
  ck_assert_int_eq(mr_st_writer_new(p, MR_ST_WRITE_FSYNC, &w), 0);
  /* added in an order unlike the layout: the writer sorts */
  ck_assert_int_eq(mr_st_writer_add(w, "u8", MR_U8, 1, (int64_t[]){5}, u8), 0);
  ck_assert_int_eq(
      mr_st_writer_add(w, "bf16", MR_BF16, 3, (int64_t[]){2, 3, 5}, bf16), 0);
  ck_assert_int_eq(mr_st_writer_add_converted(w, "f16", MR_F16, 2,
                                              (int64_t[]){4, 2}, MR_F32,
                                              f16_src),
                   0);
  ck_assert_int_eq(mr_st_writer_add(w, "scalar", MR_F32, 0, NULL, &scalar), 0);
  ck_assert_int_eq(
      mr_st_writer_add(w, "f32", MR_F32, 2, (int64_t[]){3, 4}, f32), 0);
  ck_assert_int_eq(mr_st_writer_add(w, "i64", MR_I64, 1, (int64_t[]){3}, i64),
                   0);
  ck_assert_int_eq(mr_st_writer_add_metadata(w, "format", "np"), 0);
  ck_assert_int_eq(mr_st_writer_add_metadata(w, "note", "reference"), 0);
  ck_assert_int_eq(mr_st_writer_add_metadata(w, "format", "pt"), 0); /* replace */
  ck_assert_int_eq(mr_st_writer_add(w, "u8", MR_U8, 1, (int64_t[]){5}, u8),
                   MR_EINVAL); /* duplicate */
  ck_assert_uint_eq(mr_st_writer_data_bytes(w), 5 + 60 + 16 + 4 + 48 + 24);
  ck_assert_int_eq(mr_st_writer_finish(w), 0);
  mr_st_writer_free(w);
  ck_assert_int_eq(run_reference("verify", p), 0);
}
END_TEST

START_TEST(test_safetensors_round_trip_all_dtypes) {
  enum { N = 37 };
  uint8_t src[MR_DTYPE_COUNT][N * 8];
  for (int d = 0; d < MR_DTYPE_COUNT; d++)
    for (int i = 0; i < N * 8; i++)
      src[d][i] = (uint8_t)(i * 7 + d * 31 + 1);
  const char *names[MR_DTYPE_COUNT] = {"t.f32", "t.bf16", "t.f16", "t.i32",
                                       "t.i64", "t.u16", "t.\"u8\"/\xc3\xbc\\", "t.f64"};
  const char *p = path_of("all.safetensors");
  struct mr_st_writer *w;
  ck_assert_int_eq(mr_st_writer_new(p, 0, &w), 0);
  for (int d = 0; d < MR_DTYPE_COUNT; d++)
    ck_assert_int_eq(mr_st_writer_add(w, names[d], (enum mr_dtype)d, 1,
                                      (int64_t[]){N}, src[d]),
                     0);
  ck_assert_int_eq(mr_st_writer_add(w, "empty", MR_F32, 2, (int64_t[]){0, 4},
                                    NULL),
                   0);
  ck_assert_int_eq(mr_st_writer_finish(w), 0);
  mr_st_writer_free(w);
  struct mr_st_file *f;
  ck_assert_msg(mr_st_open(p, &f) == 0, "%s", mr_error_message());
  ck_assert_int_eq(mr_st_count(f), MR_DTYPE_COUNT + 1);
  ck_assert_int_eq(mr_st_metadata_count(f), 0);
  for (int d = 0; d < MR_DTYPE_COUNT; d++) {
    const struct mr_st_tensor *t = mr_st_find(f, names[d]);
    ck_assert_ptr_nonnull(t);
    ck_assert_int_eq(t->dtype, d);
    ck_assert_int_eq(t->shape[0], N);
    size_t es = mr_dtype_size((enum mr_dtype)d);
    ck_assert_uint_eq(t->begin % es, 0); /* aligned to its element size */
    ck_assert_int_eq(memcmp(mr_st_data(f, t), src[d], N * es), 0);
    uint8_t back[N * 8];
    ck_assert_int_eq(mr_st_read(f, t, (enum mr_dtype)d, back), 0);
    ck_assert_int_eq(memcmp(back, src[d], N * es), 0);
  }
  /* the data buffer starts 8-byte aligned in the file */
  FILE *fp = fopen(p, "rb");
  uint8_t h8[8];
  ck_assert_uint_eq(fread(h8, 1, 8, fp), 8);
  fclose(fp);
  ck_assert_uint_eq(h8[0] % 8, 0);
  const struct mr_st_tensor *e = mr_st_find(f, "empty");
  ck_assert_int_eq(e->numel, 0);
  ck_assert_uint_eq(e->begin, e->end);
  mr_st_free(f);
}
END_TEST

/* A tensor larger than the staging buffer goes straight from memory. */
START_TEST(test_safetensors_large_tensor_streams) {
  enum { ROWS = 1536, COLS = 4096 }; /* 24 MiB of F32 */
  float *a = malloc(sizeof(float) * ROWS * COLS);
  ck_assert_ptr_nonnull(a);
  for (size_t i = 0; i < (size_t)ROWS * COLS; i++)
    a[i] = (float)(i % 1000003);
  float small[3] = {1, 2, 3};
  const char *p = path_of("big.safetensors");
  struct mr_st_writer *w;
  ck_assert_int_eq(mr_st_writer_new(p, 0, &w), 0);
  ck_assert_int_eq(mr_st_writer_add(w, "a", MR_F32, 2,
                                    (int64_t[]){ROWS, COLS}, a),
                   0);
  ck_assert_int_eq(mr_st_writer_add(w, "b", MR_F32, 1, (int64_t[]){3}, small),
                   0);
  ck_assert_int_eq(mr_st_writer_add_converted(w, "a_bf16", MR_BF16, 2,
                                              (int64_t[]){ROWS, COLS}, MR_F32,
                                              a),
                   0);
  ck_assert_int_eq(mr_st_writer_finish(w), 0);
  mr_st_writer_free(w);
  struct mr_st_file *f;
  ck_assert_int_eq(mr_st_open(p, &f), 0);
  const struct mr_st_tensor *t = mr_st_find(f, "a");
  ck_assert_int_eq(memcmp(mr_st_data(f, t), a, sizeof(float) * ROWS * COLS),
                   0);
  float row[COLS];
  const struct mr_st_tensor *tb = mr_st_find(f, "a_bf16");
  ck_assert_int_eq(mr_st_read_rows(f, tb, 1000, 1, MR_F32, row), 0);
  for (int j = 0; j < COLS; j++) {
    float x = a[1000 * COLS + j];
    ck_assert_msg(fabsf(row[j] - x) <= fabsf(x) * 0x1p-8f, "%g vs %g", row[j],
                  x);
  }
  ck_assert_int_eq(mr_st_read(f, mr_st_find(f, "b"), MR_F32, row), 0);
  ck_assert(row[0] == 1 && row[2] == 3);
  mr_st_free(f);
  free(a);
}
END_TEST

/* ---- slices ---- */

START_TEST(test_safetensors_slices_match_full_read) {
  enum { A = 3, B = 4, C = 5, D = 6, N = A * B * C * D };
  float full[N];
  uint16_t bf[N];
  for (int i = 0; i < N; i++)
    full[i] = (float)i; /* exact in bf16 up to 256, scaled below */
  for (int i = 0; i < N; i++)
    bf[i] = (uint16_t)(0x3f80 + i); /* distinct bfloat16 values */
  const char *p = path_of("s.safetensors");
  struct mr_st_writer *w;
  ck_assert_int_eq(mr_st_writer_new(p, 0, &w), 0);
  int64_t shape[4] = {A, B, C, D};
  ck_assert_int_eq(mr_st_writer_add(w, "x", MR_F32, 4, shape, full), 0);
  ck_assert_int_eq(mr_st_writer_add(w, "y", MR_BF16, 4, shape, bf), 0);
  ck_assert_int_eq(mr_st_writer_finish(w), 0);
  mr_st_writer_free(w);
  struct mr_st_file *f;
  ck_assert_int_eq(mr_st_open(p, &f), 0);
  const struct mr_st_tensor *tx = mr_st_find(f, "x"), *ty = mr_st_find(f, "y");
  uint32_t s = 1;
  float out[N];
  uint16_t outb[N];
  for (int trial = 0; trial < 300; trial++) {
    int64_t st[4], ct[4];
    for (int k = 0; k < 4; k++) {
      s = s * 1103515245u + 12345u;
      st[k] = (int64_t)((s >> 8) % (uint32_t)shape[k]);
      s = s * 1103515245u + 12345u;
      ct[k] = 1 + (int64_t)((s >> 8) % (uint32_t)(shape[k] - st[k]));
      if (trial % 5 == 0 && k >= 2) { /* whole inner dims */
        st[k] = 0;
        ct[k] = shape[k];
      }
    }
    ck_assert_int_eq(mr_st_read_slice(f, tx, st, ct, MR_F32, out), 0);
    ck_assert_int_eq(mr_st_read_slice(f, ty, st, ct, MR_BF16, outb), 0);
    int o = 0;
    for (int a = 0; a < ct[0]; a++)
      for (int b = 0; b < ct[1]; b++)
        for (int c = 0; c < ct[2]; c++)
          for (int d = 0; d < ct[3]; d++, o++) {
            int64_t i = (((st[0] + a) * B + st[1] + b) * C + st[2] + c) * D +
                        st[3] + d;
            ck_assert(out[o] == full[i]);
            ck_assert_uint_eq(outb[o], bf[i]);
          }
  }
  /* rows, converted from bf16 to f32: bit pattern h -> h << 16 */
  ck_assert_int_eq(mr_st_read_rows(f, ty, 1, 2, MR_F32, out), 0);
  for (int i = 0; i < 2 * B * C * D; i++) {
    uint32_t bits;
    memcpy(&bits, &out[i], 4);
    ck_assert_uint_eq(bits, (uint32_t)bf[B * C * D + i] << 16);
  }
  /* out of range, and empty */
  ck_assert_int_eq(mr_st_read_rows(f, tx, 2, 2, MR_F32, out), MR_ERANGE);
  ck_assert_int_eq(mr_st_read_slice(f, tx, (int64_t[]){0, 0, 0, -1},
                                    (int64_t[]){1, 1, 1, 1}, MR_F32, out),
                   MR_ERANGE);
  ck_assert_int_eq(mr_st_read_slice(f, tx, (int64_t[]){0, 0, 0, 6},
                                    (int64_t[]){1, 1, 1, 0}, MR_F32, out),
                   0);
  mr_st_free(f);
}
END_TEST

/* ---- malformed files, each built here ---- */

/* header text (length given by hlen, or strlen) then ndata bytes */
static const char *bad_file(const char *name, const char *header, uint64_t hlen,
                            size_t ndata) {
  const char *p = path_of(name);
  FILE *f = fopen(p, "wb");
  ck_assert_ptr_nonnull(f);
  size_t n = strlen(header);
  uint64_t len = hlen ? hlen : n;
  uint8_t h8[8];
  for (int i = 0; i < 8; i++)
    h8[i] = (uint8_t)(len >> (8 * i));
  fwrite(h8, 1, 8, f);
  fwrite(header, 1, n, f);
  for (size_t i = 0; i < ndata; i++)
    fputc((int)i, f);
  fclose(f);
  return p;
}

static void expect_bad(const char *p, const char *needle1,
                       const char *needle2) {
  struct mr_st_file *f = (struct mr_st_file *)1;
  mr_error_clear();
  int rc = mr_st_open(p, &f);
  const char *m = mr_error_message();
  ck_assert_msg(rc == MR_EFORMAT, "%s: rc %d (%s)", p, rc, m);
  ck_assert_ptr_null(f);
  ck_assert_msg(strstr(m, p) != NULL, "\"%s\" does not name the file", m);
  ck_assert_msg(strstr(m, needle1) != NULL, "\"%s\" lacks \"%s\"", m, needle1);
  if (needle2 != NULL)
    ck_assert_msg(strstr(m, needle2) != NULL, "\"%s\" lacks \"%s\"", m,
                  needle2);
}

#define T1(name, off) \
  "{\"" name "\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":" off "}"

START_TEST(test_safetensors_rejects_malformed_headers) {
  /* short file */
  const char *p = path_of("short");
  FILE *fp = fopen(p, "wb");
  fwrite("abc", 1, 3, fp);
  fclose(fp);
  expect_bad(p, "at least 8", NULL);
  expect_bad(bad_file("beyond", "{}", 4096, 0), "beyond the file", NULL);
  expect_bad(bad_file("huge", "{}", 200000000, 0), "at most", NULL);
  expect_bad(bad_file("array", "[1, 2]  ", 0, 0), "JSON object", NULL);
  expect_bad(bad_file("string", "\"x\"", 0, 0), "JSON object", NULL);
  expect_bad(bad_file("broken", "{\"a\": ", 0, 0), "malformed JSON", NULL);
  expect_bad(bad_file("trailing", "{}  x", 0, 0), "after the JSON", NULL);
  expect_bad(bad_file("notobj", "{\"w\": 5}", 0, 0), "\"w\"", "expected an "
                                                              "object");
  expect_bad(bad_file("nodtype", "{\"w\":{\"shape\":[1],\"data_offsets\":"
                                 "[0,4]}}",
                      0, 4),
             "\"w\"", "dtype");
  expect_bad(bad_file("dtype", "{\"w\":{\"dtype\":\"Q7\",\"shape\":[1],"
                               "\"data_offsets\":[0,4]}}",
                      0, 4),
             "\"w\"", "unsupported dtype \"Q7\"");
  expect_bad(bad_file("shape", "{\"w\":{\"dtype\":\"F32\",\"shape\":3,"
                               "\"data_offsets\":[0,4]}}",
                      0, 4),
             "\"w\"", "shape");
  expect_bad(bad_file("frac", "{\"w\":{\"dtype\":\"F32\",\"shape\":[2.5],"
                              "\"data_offsets\":[0,10]}}",
                      0, 10),
             "\"w\"", "shape[0]: expected a non-negative integer");
  expect_bad(bad_file("neg", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1,-1],"
                             "\"data_offsets\":[0,4]}}",
                      0, 4),
             "\"w\"", "shape[1]");
  expect_bad(bad_file("strdim", "{\"w\":{\"dtype\":\"F32\",\"shape\":[\"1\"],"
                                "\"data_offsets\":[0,4]}}",
                      0, 4),
             "\"w\"", "shape[0]");
  expect_bad(bad_file("rank", "{\"w\":{\"dtype\":\"U8\",\"shape\":"
                              "[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}",
                      0, 1),
             "\"w\"", "rank 9");
  expect_bad(bad_file("offs3", T1("w", "[0,4,8]") "}", 0, 8), "\"w\"",
             "data_offsets");
  expect_bad(bad_file("offsorder", T1("w", "[8,0]") "}", 0, 8), "\"w\"",
             "begin <= end");
  expect_bad(bad_file("range", T1("w", "[0,8]") "}", 0, 4), "\"w\"",
             "out of range");
  expect_bad(bad_file("size", T1("w", "[0,12]") "}", 0, 12), "\"w\"",
             "needs 8 bytes");
  expect_bad(bad_file("overlap",
                      T1("a", "[0,8]") ",\"b\":{\"dtype\":\"F32\",\"shape\":"
                                       "[2],\"data_offsets\":[4,12]}}",
                      0, 12),
             "overlap", "\"a\"");
  expect_bad(bad_file("hole",
                      T1("a", "[0,8]") ",\"b\":{\"dtype\":\"F32\",\"shape\":"
                                       "[2],\"data_offsets\":[12,20]}}",
                      0, 20),
             "hole", "\"b\"");
  expect_bad(bad_file("tail", T1("a", "[0,8]") "}", 0, 16), "16 bytes",
             "cover 8");
  expect_bad(bad_file("dup",
                      T1("a", "[0,8]") ",\"a\":{\"dtype\":\"F32\",\"shape\":"
                                       "[2],\"data_offsets\":[8,16]}}",
                      0, 16),
             "\"a\"", "twice");
  expect_bad(bad_file("meta", "{\"__metadata__\":{\"k\":1}}", 0, 0),
             "__metadata__", "\"k\"");
  expect_bad(bad_file("metaobj", "{\"__metadata__\":[1]}", 0, 0),
             "__metadata__", "object");
  expect_bad(bad_file("noname", T1("", "[0,8]") "}", 0, 8), "name", NULL);
  /* a directory */
  struct mr_st_file *f;
  ck_assert_int_eq(mr_st_open(dir, &f), MR_EIO);
  ck_assert_int_eq(mr_st_open(path_of("missing"), &f), MR_ENOENT);
}
END_TEST

START_TEST(test_safetensors_accepts_padding_and_empty) {
  const char *p = bad_file("pad", T1("w", "[0,8]") "}     \n ", 0, 8);
  struct mr_st_file *f;
  ck_assert_msg(mr_st_open(p, &f) == 0, "%s", mr_error_message());
  ck_assert_int_eq(mr_st_count(f), 1);
  mr_st_free(f);
  ck_assert_int_eq(mr_st_open(bad_file("empty", "{}", 0, 0), &f), 0);
  ck_assert_int_eq(mr_st_count(f), 0);
  mr_st_free(f);
  mr_st_free(NULL);
}
END_TEST

START_TEST(test_safetensors_writer_errors) {
  struct mr_st_writer *w;
  float x = 0;
  ck_assert_int_eq(mr_st_writer_new(path_of("nodir/x.safetensors"), 0, &w), 0);
  ck_assert_int_eq(mr_st_writer_add(w, "", MR_F32, 0, NULL, &x), MR_EINVAL);
  ck_assert_int_eq(mr_st_writer_add(w, "__metadata__", MR_F32, 0, NULL, &x),
                   MR_EINVAL);
  int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  ck_assert_int_eq(mr_st_writer_add(w, "r", MR_F32, 9, nine, &x), MR_EINVAL);
  ck_assert_int_eq(mr_st_writer_add(w, "n", MR_F32, 1, (int64_t[]){-2}, &x),
                   MR_EINVAL);
  ck_assert_int_eq(mr_st_writer_add_converted(w, "c", MR_F32, 0, NULL, MR_I32,
                                              &x),
                   MR_EINVAL);
  ck_assert_int_eq(mr_st_writer_add(w, "ok", MR_F32, 0, NULL, &x), 0);
  mr_error_clear();
  ck_assert_int_eq(mr_st_writer_finish(w), MR_ENOENT);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "nodir/x.safetensors"));
  mr_st_writer_free(w);
  mr_st_writer_free(NULL);
}
END_TEST

/* ---- checksums taken while writing ---- */

/* XXH3-128 of n bytes by libxxhash's one-shot function (the streaming
 * checksum under test is fed piece by piece by the writer's threads), in
 * XXH128's canonical big-endian hex. */
static void reference_checksum(const void *p, size_t n, char hex[MR_CHECKSUM_HEX]) {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits(p, n));
  for (size_t i = 0; i < sizeof c.digest; i++)
    snprintf(hex + 2 * i, 3, "%02x", c.digest[i]);
}

/* The streaming checksum fed in two pieces split anywhere against the
 * one-shot reference, every length up to 1100 bytes. */
START_TEST(test_checksum_matches_reference_every_length_and_split) {
  enum { MAX = 1100 };
  uint8_t *b = malloc(MAX);
  ck_assert_ptr_nonnull(b);
  for (size_t i = 0; i < MAX; i++)
    b[i] = (uint8_t)(i * 131 + 7);
  char got[MR_CHECKSUM_HEX], want[MR_CHECKSUM_HEX];
  for (size_t n = 0; n <= MAX; n += n < 300 ? 1 : 37)
    for (size_t split = 0; split <= n; split += n / 5 + 1) {
      struct mr_checksum h;
      ck_assert_int_eq(mr_checksum_init(&h), 0);
      mr_checksum_update(&h, b, split);
      mr_checksum_update(&h, b + split, n - split);
      mr_checksum_final(&h, got);
      reference_checksum(b, n, want);
      ck_assert_msg(strcmp(got, want) == 0, "%zu bytes split at %zu", n, split);
    }
  free(b);
}
END_TEST

/* Writes a file of a (rows x 1024 F32), b (5 F32) and c (b as BF16) with
 * flags and checks that the checksum given is that of the bytes on disk
 * and that the data reads back. */
static void check_hashed_write(const char *p, int flags, const float *a, int64_t rows) {
  float small[5] = {1, 2, 3, 4, 5};
  struct mr_st_writer *w;
  char hex[MR_CHECKSUM_HEX], want[MR_CHECKSUM_HEX], again[MR_CHECKSUM_HEX];
  ck_assert_int_eq(mr_st_writer_new(p, flags | MR_ST_WRITE_CHECKSUM, &w), 0);
  ck_assert_int_eq(mr_st_writer_add(w, "a", MR_F32, 2, (int64_t[]){rows, 1024}, a), 0);
  ck_assert_int_eq(mr_st_writer_add(w, "b", MR_F32, 1, (int64_t[]){5}, small), 0);
  ck_assert_int_eq(mr_st_writer_add_converted(w, "c", MR_BF16, 1, (int64_t[]){5}, MR_F32,
                                              small),
                   0);
  ck_assert_int_eq(mr_st_writer_add_metadata(w, "format", "pt"), 0);
  ck_assert_int_eq(mr_st_writer_checksum(w, hex), MR_EINVAL); /* not finished */
  ck_assert_msg(mr_st_writer_finish(w) == 0, "%s", mr_error_message());
  ck_assert_int_eq(mr_st_writer_checksum(w, hex), 0);
  mr_st_writer_free(w);

  FILE *f = fopen(p, "rb");
  ck_assert_ptr_nonnull(f);
  fseek(f, 0, SEEK_END);
  size_t size = (size_t)ftell(f);
  rewind(f);
  uint8_t *bytes = malloc(size);
  ck_assert_ptr_nonnull(bytes);
  ck_assert_uint_eq(fread(bytes, 1, size, f), size);
  fclose(f);
  reference_checksum(bytes, size, want);
  ck_assert_str_eq(hex, want);
  ck_assert_int_eq(mr_checksum_file(p, again), 0);
  ck_assert_str_eq(again, want);
  free(bytes);

  struct mr_st_file *sf;
  ck_assert_msg(mr_st_open(p, &sf) == 0, "%s", mr_error_message());
  ck_assert_int_eq(memcmp(mr_st_data(sf, mr_st_find(sf, "a")), a,
                          sizeof(float) * (size_t)rows * 1024),
                   0);
  float back[5];
  ck_assert_int_eq(mr_st_read(sf, mr_st_find(sf, "c"), MR_F32, back), 0);
  ck_assert(back[0] == 1 && back[4] == 5);
  ck_assert_int_eq(mr_st_read(sf, mr_st_find(sf, "b"), MR_F32, back), 0);
  ck_assert(back[0] == 1 && back[4] == 5);
  mr_st_free(sf);
}

/* Durable files larger than the write-behind window (pieces are waited for
 * and dropped from the page cache on the way) and than the direct-I/O ring
 * (its buffers are reused), of a size that is no multiple of the block
 * size, and small ones; hashed while written. */
START_TEST(test_safetensors_durable_write_hashes_what_it_wrote) {
  enum { ROWS = 25000 }; /* 100 MB of F32 */
  float *a = malloc(sizeof(float) * ROWS * 1024);
  ck_assert_ptr_nonnull(a);
  for (size_t i = 0; i < (size_t)ROWS * 1024; i++)
    a[i] = (float)(i % 999983) * 0.5f;
  const int flags[2] = {MR_ST_WRITE_FSYNC, MR_ST_WRITE_DIRECT};
  for (int k = 0; k < 2; k++) {
    check_hashed_write(path_of("durable.safetensors"), flags[k], a, ROWS);
    check_hashed_write(path_of("small.safetensors"), flags[k], a, 3);
  }
  /* a filesystem without O_DIRECT (tmpfs) is written through the cache */
  char shm[64];
  snprintf(shm, sizeof shm, "/dev/shm/mr-test-st-%d.safetensors", (int)getpid());
  if (access("/dev/shm", W_OK) == 0) {
    check_hashed_write(shm, MR_ST_WRITE_DIRECT, a, 300);
    unlink(shm);
  }

  /* without the flag there is no checksum to give */
  struct mr_st_writer *w;
  char hex[MR_CHECKSUM_HEX];
  ck_assert_int_eq(mr_st_writer_new(path_of("plain.safetensors"), 0, &w), 0);
  ck_assert_int_eq(mr_st_writer_add(w, "b", MR_F32, 1, (int64_t[]){5}, a), 0);
  ck_assert_int_eq(mr_st_writer_finish(w), 0);
  ck_assert_int_eq(mr_st_writer_checksum(w, hex), MR_EINVAL);
  mr_st_writer_free(w);
  free(a);
}
END_TEST

/* A write that fails half way (the file-size limit, as a full disk would)
 * is an error and leaves no file of its own behind, through the page cache
 * or not; the file that was at the path (a previous run's weights) stays
 * as it was. */
START_TEST(test_safetensors_failed_write_keeps_the_file_there) {
  enum { N = 4 << 20 }; /* 16 MiB of F32 */
  float *a = calloc(N, sizeof(float));
  ck_assert_ptr_nonnull(a);
  const float before[3] = {1.5f, -2.0f, 3.25f};
  struct mr_st_writer *w0;
  ck_assert_int_eq(mr_st_writer_new(path_of("full.safetensors"), 0, &w0), 0);
  ck_assert_int_eq(mr_st_writer_add(w0, "old", MR_F32, 1, (int64_t[]){3}, before), 0);
  ck_assert_int_eq(mr_st_writer_finish(w0), 0);
  mr_st_writer_free(w0);
  signal(SIGXFSZ, SIG_IGN); /* write(2) returns EFBIG instead */
  struct rlimit lim = {.rlim_cur = 5 << 20, .rlim_max = RLIM_INFINITY};
  ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &lim), 0); /* this test's process only */
  const int flags[3] = {MR_ST_WRITE_FSYNC, MR_ST_WRITE_DIRECT | MR_ST_WRITE_CHECKSUM,
                        MR_ST_WRITE_DIRECT};
  for (int k = 0; k < 3; k++) {
    const char *p = path_of("full.safetensors");
    struct mr_st_writer *w;
    char hex[MR_CHECKSUM_HEX];
    ck_assert_int_eq(mr_st_writer_new(p, flags[k], &w), 0);
    ck_assert_int_eq(mr_st_writer_add(w, "a", MR_F32, 1, (int64_t[]){N}, a), 0);
    mr_error_clear();
    ck_assert_int_eq(mr_st_writer_finish(w), MR_EIO);
    ck_assert_ptr_nonnull(strstr(mr_error_message(), "full.safetensors"));
    ck_assert_int_eq(mr_st_writer_checksum(w, hex), MR_EINVAL);
    mr_st_writer_free(w);
    struct mr_st_file *f;
    ck_assert_int_eq(mr_st_open(p, &f), 0);
    const struct mr_st_tensor *t = mr_st_find(f, "old");
    ck_assert_ptr_nonnull(t);
    ck_assert_int_eq(memcmp(mr_st_data(f, t), before, sizeof before), 0);
    mr_st_free(f);
    ck_assert_int_eq(mr_t_count_files(dir), 1);
  }
  free(a);
}
END_TEST

/* ---- the index ---- */

START_TEST(test_safetensors_index_round_trip) {
  struct mr_st_index *ix;
  ck_assert_int_eq(mr_st_index_new(&ix), 0);
  ck_assert_int_eq(mr_st_index_add(ix, "model.norm.weight",
                                   "model-00002-of-00002.safetensors"),
                   0);
  ck_assert_int_eq(mr_st_index_add(ix, "lm_head.weight",
                                   "model-00002-of-00002.safetensors"),
                   0);
  ck_assert_int_eq(mr_st_index_add(ix, "model.embed_tokens.weight",
                                   "model-00001-of-00002.safetensors"),
                   0);
  ck_assert_int_eq(mr_st_index_add(ix, "lm_head.weight", "x"), MR_EINVAL);
  mr_st_index_set_total_size(ix, 13476839424ull); /* beyond 2^32 */
  const char *p = path_of("model.safetensors.index.json");
  ck_assert_int_eq(mr_st_index_write(ix, p), 0);
  mr_st_index_free(ix);
  /* the JSON as any reader sees it */
  FILE *fp = fopen(p, "rb");
  char text[4096];
  size_t n = fread(text, 1, sizeof text - 1, fp);
  fclose(fp);
  text[n] = '\0';
  ck_assert_ptr_nonnull(strstr(text, "13476839424"));
  cJSON *root = cJSON_Parse(text);
  ck_assert_ptr_nonnull(root);
  cJSON *ts = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "metadata"),
                                  "total_size");
  ck_assert(cJSON_IsNumber(ts) && ts->valuedouble == 13476839424.0);
  cJSON *wm = cJSON_GetObjectItem(root, "weight_map");
  ck_assert_int_eq(cJSON_GetArraySize(wm), 3);
  ck_assert_str_eq(cJSON_GetObjectItem(wm, "lm_head.weight")->valuestring,
                   "model-00002-of-00002.safetensors");
  cJSON_Delete(root);
  ck_assert_int_eq(mr_st_index_read(p, &ix), 0);
  ck_assert_int_eq(mr_st_index_count(ix), 3);
  ck_assert_uint_eq(mr_st_index_total_size(ix), 13476839424ull);
  ck_assert_str_eq(mr_st_index_file(ix, "model.embed_tokens.weight"),
                   "model-00001-of-00002.safetensors");
  ck_assert_ptr_null(mr_st_index_file(ix, "nope"));
  const char *name, *file;
  mr_st_index_at(ix, 0, &name, &file);
  ck_assert_str_eq(name, "lm_head.weight"); /* name order */
  mr_st_index_free(ix);
  ck_assert_int_ne(access(path_of("model.safetensors.index.json.tmp"), F_OK),
                   0);
}
END_TEST

/* A checkpoint rank file's "pieces" entry is untrusted: whole numbers in
 * range are taken and the read returns the box's elements (worked by hand
 * from the row-major layout); infinities, fractions, negatives, huge values,
 * a box whose size overflows and a count that is not the stored length are
 * each refused with the file and the entry named. */
START_TEST(test_ckpt_pieces_reject_bad_numbers) {
  float f[12];
  for (int i = 0; i < 12; i++)
    f[i] = (float)i;
  static const struct {
    const char *pieces;
    int ok;
  } cases[] = {
      {"{\"w\":[0,0,2,6,0,12]}", 1},
      {"{\"w\":[0,0,2,1e400,0,12]}", 0},
      {"{\"w\":[0,0,2.5,6,0,12]}", 0},
      {"{\"w\":[0,-1,2,6,0,12]}", 0},
      {"{\"w\":[0,0,2,1e30,0,12]}", 0},
      {"{\"w\":[0,0,1099511627776,1099511627776,0,12]}", 0},
      {"{\"w\":[0,0,2,6,0,11]}", 0},
      {"{\"w\":[0,0,2,6,1e400,12]}", 0},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    struct mr_st_writer *w;
    ck_assert_int_eq(mr_st_writer_new(path_of("rank-0.safetensors"), 0, &w), 0);
    ck_assert_int_eq(mr_st_writer_add(w, "w", MR_F32, 1, (int64_t[]){12}, f), 0);
    ck_assert_int_eq(mr_st_writer_add_metadata(w, "pieces", cases[c].pieces), 0);
    ck_assert_int_eq(mr_st_writer_finish(w), 0);
    mr_st_writer_free(w);
    char sum[MR_CHECKSUM_HEX];
    ck_assert_int_eq(mr_checksum_file(path_of("rank-0.safetensors"), sum), 0);
    ck_assert_int_eq(mr_ckpt_write_marker(dir, 1, (const char *[]){"rank-0.safetensors"},
                                          (const char *[]){sum}, 1), 0);
    struct mr_ckpt_reader *r = NULL;
    int rc = mr_ckpt_reader_open(dir, &r);
    if (cases[c].ok) {
      ck_assert_msg(rc == 0, "%s: %s", cases[c].pieces, mr_error_message());
      /* the box rows [1, 2) x cols [2, 5) of the 2 x 6 tensor: 8, 9, 10 */
      float got[3] = {0};
      ck_assert_int_eq(mr_ckpt_reader_read(r, "w", 2, (int64_t[]){2, 6}, (int64_t[]){1, 2},
                                           (int64_t[]){1, 3}, 0, 3, got), 0);
      for (int i = 0; i < 3; i++)
        ck_assert_float_eq(got[i], (float)(1 * 6 + 2 + i));
    } else {
      ck_assert_msg(rc == MR_EFORMAT, "%s accepted", cases[c].pieces);
      ck_assert_ptr_nonnull(strstr(mr_error_message(), "rank-0.safetensors"));
      ck_assert_ptr_nonnull(strstr(mr_error_message(), "pieces.w"));
    }
    mr_ckpt_reader_free(r);
  }
}
END_TEST

START_TEST(test_safetensors_index_rejects_malformed) {
  const char *cases[][2] = {
      {"{\"weight_map\": []}", "weight_map"},
      {"{\"metadata\": {}}", "weight_map"},
      {"{\"weight_map\": {\"a\": 3}}", "weight_map.a"},
      {"{\"weight_map\": {\"a\": \"f\", \"a\": \"g\"}}", "twice"},
      {"{\"metadata\": {\"total_size\": -1}, \"weight_map\": {}}",
       "total_size"},
      {"[1]", "object"},
      {"{\"weight_map\": ", "object"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const char *p = path_of("bad.index.json");
    FILE *fp = fopen(p, "wb");
    fputs(cases[i][0], fp);
    fclose(fp);
    struct mr_st_index *ix = (struct mr_st_index *)1;
    mr_error_clear();
    ck_assert_int_eq(mr_st_index_read(p, &ix), MR_EFORMAT);
    ck_assert_ptr_null(ix);
    ck_assert_msg(strstr(mr_error_message(), cases[i][1]) != NULL &&
                      strstr(mr_error_message(), p) != NULL,
                  "case %zu: %s", i, mr_error_message());
  }
}
END_TEST

/* A rank file `name` in dir holding one piece of tensor w, given as its
 * metadata entry [off.., len.., begin, count] (count floats). */
static void write_piece(const char *name, const char *entry, int64_t count) {
  float f[24] = {0};
  struct mr_st_writer *w;
  char meta[128];
  snprintf(meta, sizeof meta, "{\"w\":%s}", entry);
  ck_assert_int_eq(mr_st_writer_new(path_of(name), 0, &w), 0);
  ck_assert_int_eq(mr_st_writer_add(w, "w", MR_F32, 1, &count, f), 0);
  ck_assert_int_eq(mr_st_writer_add_metadata(w, "pieces", meta), 0);
  ck_assert_int_eq(mr_st_writer_finish(w), 0);
  mr_st_writer_free(w);
}

/* Whether the rank files listed in dir's marker cover w, [4, 6], exactly
 * once; the listed files are r0.. r(n-1). */
static int covers(int n) {
  const char *names[4] = {"r0.safetensors", "r1.safetensors", "r2.safetensors",
                          "r3.safetensors"};
  char sums[4][MR_CHECKSUM_HEX];
  const char *sp[4] = {sums[0], sums[1], sums[2], sums[3]};
  for (int i = 0; i < n; i++)
    ck_assert_int_eq(mr_checksum_file(path_of(names[i]), sums[i]), 0);
  ck_assert_int_eq(mr_ckpt_write_marker(dir, 1, names, sp, n), 0);
  struct mr_ckpt_reader *r;
  ck_assert_int_eq(mr_ckpt_reader_open(dir, &r), 0);
  int rc = mr_ckpt_reader_covers(r, "w", 2, (int64_t[]){4, 6});
  mr_ckpt_reader_free(r);
  return rc;
}

/* The coverage check, worked by hand on a [4, 6] tensor (24 elements):
 * row halves in two files, ZeRO blocks of one box, a half missing, a half
 * twice, and two blocks that overlap by as much as they leave out; a
 * stray file in the folder that the marker does not list is not read. */
START_TEST(test_ckpt_pieces_cover_exactly_once) {
  write_piece("r0.safetensors", "[0,0,2,6,0,12]", 12); /* rows 0-1 */
  write_piece("r1.safetensors", "[2,0,2,6,0,12]", 12); /* rows 2-3 */
  write_piece("r2.safetensors", "[0,0,2,6,0,12]", 12); /* rows 0-1 again */
  ck_assert_int_eq(covers(2), 0);
  ck_assert_int_eq(covers(1), MR_EFORMAT);
  ck_assert_msg(strstr(mr_error_message(), "hold 12 of its 24 elements (a rank file missing)"),
                "%s", mr_error_message());
  ck_assert_int_eq(covers(3), MR_EFORMAT);
  ck_assert_msg(strstr(mr_error_message(), "hold 36 of its 24"), "%s", mr_error_message());
  /* r2 stays in the folder, unlisted: not read */
  ck_assert_int_eq(covers(2), 0);
  write_piece("r0.safetensors", "[0,0,4,6,0,10]", 10); /* ZeRO blocks of the whole box */
  write_piece("r1.safetensors", "[0,0,4,6,10,14]", 14);
  ck_assert_int_eq(covers(2), 0);
  write_piece("r1.safetensors", "[0,0,4,6,8,14]", 14); /* 8..22: 2 twice, 22..24 none */
  ck_assert_int_eq(covers(2), MR_EFORMAT);
  ck_assert_msg(strstr(mr_error_message(), "overlap"), "%s", mr_error_message());
  write_piece("r0.safetensors", "[0,0,2,6,0,12]", 12); /* boxes that meet: rows 0-1, 1-2 */
  write_piece("r1.safetensors", "[1,0,2,6,0,6]", 6);
  write_piece("r2.safetensors", "[3,0,1,6,0,6]", 6);
  ck_assert_int_eq(covers(3), MR_EFORMAT);
  ck_assert_msg(strstr(mr_error_message(), "overlap"), "%s", mr_error_message());
}
END_TEST

static Suite *safetensors_suite(void) {
  Suite *s = suite_create("safetensors");
  TCase *tc = tcase_create("safetensors");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, test_safetensors_reads_reference_file);
  tcase_add_test(tc, test_safetensors_written_file_passes_reference_check);
  tcase_add_test(tc, test_safetensors_round_trip_all_dtypes);
  tcase_add_test(tc, test_safetensors_large_tensor_streams);
  tcase_add_test(tc, test_safetensors_slices_match_full_read);
  tcase_add_test(tc, test_safetensors_rejects_malformed_headers);
  tcase_add_test(tc, test_safetensors_accepts_padding_and_empty);
  tcase_add_test(tc, test_safetensors_writer_errors);
  tcase_add_test(tc, test_checksum_matches_reference_every_length_and_split);
  tcase_add_test(tc, test_safetensors_durable_write_hashes_what_it_wrote);
  tcase_add_test(tc, test_safetensors_failed_write_keeps_the_file_there);
  tcase_add_test(tc, test_safetensors_index_round_trip);
  tcase_add_test(tc, test_safetensors_index_rejects_malformed);
  tcase_add_test(tc, test_ckpt_pieces_reject_bad_numbers);
  tcase_add_test(tc, test_ckpt_pieces_cover_exactly_once);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(safetensors_suite)
