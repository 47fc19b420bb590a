/* safetensors_direct.c - writing a file with O_DIRECT from a ring of aligned
 * staging buffers, with an I/O thread and a hashing thread (see
 * safetensors_internal.h). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/safetensors_internal.h"

/* Four buffers of MR__ST_DIRECT_BYTES: each write as fast as larger ones on
 * the disks measured, and a buffer just filled is still in the cache when
 * it is hashed. */
#define RING 4

struct mr__st_direct {
  pthread_t io_thread, hash_thread;
  int hashing;               // hash_thread runs
  pthread_mutex_t mu;
  pthread_cond_t cv;         // a counter or stop changed
  uint8_t *ring[RING];       // MR__ST_DIRECT_BYTES each, as aligned
  size_t len[RING];          // bytes of the file in ring[i]
  uint64_t submitted;        // buffers handed over
  uint64_t written, hashed;  // buffers each thread is done with (<= submitted)
  int stop;
  int err;                   // errno of the first failed write; 0: none
  int fd;                    // borrowed
  struct mr_checksum *sha;   // borrowed; only hash_thread touches it meanwhile
  const char *path;          // borrowed, for messages
};

static uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }

/* Writes buffer after buffer, whole blocks: the last one padded with zeros
 * (which the hashing thread never reads: it stops at len). */
static void *write_main(void *arg) {
  struct mr__st_direct *d = arg;
  pthread_mutex_lock(&d->mu);
  for (;;) {
    while (d->written == d->submitted && !d->stop)
      pthread_cond_wait(&d->cv, &d->mu);
    if (d->written == d->submitted)
      break; /* stopped with nothing left */
    int i = (int)(d->written % RING), failed = d->err != 0;
    off_t at = (off_t)(d->written * MR__ST_DIRECT_BYTES);
    size_t len = (d->len[i] + MR__ST_DIRECT_ALIGN - 1) & ~(size_t)(MR__ST_DIRECT_ALIGN - 1);
    pthread_mutex_unlock(&d->mu);
    memset(d->ring[i] + d->len[i], 0, len - d->len[i]);
    int err = 0;
    for (size_t done = 0; !failed && !err && done < len;) {
      ssize_t k = pwrite(d->fd, d->ring[i] + done, len - done, at + (off_t)done);
      if (k > 0)
        done += (size_t)k;
      else if (k == 0 || errno != EINTR)
        err = k < 0 ? errno : EIO;
    }
    pthread_mutex_lock(&d->mu);
    if (err != 0 && d->err == 0)
      d->err = err;
    d->written++;
    pthread_cond_broadcast(&d->cv);
  }
  pthread_mutex_unlock(&d->mu);
  return NULL;
}

/* Hashes buffer after buffer, in the file's order. */
static void *hash_main(void *arg) {
  struct mr__st_direct *d = arg;
  pthread_mutex_lock(&d->mu);
  for (;;) {
    while (d->hashed == d->submitted && !d->stop)
      pthread_cond_wait(&d->cv, &d->mu);
    if (d->hashed == d->submitted)
      break;
    int i = (int)(d->hashed % RING);
    pthread_mutex_unlock(&d->mu);
    mr_checksum_update(d->sha, d->ring[i], d->len[i]);
    pthread_mutex_lock(&d->mu);
    d->hashed++;
    pthread_cond_broadcast(&d->cv);
  }
  pthread_mutex_unlock(&d->mu);
  return NULL;
}

int mr__st_direct_usable(int fd) {
#ifdef STATX_DIOALIGN
  struct statx sx;
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN))
    return sx.stx_dio_offset_align != 0 && MR__ST_DIRECT_ALIGN % sx.stx_dio_offset_align == 0 &&
           sx.stx_dio_mem_align != 0 && MR__ST_DIRECT_ALIGN % sx.stx_dio_mem_align == 0;
#endif
  (void)fd; /* the kernel cannot tell (before Linux 6.1): the open succeeded */
  return 1;
}

static void free_ring(struct mr__st_direct *d) {
  for (int i = 0; i < RING; i++)
    free(d->ring[i]);
  pthread_mutex_destroy(&d->mu);
  pthread_cond_destroy(&d->cv);
  free(d);
}

void mr__st_direct_close(struct mr__st_direct *d) {
  if (d == NULL)
    return;
  pthread_mutex_lock(&d->mu);
  d->stop = 1;
  pthread_cond_broadcast(&d->cv);
  pthread_mutex_unlock(&d->mu);
  pthread_join(d->io_thread, NULL);
  if (d->hashing)
    pthread_join(d->hash_thread, NULL);
  free_ring(d);
}

int mr__st_direct_open(int fd, struct mr_checksum *sha, const char *path,
                       struct mr__st_direct **out, uint8_t **first) {
  *out = NULL;
  struct mr__st_direct *d = calloc(1, sizeof *d);
  if (d == NULL)
    return mr_error_set(MR_ENOMEM, "%s: out of memory", path);
  pthread_mutex_init(&d->mu, NULL);
  pthread_cond_init(&d->cv, NULL);
  for (int i = 0; i < RING; i++) {
    if (posix_memalign((void **)&d->ring[i], MR__ST_DIRECT_BYTES, MR__ST_DIRECT_BYTES) != 0) {
      free_ring(d);
      return mr_error_set(MR_ENOMEM, "%s: out of memory", path);
    }
    (void)madvise(d->ring[i], MR__ST_DIRECT_BYTES, MADV_HUGEPAGE); /* one fault, not 512 */
  }
  d->fd = fd;
  d->sha = sha;
  d->path = path;
  if (pthread_create(&d->io_thread, NULL, write_main, d) != 0) {
    free_ring(d);
    return mr_error_set(MR_ESYS, "%s: cannot start the I/O thread", path);
  }
  if (sha != NULL) {
    if (pthread_create(&d->hash_thread, NULL, hash_main, d) != 0) {
      mr__st_direct_close(d);
      return mr_error_set(MR_ESYS, "%s: cannot start the hashing thread", path);
    }
    d->hashing = 1;
  }
  *out = d;
  *first = d->ring[0];
  return 0;
}

int mr__st_direct_submit(struct mr__st_direct *d, size_t len, uint8_t **next) {
  pthread_mutex_lock(&d->mu);
  d->len[d->submitted % RING] = len;
  d->submitted++;
  if (!d->hashing)
    d->hashed = d->submitted;
  pthread_cond_broadcast(&d->cv);
  while (d->submitted - min_u64(d->written, d->hashed) >= RING)
    pthread_cond_wait(&d->cv, &d->mu);
  int err = d->err;
  pthread_mutex_unlock(&d->mu);
  *next = d->ring[d->submitted % RING];
  if (err != 0)
    return mr_error_set(MR_EIO, "%s: write: %s", d->path, strerror(err));
  return 0;
}

int mr__st_direct_drain(struct mr__st_direct *d) {
  pthread_mutex_lock(&d->mu);
  while (d->written != d->submitted || d->hashed != d->submitted)
    pthread_cond_wait(&d->cv, &d->mu);
  int err = d->err;
  pthread_mutex_unlock(&d->mu);
  if (err != 0)
    return mr_error_set(MR_EIO, "%s: write: %s", d->path, strerror(err));
  return 0;
}
