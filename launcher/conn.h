/* conn.h - one RPC connection of the coordinator: a libuv stream (Unix or
 * TCP) with frame reassembly, the server side of the token handshake, and
 * envelope sending.
 *
 * A connection is useless until it authenticates: the coordinator sends an
 * AuthChallenge on accept, and anything but a correct AuthResponse within
 * the auth timeout closes it with a log line.  After that every decoded and
 * validated envelope is handed to on_message.  A malformed, truncated or
 * oversized frame closes the connection with a log line naming the reason;
 * it never affects other connections. */
#ifndef MR_CONN_H
#define MR_CONN_H

#include <stdint.h>
#include <uv.h>

#include "common/auth.h"
#include "common/frame.h"
#include "meshrun.pb-c.h"

struct mr_conn;

struct mr_conn_callbacks {
  void *ctx;
  /* An authenticated peer's message.  env is borrowed for the call. */
  void (*on_message)(void *ctx, struct mr_conn *c, const Meshrun__Envelope *env);
  /* The connection is closing (any reason); c is freed after this returns. */
  void (*on_close)(void *ctx, struct mr_conn *c);
};

/* The connections of one listener that have not authenticated yet, oldest
 * first: before authenticating a peer may hold only the handshake
 * (MR_PREAUTH_FRAME_MAX bytes buffered), and at most max of them wait at
 * once, the oldest dropped for a new one; with the auth deadline that
 * bounds what strangers can make a launcher hold to about
 * max x (MR_PREAUTH_FRAME_MAX + a 64 KiB read). */
struct mr_preauth {
  struct mr_conn *head, *tail;
  int n, max;
};

/* The largest frame an unauthenticated peer may send: its AuthResponse
 * is about 80 bytes. */
#define MR_PREAUTH_FRAME_MAX 512

struct mr_conn {
  union {
    uv_stream_t stream;
    uv_pipe_t pipe;
    uv_tcp_t tcp;
  } h;
  uv_timer_t auth_timer;
  struct mr_frame_reader reader;
  struct mr_conn_callbacks cb;
  const uint8_t *token;           // borrowed job token
  uint8_t nonce[MR_NONCE_BYTES];  // our challenge
  int authenticated;
  int closing;
  int peer_gone;                  // a write found the peer gone: no more
                                  // writes, reading goes on to the end
  int handles_open;               // closes still pending before free
  int id;                         // for logs
  int rank;                       // -1 until the coordinator binds it
  int node;                       // > 0: the launcher of that node
  char peer[64];                  // "unix" or "127.0.0.1:5555"
  struct mr_preauth *preauth;     // its listener's queue while unauthenticated
  struct mr_conn *preauth_prev, *preauth_next;
};

/* Accepts a pending connection on server (a pipe or tcp server), starts the
 * handshake.  Returns the new connection (owned by the loop; it frees
 * itself after on_close) or NULL when accepting failed. */
struct mr_conn *mr_conn_accept(uv_stream_t *server, int is_tcp,
                               const uint8_t *token,
                               const struct mr_conn_callbacks *cb, int id,
                               struct mr_preauth *preauth);

/* Queues env for sending.  Returns 0 or an error (the connection is then
 * closed). */
int mr_conn_send(struct mr_conn *c, const Meshrun__Envelope *env);

/* Closes the connection, logging why (reason may be NULL for a quiet
 * close). */
void mr_conn_close(struct mr_conn *c, const char *reason);

#endif
