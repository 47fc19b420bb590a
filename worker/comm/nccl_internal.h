/* nccl_internal.h - private to the NCCL comm backend (nccl.c, nccl_req.c):
 * its communicator, group and request, and the calls that issue an
 * operation on a group and watch it (nccl_req.c).  Every call here runs on
 * the rank's GPU and returns 0 or a negative MR_E* code with the message set;
 * a failure that aborted the group's communicator marks the group broken. */
#ifndef MR_COMM_NCCL_INTERNAL_H
#define MR_COMM_NCCL_INTERNAL_H

#include <nccl.h>
#include <pthread.h>
#include <stdint.h>

#include "worker/backend/cuda/cuda_internal.h"
#include "worker/comm/comm.h"

struct nccl_req;

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
  struct nccl_req *p2p;      // sends and receives waiting for mr__nccl_flush_p2p
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
  /* a send or receive not yet given to NCCL (see mr__nccl_flush_p2p) */
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
static inline ncclResult_t mr__nccl_group_end(ncclResult_t res) {
  ncclResult_t end = ncclGroupEnd();
  return NCCL_OK(res) ? end : res;
}

/* NCCL call `call` on g returned r: aborts g's communicator, marks g broken
 * and returns MR_EPEER (a remote or system error) or MR_EIO. */
int mr__nccl_failed(struct nccl_group *g, ncclResult_t r, const char *call);

/* Polls g's communicator until its last call (`what`, operation number
 * seq, waiting on group rank peer or -1 for all) has settled; past the
 * timeout aborts it and returns MR_ETIMEDOUT naming the peers. */
int mr__nccl_settle(struct nccl_group *g, const char *what, uint64_t seq, int peer);

/* Starts operation `op` (a static string) on g: flushes held sends and
 * receives unless op is one, fails if g is broken, orders g's stream after
 * the compute stream, and returns a new request in *out (the caller owns it
 * until mr__nccl_op_end or mr__nccl_req_free). */
int mr__nccl_op_begin(struct nccl_group *g, const char *op, int peer,
                      struct nccl_req **out);

/* After the NCCL call(s) of r returned res: settles, records r's end on g's
 * stream and queues r, returned in *out (owned by the caller until wait).
 * On failure frees r. */
int mr__nccl_op_end(struct nccl_group *g, struct nccl_req *r, ncclResult_t res,
                    const char *call, struct mr_comm_req **out);

/* Frees a request not in the in-flight list; NULL is a no-op. */
void mr__nccl_req_free(struct nccl_req *r);

/* Appends r to c's in-flight list (c's lock taken here). */
void mr__nccl_queue_req(struct nccl_comm *c, struct nccl_req *r);

/* Gives the held sends and receives to NCCL as one group.  On failure each
 * of them finishes with the error, which is returned. */
int mr__nccl_flush_p2p(struct nccl_group *g);

/* The backend's test, wait and blocked (comm.h). */
int mr__nccl_test(struct mr_comm_req *rr, int *done);
int mr__nccl_wait(struct mr_comm_req *rr);
const char *mr__nccl_blocked(struct mr_comm *cc, char *buf, size_t len);

#endif
