/* shm_segment.c - the shared-memory transport's segment: one POSIX shm
 * object per group, made by group rank 0 and mapped by the other members.
 *
 * Layout: a 4 KiB header (rank 0's cut of the segment, which the others
 * check against their own settings), then per member a control block
 * (shm_internal.h), two staging buffers and a zero-copy heap.  Rank 0
 * reserves the pages at creation, so a /dev/shm too small is found then and
 * the chunks shrink to fit instead of a SIGBUS mid-step.  The segment is
 * unlinked as soon as every member has mapped it, so a crash of any rank
 * after group creation leaves nothing in /dev/shm. */
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
#include "common/rng.h"
#include "common/shm_name.h"
#include "common/tunable.h"
#include "worker/comm/comm.h"
#include "worker/comm/shm_internal.h"

/* The deadline has passed, or the rank is stopping (the caller's error
 * then goes unreported: worker/main.c). */
static int past(int64_t deadline) { return mr_clock_ns() > deadline || mr_comm_stopping(); }

#define SEG_MAGIC 0x6d65736873686d31ull /* "meshshm1" */
#define SEG_HDR_BYTES 4096
#define SHM_MIN_SLOT 16384 /* the smallest chunk a small /dev/shm gets */

struct seg_hdr {
  _Atomic uint64_t magic;
  uint64_t n, slot_bytes, heap_bytes, stride, total;
  uint64_t fitted; /* rank 0 made do with less than asked (a small /dev/shm) */
  _Atomic uint32_t mapped;
};

static size_t ctl_bytes(int n) {
  size_t b = sizeof(struct ctl) + 2 * (size_t)n * LINE;
  return (b + 4095) & ~(size_t)4095;
}

static void nap_us(long us) {
  struct timespec ts = {0, us * 1000};
  nanosleep(&ts, NULL);
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


/* The member's state, its settings from the tunables; *out owned by the
 * caller (shm_free_state). */
static int state_new(struct mr__group *g, struct shm **out) {
  const struct mr__cpu_info *ci = mr__cpu_info(g);
  int n = g->n;
  struct shm *s = calloc(1, sizeof *s);
  if (s == NULL)
    return mr_error_set(MR_ENOMEM, "comm group %s: out of memory", g->desc);
  s->n = n;
  s->me = g->me;
  s->slot_bytes = (size_t)mr_tunable_int(MR_TUNABLE_COMM_SHM_CHUNK_BYTES);
  s->slot_bytes = (s->slot_bytes + 4095) & ~(size_t)4095;
  if (s->slot_bytes < 4096)
    s->slot_bytes = 4096;
  s->heap_bytes = (size_t)mr_tunable_int(MR_TUNABLE_COMM_SHM_HEAP_BYTES);
  s->heap_bytes = (s->heap_bytes + 4095) & ~(size_t)4095;
  s->small_bytes = (size_t)mr_tunable_int(MR_TUNABLE_COMM_SHM_SMALL_BYTES);
  s->ctl = calloc((size_t)n, sizeof *s->ctl);
  s->stage = calloc((size_t)n, sizeof *s->stage);
  s->heap = calloc((size_t)n, sizeof *s->heap);
  s->sent = calloc((size_t)n, sizeof *s->sent);
  s->recvd = calloc((size_t)n, sizeof *s->recvd);
  s->seen = calloc((size_t)n, sizeof *s->seen);
  s->use[0].p2p_peer = s->use[1].p2p_peer = -1;
  if (!s->ctl || !s->stage || !s->heap || !s->sent || !s->recvd || !s->seen) {
    shm_free_state(s);
    return mr_error_set(MR_ENOMEM, "comm group %s: out of memory", g->desc);
  }
  mr_shm_segment_name(s->name, sizeof s->name, ci->job_id, ci->nonce, g->desc,
                      mr__group_occurrence(g));
  *out = s;
  return 0;
}

/* Group rank 0: creates the segment and gives it its pages.  Returns 1
 * when it made do with less than asked, 0, or an error (nothing left in
 * /dev/shm); *fd_out is the caller's to close. */
static int create_segment(struct mr__group *g, struct shm *s, size_t cb, int *fd_out) {
  int fd = shm_open(s->name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0)
    return mr_error_set(MR_ESYS, "comm group %s: shm segment %s: %s", g->desc, s->name,
                        strerror(errno));
  int rc = reserve(g, s, fd, SEG_HDR_BYTES, cb);
  if (rc < 0) {
    shm_unlink(s->name);
    close(fd);
    return rc;
  }
  *fd_out = fd;
  return rc;
}

/* The other members: opens rank 0's segment once it exists and has its
 * size, which appears whole once rank 0 has the pages (it stays 0 while
 * rank 0 tries smaller chunks).  *fd_out is the caller's to close. */
static int attach_segment(struct mr__group *g, struct shm *s, int64_t deadline,
                          int *fd_out) {
  int fd;
  while ((fd = shm_open(s->name, O_RDWR, 0600)) < 0) {
    if (errno != ENOENT || past(deadline))
      return mr_error_set(errno == ENOENT ? MR_ETIMEDOUT : MR_ESYS,
                          "comm group %s: segment %s from rank %d: %s", g->desc, s->name,
                          g->ranks[0], errno == ENOENT ? "never created" : strerror(errno));
    nap_us(200);
  }
  struct stat st;
  for (;;) {
    if (fstat(fd, &st) != 0) {
      int rc = mr_error_set(MR_ESYS, "comm group %s: segment %s: %s", g->desc, s->name,
                            strerror(errno));
      close(fd);
      return rc;
    }
    if ((size_t)st.st_size >= SEG_HDR_BYTES)
      break;
    if (past(deadline)) {
      close(fd);
      return mr_error_set(MR_ETIMEDOUT, "comm group %s: segment %s from rank %d never "
                          "sized", g->desc, s->name, g->ranks[0]);
    }
    nap_us(100);
  }
  s->bytes = (size_t)st.st_size;
  *fd_out = fd;
  return 0;
}

/* Rank 0 writes its cut of the segment into the header; the others wait
 * for it, check it against their own settings and take it.  Then every
 * member's part is found at its stride. */
static int agree_layout(struct mr__group *g, struct shm *s, size_t cb, int fitted,
                        int64_t deadline) {
  struct seg_hdr *h = (struct seg_hdr *)s->base;
  size_t stride = cb + 2 * s->slot_bytes + s->heap_bytes;
  if (s->me == 0) {
    h->n = (uint64_t)s->n;
    h->slot_bytes = s->slot_bytes;
    h->heap_bytes = s->heap_bytes;
    h->stride = stride;
    h->total = s->bytes;
    h->fitted = (uint64_t)fitted;
    atomic_store_explicit(&h->magic, SEG_MAGIC, memory_order_release);
  } else {
    while (atomic_load_explicit(&h->magic, memory_order_acquire) != SEG_MAGIC) {
      if (past(deadline))
        return mr_error_set(MR_ETIMEDOUT, "comm group %s: segment %s never "
                            "initialized", g->desc, s->name);
      nap_us(100);
    }
    if (h->n != (uint64_t)s->n || h->total != s->bytes ||
        (!h->fitted && (h->slot_bytes != s->slot_bytes ||
                        h->heap_bytes != s->heap_bytes)))
      return mr_error_set(MR_EINVAL, "comm group %s: rank %d made the segment "
                          "for %llu ranks, %llu-byte chunks, %llu-byte heaps; "
                          "this rank expected %d, %zu, %zu (MESHRUN_COMM_SHM_* "
                          "must match on every rank)", g->desc, g->ranks[0],
                          (unsigned long long)h->n,
                          (unsigned long long)h->slot_bytes,
                          (unsigned long long)h->heap_bytes, s->n, s->slot_bytes,
                          s->heap_bytes);
    s->slot_bytes = h->slot_bytes; /* rank 0's cut, smaller where it had to be */
    s->heap_bytes = h->heap_bytes;
    stride = h->stride;
  }
  if (s->small_bytes > s->slot_bytes)
    s->small_bytes = s->slot_bytes;
  for (int i = 0; i < s->n; i++) {
    unsigned char *r = s->base + SEG_HDR_BYTES + (size_t)i * stride;
    s->ctl[i] = (struct ctl *)r;
    s->stage[i][0] = r + cb;
    s->stage[i][1] = r + cb + s->slot_bytes;
    s->heap[i] = r + cb + 2 * s->slot_bytes;
  }
  return 0;
}

/* Marks this member mapped and waits for the rest; the last to map it
 * unlinks the segment, after which no crash can leak it.  A timeout names
 * the ranks that never came. */
static int wait_all_mapped(struct mr__group *g, struct shm *s, int64_t deadline) {
  struct seg_hdr *h = (struct seg_hdr *)s->base;
  atomic_store_explicit(&s->ctl[s->me]->joined, 1, memory_order_release);
  if (atomic_fetch_add(&h->mapped, 1) + 1 == (uint32_t)s->n)
    shm_unlink(s->name);
  while (atomic_load_explicit(&h->mapped, memory_order_acquire) < (uint32_t)s->n) {
    if (past(deadline)) {
      char who[256];
      size_t off = 0;
      for (int i = 0; i < s->n && off < sizeof who - 12; i++)
        if (!atomic_load(&s->ctl[i]->joined))
          off += (size_t)snprintf(who + off, sizeof who - off, "%s%d",
                                  off ? ", " : "", g->ranks[i]);
      shm_unlink(s->name);
      return mr_error_set(MR_ETIMEDOUT, "comm group %s: timed out after %.1f s "
                          "creating the group: ranks %s have not arrived", g->desc,
                          (double)mr__cpu_info(g)->timeout_ms / 1000, who);
    }
    nap_us(100);
  }
  return 0;
}

int mr__shm_open_group(struct mr__group *g) {
  struct shm *s = NULL;
  MR_TRY(state_new(g, &s));
  size_t cb = ctl_bytes(g->n);
  int64_t deadline = mr_clock_ns() + mr__cpu_info(g)->timeout_ms * 1000000;
  int fd = -1, fitted = 0, rc;
  if (s->me == 0) {
    rc = create_segment(g, s, cb, &fd);
    fitted = rc > 0;
  } else {
    rc = attach_segment(g, s, deadline, &fd);
  }
  if (rc < 0)
    goto err;
  void *p = mmap(NULL, s->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    rc = mr_error_set(MR_ESYS, "comm group %s: mmap of %zu bytes: %s", g->desc, s->bytes,
                      strerror(errno));
    if (s->me == 0)
      shm_unlink(s->name);
    goto err;
  }
  s->base = p;
  MR_TRY_GOTO(rc, agree_layout(g, s, cb, fitted, deadline), err);
  MR_TRY_GOTO(rc, wait_all_mapped(g, s, deadline), err);
  if (s->heap_bytes > 0)
    mr__shm_heap_init(&s->alloc, s->heap[s->me], s->heap_bytes);
  g->tp_state = s;
  return 0;
err:
  shm_free_state(s);
  return rc;
}

void mr__shm_close_group(struct mr__group *g) {
  shm_free_state(g->tp_state);
  g->tp_state = NULL;
}

int mr__shm_mem_alloc(struct mr__group *g, size_t bytes, void **out) {
  struct shm *s = g->tp_state;
  if (s->heap_bytes == 0)
    return MR_ENOMEM;
  *out = mr__shm_heap_alloc(&s->alloc, bytes);
  return *out != NULL ? 0 : MR_ENOMEM;
}

int mr__shm_mem_free(struct mr__group *g, void *p) {
  struct shm *s = g->tp_state;
  if (s->heap_bytes == 0 || (unsigned char *)p < s->heap[s->me] ||
      (unsigned char *)p >= s->heap[s->me] + s->heap_bytes)
    return 0;
  mr__shm_heap_free(&s->alloc, p);
  return 1;
}
