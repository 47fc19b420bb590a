/* comm.h - the communication backend interface: groups of ranks and
 * asynchronous collectives on them.
 *
 * A backend (cpu: shared memory and TCP; later nccl) is one table of
 * functions, struct mr_comm_ops.  A process opens one communicator over the
 * whole world with a bootstrap, then creates groups from lists of global
 * ranks; a rank belongs to any number of groups.  Every operation starts
 * asynchronously and returns a request that is later tested or waited on;
 * operations on one group complete in the order they were issued, and every
 * member must issue the same collectives on a group in the same order.
 * Reductions run in a fixed order (rank 0 first), so equal inputs give
 * bitwise equal results on every run and every rank; bf16 and fp16 are
 * accumulated in float32.  An operation that cannot complete within the
 * backend's timeout fails with MR_ETIMEDOUT and a message naming the group,
 * the operation, its sequence number and the ranks that have not arrived;
 * after that the group is broken and later operations on it fail.  Once
 * the stop flag the process watches is set (mr_comm_watch_stop), every
 * wait fails within a few milliseconds with MR_ECANCELED: a rank the
 * launcher stops while it waits on a dead peer leaves at once.
 *
 * Buffers are borrowed from start until the request completes. */
#ifndef MR_COMM_H
#define MR_COMM_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common/clock.h"
#include "common/dtype.h"
#include "worker/comm/bootstrap.h"

enum mr_red_op {
  MR_RED_SUM = 0,
  MR_RED_AVG = 1, /* the sum divided by the group size (integers truncate) */
  MR_RED_MAX = 2,
};

/* Every backend's objects start with these, so the inline dispatchers below
 * find the table. */
struct mr_comm {
  const struct mr_comm_ops *ops;
};
struct mr_comm_group {
  struct mr_comm *comm;
  const char *label;  // "model{0,1,2,3}": its name and global ranks
  uint64_t issued;    // operations started on it (the dispatchers count)
};
struct mr_comm_req {
  struct mr_comm *comm;
};

struct mr_comm_ops {
  const char *name;
  /* Opens a communicator; collective over the world (every rank calls it).
   * bs is borrowed for the call only. */
  int (*open)(const struct mr_bootstrap *bs, struct mr_comm **out);
  /* Frees the communicator and every group left open; no operation may be
   * in flight.  NULL is a no-op. */
  void (*close)(struct mr_comm *c);
  /* Creates a group of n global ranks (in the order given: group rank i is
   * ranks[i]); collective over those ranks, which call it with the same name
   * and list.  name ("model", "data", "pp0-1") is copied and appears in error
   * messages as name{ranks}. */
  int (*group_new)(struct mr_comm *c, const char *name, const int *ranks,
                   int n, struct mr_comm_group **out);
  /* Frees a group with nothing in flight; NULL is a no-op. */
  void (*group_free)(struct mr_comm_group *g);
  /* This process's rank in the group, and the group's size. */
  int (*group_rank)(const struct mr_comm_group *g);
  int (*group_size)(const struct mr_comm_group *g);
  /* Allocates bytes that peers can read directly (e.g. shared memory), so
   * that operations on it skip the copy in.  Returns 0 or MR_ENOMEM;
   * backends without such memory return ordinary memory.  Free with
   * mem_free on the same group. */
  int (*mem_alloc)(struct mr_comm_group *g, size_t bytes, void **out);
  void (*mem_free)(struct mr_comm_group *g, void *p);

  /* recv[i] = red over ranks of send[i], count elements; send == recv is
   * allowed. */
  int (*all_reduce)(struct mr_comm_group *g, const void *send, void *recv,
                    size_t count, enum mr_dtype dt, enum mr_red_op op,
                    struct mr_comm_req **req);
  /* send holds n * recv_count elements; recv gets block <group rank> of the
   * reduction. */
  int (*reduce_scatter)(struct mr_comm_group *g, const void *send, void *recv,
                        size_t recv_count, enum mr_dtype dt,
                        enum mr_red_op op, struct mr_comm_req **req);
  /* recv = concatenation of every rank's send, in group-rank order.  counts
   * (n entries, copied) gives each rank's element count, or is NULL when all
   * send count elements. */
  int (*all_gather)(struct mr_comm_group *g, const void *send, void *recv,
                    size_t count, const size_t *counts, enum mr_dtype dt,
                    struct mr_comm_req **req);
  /* buf of group rank root is copied to every rank's buf. */
  int (*broadcast)(struct mr_comm_group *g, void *buf, size_t count,
                   enum mr_dtype dt, int root, struct mr_comm_req **req);
  /* Block j (count elements) of send goes to group rank j, landing in block
   * <my rank> of its recv. */
  int (*all_to_all)(struct mr_comm_group *g, const void *send, void *recv,
                    size_t count, enum mr_dtype dt, struct mr_comm_req **req);
  /* Point to point with group rank peer; each send matches the peer's next
   * recv from this rank with the same count.  A send larger than the
   * backend's buffering completes only when the receiver takes it. */
  int (*send)(struct mr_comm_group *g, const void *buf, size_t count,
              enum mr_dtype dt, int peer, struct mr_comm_req **req);
  int (*recv)(struct mr_comm_group *g, void *buf, size_t count,
              enum mr_dtype dt, int peer, struct mr_comm_req **req);
  int (*barrier)(struct mr_comm_group *g, struct mr_comm_req **req);

  /* *done = 1 when the request completed (successfully or not); it must
   * still be waited on.  Drives progress.  Returns 0 or MR_EINVAL. */
  int (*test)(struct mr_comm_req *r, int *done);
  /* Waits for the request, frees it, and returns its result: 0 or a
   * negative MR_E* code with the message in mr_error_message(). */
  int (*wait)(struct mr_comm_req *r);
  /* Writes into buf (len bytes, NUL-terminated) a description of the
   * operation this process has been blocked on longest, e.g. "AllReduce #12
   * on group model{0,1,2,3}: 2.1 s, waiting for ranks 2, 3", or "" when
   * nothing is in flight.  Thread-safe.  Returns buf. */
  const char *(*blocked)(struct mr_comm *c, char *buf, size_t len);
};

/* The CPU backend: shared memory between ranks whose host ids match, TCP
 * otherwise (MESHRUN_COMM_TRANSPORT=tcp forces TCP). */
const struct mr_comm_ops *mr_comm_cpu_ops(void);

/* What a timeline of the process is told about its operations (the
 * worker's trace): start when one was issued, with the bytes of the whole
 * operation (for a reduce-scatter or an all-gather, the n blocks), the
 * group rank of the peer (-1 for a collective) and its number on the group
 * (equal on every member) and t_ns, the clock (mr_clock_ns) just before
 * it was issued: a peer may finish it before the issuing call returns;
 * end when its wait returned.  r identifies the operation from start to
 * end only. */
struct mr_comm_tracer {
  void *ctx;
  void (*start)(void *ctx, const struct mr_comm_group *g, const char *op, size_t bytes,
                int peer, uint64_t seq, const struct mr_comm_req *r, int64_t t_ns);
  void (*end)(void *ctx, const struct mr_comm_req *r, int rc);
};

/* Installs the process's tracer (NULL: none, the default); the caller keeps
 * it alive and sets it while no operation is in flight. */
void mr_comm_set_tracer(const struct mr_comm_tracer *t);

extern const struct mr_comm_tracer *mr__comm_tracer;

/* The time an operation is issued at, for the tracer (0 without one). */
static inline int64_t mr__comm_now(void) { return mr__comm_tracer != NULL ? mr_clock_ns() : 0; }

/* After a start: counts the operation on g and tells the tracer, if one is
 * installed, its bytes: count elements, times the group's size where
 * `blocks` (the n blocks of a reduce-scatter, all-gather, all-to-all), or
 * the sum of counts[] where given.  Without a tracer only the count. */
static inline int mr__comm_started(struct mr_comm_group *g, int64_t t0, int rc, const char *op,
                                   size_t count, const size_t *counts, int blocks,
                                   enum mr_dtype dt, int peer, struct mr_comm_req **req) {
  if (rc != 0)
    return rc;
  uint64_t seq = g->issued++;
  const struct mr_comm_tracer *t = mr__comm_tracer;
  if (t != NULL) {
    size_t n = blocks ? (size_t)g->comm->ops->group_size(g) : 1, all = count * n;
    if (counts != NULL) {
      all = 0;
      for (size_t i = 0; i < n; i++)
        all += counts[i];
    }
    t->start(t->ctx, g, op, all * mr_dtype_size(dt), peer, seq, *req, t0);
  }
  return 0;
}

/* Dispatchers, so callers write mr_comm_all_reduce(g, ...). */
static inline int mr_comm_all_reduce(struct mr_comm_group *g, const void *s,
                                     void *r, size_t n, enum mr_dtype dt,
                                     enum mr_red_op op,
                                     struct mr_comm_req **req) {
  int64_t t0 = mr__comm_now();
  return mr__comm_started(g, t0, g->comm->ops->all_reduce(g, s, r, n, dt, op, req), "AllReduce",
                          n, NULL, 0, dt, -1, req);
}
static inline int mr_comm_reduce_scatter(struct mr_comm_group *g,
                                         const void *s, void *r, size_t n,
                                         enum mr_dtype dt, enum mr_red_op op,
                                         struct mr_comm_req **req) {
  int64_t t0 = mr__comm_now();
  return mr__comm_started(g, t0, g->comm->ops->reduce_scatter(g, s, r, n, dt, op, req),
                          "ReduceScatter", n, NULL, 1, dt, -1, req);
}
static inline int mr_comm_all_gather(struct mr_comm_group *g, const void *s,
                                     void *r, size_t n, const size_t *counts,
                                     enum mr_dtype dt,
                                     struct mr_comm_req **req) {
  int64_t t0 = mr__comm_now();
  return mr__comm_started(g, t0, g->comm->ops->all_gather(g, s, r, n, counts, dt, req),
                          "AllGather", n, counts, 1, dt, -1, req);
}
static inline int mr_comm_broadcast(struct mr_comm_group *g, void *buf,
                                    size_t n, enum mr_dtype dt, int root,
                                    struct mr_comm_req **req) {
  int64_t t0 = mr__comm_now();
  return mr__comm_started(g, t0, g->comm->ops->broadcast(g, buf, n, dt, root, req), "Broadcast",
                          n, NULL, 0, dt, -1, req);
}
static inline int mr_comm_all_to_all(struct mr_comm_group *g, const void *s,
                                     void *r, size_t n, enum mr_dtype dt,
                                     struct mr_comm_req **req) {
  int64_t t0 = mr__comm_now();
  return mr__comm_started(g, t0, g->comm->ops->all_to_all(g, s, r, n, dt, req), "AllToAll", n,
                          NULL, 1, dt, -1, req);
}
static inline int mr_comm_send(struct mr_comm_group *g, const void *buf,
                               size_t n, enum mr_dtype dt, int peer,
                               struct mr_comm_req **req) {
  int64_t t0 = mr__comm_now();
  return mr__comm_started(g, t0, g->comm->ops->send(g, buf, n, dt, peer, req), "Send", n, NULL, 0,
                          dt, peer, req);
}
static inline int mr_comm_recv(struct mr_comm_group *g, void *buf, size_t n,
                               enum mr_dtype dt, int peer,
                               struct mr_comm_req **req) {
  int64_t t0 = mr__comm_now();
  return mr__comm_started(g, t0, g->comm->ops->recv(g, buf, n, dt, peer, req), "Recv", n, NULL, 0,
                          dt, peer, req);
}
static inline int mr_comm_barrier(struct mr_comm_group *g,
                                  struct mr_comm_req **req) {
  int64_t t0 = mr__comm_now();
  return mr__comm_started(g, t0, g->comm->ops->barrier(g, req), "Barrier", 0, NULL, 0, MR_F32, -1,
                          req);
}
static inline int mr_comm_test(struct mr_comm_req *r, int *done) {
  return r->comm->ops->test(r, done);
}
static inline int mr_comm_wait(struct mr_comm_req *r) {
  const struct mr_comm_tracer *t = mr__comm_tracer;
  int rc = r->comm->ops->wait(r);
  if (t != NULL)
    t->end(t->ctx, r, rc); /* r is freed: only its address is used */
  return rc;
}

/* Every communicator of this process watches *flag (set by the rank's
 * SIGTERM handler or the launcher's Stop; it must outlive them): once it
 * is non-zero, pending and later operations, group set-up and the
 * bootstrap's exchanges give up within a few milliseconds, operations
 * with MR_ECANCELED.  NULL watches nothing.  Call before opening one. */
void mr_comm_watch_stop(const atomic_int *flag);

/* Whether the watched flag is set (async-signal-safe, lock-free). */
int mr_comm_stopping(void);

#endif
