/* rpc.h - encoding, decoding and validating RPC envelopes, and blocking
 * send/receive on a socket for the worker side.
 *
 * Decoding never trusts the bytes: a payload that protobuf-c cannot unpack,
 * an envelope with no message set, or a message whose fields are out of
 * their allowed form (a nonce that is not 32 bytes, a negative rank, a
 * Hello of another protocol version) is an error with a message; the caller
 * closes the connection.  The coordinator's nonblocking side lives in
 * launcher/coordinator.c and uses the same decode/validate functions. */
#ifndef MR_RPC_H
#define MR_RPC_H

#include <stddef.h>
#include <stdint.h>

#include "meshrun.pb-c.h"
#include "common/frame.h"

#define MR_PROTOCOL_VERSION 2u

/* Packs env into a freshly allocated frame (header + payload).  The caller
 * frees *frame.  Returns 0, MR_ETOOBIG or MR_ENOMEM. */
int mr_rpc_encode(const Meshrun__Envelope *env, uint8_t **frame, size_t *len);

/* Unpacks and validates one payload.  On success *env is owned by the
 * caller, freed with mr_rpc_free().  Returns 0 or MR_EPROTO/MR_EVERSION
 * with a message (mr_error_message). */
int mr_rpc_decode(const uint8_t *payload, size_t len, Meshrun__Envelope **env);

/* Frees an envelope from mr_rpc_decode.  NULL is a no-op. */
void mr_rpc_free(Meshrun__Envelope *env);

/* Checks the fields of a decoded envelope (called by mr_rpc_decode). */
int mr_rpc_validate(const Meshrun__Envelope *env);

/* Name of the message in env, for logs ("hello", "heartbeat", ...). */
const char *mr_rpc_name(const Meshrun__Envelope *env);

/* Writes the whole frame for env to a blocking fd.  Returns 0 or an error. */
int mr_rpc_send_fd(int fd, const Meshrun__Envelope *env);

/* Reads from a blocking fd until one envelope is decoded or timeout_ms
 * passes (-1: forever).  Returns 0 with *env set, MR_ETIMEDOUT, MR_ECLOSED
 * on end of stream, or a decode error. */
int mr_rpc_recv_fd(int fd, struct mr_frame_reader *r, int timeout_ms,
                   Meshrun__Envelope **env);

/* Connects to a coordinator address: "unix:PATH" or "tcp:HOST:PORT".
 * Returns a blocking fd (>= 0) or an error. */
int mr_rpc_connect(const char *address);

#endif
