/* test_auth.c - job token handling and the HMAC challenge-response.
 * The coordinator's side of the handshake is played by this test with the
 * MAC primitives, and checked independently against libsodium's one-shot
 * HMAC over the concatenated message. */
#include <check.h>
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check_main.h"
#include "common/auth.h"
#include "common/error.h"
#include "common/rpc.h"
#include "testutil.h"

START_TEST(test_auth_mac_matches_one_shot_hmac) {
  ck_assert_int_eq(mr_auth_init(), 0);
  uint8_t token[32], a[32], b[32], mac[32], ref[32];
  for (int i = 0; i < 32; i++) {
    token[i] = (uint8_t)i;
    a[i] = (uint8_t)(100 + i);
    b[i] = (uint8_t)(200 - i);
  }
  uint8_t msg[14 + 64];
  memcpy(msg, "meshrun-client", 14);
  memcpy(msg + 14, a, 32);
  memcpy(msg + 46, b, 32);
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, token, 32);
  crypto_auth_hmacsha256_update(&st, msg, sizeof msg);
  crypto_auth_hmacsha256_final(&st, ref);
  mr_auth_client_mac(token, a, b, mac);
  ck_assert_int_eq(memcmp(mac, ref, 32), 0);
  /* the server's proof differs from the client's (no reflection) */
  uint8_t smac[32];
  mr_auth_server_mac(token, a, b, smac);
  ck_assert_int_ne(memcmp(mac, smac, 32), 0);
  ck_assert_int_eq(mr_auth_mac_check(mac, ref), 0);
  ref[31] ^= 1;
  ck_assert_int_eq(mr_auth_mac_check(mac, ref), MR_EAUTH);
}
END_TEST

START_TEST(test_auth_token_hex_round_trip) {
  uint8_t token[32], back[32];
  mr_auth_random(token, 32);
  char hex[65];
  mr_auth_token_hex(token, hex);
  ck_assert_uint_eq(strlen(hex), 64);
  ck_assert_int_eq(mr_auth_token_parse(hex, 64, back), 0);
  ck_assert_int_eq(memcmp(token, back, 32), 0);
  ck_assert_int_eq(mr_auth_token_parse(hex, 63, back), MR_EAUTH);
  ck_assert_int_eq(mr_auth_token_parse("zz", 2, back), MR_EAUTH);
}
END_TEST

START_TEST(test_auth_token_file_must_be_private) {
  char dir[] = "/tmp/mr-auth-XXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  char path[256];
  snprintf(path, sizeof path, "%s/token", dir);
  uint8_t token[32], back[32];
  mr_auth_random(token, 32);
  ck_assert_int_eq(mr_auth_token_write_file(path, token), 0);
  struct stat st;
  ck_assert_int_eq(stat(path, &st), 0);
  ck_assert_int_eq(st.st_mode & 0777, 0600);
  ck_assert_int_eq(mr_auth_token_read_file(path, back), 0);
  ck_assert_int_eq(memcmp(token, back, 32), 0);
  /* a second writer (another node 0 starting) does not replace it, and
   * leaves nothing beside it */
  uint8_t other[32];
  mr_auth_random(other, 32);
  ck_assert_int_lt(mr_auth_token_write_file(path, other), 0);
  ck_assert_int_eq(mr_auth_token_read_file(path, back), 0);
  ck_assert_int_eq(memcmp(token, back, 32), 0);
  ck_assert_int_eq(mr_t_count_files(dir), 1);
  chmod(path, 0644);
  ck_assert_int_eq(mr_auth_token_read_file(path, back), MR_EAUTH);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "0600"));
  unlink(path);
  ck_assert_int_eq(mr_auth_token_read_file(path, back), MR_ENOENT);
  rmdir(dir);
}
END_TEST

struct server_args {
  int fd;
  uint8_t token[32];
  int client_ok; /* out: the client's proof verified */
};

/* A minimal coordinator side, written against the primitives. */
static void *server_main(void *p) {
  struct server_args *sa = p;
  uint8_t nonce[32];
  mr_auth_random(nonce, 32);
  Meshrun__AuthChallenge ch = MESHRUN__AUTH_CHALLENGE__INIT;
  ch.nonce.data = nonce;
  ch.nonce.len = 32;
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_AUTH_CHALLENGE;
  env.auth_challenge = &ch;
  mr_rpc_send_fd(sa->fd, &env);
  struct mr_frame_reader r;
  mr_frame_reader_init(&r, 1 << 16);
  Meshrun__Envelope *in;
  if (mr_rpc_recv_fd(sa->fd, &r, 2000, &in) == 0) {
    uint8_t expect[32];
    mr_auth_client_mac(sa->token, nonce, in->auth_response->nonce.data, expect);
    sa->client_ok = mr_auth_mac_check(expect, in->auth_response->mac.data) == 0;
    uint8_t smac[32];
    mr_auth_server_mac(sa->token, nonce, in->auth_response->nonce.data, smac);
    Meshrun__AuthResult res = MESHRUN__AUTH_RESULT__INIT;
    res.ok = sa->client_ok;
    res.mac.data = smac;
    res.mac.len = sa->client_ok ? 32 : 0;
    Meshrun__Envelope out = MESHRUN__ENVELOPE__INIT;
    out.msg_case = MESHRUN__ENVELOPE__MSG_AUTH_RESULT;
    out.auth_result = &res;
    mr_rpc_send_fd(sa->fd, &out);
    mr_rpc_free(in);
  }
  mr_frame_reader_close(&r);
  return NULL;
}

static int handshake_with(const uint8_t server_token[32],
                          const uint8_t client_token[32], int *client_ok) {
  int sv[2];
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  struct server_args sa = {.fd = sv[0]};
  memcpy(sa.token, server_token, 32);
  pthread_t th;
  pthread_create(&th, NULL, server_main, &sa);
  struct mr_frame_reader r;
  mr_frame_reader_init(&r, 1 << 16);
  int rc = mr_auth_client_handshake(sv[1], &r, client_token, 2000);
  pthread_join(th, NULL);
  mr_frame_reader_close(&r);
  close(sv[0]);
  close(sv[1]);
  *client_ok = sa.client_ok;
  return rc;
}

START_TEST(test_auth_handshake_right_token) {
  uint8_t token[32];
  mr_auth_random(token, 32);
  int ok = 0;
  ck_assert_int_eq(handshake_with(token, token, &ok), 0);
  ck_assert_int_eq(ok, 1);
}
END_TEST

START_TEST(test_auth_handshake_wrong_token_refused) {
  uint8_t token[32], other[32];
  mr_auth_random(token, 32);
  memcpy(other, token, 32);
  other[0] ^= 0x80;
  int ok = 1;
  ck_assert_int_eq(handshake_with(token, other, &ok), MR_EAUTH);
  ck_assert_int_eq(ok, 0);
}
END_TEST

static Suite *auth_suite(void) {
  Suite *s = suite_create("auth");
  TCase *tc = tcase_create("hmac");
  tcase_add_test(tc, test_auth_mac_matches_one_shot_hmac);
  tcase_add_test(tc, test_auth_token_hex_round_trip);
  tcase_add_test(tc, test_auth_token_file_must_be_private);
  tcase_add_test(tc, test_auth_handshake_right_token);
  tcase_add_test(tc, test_auth_handshake_wrong_token_refused);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(auth_suite)
