/* box.c - walking and copying boxes of row-major tensors. */
#include "common/box.h"

#include <string.h>

void mr_box_runs(int ndim, const int64_t *shape, const int64_t *off, const int64_t *len,
                 void (*fn)(void *ctx, int64_t at, int64_t in_box, int64_t n), void *ctx) {
  int64_t idx[MR_MAX_DIMS] = {0}, stride[MR_MAX_DIMS];
  for (int d = 0; d < ndim; d++)
    if (len[d] <= 0)
      return;
  stride[ndim - 1] = 1;
  for (int d = ndim - 2; d >= 0; d--)
    stride[d] = stride[d + 1] * shape[d + 1];
  int64_t run = len[ndim - 1];
  for (int64_t in_box = 0;; in_box += run) {
    int64_t at = off[ndim - 1];
    for (int d = 0; d < ndim - 1; d++)
      at += (off[d] + idx[d]) * stride[d];
    fn(ctx, at, in_box, run);
    int d = ndim - 2;
    while (d >= 0 && ++idx[d] == len[d])
      idx[d--] = 0;
    if (d < 0)
      return;
  }
}

struct box_copy {
  float *whole, *box;
  int into_box;
};

static void box_copy_run(void *ctx, int64_t at, int64_t in_box, int64_t n) {
  struct box_copy *x = ctx;
  if (x->into_box)
    memcpy(x->box + in_box, x->whole + at, (size_t)n * sizeof(float));
  else
    memcpy(x->whole + at, x->box + in_box, (size_t)n * sizeof(float));
}

void mr_box_gather(int ndim, const int64_t *shape, const int64_t *off, const int64_t *len,
                   const float *whole, float *box) {
  struct box_copy x = {.whole = (float *)whole, .box = box, .into_box = 1};
  mr_box_runs(ndim, shape, off, len, box_copy_run, &x);
}

void mr_box_scatter(int ndim, const int64_t *shape, const int64_t *off, const int64_t *len,
                    const float *box, float *whole) {
  struct box_copy x = {.whole = whole, .box = (float *)box, .into_box = 0};
  mr_box_runs(ndim, shape, off, len, box_copy_run, &x);
}
