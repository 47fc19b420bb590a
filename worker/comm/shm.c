/* shm.c - the shared-memory transport: one POSIX shm segment per group.
 *
 * Each member owns a control block, two staging buffers and a heap in the
 * segment; it writes only its own and reads everyone's.  Progress is counted
 * in ticks: every member passes through the same phases of the same
 * collectives, and at the end of each phase stores its tick with release
 * order; a member that needs a peer's phase done waits (acquire) until the
 * peer's tick reaches it.  Point to point uses per-pair counters instead.
 * A staging buffer is rewritten only after every reader has ticked past its
 * last use, and the two buffers alternate, so one member's copy in overlaps
 * its peers' copy out.
 *
 * Bytes moved per rank for an AllReduce of S bytes over n ranks (large
 * path): copy in (n-1)S/n, reduce reads S and writes 2S/n (staging and
 * result), copy out (n-1)S/n; with chunks that fit the shared L3 the staging
 * traffic stays in cache, so DRAM sees roughly S read and S written, as a
 * memcpy.  When every member's buffers were allocated with mem_alloc, the
 * reduction reads peers' buffers in place and nothing is copied in.
 *
 * The segment is unlinked as soon as every member has mapped it, so a crash
 * of any rank after group creation leaves nothing in /dev/shm. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/tunable.h"
#include "worker/comm/cpu.h"
#include "worker/comm/reduce.h"
#include "worker/comm/shm_heap.h"

#define SEG_MAGIC 0x6d65736873686d31ull /* "meshshm1" */
#define LINE 64

#define SHM_MIN_SLOT 16384 /* the smallest chunk a small /dev/shm gets */

struct seg_hdr {
  _Atomic uint64_t magic;
  uint64_t n, slot_bytes, heap_bytes, stride, total;
  uint64_t fitted; /* rank 0 made do with less than asked (a small /dev/shm) */
  _Atomic uint32_t mapped;
};

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

static _Atomic uint64_t *pair_ctr(struct ctl *c, int n, int which, int peer) {
  unsigned char *p = (unsigned char *)c + sizeof(struct ctl);
  return (_Atomic uint64_t *)(p + ((size_t)which * (size_t)n + (size_t)peer) *
                                      LINE);
}

static size_t ctl_bytes(int n) {
  size_t b = sizeof(struct ctl) + 2 * (size_t)n * LINE;
  return (b + 4095) & ~(size_t)4095;
}

/* ---- ticks and buffers ------------------------------------------------- */

static void publish(struct shm *s) {
  s->tick++;
  atomic_store_explicit(&s->ctl[s->me]->tick, s->tick, memory_order_release);
}

/* Whether every peer in mask (NULL: all) has ticked to t; marks laggards. */
static int peers_at(struct mr__group *g, struct shm *s, uint64_t t,
                    int only) {
  int ok = 1;
  for (int i = 0; i < s->n; i++) {
    if (i == s->me || (only >= 0 && i != only))
      continue;
    if (s->seen[i] >= t) {
      g->waiting[i] = 0;
      continue;
    }
    s->seen[i] = atomic_load_explicit(&s->ctl[i]->tick, memory_order_acquire);
    if (s->seen[i] < t) {
      g->waiting[i] = 1;
      ok = 0;
    } else {
      g->waiting[i] = 0;
    }
  }
  return ok;
}

static int buf_free(struct mr__group *g, struct shm *s, int b) {
  struct buf_use *u = &s->use[b];
  if (!peers_at(g, s, u->tick_need, -1))
    return 0;
  if (u->p2p_peer >= 0) {
    _Atomic uint64_t *c = pair_ctr(s->ctl[u->p2p_peer], s->n, 1, s->me);
    if (atomic_load_explicit(c, memory_order_acquire) < u->p2p_need) {
      g->waiting[u->p2p_peer] = 1;
      return 0;
    }
    u->p2p_peer = -1;
  }
  return 1;
}

static size_t chunk_elems(size_t bytes_avail, enum mr_dtype dt) {
  size_t es = mr_dtype_size(dt);
  size_t c = bytes_avail / es;
  c &= ~(size_t)15; /* 64-byte aligned slots for every dtype up to 4 bytes */
  return c ? c : 1;
}

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

/* Elements of sub-range k (cp each) of a part len long. */
static size_t sub_len(size_t len, size_t k, size_t cp) {
  return k * cp >= len ? 0 : min_sz(cp, len - k * cp);
}

/* ---- zero copy offers -------------------------------------------------- */

static uint64_t heap_off(struct shm *s, const void *p, size_t bytes) {
  const unsigned char *c = p;
  if (s->heap_bytes == 0 || c < s->heap[s->me] ||
      c + bytes > s->heap[s->me] + s->heap_bytes)
    return 0;
  return (uint64_t)(c - s->heap[s->me]) + 1;
}

/* ---- AllReduce / ReduceScatter ----------------------------------------- */

/* Reduction of part `part` (elements [off, off+len) of every rank's input),
 * sources in rank order: my own input and peers' staging slots. */
static int reduce_part(struct shm *s, struct mr__op *op, const void *mine,
                       size_t slot_off, void *dst, size_t len) {
  const void *srcs[MR__MAX_GROUP];
  for (int i = 0; i < s->n; i++)
    srcs[i] = i == s->me ? mine : s->stage[i][op->buf] + slot_off;
  return mr__reduce(op->dt, op->red, dst, srcs, s->n, len);
}

/* Small AllReduce: everyone publishes the whole input, everyone reduces it
 * all (in the same order), one wait. */
static int allreduce_small(struct mr__group *g, struct shm *s,
                           struct mr__op *op) {
  size_t bytes = mr__bytes(op->count, op->dt);
  if (op->phase == 0) {
    op->buf = (int)(s->chunks & 1);
    if (!buf_free(g, s, op->buf))
      return MR__PENDING;
    s->chunks++;
    memcpy(s->stage[s->me][op->buf], op->send, bytes);
    publish(s);
    op->mark = s->tick;
    op->phase = 1;
  }
  if (!peers_at(g, s, op->mark, -1))
    return MR__PENDING;
  int rc = reduce_part(s, op, op->send, 0, op->recv, op->count);
  publish(s);
  s->use[op->buf].tick_need = s->tick;
  return rc < 0 ? rc : MR__DONE;
}

static int zc_offer(struct mr__group *g, struct shm *s, struct mr__op *op,
                    size_t send_bytes, size_t recv_bytes) {
  if (op->phase == 0) {
    struct ctl *me = s->ctl[s->me];
    me->zc_send = heap_off(s, op->send, send_bytes);
    me->zc_recv = heap_off(s, op->recv, recv_bytes);
    publish(s);
    op->mark = s->tick;
    op->phase = 1;
  }
  if (!peers_at(g, s, op->mark, -1))
    return MR__PENDING;
  op->zero_copy = 1;
  for (int i = 0; i < s->n; i++)
    if (s->ctl[i]->zc_send == 0 || s->ctl[i]->zc_recv == 0)
      op->zero_copy = 0;
  op->phase = 2;
  return MR__DONE;
}

static const void *peer_ptr(struct shm *s, int i, uint64_t off1) {
  return s->heap[i] + (off1 - 1);
}

/* Every member's buffers live in its heap: reduce my part straight from the
 * peers' send buffers, then copy the peers' results from their recv. */
static int allreduce_zc(struct mr__group *g, struct shm *s,
                        struct mr__op *op) {
  size_t es = mr_dtype_size(op->dt), off, len;
  mr__part(op->count, s->n, s->me, &off, &len);
  if (op->phase == 2) {
    const void *srcs[MR__MAX_GROUP];
    for (int i = 0; i < s->n; i++)
      srcs[i] = (const unsigned char *)peer_ptr(s, i, s->ctl[i]->zc_send) +
                off * es;
    MR_TRY(mr__reduce(op->dt, op->red, (unsigned char *)op->recv + off * es,
                      srcs, s->n, len));
    publish(s);
    op->mark = s->tick;
    op->phase = 3;
  }
  if (op->phase == 3) {
    if (!peers_at(g, s, op->mark, -1))
      return MR__PENDING;
    for (int i = 0; i < s->n; i++) {
      if (i == s->me)
        continue;
      mr__part(op->count, s->n, i, &off, &len);
      memcpy((unsigned char *)op->recv + off * es,
             (const unsigned char *)peer_ptr(s, i, s->ctl[i]->zc_recv) +
                 off * es,
             len * es);
    }
    publish(s);
    op->mark = s->tick;
    op->phase = 4;
  }
  /* peers read my buffers until they tick past the copy out */
  return peers_at(g, s, op->mark, -1) ? MR__DONE : MR__PENDING;
}

/* Large AllReduce (scatter = 0) and ReduceScatter (scatter = 1), through
 * staging, chunk by chunk: copy in the parts peers reduce, reduce mine,
 * (AllReduce) copy out the peers' results. */
static int reduce_chunks(struct mr__group *g, struct shm *s,
                         struct mr__op *op, int scatter) {
  size_t es = mr_dtype_size(op->dt);
  size_t cp = chunk_elems(s->slot_bytes / (size_t)s->n, op->dt);
  size_t poff, plen, moff, mlen;
  size_t part0 = scatter ? op->count : (mr__part(op->count, s->n, 0, &poff,
                                                  &plen), plen);
  op->nchunks = (part0 + cp - 1) / cp;
  const unsigned char *in = op->send;
  unsigned char *out = op->recv;
  for (;;) {
    if (op->chunk >= op->nchunks)
      return MR__DONE;
    size_t k = op->chunk;
    if (op->phase == 2) { /* copy in */
      op->buf = (int)(s->chunks & 1);
      if (!buf_free(g, s, op->buf))
        return MR__PENDING;
      s->chunks++;
      for (int j = 0; j < s->n; j++) {
        if (j == s->me)
          continue;
        if (scatter)
          poff = (size_t)j * op->count, plen = op->count;
        else
          mr__part(op->count, s->n, j, &poff, &plen);
        memcpy(s->stage[s->me][op->buf] + (size_t)j * cp * es,
               in + (poff + k * cp) * es, sub_len(plen, k, cp) * es);
      }
      publish(s);
      op->mark = s->tick;
      op->phase = 3;
    }
    if (scatter)
      moff = (size_t)s->me * op->count, mlen = op->count;
    else
      mr__part(op->count, s->n, s->me, &moff, &mlen);
    size_t ml = sub_len(mlen, k, cp);
    unsigned char *slot = s->stage[s->me][op->buf] + (size_t)s->me * cp * es;
    if (op->phase == 3) { /* reduce my part */
      if (!peers_at(g, s, op->mark, -1))
        return MR__PENDING;
      unsigned char *dst = scatter ? out + k * cp * es : slot;
      MR_TRY(reduce_part(s, op, in + (moff + k * cp) * es,
                         (size_t)s->me * cp * es, dst, ml));
      if (!scatter)
        memcpy(out + (moff + k * cp) * es, slot, ml * es);
      publish(s);
      if (scatter) {
        s->use[op->buf].tick_need = s->tick;
        op->chunk++;
        op->phase = 2;
        continue;
      }
      op->phase = 4;
    }
    if (op->phase == 4) { /* copy out the peers' results */
      if (!peers_at(g, s, op->mark + 1, -1))
        return MR__PENDING;
      for (int j = 0; j < s->n; j++) {
        if (j == s->me)
          continue;
        mr__part(op->count, s->n, j, &poff, &plen);
        memcpy(out + (poff + k * cp) * es,
               s->stage[j][op->buf] + (size_t)j * cp * es,
               sub_len(plen, k, cp) * es);
      }
      publish(s);
      s->use[op->buf].tick_need = s->tick;
      op->chunk++;
      op->phase = 2;
    }
  }
}

static int allreduce(struct mr__group *g, struct shm *s, struct mr__op *op) {
  size_t bytes = mr__bytes(op->count, op->dt);
  if (op->count == 0)
    return MR__DONE;
  if (bytes <= s->small_bytes)
    return allreduce_small(g, s, op);
  if (op->phase < 2) {
    int r = zc_offer(g, s, op, bytes, bytes);
    if (r != MR__DONE)
      return r;
  }
  return op->zero_copy ? allreduce_zc(g, s, op) : reduce_chunks(g, s, op, 0);
}

/* ---- AllGather, Broadcast, AllToAll, Barrier --------------------------- */

static int allgather(struct mr__group *g, struct shm *s, struct mr__op *op) {
  size_t es = mr_dtype_size(op->dt), maxc = 0;
  for (int i = 0; i < s->n; i++)
    maxc = op->counts[i] > maxc ? op->counts[i] : maxc;
  size_t cp = chunk_elems(s->slot_bytes, op->dt);
  op->nchunks = (maxc + cp - 1) / cp;
  unsigned char *out = op->recv;
  if (op->chunk == 0 && op->phase == 0) {
    memmove(out + op->displs[s->me] * es, op->send, op->counts[s->me] * es);
    op->phase = 1;
  }
  for (; op->chunk < op->nchunks;) {
    size_t k = op->chunk;
    if (op->phase == 1) {
      op->buf = (int)(s->chunks & 1);
      if (!buf_free(g, s, op->buf))
        return MR__PENDING;
      s->chunks++;
      memcpy(s->stage[s->me][op->buf],
             (const unsigned char *)op->send + k * cp * es,
             sub_len(op->counts[s->me], k, cp) * es);
      publish(s);
      op->mark = s->tick;
      op->phase = 2;
    }
    if (!peers_at(g, s, op->mark, -1))
      return MR__PENDING;
    for (int j = 0; j < s->n; j++)
      if (j != s->me)
        memcpy(out + (op->displs[j] + k * cp) * es, s->stage[j][op->buf],
               sub_len(op->counts[j], k, cp) * es);
    publish(s);
    s->use[op->buf].tick_need = s->tick;
    op->chunk++;
    op->phase = 1;
  }
  return MR__DONE;
}

static int broadcast(struct mr__group *g, struct shm *s, struct mr__op *op) {
  size_t es = mr_dtype_size(op->dt);
  size_t cp = chunk_elems(s->slot_bytes, op->dt);
  op->nchunks = (op->count + cp - 1) / cp;
  unsigned char *buf = op->recv;
  int root = op->peer;
  for (; op->chunk < op->nchunks;) {
    size_t k = op->chunk, len = sub_len(op->count, k, cp) * es;
    if (op->phase == 0) {
      op->buf = (int)(s->chunks & 1);
      if (!buf_free(g, s, op->buf))
        return MR__PENDING;
      s->chunks++;
      if (s->me == root)
        memcpy(s->stage[s->me][op->buf], buf + k * cp * es, len);
      publish(s);
      op->mark = s->tick;
      op->phase = 1;
    }
    if (s->me != root) {
      if (!peers_at(g, s, op->mark, root))
        return MR__PENDING;
      memcpy(buf + k * cp * es, s->stage[root][op->buf], len);
    }
    publish(s);
    s->use[op->buf].tick_need = s->tick;
    op->chunk++;
    op->phase = 0;
  }
  return MR__DONE;
}

static int alltoall(struct mr__group *g, struct shm *s, struct mr__op *op) {
  size_t es = mr_dtype_size(op->dt);
  size_t cp = chunk_elems(s->slot_bytes / (size_t)s->n, op->dt);
  op->nchunks = (op->count + cp - 1) / cp;
  const unsigned char *in = op->send;
  unsigned char *out = op->recv;
  if (op->chunk == 0 && op->phase == 0) {
    memcpy(out + (size_t)s->me * op->count * es,
           in + (size_t)s->me * op->count * es, op->count * es);
    op->phase = 1;
  }
  for (; op->chunk < op->nchunks;) {
    size_t k = op->chunk, len = sub_len(op->count, k, cp) * es;
    if (op->phase == 1) {
      op->buf = (int)(s->chunks & 1);
      if (!buf_free(g, s, op->buf))
        return MR__PENDING;
      s->chunks++;
      for (int j = 0; j < s->n; j++)
        if (j != s->me)
          memcpy(s->stage[s->me][op->buf] + (size_t)j * cp * es,
                 in + ((size_t)j * op->count + k * cp) * es, len);
      publish(s);
      op->mark = s->tick;
      op->phase = 2;
    }
    if (!peers_at(g, s, op->mark, -1))
      return MR__PENDING;
    for (int j = 0; j < s->n; j++)
      if (j != s->me)
        memcpy(out + ((size_t)j * op->count + k * cp) * es,
               s->stage[j][op->buf] + (size_t)s->me * cp * es, len);
    publish(s);
    s->use[op->buf].tick_need = s->tick;
    op->chunk++;
    op->phase = 1;
  }
  return MR__DONE;
}

static int barrier(struct mr__group *g, struct shm *s, struct mr__op *op) {
  if (op->phase == 0) {
    publish(s);
    op->mark = s->tick;
    op->phase = 1;
  }
  return peers_at(g, s, op->mark, -1) ? MR__DONE : MR__PENDING;
}

/* ---- Send / Recv ------------------------------------------------------- */

static int p2p_send(struct mr__group *g, struct shm *s, struct mr__op *op) {
  size_t es = mr_dtype_size(op->dt), cp = chunk_elems(s->slot_bytes, op->dt);
  int p = op->peer;
  op->nchunks = (op->count + cp - 1) / cp;
  for (; op->chunk < op->nchunks; op->chunk++) {
    uint64_t m = s->sent[p];
    int b = (int)(m & 1);
    if (!buf_free(g, s, b))
      return MR__PENDING;
    memcpy(s->stage[s->me][b],
           (const unsigned char *)op->send + op->chunk * cp * es,
           sub_len(op->count, op->chunk, cp) * es);
    s->sent[p] = m + 1;
    s->use[b].p2p_peer = p;
    s->use[b].p2p_need = m + 1;
    atomic_store_explicit(pair_ctr(s->ctl[s->me], s->n, 0, p), m + 1,
                          memory_order_release);
  }
  return MR__DONE;
}

static int p2p_recv(struct mr__group *g, struct shm *s, struct mr__op *op) {
  size_t es = mr_dtype_size(op->dt), cp = chunk_elems(s->slot_bytes, op->dt);
  int p = op->peer;
  op->nchunks = (op->count + cp - 1) / cp;
  for (; op->chunk < op->nchunks; op->chunk++) {
    uint64_t m = s->recvd[p];
    if (atomic_load_explicit(pair_ctr(s->ctl[p], s->n, 0, s->me),
                             memory_order_acquire) < m + 1) {
      g->waiting[p] = 1;
      return MR__PENDING;
    }
    g->waiting[p] = 0;
    memcpy((unsigned char *)op->recv + op->chunk * cp * es,
           s->stage[p][m & 1], sub_len(op->count, op->chunk, cp) * es);
    s->recvd[p] = m + 1;
    atomic_store_explicit(pair_ctr(s->ctl[s->me], s->n, 1, p), m + 1,
                          memory_order_release);
  }
  return MR__DONE;
}

static int shm_progress(struct mr__group *g, struct mr__op *op) {
  struct shm *s = g->tp_state;
  int r;
  switch (op->kind) {
  case MR__ALL_REDUCE:
    r = allreduce(g, s, op);
    break;
  case MR__REDUCE_SCATTER:
    if (op->phase < 2)
      op->phase = 2;
    r = reduce_chunks(g, s, op, 1);
    break;
  case MR__ALL_GATHER:
    r = allgather(g, s, op);
    break;
  case MR__BROADCAST:
    r = broadcast(g, s, op);
    break;
  case MR__ALL_TO_ALL:
    r = alltoall(g, s, op);
    break;
  case MR__SEND:
    r = p2p_send(g, s, op);
    break;
  case MR__RECV:
    r = p2p_recv(g, s, op);
    break;
  default:
    r = barrier(g, s, op);
    break;
  }
  if (r < 0)
    snprintf(op->err, sizeof op->err, "%s #%llu on group %s: %s",
             mr__op_name(op->kind), (unsigned long long)op->seq, g->desc,
             mr_error_message());
  return r;
}

/* ---- segment lifecycle ------------------------------------------------- */

static uint64_t fnv1a(const char *str) {
  uint64_t h = 1469598103934665603ull;
  for (; *str; str++)
    h = (h ^ (unsigned char)*str) * 1099511628211ull;
  return h;
}

static void shm_free_state(struct shm *s) {
  if (s == NULL)
    return;
  if (s->base != NULL)
    munmap(s->base, s->bytes);
  mr__shm_heap_close(&s->alloc);
  free(s->ctl);
  free(s->stage);
  free(s->heap);
  free(s->sent);
  free(s->recvd);
  free(s->seen);
  free(s);
}

/* Rank 0: gives the segment its pages now, not at their first touch, so a
 * /dev/shm too small (a container's 64 MiB) is found here, not as SIGBUS
 * mid-step.  Where there is no room, the zero-copy heaps go first, then the
 * chunk halves, down to SHM_MIN_SLOT: slower large transfers, but the job
 * runs; a warning says what was given up.  tmpfs leaves the size 0 when it
 * cannot reserve, so a peer never maps a size that is taken back.  Returns
 * 1 when it made do with less than asked, 0, or an error. */
static int reserve(struct mr__group *g, struct shm *s, int fd, size_t hdr, size_t cb) {
  size_t asked_slot = s->slot_bytes, asked_bytes = 0;
  for (;;) {
    s->bytes = hdr + (size_t)s->n * (cb + 2 * s->slot_bytes + s->heap_bytes);
    if (asked_bytes == 0)
      asked_bytes = s->bytes;
    int e = posix_fallocate(fd, 0, (off_t)s->bytes);
    if (e == 0)
      break;
    if (e == EOPNOTSUPP || e == EINVAL) { /* cannot reserve: pages at first touch */
      if (ftruncate(fd, (off_t)s->bytes) == 0)
        break;
      return mr_error_set(MR_ESYS, "comm group %s: shm segment %s: %s", g->desc, s->name,
                          strerror(errno));
    }
    struct stat st;
    int again = e == ENOSPC && fstat(fd, &st) == 0 && st.st_size == 0;
    if (again && s->heap_bytes > 0) {
      s->heap_bytes = 0;
    } else if (again && s->slot_bytes > SHM_MIN_SLOT) {
      s->slot_bytes = (s->slot_bytes / 2) & ~(size_t)4095;
      if (s->slot_bytes < SHM_MIN_SLOT)
        s->slot_bytes = SHM_MIN_SLOT;
    } else {
      return mr_error_set(MR_ESYS, "comm group %s: %zu KiB of shared memory in /dev/shm "
                          "(%zu KiB with the smallest chunks): %s (a container's /dev/shm "
                          "is small: docker run --shm-size=1g, or MESHRUN_COMM_TRANSPORT=tcp)",
                          g->desc, asked_bytes >> 10, s->bytes >> 10, strerror(e));
    }
  }
  if (s->bytes == asked_bytes)
    return 0;
  MR_WARN("comm", "group %s: /dev/shm has no room for %zu KiB; made do with %zu KiB "
          "(%zu KiB chunks instead of %zu): large transfers are slower (a container's "
          "/dev/shm is small: docker run --shm-size=1g)", g->desc, asked_bytes >> 10,
          s->bytes >> 10, s->slot_bytes >> 10, asked_slot >> 10);
  return 1;
}

static int shm_open_group(struct mr__group *g) {
  const struct mr__cpu_info *ci = mr__cpu_info(g);
  struct shm *s = calloc(1, sizeof *s);
  if (s == NULL)
    return mr_error_set(MR_ENOMEM, "comm group %s: out of memory", g->desc);
  int n = g->n, rc = 0, fd = -1;
  s->n = n;
  s->me = g->me;
  s->slot_bytes = (size_t)mr_tunable_int(MR_TUNABLE_COMM_SHM_CHUNK_BYTES);
  s->slot_bytes = (s->slot_bytes + 4095) & ~(size_t)4095;
  if (s->slot_bytes < 4096)
    s->slot_bytes = 4096;
  s->heap_bytes = (size_t)mr_tunable_int(MR_TUNABLE_COMM_SHM_HEAP_BYTES);
  s->heap_bytes = (s->heap_bytes + 4095) & ~(size_t)4095;
  s->small_bytes = (size_t)mr_tunable_int(MR_TUNABLE_COMM_SHM_SMALL_BYTES);
  int fitted = 0;
  s->ctl = calloc((size_t)n, sizeof *s->ctl);
  s->stage = calloc((size_t)n, sizeof *s->stage);
  s->heap = calloc((size_t)n, sizeof *s->heap);
  s->sent = calloc((size_t)n, sizeof *s->sent);
  s->recvd = calloc((size_t)n, sizeof *s->recvd);
  s->seen = calloc((size_t)n, sizeof *s->seen);
  s->use[0].p2p_peer = s->use[1].p2p_peer = -1;
  if (!s->ctl || !s->stage || !s->heap || !s->sent || !s->recvd ||
      !s->seen) {
    shm_free_state(s);
    return mr_error_set(MR_ENOMEM, "comm group %s: out of memory", g->desc);
  }
  int occ = mr__group_occurrence(g);
  snprintf(s->name, sizeof s->name, "/meshrun-%s-%016llx-%016llx-%d",
           ci->job_id, (unsigned long long)ci->nonce,
           (unsigned long long)fnv1a(g->desc), occ);
  size_t hdr = 4096, cb = ctl_bytes(n);
  int64_t deadline = mr_clock_ns() + ci->timeout_ms * 1000000;
  if (s->me == 0) {
    fd = shm_open(s->name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      rc = mr_error_set(MR_ESYS, "comm group %s: shm segment %s: %s", g->desc,
                        s->name, strerror(errno));
      goto err;
    }
    rc = reserve(g, s, fd, hdr, cb);
    if (rc < 0) {
      shm_unlink(s->name);
      goto err;
    }
    fitted = rc;
    rc = 0;
  } else {
    while ((fd = shm_open(s->name, O_RDWR, 0600)) < 0) {
      if (errno != ENOENT || mr_clock_ns() > deadline) {
        rc = mr_error_set(errno == ENOENT ? MR_ETIMEDOUT : MR_ESYS,
                          "comm group %s: segment %s from rank %d: %s",
                          g->desc, s->name, g->ranks[0],
                          errno == ENOENT ? "never created" : strerror(errno));
        goto err;
      }
      struct timespec ts = {0, 200000};
      nanosleep(&ts, NULL);
    }
    /* the size appears whole once rank 0 has the pages (it stays 0 while
     * rank 0 tries smaller chunks); the header then says how it is cut */
    struct stat st;
    while (fstat(fd, &st) == 0 && (size_t)st.st_size < hdr) {
      if (mr_clock_ns() > deadline) {
        rc = mr_error_set(MR_ETIMEDOUT, "comm group %s: segment %s from rank %d "
                          "never sized", g->desc, s->name, g->ranks[0]);
        goto err;
      }
      struct timespec ts = {0, 100000};
      nanosleep(&ts, NULL);
    }
    s->bytes = (size_t)st.st_size;
  }
  void *p = mmap(NULL, s->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  fd = -1;
  if (p == MAP_FAILED) {
    rc = mr_error_set(MR_ESYS, "comm group %s: mmap of %zu bytes: %s",
                      g->desc, s->bytes, strerror(errno));
    goto err;
  }
  s->base = p;
  struct seg_hdr *h = p;
  size_t stride = cb + 2 * s->slot_bytes + s->heap_bytes;
  if (s->me == 0) {
    h->n = (uint64_t)n;
    h->slot_bytes = s->slot_bytes;
    h->heap_bytes = s->heap_bytes;
    h->stride = stride;
    h->total = s->bytes;
    h->fitted = (uint64_t)fitted;
    atomic_store_explicit(&h->magic, SEG_MAGIC, memory_order_release);
  } else {
    while (atomic_load_explicit(&h->magic, memory_order_acquire) != SEG_MAGIC) {
      if (mr_clock_ns() > deadline) {
        rc = mr_error_set(MR_ETIMEDOUT, "comm group %s: segment %s never "
                          "initialized", g->desc, s->name);
        goto err;
      }
      struct timespec ts = {0, 100000};
      nanosleep(&ts, NULL);
    }
    if (h->n != (uint64_t)n || h->total != s->bytes ||
        (!h->fitted && (h->slot_bytes != s->slot_bytes ||
                        h->heap_bytes != s->heap_bytes))) {
      rc = mr_error_set(MR_EINVAL, "comm group %s: rank %d made the segment "
                        "for %llu ranks, %llu-byte chunks, %llu-byte heaps; "
                        "this rank expected %d, %zu, %zu (MESHRUN_COMM_SHM_* "
                        "must match on every rank)", g->desc, g->ranks[0],
                        (unsigned long long)h->n,
                        (unsigned long long)h->slot_bytes,
                        (unsigned long long)h->heap_bytes, n, s->slot_bytes,
                        s->heap_bytes);
      goto err;
    }
    s->slot_bytes = h->slot_bytes; /* rank 0's cut, smaller where it had to be */
    s->heap_bytes = h->heap_bytes;
    stride = h->stride;
  }
  if (s->small_bytes > s->slot_bytes)
    s->small_bytes = s->slot_bytes;
  for (int i = 0; i < n; i++) {
    unsigned char *r = s->base + hdr + (size_t)i * stride;
    s->ctl[i] = (struct ctl *)r;
    s->stage[i][0] = r + cb;
    s->stage[i][1] = r + cb + s->slot_bytes;
    s->heap[i] = r + cb + 2 * s->slot_bytes;
  }
  atomic_store_explicit(&s->ctl[s->me]->joined, 1, memory_order_release);
  if (atomic_fetch_add(&h->mapped, 1) + 1 == (uint32_t)n)
    shm_unlink(s->name); /* everyone has it mapped: nothing can leak now */
  while (atomic_load_explicit(&h->mapped, memory_order_acquire) <
         (uint32_t)n) {
    if (mr_clock_ns() > deadline) {
      char who[256];
      size_t off = 0;
      for (int i = 0; i < n && off < sizeof who - 12; i++)
        if (!atomic_load(&s->ctl[i]->joined))
          off += (size_t)snprintf(who + off, sizeof who - off, "%s%d",
                                  off ? ", " : "", g->ranks[i]);
      shm_unlink(s->name);
      rc = mr_error_set(MR_ETIMEDOUT, "comm group %s: timed out after %.1f s "
                        "creating the group: ranks %s have not arrived",
                        g->desc, (double)ci->timeout_ms / 1000, who);
      goto err;
    }
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
  }
  if (s->heap_bytes > 0)
    mr__shm_heap_init(&s->alloc, s->heap[s->me], s->heap_bytes);
  g->tp_state = s;
  return 0;
err:
  if (fd >= 0)
    close(fd);
  shm_free_state(s);
  return rc;
}

static void shm_close_group(struct mr__group *g) {
  shm_free_state(g->tp_state);
  g->tp_state = NULL;
}

static int shm_mem_alloc(struct mr__group *g, size_t bytes, void **out) {
  struct shm *s = g->tp_state;
  if (s->heap_bytes == 0)
    return MR_ENOMEM;
  *out = mr__shm_heap_alloc(&s->alloc, bytes);
  return *out != NULL ? 0 : MR_ENOMEM;
}

static int shm_mem_free(struct mr__group *g, void *p) {
  struct shm *s = g->tp_state;
  if (s->heap_bytes == 0 || (unsigned char *)p < s->heap[s->me] ||
      (unsigned char *)p >= s->heap[s->me] + s->heap_bytes)
    return 0;
  mr__shm_heap_free(&s->alloc, p);
  return 1;
}

const struct mr__transport mr__shm_transport = {
    .name = "shm",
    .open = shm_open_group,
    .close = shm_close_group,
    .progress = shm_progress,
    .mem_alloc = shm_mem_alloc,
    .mem_free = shm_mem_free,
};

int mr_comm_shm_sweep(const char *job_id) {
  char prefix[128];
  snprintf(prefix, sizeof prefix, "meshrun-%s-", job_id);
  size_t pl = strlen(prefix);
  int removed = 0;
  DIR *d = opendir("/dev/shm");
  if (d == NULL)
    return 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (strncmp(e->d_name, prefix, pl) == 0) {
      char name[300];
      snprintf(name, sizeof name, "/%s", e->d_name);
      removed += shm_unlink(name) == 0;
    }
  closedir(d);
  return removed;
}
