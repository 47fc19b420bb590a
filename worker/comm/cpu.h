/* cpu.h - private to the CPU comm backend: the operation record, the group,
 * and the table a transport (shm.c, tcp.c) implements.
 *
 * The engine (cpu.c) keeps one FIFO of operations per group and runs the
 * head of each with the transport's progress function, from the progress
 * thread or from a thread waiting on a request; the transport never blocks,
 * it returns MR__PENDING and is called again. */
#ifndef MR_COMM_CPU_H
#define MR_COMM_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "worker/comm/comm.h"

enum mr__op_kind {
  MR__ALL_REDUCE,
  MR__REDUCE_SCATTER,
  MR__ALL_GATHER,
  MR__BROADCAST,
  MR__ALL_TO_ALL,
  MR__SEND,
  MR__RECV,
  MR__BARRIER,
};

/* Largest group (reductions keep one source pointer per member). */
#define MR__MAX_GROUP 1024

#define MR__PENDING 0
#define MR__DONE 1

struct mr__op {
  struct mr_comm_req base;
  struct mr__op *next;       /* in the group's FIFO */
  struct mr__group *group;
  enum mr__op_kind kind;
  const void *send;
  void *recv;
  size_t count;              /* elements (per rank, per block, see comm.h) */
  size_t *counts;            /* (n) all_gather counts, owned; else NULL */
  size_t *displs;            /* (n) element offsets of all_gather blocks */
  enum mr_dtype dt;
  enum mr_red_op red;
  int peer;                  /* root, or peer of send/recv (group rank) */
  uint64_t seq;              /* 1-based issue number on the group */
  int started;               /* it has been the group's running op */
  int64_t start_ns;          /* when it first had to wait, or 0 */
  unsigned polls;            /* progress calls that found it pending */
  int moved;                 /* set by a transport that moved bytes */
  _Atomic int done;          /* 1 once finished; rc holds the result */
  int rc;
  char err[768];             /* the message when rc < 0 */
  /* transport state for the running op */
  int phase;
  int buf;                   /* staging buffer of the current chunk */
  int zero_copy;             /* every member's buffers are peer-readable */
  uint64_t mark;             /* tick the current chunk started at */
  size_t chunk, nchunks;
  void *scratch;             /* transport-owned, freed by it on completion */
  size_t scratch_bytes;
};

struct mr__transport;

struct mr__group {
  struct mr_comm_group base;
  struct mr__cpu *cpu;
  char *name;                /* "model" */
  char desc[160];            /* "model{0,1,2,3}" */
  int n, me;                 /* size, my group rank */
  int *ranks;                /* (n) global ranks */
  const struct mr__transport *tp;
  void *tp_state;
  struct mr__op *head, *tail; /* FIFO; head is running */
  uint64_t issued;
  char *broken;              /* message of the failure that broke it */
  unsigned char *waiting;    /* (n) 1 for peers the running op waits on */
  struct mr__group *next;    /* in the communicator's list */
};

struct mr__transport {
  const char *name;
  /* Establishes the group's links (collective over its members). */
  int (*open)(struct mr__group *g);
  void (*close)(struct mr__group *g);
  /* Advances op; returns MR__PENDING, MR__DONE, or a negative code with
   * op->err filled.  Marks in g->waiting the peers it is blocked on. */
  int (*progress)(struct mr__group *g, struct mr__op *op);
  /* Peer-readable memory, or NULL when the transport has none. */
  int (*mem_alloc)(struct mr__group *g, size_t bytes, void **out);
  int (*mem_free)(struct mr__group *g, void *p); /* 1 if it was ours */
};

extern const struct mr__transport mr__shm_transport;
extern const struct mr__transport mr__tcp_transport;

/* Per-process state the transports need from the engine. */
struct mr__peer_info {
  char host[64];             /* host id */
  char addr[64];             /* TCP address advertised, "10.0.0.2" */
  int port;
};

struct mr__cpu_info {
  int rank, world;
  const char *job_id;
  uint64_t nonce;            /* rank 0's random number, same on all ranks */
  const struct mr__peer_info *peers; /* (world) */
  int listen_fd;             /* TCP listening socket, or -1 */
  int64_t timeout_ms;
};

const struct mr__cpu_info *mr__cpu_info(const struct mr__group *g);

/* The group's index among this process's groups with the same description,
 * so equal groups created twice get different names (every member creates
 * its groups in the same order).  Returns -1 when out of memory. */
int mr__group_occurrence(struct mr__group *g);


/* "AllReduce", "ReduceScatter", ... */
const char *mr__op_name(enum mr__op_kind k);

/* Bytes of count elements of dt. */
static inline size_t mr__bytes(size_t count, enum mr_dtype dt) {
  return count * mr_dtype_size(dt);
}

/* Splits count elements into n near-equal parts (the first count % n one
 * larger) and returns part i's offset and length. */
static inline void mr__part(size_t count, int n, int i, size_t *off,
                            size_t *len) {
  size_t q = count / (size_t)n, r = count % (size_t)n, ui = (size_t)i;
  *off = ui * q + (ui < r ? ui : r);
  *len = q + (ui < r ? 1 : 0);
}

#endif
