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
 * The requests (issue, settle, test, wait, timeout) are nccl_req.c.
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#include "common/tunable.h"
#include "worker/comm/nccl_internal.h"

static const struct mr_comm_ops nccl_ops;

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
  MR_TRY(mr__nccl_op_begin(g, scatter ? "ReduceScatter" : "AllReduce", -1, &r));
  ncclResult_t res = scatter ? ncclReduceScatter(send, recv, count, t, red, g->nc, g->stream)
                             : ncclAllReduce(send, recv, count, t, red, g->nc, g->stream);
  if (int_avg && NCCL_OK(res)) {
    int rc = mr__nccl_settle(g, r->op, r->seq, -1);
    if (rc == 0)
      rc = finish_int_avg(g, recv, count, dt);
    if (rc < 0) {
      mr__nccl_req_free(r);
      return rc;
    }
  }
  return mr__nccl_op_end(g, r, res, scatter ? "ncclReduceScatter" : "ncclAllReduce", out);
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
  MR_TRY(mr__nccl_op_begin(g, "AllGather", -1, &r));
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
        mr__nccl_req_free(r);
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
    res = mr__nccl_group_end(res);
  }
  return mr__nccl_op_end(g, r, res, "ncclAllGather", out);
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
  MR_TRY(mr__nccl_op_begin(g, "Broadcast", root == g->me ? -1 : root, &r));
  ncclResult_t res = ncclBroadcast(buf, buf, count, t, root, g->nc, g->stream);
  return mr__nccl_op_end(g, r, res, "ncclBroadcast", out);
}

static int nc_all_to_all(struct mr_comm_group *gg, const void *send, void *recv,
                         size_t count, enum mr_dtype dt, struct mr_comm_req **out) {
  struct nccl_group *g = GROUP(gg);
  ncclDataType_t t;
  MR_TRY(nccl_type(dt, 0, &t));
  size_t block = count * mr_dtype_size(dt);
  struct nccl_req *r;
  MR_TRY(mr__nccl_op_begin(g, "AllToAll", -1, &r));
  if (count > 0) {
    int rc = mr__cuda_check(cudaMemcpyAsync((char *)recv + (size_t)g->me * block,
                                            (const char *)send + (size_t)g->me * block,
                                            block, cudaMemcpyDeviceToDevice, g->stream),
                            "cudaMemcpyAsync");
    if (rc < 0) {
      mr__nccl_req_free(r);
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
  res = mr__nccl_group_end(res);
  return mr__nccl_op_end(g, r, res, "ncclSend/ncclRecv (AllToAll)", out);
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
  MR_TRY(mr__nccl_op_begin(g, op, peer, &r));
  /* held until mr__nccl_flush_p2p, which batches it with its neighbours */
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
  mr__nccl_queue_req(g->c, r);
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
  MR_TRY(mr__nccl_op_begin(g, "Barrier", -1, &r));
  ncclResult_t res = ncclAllReduce(g->barrier, g->barrier, 1, ncclFloat32, ncclSum,
                                   g->nc, g->stream);
  return mr__nccl_op_end(g, r, res, "ncclAllReduce (barrier)", out);
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
    mr__nccl_flush_p2p(g);
  if (g->nc != NULL) {
    /* finalize flushes what was issued; a hang there aborts instead */
    ncclResult_t r = ncclCommFinalize(g->nc);
    if (NCCL_OK(r) && mr__nccl_settle(g, "ncclCommFinalize", g->seq, -1) == 0)
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
  g->base.label = g->desc;
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
    rc = mr__nccl_failed(g, r, "ncclCommInitRankConfig");
    goto err;
  }
  MR_TRY_GOTO(rc, mr__nccl_settle(g, "ncclCommInitRankConfig", 0, -1), err);
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
    mr__nccl_req_free(r);
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
    .test = mr__nccl_test,
    .wait = mr__nccl_wait,
    .blocked = mr__nccl_blocked,
};

const struct mr_comm_ops *mr__comm_nccl_ops(void) { return &nccl_ops; }
