/* auth.h - the job token and the challenge-response that proves a peer
 * knows it.
 *
 * The launcher draws a 32-byte random token per job.  A connection is
 * authenticated, before any other message, by a mutual HMAC-SHA256
 * exchange (libsodium): the coordinator sends a nonce, the worker answers
 * with its own nonce and HMAC(token, "meshrun-client" | nonce_c | nonce_w),
 * the coordinator checks it in constant time and answers with
 * HMAC(token, "meshrun-server" | nonce_w | nonce_c), which the worker checks.
 * The token itself never crosses the wire.  Local workers read it from an
 * inherited descriptor; remote ones from a file that must be mode 0600. */
#ifndef MR_AUTH_H
#define MR_AUTH_H

#include <stddef.h>
#include <stdint.h>

#include "common/frame.h"

#define MR_TOKEN_BYTES 32
#define MR_NONCE_BYTES 32
#define MR_MAC_BYTES 32

/* Initialises libsodium once.  Returns 0 or MR_ESYS. */
int mr_auth_init(void);

/* Fills buf with n cryptographically random bytes. */
void mr_auth_random(uint8_t *buf, size_t n);

/* The worker's proof: HMAC(token, "meshrun-client" | coord | worker). */
void mr_auth_client_mac(const uint8_t token[MR_TOKEN_BYTES],
                        const uint8_t coord_nonce[MR_NONCE_BYTES],
                        const uint8_t worker_nonce[MR_NONCE_BYTES],
                        uint8_t mac[MR_MAC_BYTES]);

/* The coordinator's proof: HMAC(token, "meshrun-server" | worker | coord). */
void mr_auth_server_mac(const uint8_t token[MR_TOKEN_BYTES],
                        const uint8_t coord_nonce[MR_NONCE_BYTES],
                        const uint8_t worker_nonce[MR_NONCE_BYTES],
                        uint8_t mac[MR_MAC_BYTES]);

/* Constant-time comparison of two MACs: 0 when equal, MR_EAUTH otherwise. */
int mr_auth_mac_check(const uint8_t a[MR_MAC_BYTES],
                      const uint8_t b[MR_MAC_BYTES]);

/* Token as 64 lowercase hex characters plus NUL. */
void mr_auth_token_hex(const uint8_t token[MR_TOKEN_BYTES], char hex[65]);

/* Parses 64 hex characters (surrounding whitespace allowed). */
int mr_auth_token_parse(const char *text, size_t len,
                        uint8_t token[MR_TOKEN_BYTES]);

/* Reads the token (hex) from an open descriptor, from offset 0. */
int mr_auth_token_read_fd(int fd, uint8_t token[MR_TOKEN_BYTES]);

/* Reads the token from a file, refusing one that group or others can
 * read (it must be 0600 or stricter). */
int mr_auth_token_read_file(const char *path, uint8_t token[MR_TOKEN_BYTES]);

/* Writes the token to a new file of mode 0600, whole at once (readers
 * never see it partly written); fails when the file exists. */
int mr_auth_token_write_file(const char *path,
                             const uint8_t token[MR_TOKEN_BYTES]);

/* An anonymous in-memory file (close-on-exec) holding the token in hex,
 * for workers to inherit as a descriptor.  Returns the descriptor or an
 * error. */
int mr_auth_token_memfd(const uint8_t token[MR_TOKEN_BYTES]);

/* Runs the worker side of the handshake on a blocking fd, using r for
 * buffered input.  Returns 0, or MR_EAUTH when the coordinator refuses us
 * or fails to prove it knows the token. */
int mr_auth_client_handshake(int fd, struct mr_frame_reader *r,
                             const uint8_t token[MR_TOKEN_BYTES],
                             int timeout_ms);

#endif
