/* nccl.c - the NCCL comm backend (part of the CUDA module).
 *
 * One NCCL communicator per group.  Its unique id is made by group rank 0
 * and sent to the other members over a CPU communicator that the NCCL one
 * opens beside itself with the same bootstrap, so creating a group is
 * collective over its members only, as comm.h asks.  Communicators are
 * non-blocking (ncclConfig_t.blocking = 0): every NCCL call is followed by
 * polling ncclCommGetAsyncError until it settles, which lets a creation or
 * an operation that does not finish within MESHRUN_COMM_TIMEOUT_MS abort
 * its communicator (ncclCommAbort) and fail, naming the operation and the
 * group's peers, instead of hanging the job.
 *
 * The communicator drives the GPU of the process's CUDA backend (open the
 * backend first), else the opening thread's current device.
 *
 * Each group has its own stream.  An operation first makes that stream wait
 * for the work queued so far on the CUDA backend's compute stream (so it
 * sees the kernels that produced its input), then runs there; its request
 * is a CUDA event recorded after it.  test() queries the event; wait()
 * polls it with the timeout, so when wait returns the host and every later
 * kernel see the result.  Buffers are device memory.
 *
 * Sends and receives are batched: each is held until the next operation
 * on its group, or a test or wait on one of them, and then all held ones go
 * to NCCL in one ncclGroupStart/End (as torch's batch_isend_irecv), so a
 * pipeline stage that posts its send and its receive before waiting cannot
 * deadlock against its peer doing the same.
 *
 * Differences from the CPU backend, which NCCL does not offer: reductions
 * follow NCCL's ring or tree, deterministic for a fixed topology and size
 * but not in rank order, and bf16 / fp16 sums round at each step rather
 * than accumulating in float32; a timeout cannot say which ranks did not
 * arrive, so the message lists the group's peers. */
#include <errno.h>
#include <nccl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/tunable.h"
#include "worker/backend/cuda/cuda_internal.h"
#include "worker/comm/comm.h"

struct nccl_req;
static const struct mr_comm_ops nccl_ops;

struct nccl_group {
  struct mr_comm_group base;
  struct nccl_comm *c;
  ncclComm_t nc;             // NULL once aborted or destroyed
  cudaStream_t stream;
  cudaEvent_t ev_in;         // the compute stream's position at a start
  float *barrier;            // device, 1 float
  int n, me;
  int *ranks;
  uint64_t seq;              // operations issued
  struct nccl_req *p2p;      // sends and receives waiting for flush_p2p
  int p2p_n;
  int broken;
  char broken_msg[512];
  char desc[256];            // name{r0,r1,...}
  struct nccl_group *next;
};

struct nccl_comm {
  struct mr_comm base;
  struct mr_comm *cpu;       // id exchange
  int rank, world, device;
  int64_t timeout_ns;
  pthread_mutex_t lock;      // groups and the in-flight list
  struct nccl_group *groups;
  struct nccl_req *inflight; // oldest first
};

struct nccl_req {
  struct mr_comm_req base;
  struct nccl_group *g;
  cudaEvent_t done;
  const char *op;
  uint64_t seq;
  int peer;                  // -1: every member
  int64_t start_ns;
  int finished;              // observed complete (or failed)
  int rc;
  struct nccl_req *next;     // in the in-flight list
  /* a send or receive not yet given to NCCL (see flush_p2p) */
  int pending, is_send;
  void *buf;
  size_t count;
  ncclDataType_t type;
  struct nccl_req *pnext;
};

/* a call that succeeded, or was accepted by a non-blocking communicator */
#define NCCL_OK(r) ((r) == ncclSuccess || (r) == ncclInProgress)

/* Closes an ncclGroupStart: the first failure, inside the group or at its
 * end, is the result. */
static ncclResult_t group_end(ncclResult_t res) {
  ncclResult_t end = ncclGroupEnd();
  return NCCL_OK(res) ? end : res;
}

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
  MR_ERROR("comm", "%s", g->broken_msg);
  return mr_error_set(code, "%s", g->broken_msg);
}

static int nccl_failed(struct nccl_group *g, ncclResult_t r, const char *call) {
  const char *last = g->nc != NULL ? ncclGetLastError(g->nc) : "";
  return group_break(g, r == ncclRemoteError || r == ncclSystemError ? MR_EPEER : MR_EIO,
                     "nccl: %s on group %s: %s%s%s; the communicator was aborted",
                     call, g->desc, ncclGetErrorString(r), last && last[0] ? ": " : "",
                     last ? last : "");
}

/* Polls the communicator until its last call has settled. */
static int settle(struct nccl_group *g, const char *what, uint64_t seq, int peer) {
  int64_t start = mr_clock_ns();
  for (;;) {
    ncclResult_t st = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(g->nc, &st);
    if (r != ncclSuccess)
      return nccl_failed(g, r, "ncclCommGetAsyncError");
    if (st == ncclSuccess)
      return 0;
    if (st != ncclInProgress)
      return nccl_failed(g, st, what);
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

static int nccl_type(enum mr_dtype dt, int reduce, ncclDataType_t *out) {
  switch (dt) {
  case MR_F32: *out = ncclFloat32; return 0;
  case MR_BF16: *out = ncclBfloat16; return 0;
  case MR_F16: *out = ncclFloat16; return 0;
  case MR_I32: *out = ncclInt32; return 0;
  case MR_I64: *out = ncclInt64; return 0;
  case MR_U8: *out = ncclUint8; return 0;
  case MR_F64: *out = ncclFloat64; return 0;
  case MR_U16:
    if (!reduce) { /* moved, never added: any 2-byte type carries it */
      *out = ncclFloat16;
      return 0;
    }
    break;
  default:
    break;
  }
  return mr_error_set(MR_ENOTSUP, "nccl: dtype %s cannot be %s", mr_dtype_name(dt),
                      reduce ? "reduced" : "sent");
}

static int nccl_red(enum mr_red_op op, enum mr_dtype dt, ncclRedOp_t *out, int *int_avg) {
  *int_avg = 0;
  switch (op) {
  case MR_RED_SUM: *out = ncclSum; return 0;
  case MR_RED_MAX: *out = ncclMax; return 0;
  case MR_RED_AVG:
    if (dt == MR_I32 || dt == MR_I64 || dt == MR_U8) {
      /* integers: the sum, then a truncating division on the device */
      *out = ncclSum;
      *int_avg = 1;
    } else {
      *out = ncclAvg;
    }
    return 0;
  }
  return mr_error_set(MR_EINVAL, "nccl: reduction %d", (int)op);
}

/* ---- requests ---- */

static int flush_p2p(struct nccl_group *g);
static void queue_req(struct nccl_comm *c, struct nccl_req *r);

static int op_begin(struct nccl_group *g, const char *op, int peer,
                    struct nccl_req **out) {
  *out = NULL;
  int is_p2p = strcmp(op, "Send") == 0 || strcmp(op, "Recv") == 0;
  if (!is_p2p || g->p2p_n >= 256) {
    /* operations on a group run in issue order: held sends go first */
    int rc = flush_p2p(g);
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

static void req_free(struct nccl_req *r) {
  if (r == NULL)
    return;
  cudaEventDestroy(r->done);
  free(r);
}

static void queue_req(struct nccl_comm *c, struct nccl_req *r) {
  pthread_mutex_lock(&c->lock);
  struct nccl_req **p = &c->inflight;
  while (*p != NULL)
    p = &(*p)->next;
  *p = r;
  r->next = NULL;
  pthread_mutex_unlock(&c->lock);
}

/* Gives the held sends and receives to NCCL as one group.  On failure
 * each of them finishes with the error. */
static int flush_p2p(struct nccl_group *g) {
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
    res = group_end(res);
    if (!NCCL_OK(res))
      rc = nccl_failed(g, res, "ncclSend/ncclRecv");
    if (rc == 0)
      rc = settle(g, list->op, list->seq, list->peer);
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

/* After the NCCL call(s) of r returned res: settle, mark the end, queue. */
static int op_end(struct nccl_group *g, struct nccl_req *r, ncclResult_t res,
                  const char *call, struct mr_comm_req **out) {
  int rc = 0;
  if (!NCCL_OK(res))
    rc = nccl_failed(g, res, call);
  if (rc == 0)
    rc = settle(g, r->op, r->seq, r->peer);
  if (rc == 0)
    rc = mr__cuda_check(cudaEventRecord(r->done, g->stream), "cudaEventRecord");
  if (rc < 0) {
    req_free(r);
    return rc;
  }
  queue_req(g->c, r);
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
    flush_p2p(g); /* a failure finishes r with its error */
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
    r->rc = nccl_failed(g, st, r->op);
    return;
  }
  int64_t waited = mr_clock_ns() - r->start_ns;
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

static int nc_test(struct mr_comm_req *rr, int *done) {
  struct nccl_req *r = (struct nccl_req *)rr;
  if (r == NULL || done == NULL)
    return mr_error_set(MR_EINVAL, "nccl test: no request");
  req_poll(r);
  *done = r->finished;
  return 0;
}

static int nc_wait(struct mr_comm_req *rr) {
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
    req_free(r);
    return mr_error_set(rc, "%s", msg);
  }
  req_free(r);
  return 0;
}

static const char *nc_blocked(struct mr_comm *cc, char *buf, size_t len) {
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

/* ---- operations ---- */

#define GROUP(gg) ((struct nccl_group *)(gg))

static int finish_int_avg(struct nccl_group *g, void *recv, size_t count,
                          enum mr_dtype dt) {
  if (dt == MR_U8)
    return mr_error_set(MR_ENOTSUP, "nccl: average of uint8 on group %s", g->desc);
  return mr__cuda_check(mr__k_div_int(g->stream, recv, (int64_t)count, dt, g->n),
                        "average (integer division)");
}

/* AllReduce, or ReduceScatter when scatter: NCCL has no integer average,
 * so an integer one is a sum the group divides once the sum has landed. */
static int nc_reduce(struct mr_comm_group *gg, const void *send, void *recv, size_t count,
                     enum mr_dtype dt, enum mr_red_op op, int scatter,
                     struct mr_comm_req **out) {
  struct nccl_group *g = GROUP(gg);
  ncclDataType_t t;
  ncclRedOp_t red = ncclSum;
  int int_avg;
  MR_TRY(nccl_type(dt, 1, &t));
  MR_TRY(nccl_red(op, dt, &red, &int_avg));
  struct nccl_req *r;
  MR_TRY(op_begin(g, scatter ? "ReduceScatter" : "AllReduce", -1, &r));
  ncclResult_t res = scatter ? ncclReduceScatter(send, recv, count, t, red, g->nc, g->stream)
                             : ncclAllReduce(send, recv, count, t, red, g->nc, g->stream);
  if (int_avg && NCCL_OK(res)) {
    int rc = settle(g, r->op, r->seq, -1);
    if (rc == 0)
      rc = finish_int_avg(g, recv, count, dt);
    if (rc < 0) {
      req_free(r);
      return rc;
    }
  }
  return op_end(g, r, res, scatter ? "ncclReduceScatter" : "ncclAllReduce", out);
}

static int nc_all_reduce(struct mr_comm_group *g, const void *send, void *recv,
                         size_t count, enum mr_dtype dt, enum mr_red_op op,
                         struct mr_comm_req **out) {
  return nc_reduce(g, send, recv, count, dt, op, 0, out);
}

static int nc_reduce_scatter(struct mr_comm_group *g, const void *send, void *recv,
                             size_t count, enum mr_dtype dt, enum mr_red_op op,
                             struct mr_comm_req **out) {
  return nc_reduce(g, send, recv, count, dt, op, 1, out);
}

static int nc_all_gather(struct mr_comm_group *gg, const void *send, void *recv,
                         size_t count, const size_t *counts, enum mr_dtype dt,
                         struct mr_comm_req **out) {
  struct nccl_group *g = GROUP(gg);
  ncclDataType_t t;
  MR_TRY(nccl_type(dt, 0, &t));
  size_t es = mr_dtype_size(dt);
  int equal = 1;
  if (counts != NULL)
    for (int i = 1; i < g->n; i++)
      equal &= counts[i] == counts[0];
  struct nccl_req *r;
  MR_TRY(op_begin(g, "AllGather", -1, &r));
  ncclResult_t res;
  if (counts == NULL || equal) {
    size_t n = counts == NULL ? count : counts[0];
    res = ncclAllGather(send, recv, n, t, g->nc, g->stream);
  } else {
    /* unequal blocks: every rank sends its block to every other, grouped */
    size_t displ = 0, mine = 0;
    for (int i = 0; i < g->me; i++)
      mine += counts[i];
    char *dst = (char *)recv + mine * es;
    if (counts[g->me] > 0 && dst != (const char *)send) {
      int rc = mr__cuda_check(cudaMemcpyAsync(dst, send, counts[g->me] * es,
                                              cudaMemcpyDeviceToDevice, g->stream),
                              "cudaMemcpyAsync");
      if (rc < 0) {
        req_free(r);
        return rc;
      }
    }
    res = ncclGroupStart();
    for (int i = 0; i < g->n && NCCL_OK(res); i++) {
      size_t here = displ;
      displ += counts[i];
      if (i == g->me)
        continue;
      if (counts[g->me] > 0)
        res = ncclSend(send, counts[g->me], t, i, g->nc, g->stream);
      if (counts[i] > 0 && NCCL_OK(res))
        res = ncclRecv((char *)recv + here * es, counts[i], t, i, g->nc, g->stream);
    }
    res = group_end(res);
  }
  return op_end(g, r, res, "ncclAllGather", out);
}

static int nc_broadcast(struct mr_comm_group *gg, void *buf, size_t count,
                        enum mr_dtype dt, int root, struct mr_comm_req **out) {
  struct nccl_group *g = GROUP(gg);
  ncclDataType_t t;
  MR_TRY(nccl_type(dt, 0, &t));
  if (root < 0 || root >= g->n)
    return mr_error_set(MR_EINVAL, "Broadcast on group %s: root %d of %d ranks",
                        g->desc, root, g->n);
  struct nccl_req *r;
  MR_TRY(op_begin(g, "Broadcast", root == g->me ? -1 : root, &r));
  ncclResult_t res = ncclBroadcast(buf, buf, count, t, root, g->nc, g->stream);
  return op_end(g, r, res, "ncclBroadcast", out);
}

static int nc_all_to_all(struct mr_comm_group *gg, const void *send, void *recv,
                         size_t count, enum mr_dtype dt, struct mr_comm_req **out) {
  struct nccl_group *g = GROUP(gg);
  ncclDataType_t t;
  MR_TRY(nccl_type(dt, 0, &t));
  size_t block = count * mr_dtype_size(dt);
  struct nccl_req *r;
  MR_TRY(op_begin(g, "AllToAll", -1, &r));
  if (count > 0) {
    int rc = mr__cuda_check(cudaMemcpyAsync((char *)recv + (size_t)g->me * block,
                                            (const char *)send + (size_t)g->me * block,
                                            block, cudaMemcpyDeviceToDevice, g->stream),
                            "cudaMemcpyAsync");
    if (rc < 0) {
      req_free(r);
      return rc;
    }
  }
  ncclResult_t res = ncclGroupStart();
  for (int i = 0; i < g->n && count > 0 && NCCL_OK(res); i++) {
    if (i == g->me)
      continue;
    res = ncclSend((const char *)send + (size_t)i * block, count, t, i, g->nc, g->stream);
    if (NCCL_OK(res))
      res = ncclRecv((char *)recv + (size_t)i * block, count, t, i, g->nc, g->stream);
  }
  res = group_end(res);
  return op_end(g, r, res, "ncclSend/ncclRecv (AllToAll)", out);
}

static int nc_p2p(struct mr_comm_group *gg, void *buf, size_t count, enum mr_dtype dt,
                  int peer, int is_send, struct mr_comm_req **out) {
  struct nccl_group *g = GROUP(gg);
  const char *op = is_send ? "Send" : "Recv";
  ncclDataType_t t;
  MR_TRY(nccl_type(dt, 0, &t));
  if (peer < 0 || peer >= g->n || peer == g->me)
    return mr_error_set(MR_EINVAL, "%s on group %s: peer %d (this rank is %d of %d)",
                        op, g->desc, peer, g->me, g->n);
  struct nccl_req *r;
  MR_TRY(op_begin(g, op, peer, &r));
  /* held until flush_p2p, which batches it with its neighbours */
  r->pending = 1;
  r->is_send = is_send;
  r->buf = buf;
  r->count = count;
  r->type = t;
  struct nccl_req **p = &g->p2p;
  while (*p != NULL)
    p = &(*p)->pnext;
  *p = r;
  g->p2p_n++;
  queue_req(g->c, r);
  *out = &r->base;
  return 0;
}

static int nc_send(struct mr_comm_group *g, const void *buf, size_t count,
                   enum mr_dtype dt, int peer, struct mr_comm_req **out) {
  return nc_p2p(g, (void *)buf, count, dt, peer, 1, out);
}

static int nc_recv(struct mr_comm_group *g, void *buf, size_t count, enum mr_dtype dt,
                   int peer, struct mr_comm_req **out) {
  return nc_p2p(g, buf, count, dt, peer, 0, out);
}

static int nc_barrier(struct mr_comm_group *gg, struct mr_comm_req **out) {
  struct nccl_group *g = GROUP(gg);
  struct nccl_req *r;
  MR_TRY(op_begin(g, "Barrier", -1, &r));
  ncclResult_t res = ncclAllReduce(g->barrier, g->barrier, 1, ncclFloat32, ncclSum,
                                   g->nc, g->stream);
  return op_end(g, r, res, "ncclAllReduce (barrier)", out);
}

/* ---- groups ---- */

static int nc_group_rank(const struct mr_comm_group *g) { return GROUP(g)->me; }
static int nc_group_size(const struct mr_comm_group *g) { return GROUP(g)->n; }

static int nc_mem_alloc(struct mr_comm_group *gg, size_t bytes, void **out) {
  *out = NULL;
  MR_TRY(mr__cuda_set_device(GROUP(gg)->c->device));
  MR_CUDA_TRY(cudaMalloc(out, bytes ? bytes : 1));
  return 0;
}

static void nc_mem_free(struct mr_comm_group *gg, void *p) {
  if (p == NULL)
    return;
  mr__cuda_set_device(GROUP(gg)->c->device);
  cudaFree(p);
}

static void group_release(struct nccl_group *g) {
  if (g == NULL)
    return;
  mr__cuda_set_device(g->c->device);
  if (g->nc != NULL)
    flush_p2p(g);
  if (g->nc != NULL) {
    /* finalize flushes what was issued; a hang there aborts instead */
    ncclResult_t r = ncclCommFinalize(g->nc);
    if (NCCL_OK(r) && settle(g, "ncclCommFinalize", g->seq, -1) == 0)
      ncclCommDestroy(g->nc);
    else if (g->nc != NULL)
      ncclCommAbort(g->nc);
    g->nc = NULL;
  }
  if (g->stream != NULL) {
    cudaStreamSynchronize(g->stream);
    cudaStreamDestroy(g->stream);
  }
  if (g->ev_in != NULL)
    cudaEventDestroy(g->ev_in);
  if (g->barrier != NULL)
    cudaFree(g->barrier);
  free(g->ranks);
  free(g);
}

static int nc_group_new(struct mr_comm *cc, const char *name, const int *ranks, int n,
                        struct mr_comm_group **out) {
  struct nccl_comm *c = (struct nccl_comm *)cc;
  if (name == NULL || ranks == NULL || n <= 0 || out == NULL)
    return mr_error_set(MR_EINVAL, "nccl group: expected a name and ranks");
  *out = NULL;
  struct nccl_group *g = calloc(1, sizeof *g);
  if (g == NULL)
    return mr_error_set(MR_ENOMEM, "nccl group %s: out of memory", name);
  g->base.comm = cc;
  g->c = c;
  g->n = n;
  g->me = -1;
  g->ranks = malloc((size_t)n * sizeof(int));
  if (g->ranks == NULL) {
    free(g);
    return mr_error_set(MR_ENOMEM, "nccl group %s: out of memory", name);
  }
  size_t off = (size_t)snprintf(g->desc, sizeof g->desc, "%s{", name);
  int rc = 0;
  for (int i = 0; i < n; i++) {
    if (ranks[i] < 0 || ranks[i] >= c->world) {
      rc = mr_error_set(MR_EINVAL, "nccl group %s: rank %d is outside the world "
                        "(0..%d)", name, ranks[i], c->world - 1);
      goto err;
    }
    for (int j = 0; j < i; j++)
      if (ranks[j] == ranks[i]) {
        rc = mr_error_set(MR_EINVAL, "nccl group %s: rank %d listed twice", name,
                          ranks[i]);
        goto err;
      }
    g->ranks[i] = ranks[i];
    if (ranks[i] == c->rank)
      g->me = i;
    if (off < sizeof g->desc)
      off += (size_t)snprintf(g->desc + off, sizeof g->desc - off, "%s%d",
                              i ? "," : "", ranks[i]);
  }
  if (off < sizeof g->desc)
    snprintf(g->desc + off, sizeof g->desc - off, "}");
  if (g->me < 0) {
    rc = mr_error_set(MR_EINVAL, "nccl group %s: this rank (%d) is not a member",
                      g->desc, c->rank);
    goto err;
  }
  /* group rank 0 makes the id; the members get it over the CPU group */
  struct {
    ncclUniqueId id;
    int32_t ok;
  } blob;
  memset(&blob, 0, sizeof blob);
  struct mr_comm_group *cg = NULL;
  MR_TRY_GOTO(rc, c->cpu->ops->group_new(c->cpu, name, ranks, n, &cg), err);
  if (g->me == 0) {
    ncclResult_t r = ncclGetUniqueId(&blob.id);
    blob.ok = r == ncclSuccess;
    if (!blob.ok)
      MR_ERROR("comm", "nccl group %s: ncclGetUniqueId: %s", g->desc,
               ncclGetErrorString(r));
  }
  struct mr_comm_req *req = NULL;
  rc = mr_comm_broadcast(cg, &blob, sizeof blob, MR_U8, 0, &req);
  if (rc == 0)
    rc = mr_comm_wait(req);
  c->cpu->ops->group_free(cg);
  if (rc < 0)
    goto err;
  if (!blob.ok) {
    rc = mr_error_set(MR_EPEER, "nccl group %s: its rank 0 could not make an NCCL "
                      "id (see that rank's log)", g->desc);
    goto err;
  }
  MR_TRY_GOTO(rc, mr__cuda_set_device(c->device), err);
  MR_TRY_GOTO(rc, mr__cuda_check(cudaStreamCreateWithFlags(&g->stream,
                                                           cudaStreamNonBlocking),
                                 "cudaStreamCreateWithFlags"), err);
  MR_TRY_GOTO(rc, mr__cuda_check(cudaEventCreateWithFlags(&g->ev_in,
                                                          cudaEventDisableTiming),
                                 "cudaEventCreateWithFlags"), err);
  MR_TRY_GOTO(rc, mr__cuda_check(cudaMalloc((void **)&g->barrier, sizeof(float)),
                                 "cudaMalloc"), err);
  MR_TRY_GOTO(rc, mr__cuda_check(cudaMemset(g->barrier, 0, sizeof(float)),
                                 "cudaMemset"), err);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  cfg.commName = g->desc;
  ncclResult_t r = ncclCommInitRankConfig(&g->nc, n, blob.id, g->me, &cfg);
  if (!NCCL_OK(r)) {
    rc = nccl_failed(g, r, "ncclCommInitRankConfig");
    goto err;
  }
  MR_TRY_GOTO(rc, settle(g, "ncclCommInitRankConfig", 0, -1), err);
  pthread_mutex_lock(&c->lock);
  g->next = c->groups;
  c->groups = g;
  pthread_mutex_unlock(&c->lock);
  MR_DEBUG("comm", "nccl group %s: rank %d of %d on device %d", g->desc, g->me, n,
           c->device);
  *out = &g->base;
  return 0;
err:
  group_release(g);
  return rc;
}

static void nc_group_free(struct mr_comm_group *gg) {
  struct nccl_group *g = GROUP(gg);
  if (g == NULL)
    return;
  struct nccl_comm *c = g->c;
  pthread_mutex_lock(&c->lock);
  for (struct nccl_group **p = &c->groups; *p != NULL; p = &(*p)->next)
    if (*p == g) {
      *p = g->next;
      break;
    }
  pthread_mutex_unlock(&c->lock);
  group_release(g);
}

/* ---- communicator ---- */

/* The CPU communicator's bootstrap: the same exchange under other keys,
 * so that a CPU communicator the runtime opens too never meets ours. */
struct prefixed_bs {
  const struct mr_bootstrap *inner;
};

static int prefixed_allgather(void *ctx, const char *key, const void *blob,
                              size_t len, void *out) {
  const struct prefixed_bs *p = ctx;
  char k[160];
  snprintf(k, sizeof k, "nccl.%s", key);
  return p->inner->allgather(p->inner->ctx, k, blob, len, out);
}

static void nc_close(struct mr_comm *cc);

static int nc_open(const struct mr_bootstrap *bs, struct mr_comm **out) {
  if (bs == NULL || out == NULL || bs->allgather == NULL || bs->world_size <= 0 ||
      bs->rank < 0 || bs->rank >= bs->world_size)
    return mr_error_set(MR_EINVAL, "nccl comm open: expected a bootstrap with a rank "
                        "in 0..world_size-1 and an allgather");
  *out = NULL;
  /* the rank's GPU: that of its CUDA backend, else the thread's device */
  int dev = mr__cuda_backend_device();
  if (dev < 0) {
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess)
      return mr__cuda_check(e, "cudaGetDevice");
  }
  MR_TRY(mr__cuda_set_device(dev));
  struct nccl_comm *c = calloc(1, sizeof *c);
  if (c == NULL)
    return mr_error_set(MR_ENOMEM, "nccl comm open: out of memory");
  c->base.ops = &nccl_ops;
  c->rank = bs->rank;
  c->world = bs->world_size;
  c->device = dev;
  c->timeout_ns = mr_tunable_int(MR_TUNABLE_COMM_TIMEOUT_MS) * 1000000LL;
  pthread_mutex_init(&c->lock, NULL);
  char job[128];
  snprintf(job, sizeof job, "%s-nccl",
           bs->job_id != NULL && bs->job_id[0] ? bs->job_id : "0");
  struct prefixed_bs pb = {bs};
  struct mr_bootstrap inner = *bs;
  inner.job_id = job;
  inner.ctx = &pb;
  inner.allgather = prefixed_allgather;
  int rc = mr_comm_cpu_ops()->open(&inner, &c->cpu);
  if (rc < 0) {
    nc_close(&c->base);
    return rc;
  }
  int version = 0;
  ncclGetVersion(&version);
  MR_DEBUG("comm", "nccl %d on device %d, rank %d of %d", version, dev, c->rank,
           c->world);
  *out = &c->base;
  return 0;
}

static void nc_close(struct mr_comm *cc) {
  struct nccl_comm *c = (struct nccl_comm *)cc;
  if (c == NULL)
    return;
  while (c->groups != NULL)
    nc_group_free(&c->groups->base);
  while (c->inflight != NULL) {
    struct nccl_req *r = c->inflight;
    c->inflight = r->next;
    req_free(r);
  }
  if (c->cpu != NULL)
    c->cpu->ops->close(c->cpu);
  pthread_mutex_destroy(&c->lock);
  free(c);
}

static const struct mr_comm_ops nccl_ops = {
    .name = "nccl",
    .open = nc_open,
    .close = nc_close,
    .group_new = nc_group_new,
    .group_free = nc_group_free,
    .group_rank = nc_group_rank,
    .group_size = nc_group_size,
    .mem_alloc = nc_mem_alloc,
    .mem_free = nc_mem_free,
    .all_reduce = nc_all_reduce,
    .reduce_scatter = nc_reduce_scatter,
    .all_gather = nc_all_gather,
    .broadcast = nc_broadcast,
    .all_to_all = nc_all_to_all,
    .send = nc_send,
    .recv = nc_recv,
    .barrier = nc_barrier,
    .test = nc_test,
    .wait = nc_wait,
    .blocked = nc_blocked,
};

const struct mr_comm_ops *mr__comm_nccl_ops(void) { return &nccl_ops; }
