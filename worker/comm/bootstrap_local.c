/* bootstrap_local.c - the all-gather of a bootstrap in a shared anonymous
 * mapping, for ranks that are processes forked from one parent.
 *
 * Round k uses buffer k % 2: a rank can start round k + 2 (and overwrite
 * buffer k % 2) only after every rank arrived at round k + 1, which each
 * does only after it copied round k out. */
#include "worker/comm/bootstrap.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/rng.h"
#include "worker/comm/comm.h"

/* The deadline has passed, or the rank is stopping (the caller's error
 * then goes unreported: worker/main.c). */
static int past(int64_t deadline) { return mr_clock_ns() > deadline || mr_comm_stopping(); }

struct slot_hdr {
  uint64_t key_hash;
  uint64_t len;
};

struct area {
  int world;
  size_t max_len;
  size_t slot_bytes;
  size_t bytes;
  _Atomic uint64_t arrived[]; /* (world) rounds completed by each rank */
};

struct mr_bootstrap_local {
  struct area *a;    /* shared */
  int rank;          /* this process's copy after fork */
  int timeout_ms;
  uint64_t round;
};

static size_t hdr_bytes(int world) {
  size_t b = sizeof(struct area) + (size_t)world * sizeof(uint64_t);
  return (b + 63) & ~(size_t)63;
}

static unsigned char *slot(struct area *a, uint64_t round, int rank) {
  unsigned char *base = (unsigned char *)a + hdr_bytes(a->world);
  return base + ((round % 2) * (size_t)a->world + (size_t)rank) * a->slot_bytes;
}

struct mr_bootstrap_local *mr_bootstrap_local_new(int world_size,
                                                  size_t max_len) {
  if (world_size <= 0)
    return NULL;
  struct mr_bootstrap_local *bl = calloc(1, sizeof *bl);
  if (bl == NULL)
    return NULL;
  size_t slot_bytes = (sizeof(struct slot_hdr) + max_len + 63) & ~(size_t)63;
  size_t bytes = hdr_bytes(world_size) + 2 * (size_t)world_size * slot_bytes;
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    free(bl);
    return NULL;
  }
  bl->a = p;
  bl->a->world = world_size;
  bl->a->max_len = max_len;
  bl->a->slot_bytes = slot_bytes;
  bl->a->bytes = bytes;
  for (int i = 0; i < world_size; i++)
    atomic_init(&bl->a->arrived[i], 0);
  return bl;
}

static int local_allgather(void *ctx, const char *key, const void *blob,
                           size_t len, void *out) {
  struct mr_bootstrap_local *bl = ctx;
  struct area *a = bl->a;
  if (len > a->max_len)
    return mr_error_set(MR_ETOOBIG, "bootstrap %s: blob of %zu bytes, at most "
                        "%zu", key, len, a->max_len);
  uint64_t h = mr_hash_str(key), r = bl->round++;
  unsigned char *mine = slot(a, r, bl->rank);
  struct slot_hdr hd = {h, len};
  memcpy(mine, &hd, sizeof hd);
  memcpy(mine + sizeof hd, blob, len);
  atomic_store_explicit(&a->arrived[bl->rank], r + 1, memory_order_release);
  int64_t deadline = mr_clock_ns() + (int64_t)bl->timeout_ms * 1000000;
  for (int i = 0; i < a->world; i++) {
    unsigned spins = 0;
    while (atomic_load_explicit(&a->arrived[i], memory_order_acquire) < r + 1) {
      if (++spins < 1000)
        continue;
      if (past(deadline)) {
        char who[256];
        size_t off = 0;
        for (int j = 0; j < a->world && off < sizeof who - 12; j++)
          if (atomic_load(&a->arrived[j]) < r + 1)
            off += (size_t)snprintf(who + off, sizeof who - off, "%s%d",
                                    off ? ", " : "", j);
        return mr_error_set(MR_ETIMEDOUT, "bootstrap %s timed out after %.1f "
                            "s: ranks %s have not arrived", key,
                            bl->timeout_ms / 1000.0, who);
      }
      struct timespec ts = {0, 20000};
      nanosleep(&ts, NULL);
    }
    const unsigned char *theirs = slot(a, r, i);
    memcpy(&hd, theirs, sizeof hd);
    if (hd.key_hash != h || hd.len != len)
      return mr_error_set(MR_EPROTO, "bootstrap %s: rank %d is in another "
                          "exchange (or sent %llu bytes, expected %zu)", key,
                          i, (unsigned long long)hd.len, len);
    memcpy((unsigned char *)out + (size_t)i * len, theirs + sizeof hd, len);
  }
  return 0;
}

void mr_bootstrap_local_rank(struct mr_bootstrap_local *bl, int rank,
                             const char *host_id, const char *job_id,
                             int timeout_ms, struct mr_bootstrap *bs) {
  bl->rank = rank;
  bl->timeout_ms = timeout_ms;
  bl->round = 0;
  bs->rank = rank;
  bs->world_size = bl->a->world;
  bs->host_id = host_id;
  bs->job_id = job_id;
  bs->ctx = bl;
  bs->allgather = local_allgather;
}

void mr_bootstrap_local_free(struct mr_bootstrap_local *bl) {
  if (bl == NULL)
    return;
  munmap(bl->a, bl->a->bytes);
  free(bl);
}
