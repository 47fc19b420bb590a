/* shm_heap.c - first-fit allocation with coalescing, bookkeeping outside
 * the heap. */
#include "worker/comm/shm_heap.h"

#include <stdlib.h>

struct mr__shm_extent {
  size_t off, len;
  struct mr__shm_extent *next;
};

void mr__shm_heap_init(struct mr__shm_heap *h, void *base, size_t bytes) {
  h->base = base;
  h->bytes = bytes;
  h->used = NULL;
  h->free_list = calloc(1, sizeof *h->free_list);
  if (h->free_list != NULL)
    h->free_list->len = bytes;
}

static void free_all(struct mr__shm_extent *e) {
  while (e != NULL) {
    struct mr__shm_extent *n = e->next;
    free(e);
    e = n;
  }
}

void mr__shm_heap_close(struct mr__shm_heap *h) {
  free_all(h->free_list);
  free_all(h->used);
  h->free_list = h->used = NULL;
}

void *mr__shm_heap_alloc(struct mr__shm_heap *h, size_t bytes) {
  size_t len = (bytes + 4095) & ~(size_t)4095;
  if (len == 0)
    len = 4096;
  for (struct mr__shm_extent **p = &h->free_list; *p != NULL;
       p = &(*p)->next) {
    struct mr__shm_extent *e = *p;
    if (e->len < len)
      continue;
    struct mr__shm_extent *u = malloc(sizeof *u);
    if (u == NULL)
      return NULL;
    u->off = e->off;
    u->len = len;
    u->next = h->used;
    h->used = u;
    e->off += len;
    e->len -= len;
    if (e->len == 0) {
      *p = e->next;
      free(e);
    }
    return h->base + u->off;
  }
  return NULL;
}

void mr__shm_heap_free(struct mr__shm_heap *h, void *ptr) {
  size_t off = (size_t)((unsigned char *)ptr - h->base);
  struct mr__shm_extent *u = NULL;
  for (struct mr__shm_extent **p = &h->used; *p != NULL; p = &(*p)->next)
    if ((*p)->off == off) {
      u = *p;
      *p = u->next;
      break;
    }
  if (u == NULL)
    return;
  struct mr__shm_extent **p = &h->free_list;
  while (*p != NULL && (*p)->off < u->off)
    p = &(*p)->next;
  u->next = *p;
  *p = u;
  /* merge with the next, then with the previous */
  if (u->next != NULL && u->off + u->len == u->next->off) {
    struct mr__shm_extent *n = u->next;
    u->len += n->len;
    u->next = n->next;
    free(n);
  }
  for (struct mr__shm_extent *e = h->free_list; e != NULL; e = e->next)
    if (e->next == u && e->off + e->len == u->off) {
      e->len += u->len;
      e->next = u->next;
      free(u);
      break;
    }
}
