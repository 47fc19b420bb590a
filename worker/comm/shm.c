/* shm.c - the shared-memory transport's collectives, in the segment that
 * shm_segment.c makes for each group.
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
 * reduction reads peers' buffers in place and nothing is copied in. */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "common/error.h"
#include "worker/comm/reduce.h"
#include "worker/comm/shm_internal.h"

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

const struct mr__transport mr__shm_transport = {
    .name = "shm",
    .open = mr__shm_open_group,
    .close = mr__shm_close_group,
    .progress = shm_progress,
    .mem_alloc = mr__shm_mem_alloc,
    .mem_free = mr__shm_mem_free,
};
