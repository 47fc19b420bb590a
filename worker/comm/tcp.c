/* tcp.c - the TCP transport: a full mesh of nonblocking sockets per group.
 *
 * Member j of a group connects to every member i < j (at the address i
 * advertised when the communicator opened) and says which group and which
 * member it is; connections that arrive for a group this process has not
 * created yet wait in a stash.  Operations are sequences of exchanges: in
 * each, every peer is sent at most one contiguous range and received into
 * one, all driven together with nonblocking send/recv so that no pair of
 * ranks waits on each other.  Reductions are direct: every rank receives its
 * part of every peer's input, reduces it in rank order (the same order as
 * the shm transport, so both give the same bits), and sends the result to
 * everyone; per rank that moves 2(n-1)/n of the data each way, like a ring,
 * in 2 steps instead of 2(n-1). */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/rng.h"
#include "worker/comm/cpu.h"
#include "worker/comm/reduce.h"

#define HELLO_MAGIC 0x6d6573687463703full

struct hello {
  uint64_t magic, nonce, key;
  int32_t from; /* group rank of the connecting member */
  int32_t pad;
};

struct stashed {
  int fd;
  struct hello h;
  struct stashed *next;
};

static pthread_mutex_t stash_lock = PTHREAD_MUTEX_INITIALIZER;
static struct stashed *stash;

struct xfer {
  unsigned char *ptr;
  size_t left;
};

struct tcp {
  int n, me;
  int *fd;          /* (n), -1 for me */
  struct xfer *tx;  /* (n) the current exchange */
  struct xfer *rx;  /* (n) */
  unsigned char token[2];
};

/* ---- exchanges --------------------------------------------------------- */

static void xreset(struct tcp *t) {
  memset(t->tx, 0, (size_t)t->n * sizeof *t->tx);
  memset(t->rx, 0, (size_t)t->n * sizeof *t->rx);
}

static void xsend(struct tcp *t, int peer, const void *p, size_t len) {
  t->tx[peer].ptr = (unsigned char *)p;
  t->tx[peer].left = len;
}

static void xrecv(struct tcp *t, int peer, void *p, size_t len) {
  t->rx[peer].ptr = p;
  t->rx[peer].left = len;
}

/* Moves what the sockets allow; MR__DONE once every range is through. */
static int xprogress(struct mr__group *g, struct tcp *t, struct mr__op *op) {
  int done = 1;
  for (int i = 0; i < t->n; i++) {
    if (i == t->me)
      continue;
    g->waiting[i] = 0;
    while (t->tx[i].left > 0) {
      ssize_t k = send(t->fd[i], t->tx[i].ptr, t->tx[i].left,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) {
        op->moved = 1;
        t->tx[i].ptr += k;
        t->tx[i].left -= (size_t)k;
        continue;
      }
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        break;
      snprintf(op->err, sizeof op->err, "%s #%llu on group %s failed: rank "
               "%d closed the connection (%s)", mr__op_name(op->kind),
               (unsigned long long)op->seq, g->desc, g->ranks[i],
               k < 0 ? strerror(errno) : "no progress");
      return MR_EPEER;
    }
    while (t->rx[i].left > 0) {
      ssize_t k = recv(t->fd[i], t->rx[i].ptr, t->rx[i].left, MSG_DONTWAIT);
      if (k > 0) {
        op->moved = 1;
        t->rx[i].ptr += k;
        t->rx[i].left -= (size_t)k;
        continue;
      }
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        break;
      snprintf(op->err, sizeof op->err, "%s #%llu on group %s failed: rank "
               "%d closed the connection (%s)", mr__op_name(op->kind),
               (unsigned long long)op->seq, g->desc, g->ranks[i],
               k < 0 ? strerror(errno) : "end of stream");
      return MR_EPEER;
    }
    if (t->tx[i].left > 0 || t->rx[i].left > 0) {
      g->waiting[i] = 1;
      done = 0;
    }
  }
  return done ? MR__DONE : MR__PENDING;
}

/* ---- operations -------------------------------------------------------- */

static int scratch(struct mr__op *op, size_t bytes) {
  if (op->scratch != NULL || bytes == 0)
    return 0;
  op->scratch = malloc(bytes);
  if (op->scratch == NULL) {
    snprintf(op->err, sizeof op->err, "out of memory for %zu bytes", bytes);
    return MR_ENOMEM;
  }
  op->scratch_bytes = bytes;
  return 0;
}

/* AllReduce and ReduceScatter: step 0 exchanges inputs' parts, then each
 * rank reduces its part; AllReduce then exchanges the results. */
static int reduce_op(struct mr__group *g, struct tcp *t, struct mr__op *op,
                     int scatter) {
  size_t es = mr_dtype_size(op->dt), off, len, moff, mlen;
  const unsigned char *in = op->send;
  unsigned char *out = op->recv;
  if (scatter)
    moff = (size_t)t->me * op->count, mlen = op->count;
  else
    mr__part(op->count, t->n, t->me, &moff, &mlen);
  if (op->phase == 0) {
    int rc = scratch(op, (size_t)t->n * mlen * es);
    if (rc < 0)
      return rc;
    xreset(t);
    for (int j = 0; j < t->n; j++) {
      if (j == t->me)
        continue;
      if (scatter)
        off = (size_t)j * op->count, len = op->count;
      else
        mr__part(op->count, t->n, j, &off, &len);
      xsend(t, j, in + off * es, len * es);
      xrecv(t, j, (unsigned char *)op->scratch + (size_t)j * mlen * es,
            mlen * es);
    }
    op->phase = 1;
  }
  if (op->phase == 1) {
    int r = xprogress(g, t, op);
    if (r != MR__DONE)
      return r;
    const void *srcs[MR__MAX_GROUP];
    for (int i = 0; i < t->n; i++)
      srcs[i] = i == t->me ? (const void *)(in + moff * es)
                           : (unsigned char *)op->scratch + (size_t)i * mlen * es;
    unsigned char *dst = scatter ? out : out + moff * es;
    MR_TRY(mr__reduce(op->dt, op->red, dst, srcs, t->n, mlen));
    if (scatter)
      return MR__DONE;
    xreset(t);
    for (int j = 0; j < t->n; j++) {
      if (j == t->me)
        continue;
      mr__part(op->count, t->n, j, &off, &len);
      xsend(t, j, out + moff * es, mlen * es);
      xrecv(t, j, out + off * es, len * es);
    }
    op->phase = 2;
  }
  return xprogress(g, t, op);
}

static int tcp_progress(struct mr__group *g, struct mr__op *op) {
  struct tcp *t = g->tp_state;
  size_t es = mr_dtype_size(op->dt);
  if (op->kind == MR__ALL_REDUCE || op->kind == MR__REDUCE_SCATTER) {
    int r = reduce_op(g, t, op, op->kind == MR__REDUCE_SCATTER);
    if (r < 0 && op->err[0] == '\0')
      snprintf(op->err, sizeof op->err, "%s #%llu on group %s: %s",
               mr__op_name(op->kind), (unsigned long long)op->seq, g->desc,
               mr_error_message());
    return r;
  }
  if (op->phase == 0) {
    const unsigned char *in = op->send;
    unsigned char *out = op->recv;
    xreset(t);
    switch (op->kind) {
    case MR__ALL_GATHER:
      memmove(out + op->displs[t->me] * es, in, op->counts[t->me] * es);
      for (int j = 0; j < t->n; j++)
        if (j != t->me) {
          xsend(t, j, in, op->counts[t->me] * es);
          xrecv(t, j, out + op->displs[j] * es, op->counts[j] * es);
        }
      break;
    case MR__BROADCAST:
      for (int j = 0; j < t->n; j++)
        if (j != t->me && t->me == op->peer)
          xsend(t, j, out, op->count * es);
      if (t->me != op->peer)
        xrecv(t, op->peer, out, op->count * es);
      break;
    case MR__ALL_TO_ALL:
      memcpy(out + (size_t)t->me * op->count * es,
             in + (size_t)t->me * op->count * es, op->count * es);
      for (int j = 0; j < t->n; j++)
        if (j != t->me) {
          xsend(t, j, in + (size_t)j * op->count * es, op->count * es);
          xrecv(t, j, out + (size_t)j * op->count * es, op->count * es);
        }
      break;
    case MR__SEND:
      xsend(t, op->peer, in, op->count * es);
      break;
    case MR__RECV:
      xrecv(t, op->peer, out, op->count * es);
      break;
    default: /* barrier: one byte each way */
      op->scratch = calloc((size_t)t->n, 1);
      if (op->scratch == NULL)
        return MR_ENOMEM;
      for (int j = 0; j < t->n; j++)
        if (j != t->me) {
          xsend(t, j, t->token, 1);
          xrecv(t, j, (unsigned char *)op->scratch + j, 1);
        }
      break;
    }
    op->phase = 1;
  }
  return xprogress(g, t, op);
}

/* ---- connection setup -------------------------------------------------- */

static int set_socket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  int fl = fcntl(fd, F_GETFL);
  return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static int full_io(int fd, void *p, size_t len, int writing,
                   int64_t deadline) {
  unsigned char *c = p;
  while (len > 0) {
    ssize_t k = writing ? send(fd, c, len, MSG_NOSIGNAL) : recv(fd, c, len, 0);
    if (k > 0) {
      c += k;
      len -= (size_t)k;
      continue;
    }
    if (k == 0 || (errno != EINTR && errno != EAGAIN))
      return -1;
    if (mr_clock_ns() > deadline || mr_comm_stopping())
      return -1;
    struct pollfd pf = {fd, (short)(writing ? POLLOUT : POLLIN), 0};
    poll(&pf, 1, 10);
  }
  return 0;
}

static int connect_to(const struct mr__peer_info *p, int64_t deadline) {
  for (;;) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
      return -1;
    struct sockaddr_in sin = {.sin_family = AF_INET,
                              .sin_port = htons((uint16_t)p->port)};
    if (inet_pton(AF_INET, p->addr, &sin.sin_addr) != 1) {
      close(fd);
      errno = EINVAL;
      return -1;
    }
    if (connect(fd, (struct sockaddr *)&sin, sizeof sin) == 0)
      return fd;
    int e = errno;
    close(fd);
    if (mr_clock_ns() > deadline || mr_comm_stopping() || (e != ECONNREFUSED && e != EINTR)) {
      errno = e;
      return -1;
    }
    usleep(10000);
  }
}

static int take_stashed(uint64_t nonce, uint64_t key, int from) {
  int fd = -1;
  pthread_mutex_lock(&stash_lock);
  for (struct stashed **p = &stash; *p != NULL; p = &(*p)->next)
    if ((*p)->h.nonce == nonce && (*p)->h.key == key && (*p)->h.from == from) {
      struct stashed *s = *p;
      *p = s->next;
      fd = s->fd;
      free(s);
      break;
    }
  pthread_mutex_unlock(&stash_lock);
  return fd;
}

static void tcp_free_state(struct tcp *t) {
  if (t == NULL)
    return;
  for (int i = 0; t->fd != NULL && i < t->n; i++)
    if (t->fd[i] >= 0)
      close(t->fd[i]);
  free(t->fd);
  free(t->tx);
  free(t->rx);
  free(t);
}

static int tcp_open_group(struct mr__group *g) {
  const struct mr__cpu_info *ci = mr__cpu_info(g);
  struct tcp *t = calloc(1, sizeof *t);
  if (t == NULL)
    return mr_error_set(MR_ENOMEM, "comm group %s: out of memory", g->desc);
  t->n = g->n;
  t->me = g->me;
  t->fd = malloc((size_t)g->n * sizeof *t->fd);
  t->tx = calloc((size_t)g->n, sizeof *t->tx);
  t->rx = calloc((size_t)g->n, sizeof *t->rx);
  if (t->fd == NULL || t->tx == NULL || t->rx == NULL) {
    tcp_free_state(t);
    return mr_error_set(MR_ENOMEM, "comm group %s: out of memory", g->desc);
  }
  for (int i = 0; i < g->n; i++)
    t->fd[i] = -1;
  int occ = mr__group_occurrence(g);
  uint64_t key = mr_hash_str(g->desc) ^ ((uint64_t)occ * 0x9e3779b97f4a7c15ull);
  int64_t deadline = mr_clock_ns() + ci->timeout_ms * 1000000;
  int rc = 0;
  for (int i = 0; i < g->me; i++) {
    const struct mr__peer_info *p = &ci->peers[g->ranks[i]];
    int fd = connect_to(p, deadline);
    struct hello h = {HELLO_MAGIC, ci->nonce, key, g->me, 0};
    if (fd < 0 || full_io(fd, &h, sizeof h, 1, deadline) != 0) {
      rc = mr_error_set(MR_ECLOSED, "comm group %s: cannot connect to rank %d "
                        "at %s:%d: %s", g->desc, g->ranks[i], p->addr, p->port,
                        strerror(errno));
      if (fd >= 0)
        close(fd);
      goto err;
    }
    t->fd[i] = fd;
  }
  for (int j = g->me + 1; j < g->n; j++) {
    int fd;
    while ((fd = take_stashed(ci->nonce, key, j)) < 0) {
      struct pollfd pf = {ci->listen_fd, POLLIN, 0};
      if (mr_comm_stopping()) {
        rc = mr_error_set(MR_ECANCELED, "comm group %s: the rank is stopping", g->desc);
        goto err;
      }
      if (mr_clock_ns() > deadline) {
        rc = mr_error_set(MR_ETIMEDOUT, "comm group %s: timed out after %.1f "
                          "s creating the group: rank %d has not arrived",
                          g->desc, (double)ci->timeout_ms / 1000, g->ranks[j]);
        goto err;
      }
      if (poll(&pf, 1, 10) <= 0)
        continue;
      int c = accept4(ci->listen_fd, NULL, NULL, SOCK_CLOEXEC);
      if (c < 0)
        continue;
      struct stashed *s = calloc(1, sizeof *s);
      if (s == NULL || full_io(c, &s->h, sizeof s->h, 0, deadline) != 0 ||
          s->h.magic != HELLO_MAGIC || s->h.nonce != ci->nonce) {
        close(c); /* not one of ours, or from another job */
        free(s);
        continue;
      }
      s->fd = c;
      pthread_mutex_lock(&stash_lock);
      s->next = stash;
      stash = s;
      pthread_mutex_unlock(&stash_lock);
    }
    t->fd[j] = fd;
  }
  for (int i = 0; i < g->n; i++)
    if (t->fd[i] >= 0 && set_socket(t->fd[i]) != 0) {
      rc = mr_error_set(MR_ESYS, "comm group %s: fcntl: %s", g->desc,
                        strerror(errno));
      goto err;
    }
  g->tp_state = t;
  return 0;
err:
  tcp_free_state(t);
  return rc;
}

static void tcp_close_group(struct mr__group *g) {
  tcp_free_state(g->tp_state);
  g->tp_state = NULL;
}

const struct mr__transport mr__tcp_transport = {
    .name = "tcp",
    .open = tcp_open_group,
    .close = tcp_close_group,
    .progress = tcp_progress,
    .mem_alloc = NULL,
    .mem_free = NULL,
};
