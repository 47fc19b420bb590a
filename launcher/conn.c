/* conn.c - the coordinator's RPC connections. */
#include "launcher/conn.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#include "common/rpc.h"
#include "common/tunable.h"

struct write_req {
  uv_write_t req;
  uint8_t *frame;
};

static void on_handle_closed(uv_handle_t *h) {
  struct mr_conn *c = h->data;
  if (--c->handles_open == 0) {
    mr_frame_reader_close(&c->reader);
    free(c);
  }
}

/* Takes c out of its listener's unauthenticated queue (authenticated, or
 * closing). */
static void preauth_leave(struct mr_conn *c) {
  struct mr_preauth *q = c->preauth;
  if (q == NULL)
    return;
  if (c->preauth_prev != NULL)
    c->preauth_prev->preauth_next = c->preauth_next;
  else
    q->head = c->preauth_next;
  if (c->preauth_next != NULL)
    c->preauth_next->preauth_prev = c->preauth_prev;
  else
    q->tail = c->preauth_prev;
  q->n--;
  c->preauth = NULL;
  c->preauth_prev = c->preauth_next = NULL;
}

/* Puts c last in q, dropping the oldest waiting there when q is full. */
static void preauth_join(struct mr_conn *c, struct mr_preauth *q) {
  if (q == NULL)
    return;
  if (q->max > 0 && q->n >= q->max && q->head != NULL)
    mr_conn_close(q->head, "too many connections waiting to authenticate: the oldest dropped");
  c->preauth = q;
  c->preauth_prev = q->tail;
  if (q->tail != NULL)
    q->tail->preauth_next = c;
  else
    q->head = c;
  q->tail = c;
  q->n++;
}

void mr_conn_close(struct mr_conn *c, const char *reason) {
  if (c->closing)
    return;
  c->closing = 1;
  preauth_leave(c);
  if (reason != NULL) {
    char who[32] = "";
    if (c->rank >= 0)
      snprintf(who, sizeof who, ", rank %d", c->rank);
    MR_WARN("rpc", "closed connection %d (%s%s): %s", c->id, c->peer, who, reason);
  }
  if (c->cb.on_close != NULL)
    c->cb.on_close(c->cb.ctx, c);
  uv_read_stop(&c->h.stream);
  uv_timer_stop(&c->auth_timer);
  uv_close((uv_handle_t *)&c->auth_timer, on_handle_closed);
  uv_close((uv_handle_t *)&c->h.stream, on_handle_closed);
}

static void on_write(uv_write_t *req, int status) {
  struct write_req *w = (struct write_req *)req;
  struct mr_conn *c = req->handle->data;
  free(w->frame);
  free(w);
  if (status < 0 && !c->closing) {
    /* a peer that sent its last report and exited: what it sent is still
     * to be read, so the connection closes at the end of its stream */
    if (status == UV_EPIPE || status == UV_ECONNRESET)
      c->peer_gone = 1;
    else
      mr_conn_close(c, uv_strerror(status));
  }
}

int mr_conn_send(struct mr_conn *c, const Meshrun__Envelope *env) {
  if (c->closing || c->peer_gone)
    return MR_ECLOSED;
  struct write_req *w = malloc(sizeof *w);
  if (w == NULL)
    return MR_ENOMEM;
  size_t len;
  int rc = mr_rpc_encode(env, &w->frame, &len);
  if (rc < 0) {
    free(w);
    return rc;
  }
  uv_buf_t buf = uv_buf_init((char *)w->frame, (unsigned)len);
  int uv = uv_write(&w->req, &c->h.stream, &buf, 1, on_write);
  if (uv < 0) {
    free(w->frame);
    free(w);
    mr_conn_close(c, uv_strerror(uv));
    return MR_ECLOSED;
  }
  return 0;
}

static void send_challenge(struct mr_conn *c) {
  mr_auth_random(c->nonce, sizeof c->nonce);
  Meshrun__AuthChallenge ch = MESHRUN__AUTH_CHALLENGE__INIT;
  ch.nonce.data = c->nonce;
  ch.nonce.len = sizeof c->nonce;
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_AUTH_CHALLENGE;
  env.auth_challenge = &ch;
  mr_conn_send(c, &env);
}

/* Checks the peer's proof; answers with ours.  Returns 0 when accepted. */
static int handle_auth(struct mr_conn *c, const Meshrun__Envelope *env) {
  if (env->msg_case != MESHRUN__ENVELOPE__MSG_AUTH_RESPONSE) {
    mr_conn_close(c, "sent a message before authenticating");
    return -1;
  }
  uint8_t expect[MR_MAC_BYTES];
  mr_auth_client_mac(c->token, c->nonce, env->auth_response->nonce.data, expect);
  if (mr_auth_mac_check(expect, env->auth_response->mac.data) != 0) {
    Meshrun__AuthResult res = MESHRUN__AUTH_RESULT__INIT;
    Meshrun__Envelope out = MESHRUN__ENVELOPE__INIT;
    out.msg_case = MESHRUN__ENVELOPE__MSG_AUTH_RESULT;
    out.auth_result = &res;
    mr_conn_send(c, &out);
    mr_conn_close(c, "authentication failed: wrong job token");
    return -1;
  }
  uint8_t mac[MR_MAC_BYTES];
  mr_auth_server_mac(c->token, c->nonce, env->auth_response->nonce.data, mac);
  Meshrun__AuthResult res = MESHRUN__AUTH_RESULT__INIT;
  res.ok = 1;
  res.mac.data = mac;
  res.mac.len = sizeof mac;
  Meshrun__Envelope out = MESHRUN__ENVELOPE__INIT;
  out.msg_case = MESHRUN__ENVELOPE__MSG_AUTH_RESULT;
  out.auth_result = &res;
  c->authenticated = 1;
  preauth_leave(c);
  c->reader.max_frame = (size_t)mr_tunable_int(MR_TUNABLE_MAX_FRAME_BYTES);
  uv_timer_stop(&c->auth_timer);
  mr_conn_send(c, &out);
  MR_DEBUG("rpc", "connection %d (%s) authenticated", c->id, c->peer);
  return 0;
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  (void)h;
  static _Thread_local char slab[65536];
  (void)suggested;
  *buf = uv_buf_init(slab, sizeof slab);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  struct mr_conn *c = s->data;
  if (nread == UV_EOF) {
    mr_conn_close(c, c->authenticated ? NULL : "closed before authenticating");
    return;
  }
  if (nread < 0) {
    mr_conn_close(c, uv_strerror((int)nread));
    return;
  }
  if (mr_frame_reader_feed(&c->reader, buf->base, (size_t)nread) < 0) {
    mr_conn_close(c, "out of memory");
    return;
  }
  while (!c->closing) {
    const uint8_t *payload;
    size_t len;
    int got = mr_frame_reader_next(&c->reader, &payload, &len);
    if (got < 0) {
      char why[256];
      snprintf(why, sizeof why, "bad frame: %s", mr_error_message());
      mr_conn_close(c, why);
      return;
    }
    if (got == 0)
      return;
    Meshrun__Envelope *env;
    if (mr_rpc_decode(payload, len, &env) < 0) {
      char why[256];
      snprintf(why, sizeof why, "bad message: %s", mr_error_message());
      mr_conn_close(c, why);
      return;
    }
    if (!c->authenticated)
      handle_auth(c, env);
    else if (c->cb.on_message != NULL)
      c->cb.on_message(c->cb.ctx, c, env);
    mr_rpc_free(env);
  }
}

static void on_auth_timeout(uv_timer_t *t) {
  struct mr_conn *c = t->data;
  mr_conn_close(c, "did not authenticate in time");
}

struct mr_conn *mr_conn_accept(uv_stream_t *server, int is_tcp,
                               const uint8_t *token,
                               const struct mr_conn_callbacks *cb, int id,
                               struct mr_preauth *preauth) {
  struct mr_conn *c = calloc(1, sizeof *c);
  if (c == NULL)
    return NULL;
  uv_loop_t *loop = server->loop;
  int rc = is_tcp ? uv_tcp_init(loop, &c->h.tcp) : uv_pipe_init(loop, &c->h.pipe, 0);
  if (rc < 0) {
    free(c);
    return NULL;
  }
  c->h.stream.data = c;
  c->handles_open = 1;
  uv_timer_init(loop, &c->auth_timer);
  c->auth_timer.data = c;
  c->handles_open++;
  c->id = id;
  c->rank = -1;
  c->token = token;
  c->cb = *cb;
  mr_frame_reader_init(&c->reader, MR_PREAUTH_FRAME_MAX); /* the normal limit once authenticated */
  snprintf(c->peer, sizeof c->peer, "unix");
  if (uv_accept(server, &c->h.stream) < 0) {
    c->closing = 1;
    uv_close((uv_handle_t *)&c->auth_timer, on_handle_closed);
    uv_close((uv_handle_t *)&c->h.stream, on_handle_closed);
    return NULL;
  }
  if (is_tcp) {
    struct sockaddr_storage sa;
    int len = sizeof sa;
    if (uv_tcp_getpeername(&c->h.tcp, (struct sockaddr *)&sa, &len) == 0) {
      char ip[48] = "?";
      int port = 0;
      if (sa.ss_family == AF_INET) {
        uv_ip4_name((struct sockaddr_in *)&sa, ip, sizeof ip);
        port = ntohs(((struct sockaddr_in *)&sa)->sin_port);
      } else if (sa.ss_family == AF_INET6) {
        uv_ip6_name((struct sockaddr_in6 *)&sa, ip, sizeof ip);
        port = ntohs(((struct sockaddr_in6 *)&sa)->sin6_port);
      }
      snprintf(c->peer, sizeof c->peer, "%s:%d", ip, port);
    }
  }
  preauth_join(c, preauth);
  uv_timer_start(&c->auth_timer, on_auth_timeout,
                 (uint64_t)mr_tunable_int(MR_TUNABLE_AUTH_TIMEOUT_MS), 0);
  uv_read_start(&c->h.stream, on_alloc, on_read);
  send_challenge(c);
  return c;
}
