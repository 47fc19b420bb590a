/* cuda_pool.c - the device memory pool: a caching allocator over
 * cudaMalloc (never managed memory).  Small requests round up to 512
 * bytes, large ones to 2 MiB; a freed block waits in the cache for a
 * request of its size (up to a quarter larger for large blocks).  When
 * cudaMalloc fails the cache is handed back to CUDA and the request tried
 * once more. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#include "worker/backend/cuda/cuda_internal.h"

#define SMALL_LIMIT ((size_t)1 << 20)
#define SMALL_ROUND ((size_t)512)
#define LARGE_ROUND ((size_t)2 << 20)
#define LIVE_BUCKETS 4096

struct mr__cuda_block {
  void *ptr;
  size_t size;
  struct mr__cuda_block *next;
};

static size_t round_size(size_t bytes) {
  if (bytes == 0)
    bytes = 1;
  size_t r = bytes <= SMALL_LIMIT ? SMALL_ROUND : LARGE_ROUND;
  return (bytes + r - 1) / r * r;
}

static size_t bucket_of(const void *p) {
  uintptr_t u = (uintptr_t)p >> 9;
  return (size_t)((u ^ (u >> 12)) % LIVE_BUCKETS);
}

int mr__cuda_pool_init(struct mr__cuda_pool *p, int device) {
  memset(p, 0, sizeof *p);
  p->device = device;
  p->live = calloc(LIVE_BUCKETS, sizeof *p->live);
  if (p->live == NULL)
    return mr_error_set(MR_ENOMEM, "cuda pool: out of host memory");
  pthread_mutex_init(&p->lock, NULL);
  return 0;
}

static void release_cached(struct mr__cuda_pool *p) {
  while (p->cached != NULL) {
    struct mr__cuda_block *b = p->cached;
    p->cached = b->next;
    cudaFree(b->ptr);
    free(b);
  }
}

void mr__cuda_pool_close(struct mr__cuda_pool *p) {
  if (p->live == NULL)
    return;
  cudaSetDevice(p->device);
  release_cached(p);
  for (size_t i = 0; i < LIVE_BUCKETS; i++)
    while (p->live[i] != NULL) {
      struct mr__cuda_block *b = p->live[i];
      p->live[i] = b->next;
      cudaFree(b->ptr);
      free(b);
    }
  free(p->live);
  pthread_mutex_destroy(&p->lock);
  memset(p, 0, sizeof *p);
}

/* takes the best cached block for size, or NULL */
static struct mr__cuda_block *take_cached(struct mr__cuda_pool *p, size_t size) {
  size_t limit = size <= SMALL_LIMIT ? size : size + size / 4;
  struct mr__cuda_block **best = NULL;
  for (struct mr__cuda_block **bp = &p->cached; *bp != NULL; bp = &(*bp)->next) {
    size_t s = (*bp)->size;
    if (s >= size && s <= limit && (best == NULL || s < (*best)->size)) {
      best = bp;
      if (s == size)
        break;
    }
  }
  if (best == NULL)
    return NULL;
  struct mr__cuda_block *b = *best;
  *best = b->next;
  return b;
}

int mr__cuda_pool_alloc(struct mr__cuda_pool *p, size_t bytes, void **out) {
  *out = NULL;
  size_t size = round_size(bytes);
  pthread_mutex_lock(&p->lock);
  struct mr__cuda_block *b = take_cached(p, size);
  if (b == NULL) {
    b = malloc(sizeof *b);
    if (b == NULL) {
      pthread_mutex_unlock(&p->lock);
      return mr_error_set(MR_ENOMEM, "cuda pool: out of host memory");
    }
    b->size = size;
    cudaError_t e = cudaMalloc(&b->ptr, size);
    if (e == cudaErrorMemoryAllocation && p->cached != NULL) {
      cudaGetLastError();
      cudaDeviceSynchronize();
      release_cached(p);
      e = cudaMalloc(&b->ptr, size);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      size_t fr = 0, total = 0;
      cudaMemGetInfo(&fr, &total);
      free(b);
      size_t live = p->bytes_live;
      pthread_mutex_unlock(&p->lock);
      return mr_error_set(e == cudaErrorMemoryAllocation ? MR_ENOMEM : MR_EIO,
                          "cuda: cudaMalloc(%zu bytes) on device %d: %s (%.2f GiB "
                          "free of %.2f GiB; %.2f GiB held by this pool)",
                          size, p->device, cudaGetErrorName(e),
                          (double)fr / (1 << 30), (double)total / (1 << 30),
                          (double)live / (1 << 30));
    }
  }
  size_t k = bucket_of(b->ptr);
  b->next = p->live[k];
  p->live[k] = b;
  p->bytes_live += b->size;
  *out = b->ptr;
  pthread_mutex_unlock(&p->lock);
  return 0;
}

void mr__cuda_pool_free(struct mr__cuda_pool *p, void *ptr) {
  if (ptr == NULL)
    return;
  pthread_mutex_lock(&p->lock);
  for (struct mr__cuda_block **bp = &p->live[bucket_of(ptr)]; *bp != NULL;
       bp = &(*bp)->next)
    if ((*bp)->ptr == ptr) {
      struct mr__cuda_block *b = *bp;
      *bp = b->next;
      p->bytes_live -= b->size;
      b->next = p->cached;
      p->cached = b;
      pthread_mutex_unlock(&p->lock);
      return;
    }
  pthread_mutex_unlock(&p->lock);
  MR_WARN("cuda", "free of %p: not a block of device %d's pool (ignored)", ptr,
          p->device);
}
