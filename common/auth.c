/* auth.c - job token and HMAC-SHA256 challenge-response. */
#include "common/auth.h"

#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/rpc.h"

int mr_auth_init(void) {
  if (sodium_init() < 0)
    return mr_error_set(MR_ESYS, "libsodium failed to initialise");
  return 0;
}

void mr_auth_random(uint8_t *buf, size_t n) { randombytes_buf(buf, n); }

static void mac3(const uint8_t token[MR_TOKEN_BYTES], const char *label,
                 const uint8_t *a, const uint8_t *b, uint8_t mac[MR_MAC_BYTES]) {
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, token, MR_TOKEN_BYTES);
  crypto_auth_hmacsha256_update(&st, (const uint8_t *)label, strlen(label));
  crypto_auth_hmacsha256_update(&st, a, MR_NONCE_BYTES);
  crypto_auth_hmacsha256_update(&st, b, MR_NONCE_BYTES);
  crypto_auth_hmacsha256_final(&st, mac);
}

void mr_auth_client_mac(const uint8_t token[MR_TOKEN_BYTES],
                        const uint8_t coord_nonce[MR_NONCE_BYTES],
                        const uint8_t worker_nonce[MR_NONCE_BYTES],
                        uint8_t mac[MR_MAC_BYTES]) {
  mac3(token, "meshrun-client", coord_nonce, worker_nonce, mac);
}

void mr_auth_server_mac(const uint8_t token[MR_TOKEN_BYTES],
                        const uint8_t coord_nonce[MR_NONCE_BYTES],
                        const uint8_t worker_nonce[MR_NONCE_BYTES],
                        uint8_t mac[MR_MAC_BYTES]) {
  mac3(token, "meshrun-server", worker_nonce, coord_nonce, mac);
}

int mr_auth_mac_check(const uint8_t a[MR_MAC_BYTES],
                      const uint8_t b[MR_MAC_BYTES]) {
  return crypto_verify_32(a, b) == 0 ? 0 : MR_EAUTH;
}

void mr_auth_token_hex(const uint8_t token[MR_TOKEN_BYTES], char hex[65]) {
  sodium_bin2hex(hex, 65, token, MR_TOKEN_BYTES);
}

int mr_auth_token_parse(const char *text, size_t len,
                        uint8_t token[MR_TOKEN_BYTES]) {
  size_t bin_len = 0;
  const char *end = NULL;
  if (sodium_hex2bin(token, MR_TOKEN_BYTES, text, len, " \t\r\n", &bin_len,
                     &end) != 0 ||
      bin_len != MR_TOKEN_BYTES)
    return mr_error_set(MR_EAUTH, "job token: expected 64 hex characters");
  for (; end != NULL && end < text + len; end++)
    if (*end != ' ' && *end != '\n' && *end != '\r' && *end != '\t' && *end != '\0')
      return mr_error_set(MR_EAUTH, "job token: trailing characters");
  return 0;
}

int mr_auth_token_read_fd(int fd, uint8_t token[MR_TOKEN_BYTES]) {
  char buf[160];
  ssize_t n = pread(fd, buf, sizeof buf, 0);
  if (n < 0)
    return mr_error_set(MR_ESYS, "job token descriptor %d: %s", fd, strerror(errno));
  return mr_auth_token_parse(buf, (size_t)n, token);
}

int mr_auth_token_read_file(const char *path, uint8_t token[MR_TOKEN_BYTES]) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return mr_error_set(mr_from_errno(errno), "job token file %s: %s", path,
                        strerror(errno));
  struct stat st;
  int rc = 0;
  if (fstat(fd, &st) != 0)
    rc = mr_error_set(MR_ESYS, "job token file %s: %s", path, strerror(errno));
  else if ((st.st_mode & 077) != 0)
    rc = mr_error_set(MR_EAUTH,
                      "job token file %s: mode %03o lets others read it; "
                      "expected 0600",
                      path, (unsigned)(st.st_mode & 0777));
  else
    rc = mr_auth_token_read_fd(fd, token);
  close(fd);
  return rc;
}

int mr_auth_token_write_file(const char *path,
                             const uint8_t token[MR_TOKEN_BYTES]) {
  /* written whole beside it, then linked into place: other nodes polling
   * for the file never see it empty, and a file there already stays */
  char tmp[4096];
  if (snprintf(tmp, sizeof tmp, "%s.XXXXXX", path) >= (int)sizeof tmp)
    return mr_error_set(MR_EINVAL, "job token file %s: path too long", path);
  int fd = mkostemp(tmp, O_CLOEXEC); /* mode 0600 */
  if (fd < 0)
    return mr_error_set(mr_from_errno(errno), "job token file %s: %s", tmp, strerror(errno));
  char hex[66];
  mr_auth_token_hex(token, hex);
  hex[64] = '\n';
  ssize_t w = write(fd, hex, 65);
  sodium_memzero(hex, sizeof hex);
  close(fd);
  int rc = 0;
  if (w != 65)
    rc = mr_error_set(MR_EIO, "job token file %s: short write", tmp);
  else if (link(tmp, path) != 0)
    rc = mr_error_set(mr_from_errno(errno), "job token file %s: %s", path, strerror(errno));
  unlink(tmp);
  return rc;
}

int mr_auth_token_memfd(const uint8_t token[MR_TOKEN_BYTES]) {
  int fd = memfd_create("meshrun-token", MFD_CLOEXEC);
  if (fd < 0)
    return mr_error_set(MR_ESYS, "memfd_create: %s", strerror(errno));
  char hex[65];
  mr_auth_token_hex(token, hex);
  ssize_t w = write(fd, hex, 64);
  sodium_memzero(hex, sizeof hex);
  if (w != 64) {
    close(fd);
    return mr_error_set(MR_EIO, "writing the job token: %s", strerror(errno));
  }
  return fd;
}

int mr_auth_client_handshake(int fd, struct mr_frame_reader *r,
                             const uint8_t token[MR_TOKEN_BYTES],
                             int timeout_ms) {
  Meshrun__Envelope *in = NULL;
  MR_TRY(mr_rpc_recv_fd(fd, r, timeout_ms, &in));
  if (in->msg_case != MESHRUN__ENVELOPE__MSG_AUTH_CHALLENGE) {
    int rc = mr_error_set(MR_EAUTH, "expected an auth challenge, got %s",
                          mr_rpc_name(in));
    mr_rpc_free(in);
    return rc;
  }
  uint8_t coord_nonce[MR_NONCE_BYTES], worker_nonce[MR_NONCE_BYTES];
  uint8_t mac[MR_MAC_BYTES];
  memcpy(coord_nonce, in->auth_challenge->nonce.data, MR_NONCE_BYTES);
  mr_rpc_free(in);
  mr_auth_random(worker_nonce, sizeof worker_nonce);
  mr_auth_client_mac(token, coord_nonce, worker_nonce, mac);

  Meshrun__AuthResponse resp = MESHRUN__AUTH_RESPONSE__INIT;
  resp.nonce.data = worker_nonce;
  resp.nonce.len = MR_NONCE_BYTES;
  resp.mac.data = mac;
  resp.mac.len = MR_MAC_BYTES;
  Meshrun__Envelope out = MESHRUN__ENVELOPE__INIT;
  out.msg_case = MESHRUN__ENVELOPE__MSG_AUTH_RESPONSE;
  out.auth_response = &resp;
  MR_TRY(mr_rpc_send_fd(fd, &out));

  int rc = mr_rpc_recv_fd(fd, r, timeout_ms, &in);
  if (rc == MR_ECLOSED)
    return mr_error_set(MR_EAUTH, "coordinator refused our job token");
  if (rc < 0)
    return rc;
  if (in->msg_case != MESHRUN__ENVELOPE__MSG_AUTH_RESULT || !in->auth_result->ok) {
    mr_rpc_free(in);
    return mr_error_set(MR_EAUTH, "coordinator refused our job token");
  }
  uint8_t expect[MR_MAC_BYTES];
  mr_auth_server_mac(token, coord_nonce, worker_nonce, expect);
  rc = mr_auth_mac_check(expect, in->auth_result->mac.data);
  mr_rpc_free(in);
  if (rc < 0)
    return mr_error_set(MR_EAUTH, "coordinator could not prove it knows the token");
  return 0;
}
