/* rpc.c - envelope codec, validation and blocking socket I/O. */
#include "common/rpc.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/tunable.h"

int mr_rpc_encode(const Meshrun__Envelope *env, uint8_t **frame, size_t *len) {
  size_t n = meshrun__envelope__get_packed_size(env);
  if (n > (size_t)mr_tunable_int(MR_TUNABLE_MAX_FRAME_BYTES))
    return mr_error_set(MR_ETOOBIG, "%s message of %zu bytes exceeds the frame limit",
                        mr_rpc_name(env), n);
  uint8_t *buf = malloc(MR_FRAME_HEADER_BYTES + n);
  if (buf == NULL)
    return MR_ENOMEM;
  mr_frame_put_header(buf, (uint32_t)n);
  meshrun__envelope__pack(env, buf + MR_FRAME_HEADER_BYTES);
  *frame = buf;
  *len = MR_FRAME_HEADER_BYTES + n;
  return 0;
}

int mr_rpc_decode(const uint8_t *payload, size_t len, Meshrun__Envelope **env) {
  Meshrun__Envelope *e = meshrun__envelope__unpack(NULL, len, payload);
  if (e == NULL)
    return mr_error_set(MR_EPROTO, "undecodable message (%zu bytes)", len);
  int rc = mr_rpc_validate(e);
  if (rc < 0) {
    meshrun__envelope__free_unpacked(e, NULL);
    return rc;
  }
  *env = e;
  return 0;
}

void mr_rpc_free(Meshrun__Envelope *env) {
  if (env != NULL)
    meshrun__envelope__free_unpacked(env, NULL);
}

static int bytes_exact(ProtobufCBinaryData b, size_t n, const char *what) {
  if (b.len != n)
    return mr_error_set(MR_EPROTO, "%s is %zu bytes, expected %zu", what,
                        b.len, n);
  return 0;
}

int mr_rpc_validate(const Meshrun__Envelope *env) {
  switch (env->msg_case) {
  case MESHRUN__ENVELOPE__MSG_AUTH_CHALLENGE:
    return bytes_exact(env->auth_challenge->nonce, 32, "auth challenge nonce");
  case MESHRUN__ENVELOPE__MSG_AUTH_RESPONSE:
    MR_TRY(bytes_exact(env->auth_response->nonce, 32, "auth response nonce"));
    return bytes_exact(env->auth_response->mac, 32, "auth response mac");
  case MESHRUN__ENVELOPE__MSG_AUTH_RESULT:
    if (env->auth_result->ok)
      return bytes_exact(env->auth_result->mac, 32, "auth result mac");
    return 0;
  case MESHRUN__ENVELOPE__MSG_HELLO:
    if (env->hello->protocol_version != MR_PROTOCOL_VERSION)
      return mr_error_set(MR_EVERSION,
                          "hello from pid %u speaks protocol %u, expected %u",
                          env->hello->pid, env->hello->protocol_version,
                          MR_PROTOCOL_VERSION);
    if (env->hello->requested_rank < -1)
      return mr_error_set(MR_EPROTO, "hello asks for rank %d",
                          env->hello->requested_rank);
    if (env->hello->node_rank < 0 || (env->hello->node_rank > 0 && env->hello->node_ranks < 1))
      return mr_error_set(MR_EPROTO, "hello from node %d with %d ranks",
                          env->hello->node_rank, env->hello->node_ranks);
    return 0;
  case MESHRUN__ENVELOPE__MSG_WELCOME:
    if (env->welcome->world_size <= 0 || env->welcome->rank < 0 ||
        env->welcome->rank >= env->welcome->world_size)
      return mr_error_set(MR_EPROTO, "welcome gives rank %d of %d",
                          env->welcome->rank, env->welcome->world_size);
    return 0;
  case MESHRUN__ENVELOPE__MSG_CONTROL:
    if (env->control->kind != MESHRUN__CONTROL__KIND__STOP &&
        env->control->kind != MESHRUN__CONTROL__KIND__CHECKPOINT_NOW &&
        env->control->kind != MESHRUN__CONTROL__KIND__START &&
        env->control->kind != MESHRUN__CONTROL__KIND__FINISH)
      return mr_error_set(MR_EPROTO, "control of unknown kind %d", (int)env->control->kind);
    if (env->control->kind == MESHRUN__CONTROL__KIND__START &&
        (env->control->world_size < 1 || env->control->first_rank < 0 ||
         env->control->first_rank >= env->control->world_size))
      return mr_error_set(MR_EPROTO, "start of ranks from %d of %d", env->control->first_rank,
                          env->control->world_size);
    return 0;
  case MESHRUN__ENVELOPE__MSG_PLAN:
    if (env->plan->trace_dir != NULL && env->plan->trace_dir[0] != '\0' &&
        (env->plan->trace_first < 1 || env->plan->trace_last < env->plan->trace_first))
      return mr_error_set(MR_EPROTO, "plan traces steps %lld..%lld",
                          (long long)env->plan->trace_first, (long long)env->plan->trace_last);
    return 0;
  case MESHRUN__ENVELOPE__MSG_CLOCK_PROBE:
  case MESHRUN__ENVELOPE__MSG_HEARTBEAT:
  case MESHRUN__ENVELOPE__MSG_METRICS:
  case MESHRUN__ENVELOPE__MSG_RENDEZVOUS_DONE:
    return 0;
  case MESHRUN__ENVELOPE__MSG_REPORT:
    if (env->report->what_case == MESHRUN__REPORT__WHAT__NOT_SET)
      return mr_error_set(MR_EPROTO, "report with nothing in it");
    return 0;
  case MESHRUN__ENVELOPE__MSG_RENDEZVOUS:
    if (env->rendezvous->key == NULL || env->rendezvous->key[0] == '\0')
      return mr_error_set(MR_EPROTO, "rendezvous without a key");
    return 0;
  case MESHRUN__ENVELOPE__MSG__NOT_SET:
  default:
    return mr_error_set(MR_EPROTO, "envelope carries no known message (case %d)",
                        (int)env->msg_case);
  }
}

const char *mr_rpc_name(const Meshrun__Envelope *env) {
  switch (env->msg_case) {
  case MESHRUN__ENVELOPE__MSG_AUTH_CHALLENGE: return "auth_challenge";
  case MESHRUN__ENVELOPE__MSG_AUTH_RESPONSE: return "auth_response";
  case MESHRUN__ENVELOPE__MSG_AUTH_RESULT: return "auth_result";
  case MESHRUN__ENVELOPE__MSG_HELLO: return "hello";
  case MESHRUN__ENVELOPE__MSG_WELCOME: return "welcome";
  case MESHRUN__ENVELOPE__MSG_PLAN: return "plan";
  case MESHRUN__ENVELOPE__MSG_HEARTBEAT: return "heartbeat";
  case MESHRUN__ENVELOPE__MSG_METRICS: return "metrics";
  case MESHRUN__ENVELOPE__MSG_REPORT: return "report";
  case MESHRUN__ENVELOPE__MSG_CONTROL: return "control";
  case MESHRUN__ENVELOPE__MSG_RENDEZVOUS: return "rendezvous";
  case MESHRUN__ENVELOPE__MSG_RENDEZVOUS_DONE: return "rendezvous_done";
  case MESHRUN__ENVELOPE__MSG_CLOCK_PROBE: return "clock_probe";
  default: return "unknown";
  }
}

static int write_all(int fd, const uint8_t *p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR)
        continue;
      return mr_error_set(mr_from_errno(errno), "send: %s", strerror(errno));
    }
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

int mr_rpc_send_fd(int fd, const Meshrun__Envelope *env) {
  uint8_t *frame;
  size_t len;
  MR_TRY(mr_rpc_encode(env, &frame, &len));
  int rc = write_all(fd, frame, len);
  free(frame);
  return rc;
}

int mr_rpc_recv_fd(int fd, struct mr_frame_reader *r, int timeout_ms,
                   Meshrun__Envelope **env) {
  int64_t deadline = timeout_ms < 0 ? -1 : mr_clock_ms() + timeout_ms;
  for (;;) {
    const uint8_t *payload;
    size_t len;
    int got = mr_frame_reader_next(r, &payload, &len);
    if (got < 0)
      return got;
    if (got == 1)
      return mr_rpc_decode(payload, len, env);
    int wait = -1;
    if (deadline >= 0) {
      int64_t left = deadline - mr_clock_ms();
      if (left <= 0)
        return MR_ETIMEDOUT;
      wait = (int)left;
    }
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int pr = poll(&pfd, 1, wait);
    if (pr < 0) {
      if (errno == EINTR)
        continue;
      return mr_error_set(MR_ESYS, "poll: %s", strerror(errno));
    }
    if (pr == 0)
      return MR_ETIMEDOUT;
    uint8_t chunk[16384];
    ssize_t n = recv(fd, chunk, sizeof chunk, 0);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN)
        continue;
      return mr_error_set(mr_from_errno(errno), "recv: %s", strerror(errno));
    }
    if (n == 0)
      return mr_error_set(MR_ECLOSED, "coordinator closed the connection");
    MR_TRY(mr_frame_reader_feed(r, chunk, (size_t)n));
  }
}

int mr_rpc_connect(const char *address) {
  if (strncmp(address, "unix:", 5) == 0) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    const char *path = address + 5;
    if (strlen(path) >= sizeof sa.sun_path)
      return mr_error_set(MR_EINVAL, "socket path too long: %s", path);
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
      return mr_error_set(MR_ESYS, "socket: %s", strerror(errno));
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
      int e = errno;
      close(fd);
      return mr_error_set(mr_from_errno(e), "connect %s: %s", address, strerror(e));
    }
    return fd;
  }
  if (strncmp(address, "tcp:", 4) == 0) {
    char host[256];
    const char *hp = address + 4;
    const char *colon = strrchr(hp, ':');
    if (colon == NULL || (size_t)(colon - hp) >= sizeof host)
      return mr_error_set(MR_EINVAL, "address %s: expected tcp:HOST:PORT", address);
    memcpy(host, hp, (size_t)(colon - hp));
    host[colon - hp] = '\0';
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res;
    int g = getaddrinfo(host, colon + 1, &hints, &res);
    if (g != 0)
      return mr_error_set(MR_EINVAL, "address %s: %s", address, gai_strerror(g));
    int fd = -1, e = 0;
    for (struct addrinfo *ai = res; ai != NULL; ai = ai->ai_next) {
      fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
      if (fd < 0)
        continue;
      if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
        break;
      e = errno;
      close(fd);
      fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
      return mr_error_set(MR_ESYS, "connect %s: %s", address, strerror(e));
    return fd;
  }
  return mr_error_set(MR_EINVAL, "address %s: expected unix:PATH or tcp:HOST:PORT",
                      address);
}
