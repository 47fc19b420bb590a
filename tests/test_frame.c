/* test_frame.c - frame codec and envelope validation. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "common/error.h"
#include "common/frame.h"
#include "common/rpc.h"

static uint8_t *encode_hello(uint32_t version, size_t *len) {
  Meshrun__Hello hello = MESHRUN__HELLO__INIT;
  hello.protocol_version = version;
  hello.host = "node7";
  hello.pid = 4242;
  hello.requested_rank = 3;
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_HELLO;
  env.hello = &hello;
  uint8_t *frame = NULL;
  ck_assert_int_eq(mr_rpc_encode(&env, &frame, len), 0);
  return frame;
}

START_TEST(test_frame_header_is_little_endian) {
  uint8_t h[4];
  mr_frame_put_header(h, 0x01020304u);
  ck_assert_int_eq(h[0], 0x04);
  ck_assert_int_eq(h[1], 0x03);
  ck_assert_int_eq(h[2], 0x02);
  ck_assert_int_eq(h[3], 0x01);
  ck_assert_uint_eq(mr_frame_get_header(h), 0x01020304u);
}
END_TEST

START_TEST(test_frame_round_trip_byte_by_byte) {
  size_t len;
  uint8_t *frame = encode_hello(MR_PROTOCOL_VERSION, &len);
  /* two frames back to back, fed one byte at a time */
  struct mr_frame_reader r;
  mr_frame_reader_init(&r, 1 << 20);
  int frames = 0;
  for (int copy = 0; copy < 2; copy++) {
    for (size_t i = 0; i < len; i++) {
      ck_assert_int_eq(mr_frame_reader_feed(&r, frame + i, 1), 0);
      const uint8_t *p;
      size_t n;
      int got = mr_frame_reader_next(&r, &p, &n);
      ck_assert_int_ge(got, 0);
      if (got == 1) {
        ck_assert_uint_eq(i, len - 1); /* only complete at the last byte */
        ck_assert_uint_eq(n, len - 4);
        Meshrun__Envelope *env;
        ck_assert_int_eq(mr_rpc_decode(p, n, &env), 0);
        ck_assert_int_eq(env->msg_case, MESHRUN__ENVELOPE__MSG_HELLO);
        ck_assert_str_eq(env->hello->host, "node7");
        ck_assert_uint_eq(env->hello->pid, 4242);
        ck_assert_int_eq(env->hello->requested_rank, 3);
        mr_rpc_free(env);
        frames++;
      }
    }
  }
  ck_assert_int_eq(frames, 2);
  ck_assert_uint_eq(mr_frame_reader_pending(&r), 0);
  mr_frame_reader_close(&r);
  free(frame);
}
END_TEST

START_TEST(test_frame_truncated_yields_nothing) {
  size_t len;
  uint8_t *frame = encode_hello(MR_PROTOCOL_VERSION, &len);
  struct mr_frame_reader r;
  mr_frame_reader_init(&r, 1 << 20);
  ck_assert_int_eq(mr_frame_reader_feed(&r, frame, len - 1), 0);
  const uint8_t *p;
  size_t n;
  ck_assert_int_eq(mr_frame_reader_next(&r, &p, &n), 0);
  ck_assert_uint_eq(mr_frame_reader_pending(&r), len - 1);
  /* a payload cut short and decoded anyway is an error, not a crash */
  Meshrun__Envelope *env = NULL;
  int rc = mr_rpc_decode(frame + 4, len - 4 - 3, &env);
  ck_assert_int_lt(rc, 0);
  ck_assert_ptr_null(env);
  mr_frame_reader_close(&r);
  free(frame);
}
END_TEST

START_TEST(test_frame_oversized_rejected_before_buffering) {
  struct mr_frame_reader r;
  mr_frame_reader_init(&r, 1000);
  uint8_t h[4];
  mr_frame_put_header(h, 1001);
  ck_assert_int_eq(mr_frame_reader_feed(&r, h, 4), 0);
  const uint8_t *p;
  size_t n;
  ck_assert_int_eq(mr_frame_reader_next(&r, &p, &n), MR_ETOOBIG);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "1001"));
  /* exactly at the limit is fine */
  struct mr_frame_reader r2;
  mr_frame_reader_init(&r2, 1000);
  mr_frame_put_header(h, 1000);
  uint8_t *body = calloc(1, 1000);
  mr_frame_reader_feed(&r2, h, 4);
  mr_frame_reader_feed(&r2, body, 1000);
  ck_assert_int_eq(mr_frame_reader_next(&r2, &p, &n), 1);
  ck_assert_uint_eq(n, 1000);
  free(body);
  mr_frame_reader_close(&r);
  mr_frame_reader_close(&r2);
}
END_TEST

START_TEST(test_frame_garbage_rejected) {
  /* deterministic pseudo-random garbage: each either decodes to a valid
   * envelope or is rejected; never crashes.  A field-7 wire-type-7 tag is
   * invalid protobuf for certain. */
  uint8_t bad[] = {0x3f, 0xff, 0xff, 0xff};
  Meshrun__Envelope *env = NULL;
  ck_assert_int_eq(mr_rpc_decode(bad, sizeof bad, &env), MR_EPROTO);
  uint32_t x = 12345;
  int rejected = 0;
  for (int t = 0; t < 2000; t++) {
    uint8_t buf[64];
    size_t n = (size_t)(t % 64);
    for (size_t i = 0; i < n; i++) {
      x = x * 1103515245u + 12345u;
      buf[i] = (uint8_t)(x >> 16);
    }
    env = NULL;
    int rc = mr_rpc_decode(buf, n, &env);
    if (rc < 0) {
      ck_assert_ptr_null(env);
      rejected++;
    } else {
      mr_rpc_free(env);
    }
  }
  ck_assert_int_gt(rejected, 1000);
  /* the empty payload decodes to an envelope with nothing set: rejected */
  ck_assert_int_eq(mr_rpc_decode((const uint8_t *)"", 0, &env), MR_EPROTO);
}
END_TEST

START_TEST(test_frame_wrong_version_hello_rejected) {
  size_t len;
  uint8_t *frame = encode_hello(MR_PROTOCOL_VERSION + 1, &len);
  Meshrun__Envelope *env = NULL;
  ck_assert_int_eq(mr_rpc_decode(frame + 4, len - 4, &env), MR_EVERSION);
  char said[64];
  snprintf(said, sizeof said, "speaks protocol %u, expected %u", MR_PROTOCOL_VERSION + 1,
           MR_PROTOCOL_VERSION);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), said));
  free(frame);
}
END_TEST

START_TEST(test_frame_bad_nonce_length_rejected) {
  uint8_t nonce[31] = {0};
  Meshrun__AuthChallenge ch = MESHRUN__AUTH_CHALLENGE__INIT;
  ch.nonce.data = nonce;
  ch.nonce.len = sizeof nonce;
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_AUTH_CHALLENGE;
  env.auth_challenge = &ch;
  uint8_t *frame;
  size_t len;
  ck_assert_int_eq(mr_rpc_encode(&env, &frame, &len), 0);
  Meshrun__Envelope *out = NULL;
  ck_assert_int_eq(mr_rpc_decode(frame + 4, len - 4, &out), MR_EPROTO);
  free(frame);
}
END_TEST

static Suite *frame_suite(void) {
  Suite *s = suite_create("frame");
  TCase *tc = tcase_create("codec");
  tcase_add_test(tc, test_frame_header_is_little_endian);
  tcase_add_test(tc, test_frame_round_trip_byte_by_byte);
  tcase_add_test(tc, test_frame_truncated_yields_nothing);
  tcase_add_test(tc, test_frame_oversized_rejected_before_buffering);
  tcase_add_test(tc, test_frame_garbage_rejected);
  tcase_add_test(tc, test_frame_wrong_version_hello_rejected);
  tcase_add_test(tc, test_frame_bad_nonce_length_rejected);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(frame_suite)
