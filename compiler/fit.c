/* fit.c - first-fit arena placement. */
#include "compiler/fit.h"

#include <string.h>

int64_t mr_fit_place(struct mr_fit *f, int64_t size, int id) {
  int64_t off = 0;
  int i = 0;
  for (; i < f->n; i++) {
    if (f->lv[i].off - off >= size)
      break;
    if (f->lv[i].end > off)
      off = f->lv[i].end;
  }
  memmove(&f->lv[i + 1], &f->lv[i], (size_t)(f->n - i) * sizeof *f->lv);
  f->lv[i] = (struct mr_fit_live){off, off + size, id};
  f->n++;
  return off;
}

void mr_fit_release(struct mr_fit *f, int id) {
  for (int i = 0; i < f->n; i++)
    if (f->lv[i].id == id) {
      memmove(&f->lv[i], &f->lv[i + 1], (size_t)(f->n - i - 1) * sizeof *f->lv);
      f->n--;
      return;
    }
}
