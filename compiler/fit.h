/* fit.h - first-fit placement of buffers with lifetimes in one arena: the
 * planner of the executor's and the rank program's transient memory.
 *
 * The caller walks its ops in order, placing each buffer when it is first
 * written and releasing it after its last reader; the highest end placed
 * is the arena's size. */
#ifndef MR_FIT_H
#define MR_FIT_H

#include <stdint.h>

struct mr_fit_live {
  int64_t off, end;             // bytes
  int id;
};

/* The live buffers: lv has room for every buffer at once (the caller
 * allocates it), n of them are live, sorted by offset. */
struct mr_fit {
  struct mr_fit_live *lv;
  int n;
};

/* Places buffer id of size bytes at the lowest offset where it fits
 * between the live ones; returns the offset. */
int64_t mr_fit_place(struct mr_fit *f, int64_t size, int id);

/* Ends buffer id's lifetime (a no-op when it is not live). */
void mr_fit_release(struct mr_fit *f, int id);

#endif
