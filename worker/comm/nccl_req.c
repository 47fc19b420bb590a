/* nccl_req.c - the NCCL backend's requests: how an operation is issued on
 * its group's stream, watched until it settles, and failed when it does not.
 *
 * Every NCCL call on a non-blocking communicator is followed by polling
 * ncclCommGetAsyncError (mr__nccl_settle); an operation's request is a CUDA
 * event recorded after it on the group's stream, which test() queries and
 * wait() polls against MESHRUN_COMM_TIMEOUT_MS.  A failure or a timeout
 * aborts the group's communicator (ncclCommAbort) and names the operation,
 * its sequence number and the peers it waited for; every later operation
 * on the group fails with the same message.  Sends and receives are held
 * and given to NCCL together (mr__nccl_flush_p2p). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "worker/comm/nccl_internal.h"

static void nap(void) {
  struct timespec ts = {0, 50000};
  nanosleep(&ts, NULL);
}

/* "rank 2" or "ranks 1, 2, 3": the group's other members (or the peer) */
static void peers_text(const struct nccl_group *g, int peer, char *buf, size_t len) {
  int count = 0;
  for (int i = 0; i < g->n; i++)
    count += i != g->me && (peer < 0 || i == peer);
  size_t off = (size_t)snprintf(buf, len, count == 1 ? "rank" : "ranks");
  int first = 1;
  for (int i = 0; i < g->n && off < len; i++) {
    if (i == g->me || (peer >= 0 && i != peer))
      continue;
    off += (size_t)snprintf(buf + off, len - off, "%s %d", first ? "" : ",",
                            g->ranks[i]);
    first = 0;
  }
}

/* Aborts the group's communicator and records why; later operations on
 * it fail with that message. */
static int group_break(struct nccl_group *g, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int group_break(struct nccl_group *g, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g->broken_msg, sizeof g->broken_msg, fmt, ap);
  va_end(ap);
  if (g->nc != NULL) {
    ncclCommAbort(g->nc);
    g->nc = NULL;
  }
  g->broken = 1;
  if (code != MR_ECANCELED)
    MR_ERROR("comm", "%s", g->broken_msg);
  return mr_error_set(code, "%s", g->broken_msg);
}

int mr__nccl_failed(struct nccl_group *g, ncclResult_t r, const char *call) {
  const char *last = g->nc != NULL ? ncclGetLastError(g->nc) : "";
  return group_break(g, r == ncclRemoteError || r == ncclSystemError ? MR_EPEER : MR_EIO,
                     "nccl: %s on group %s: %s%s%s; the communicator was aborted",
                     call, g->desc, ncclGetErrorString(r), last && last[0] ? ": " : "",
                     last ? last : "");
}

int mr__nccl_settle(struct nccl_group *g, const char *what, uint64_t seq, int peer) {
  int64_t start = mr_clock_ns();
  for (;;) {
    ncclResult_t st = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(g->nc, &st);
    if (r != ncclSuccess)
      return mr__nccl_failed(g, r, "ncclCommGetAsyncError");
    if (st == ncclSuccess)
      return 0;
    if (st != ncclInProgress)
      return mr__nccl_failed(g, st, what);
    if (mr_clock_ns() - start > g->c->timeout_ns) {
      char peers[256];
      peers_text(g, peer, peers, sizeof peers);
      return group_break(g, MR_ETIMEDOUT,
                         "%s #%llu on group %s: not settled after %.1f s "
                         "(MESHRUN_COMM_TIMEOUT_MS); waiting for %s; the "
                         "communicator was aborted", what, (unsigned long long)seq,
                         g->desc, (double)(mr_clock_ns() - start) / 1e9, peers);
    }
    nap();
  }
}

/* ---- requests ---- */

int mr__nccl_op_begin(struct nccl_group *g, const char *op, int peer,
                      struct nccl_req **out) {
  *out = NULL;
  int is_p2p = strcmp(op, "Send") == 0 || strcmp(op, "Recv") == 0;
  if (!is_p2p || g->p2p_n >= 256) {
    /* operations on a group run in issue order: held sends go first */
    int rc = mr__nccl_flush_p2p(g);
    if (rc < 0)
      return rc;
  }
  if (g->broken)
    return mr_error_set(MR_EPEER, "%s on group %s: the group failed earlier: %s", op,
                        g->desc, g->broken_msg);
  MR_TRY(mr__cuda_set_device(g->c->device));
  cudaStream_t compute = mr__cuda_compute_stream(g->c->device);
  if (compute != NULL) {
    MR_CUDA_TRY(cudaEventRecord(g->ev_in, compute));
    MR_CUDA_TRY(cudaStreamWaitEvent(g->stream, g->ev_in, 0));
  }
  struct nccl_req *r = calloc(1, sizeof *r);
  if (r == NULL)
    return mr_error_set(MR_ENOMEM, "nccl: out of memory");
  int rc = mr__cuda_check(cudaEventCreateWithFlags(&r->done, cudaEventDisableTiming),
                          "cudaEventCreateWithFlags");
  if (rc < 0) {
    free(r);
    return rc;
  }
  r->base.comm = &g->c->base;
  r->g = g;
  r->op = op;
  r->peer = peer;
  r->seq = ++g->seq;
  r->start_ns = mr_clock_ns();
  *out = r;
  return 0;
}

void mr__nccl_req_free(struct nccl_req *r) {
  if (r == NULL)
    return;
  cudaEventDestroy(r->done);
  free(r);
}

void mr__nccl_queue_req(struct nccl_comm *c, struct nccl_req *r) {
  pthread_mutex_lock(&c->lock);
  struct nccl_req **p = &c->inflight;
  while (*p != NULL)
    p = &(*p)->next;
  *p = r;
  r->next = NULL;
  pthread_mutex_unlock(&c->lock);
}

int mr__nccl_flush_p2p(struct nccl_group *g) {
  if (g->p2p == NULL)
    return 0;
  struct nccl_req *list = g->p2p;
  g->p2p = NULL;
  g->p2p_n = 0;
  int rc = 0;
  if (g->broken) {
    rc = mr_error_set(MR_EPEER, "Send/Recv on group %s: the group failed earlier: %s",
                      g->desc, g->broken_msg);
  } else {
    ncclResult_t res = ncclGroupStart();
    for (struct nccl_req *r = list; r != NULL && NCCL_OK(res); r = r->pnext)
      res = r->is_send ? ncclSend(r->buf, r->count, r->type, r->peer, g->nc, g->stream)
                       : ncclRecv(r->buf, r->count, r->type, r->peer, g->nc, g->stream);
    res = mr__nccl_group_end(res);
    if (!NCCL_OK(res))
      rc = mr__nccl_failed(g, res, "ncclSend/ncclRecv");
    if (rc == 0)
      rc = mr__nccl_settle(g, list->op, list->seq, list->peer);
  }
  for (struct nccl_req *r = list; r != NULL; r = r->pnext) {
    r->pending = 0;
    if (rc == 0)
      rc = mr__cuda_check(cudaEventRecord(r->done, g->stream), "cudaEventRecord");
    if (rc < 0) {
      r->finished = 1;
      r->rc = rc;
    }
  }
  return rc;
}

int mr__nccl_op_end(struct nccl_group *g, struct nccl_req *r, ncclResult_t res,
                    const char *call, struct mr_comm_req **out) {
  int rc = 0;
  if (!NCCL_OK(res))
    rc = mr__nccl_failed(g, res, call);
  if (rc == 0)
    rc = mr__nccl_settle(g, r->op, r->seq, r->peer);
  if (rc == 0)
    rc = mr__cuda_check(cudaEventRecord(r->done, g->stream), "cudaEventRecord");
  if (rc < 0) {
    mr__nccl_req_free(r);
    return rc;
  }
  mr__nccl_queue_req(g->c, r);
  *out = &r->base;
  return 0;
}

static void unlink_req(struct nccl_comm *c, struct nccl_req *r) {
  pthread_mutex_lock(&c->lock);
  for (struct nccl_req **p = &c->inflight; *p != NULL; p = &(*p)->next)
    if (*p == r) {
      *p = r->next;
      break;
    }
  pthread_mutex_unlock(&c->lock);
}

/* One look at r: done, failed, or still running (then checks the
 * communicator for errors and the deadline). */
static void req_poll(struct nccl_req *r) {
  if (r->finished)
    return;
  struct nccl_group *g = r->g;
  if (r->pending)
    mr__nccl_flush_p2p(g); /* a failure finishes r with its error */
  if (r->finished)
    return;
  if (g->broken) {
    r->finished = 1;
    r->rc = mr_error_set(MR_EPEER, "%s #%llu on group %s: %s", r->op,
                         (unsigned long long)r->seq, g->desc, g->broken_msg);
    return;
  }
  if (mr__cuda_set_device(g->c->device) < 0) {
    r->finished = 1;
    r->rc = MR_EIO;
    return;
  }
  cudaError_t e = cudaEventQuery(r->done);
  if (e == cudaSuccess) {
    r->finished = 1;
    return;
  }
  if (e != cudaErrorNotReady) {
    r->finished = 1;
    r->rc = mr__cuda_check(e, "cudaEventQuery");
    return;
  }
  cudaGetLastError();
  ncclResult_t st = ncclSuccess;
  if (ncclCommGetAsyncError(g->nc, &st) == ncclSuccess && st != ncclSuccess &&
      st != ncclInProgress) {
    r->finished = 1;
    r->rc = mr__nccl_failed(g, st, r->op);
    return;
  }
  int64_t waited = mr_clock_ns() - r->start_ns;
  if (mr_comm_stopping()) {
    r->finished = 1;
    r->rc = group_break(g, MR_ECANCELED, "%s #%llu on group %s given up after %.1f s: the "
                        "rank is stopping; the communicator was aborted", r->op,
                        (unsigned long long)r->seq, g->desc, (double)waited / 1e9);
    return;
  }
  if (waited > g->c->timeout_ns) {
    char peers[256];
    peers_text(g, r->peer, peers, sizeof peers);
    r->finished = 1;
    r->rc = group_break(g, MR_ETIMEDOUT,
                        "%s #%llu on group %s: timed out after %.1f s "
                        "(MESHRUN_COMM_TIMEOUT_MS), waiting for %s (NCCL cannot "
                        "say which of them did not arrive); the communicator "
                        "was aborted", r->op, (unsigned long long)r->seq, g->desc,
                        (double)waited / 1e9, peers);
  }
}

int mr__nccl_test(struct mr_comm_req *rr, int *done) {
  struct nccl_req *r = (struct nccl_req *)rr;
  if (r == NULL || done == NULL)
    return mr_error_set(MR_EINVAL, "nccl test: no request");
  req_poll(r);
  *done = r->finished;
  return 0;
}

int mr__nccl_wait(struct mr_comm_req *rr) {
  struct nccl_req *r = (struct nccl_req *)rr;
  if (r == NULL)
    return mr_error_set(MR_EINVAL, "nccl wait: no request");
  for (;;) {
    req_poll(r);
    if (r->finished)
      break;
    nap();
  }
  unlink_req(r->g->c, r);
  int rc = r->rc;
  if (rc < 0) {
    /* the message belongs to the thread that polled; set it here too */
    char msg[512];
    snprintf(msg, sizeof msg, "%s", mr_error_message());
    mr__nccl_req_free(r);
    return mr_error_set(rc, "%s", msg);
  }
  mr__nccl_req_free(r);
  return 0;
}

const char *mr__nccl_blocked(struct mr_comm *cc, char *buf, size_t len) {
  struct nccl_comm *c = (struct nccl_comm *)cc;
  if (len > 0)
    buf[0] = '\0';
  pthread_mutex_lock(&c->lock);
  for (struct nccl_req *r = c->inflight; r != NULL; r = r->next) {
    if (r->finished || r->g->broken)
      continue;
    if (!r->pending && mr__cuda_set_device(c->device) == 0 &&
        cudaEventQuery(r->done) == cudaSuccess)
      continue;
    cudaGetLastError();
    char peers[256];
    peers_text(r->g, r->peer, peers, sizeof peers);
    snprintf(buf, len, "%s #%llu on group %s: %.1f s, waiting for %s (NCCL)", r->op,
             (unsigned long long)r->seq, r->g->desc,
             (double)(mr_clock_ns() - r->start_ns) / 1e9, peers);
    break;
  }
  pthread_mutex_unlock(&c->lock);
  return buf;
}
