/* shm_internal.h - private to the shared-memory transport (shm.c, the
 * collectives; shm_segment.c, the segment).  One POSIX shm segment per
 * group: a 4 KiB header, then per member a control block, two staging
 * buffers of slot_bytes and a heap of heap_bytes for zero-copy buffers.
 * A member writes only its own part and reads everyone's. */
#ifndef MR_COMM_SHM_INTERNAL_H
#define MR_COMM_SHM_INTERNAL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "worker/comm/cpu.h"
#include "worker/comm/shm_heap.h"

#define LINE 64

/* One member's control block; every counter on its own cache line. */
struct ctl {
  _Atomic uint64_t tick;
  char pad0[LINE - 8];
  _Atomic uint64_t joined;
  uint64_t zc_send, zc_recv; /* heap offsets offered for zero copy, +1 */
  char pad1[LINE - 24];
  /* then (n) lines of sent[peer], (n) lines of recvd[peer] */
};

struct buf_use {
  uint64_t tick_need;  /* peers' ticks must reach this */
  int p2p_peer;        /* or -1 */
  uint64_t p2p_need;   /* that peer's recvd[me] must reach this */
};

struct shm {
  char name[160];
  unsigned char *base;
  size_t bytes;
  int n, me;
  size_t slot_bytes;
  struct ctl **ctl;             /* (n) */
  unsigned char *(*stage)[2];   /* (n) x 2 */
  unsigned char **heap;         /* (n) */
  size_t heap_bytes;
  struct mr__shm_heap alloc;
  uint64_t tick;                /* my last published tick */
  uint64_t chunks;              /* collective chunks started: buffer parity */
  uint64_t *sent, *recvd;       /* (n) pair counters, my copies */
  uint64_t *seen;               /* (n) peers' ticks last read (they only grow) */
  struct buf_use use[2];
  size_t small_bytes;
};

/* Member c's counter `which` (0 sent, 1 received) for peer, of n. */
static inline _Atomic uint64_t *pair_ctr(struct ctl *c, int n, int which, int peer) {
  unsigned char *p = (unsigned char *)c + sizeof(struct ctl);
  return (_Atomic uint64_t *)(p + ((size_t)which * (size_t)n + (size_t)peer) * LINE);
}

/* Creates (group rank 0) or maps (the others) g's segment, lays it out and
 * waits until every member has mapped it, then unlinks it; sets
 * g->tp_state.  Fails with MR_ETIMEDOUT naming the ranks that did not come
 * within the comm timeout, MR_EINVAL when the members' MESHRUN_COMM_SHM_*
 * differ, MR_ESYS when /dev/shm has no room even for the smallest chunks. */
int mr__shm_open_group(struct mr__group *g);
/* Unmaps g's segment and frees its state. */
void mr__shm_close_group(struct mr__group *g);
/* Zero-copy buffers from this member's heap: alloc returns 0 or MR_ENOMEM
 * (no heap, or full); free returns 1 if p was from the heap, else 0. */
int mr__shm_mem_alloc(struct mr__group *g, size_t bytes, void **out);
int mr__shm_mem_free(struct mr__group *g, void *p);

#endif
