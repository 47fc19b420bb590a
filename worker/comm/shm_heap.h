/* shm_heap.h - a first-fit allocator over one rank's heap in a shared
 * segment, so callers can place their buffers where peers read them.
 *
 * The bookkeeping lives in ordinary memory (only the owner allocates from
 * its heap); blocks are 4096-byte aligned and coalesce when freed. */
#ifndef MR_COMM_SHM_HEAP_H
#define MR_COMM_SHM_HEAP_H

#include <stddef.h>

struct mr__shm_extent;

struct mr__shm_heap {
  unsigned char *base;
  size_t bytes;
  struct mr__shm_extent *free_list; /* sorted by offset */
  struct mr__shm_extent *used;
};

void mr__shm_heap_init(struct mr__shm_heap *h, void *base, size_t bytes);
void mr__shm_heap_close(struct mr__shm_heap *h);
/* Returns a block of at least bytes, or NULL when none is free. */
void *mr__shm_heap_alloc(struct mr__shm_heap *h, size_t bytes);
/* Frees a block from alloc; other pointers are ignored. */
void mr__shm_heap_free(struct mr__shm_heap *h, void *p);

#endif
