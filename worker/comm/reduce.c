/* reduce.c - element-wise reductions in a fixed source order.
 *
 * The loops work in blocks of BLOCK elements through a float (or integer)
 * accumulator array so that the compiler vectorizes them and each element
 * still sees srcs[0], srcs[1], ... in order. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O3")
#endif
#include "worker/comm/reduce.h"

#include <stdint.h>
#include <string.h>

#include "common/error.h"

#define BLOCK 512

int mr__reducible(enum mr_dtype dt) {
  return dt == MR_F32 || dt == MR_BF16 || dt == MR_F16 || dt == MR_I32 ||
         dt == MR_I64;
}

static void finish_f32(float *acc, size_t m, enum mr_red_op op, int n) {
  if (op == MR_RED_AVG) {
    float fn = (float)n;
    for (size_t i = 0; i < m; i++)
      acc[i] /= fn;
  }
}

static void accum_f32(float *restrict acc, const float *restrict x, size_t m,
                      enum mr_red_op op) {
  if (op == MR_RED_MAX) {
    for (size_t i = 0; i < m; i++)
      acc[i] = (x[i] > acc[i] || x[i] != x[i]) ? x[i] : acc[i];
  } else {
    for (size_t i = 0; i < m; i++)
      acc[i] += x[i];
  }
}

static void reduce_f32(enum mr_red_op op, float *dst, const void *const *srcs,
                       int nsrc, size_t count) {
  if (nsrc == 2 && op == MR_RED_SUM) { /* the hot case: no block buffer */
    const float *a = srcs[0], *b = srcs[1];
    for (size_t i = 0; i < count; i++)
      dst[i] = a[i] + b[i];
    return;
  }
  float acc[BLOCK];
  for (size_t o = 0; o < count; o += BLOCK) {
    size_t m = count - o < BLOCK ? count - o : BLOCK;
    memcpy(acc, (const float *)srcs[0] + o, m * sizeof(float));
    for (int k = 1; k < nsrc; k++)
      accum_f32(acc, (const float *)srcs[k] + o, m, op);
    finish_f32(acc, m, op, nsrc);
    memcpy(dst + o, acc, m * sizeof(float));
  }
}

static void widen(enum mr_dtype dt, float *out, const uint16_t *in, size_t m) {
  if (dt == MR_BF16)
    for (size_t i = 0; i < m; i++)
      out[i] = mr_bf16_to_f32(in[i]);
  else
    mr_f16_to_f32_n(out, in, m);
}

static void reduce_half(enum mr_dtype dt, enum mr_red_op op, uint16_t *dst,
                        const void *const *srcs, int nsrc, size_t count) {
  float acc[BLOCK], x[BLOCK];
  for (size_t o = 0; o < count; o += BLOCK) {
    size_t m = count - o < BLOCK ? count - o : BLOCK;
    widen(dt, acc, (const uint16_t *)srcs[0] + o, m);
    for (int k = 1; k < nsrc; k++) {
      widen(dt, x, (const uint16_t *)srcs[k] + o, m);
      accum_f32(acc, x, m, op);
    }
    finish_f32(acc, m, op, nsrc);
    if (dt == MR_BF16)
      for (size_t i = 0; i < m; i++)
        dst[o + i] = mr_f32_to_bf16(acc[i]);
    else
      mr_f32_to_f16_n(dst + o, acc, m);
  }
}

static void reduce_i32(enum mr_red_op op, int32_t *dst,
                       const void *const *srcs, int nsrc, size_t count) {
  int64_t acc[BLOCK];
  for (size_t o = 0; o < count; o += BLOCK) {
    size_t m = count - o < BLOCK ? count - o : BLOCK;
    const int32_t *s0 = (const int32_t *)srcs[0] + o;
    for (size_t i = 0; i < m; i++)
      acc[i] = s0[i];
    for (int k = 1; k < nsrc; k++) {
      const int32_t *x = (const int32_t *)srcs[k] + o;
      if (op == MR_RED_MAX)
        for (size_t i = 0; i < m; i++)
          acc[i] = x[i] > acc[i] ? x[i] : acc[i];
      else
        for (size_t i = 0; i < m; i++)
          acc[i] += x[i];
    }
    for (size_t i = 0; i < m; i++) {
      int64_t v = op == MR_RED_AVG ? acc[i] / nsrc : acc[i];
      dst[o + i] = (int32_t)(uint32_t)(uint64_t)v; /* wraps like int32 */
    }
  }
}

static void reduce_i64(enum mr_red_op op, int64_t *dst,
                       const void *const *srcs, int nsrc, size_t count) {
  for (size_t i = 0; i < count; i++) {
    if (op == MR_RED_MAX) {
      int64_t a = ((const int64_t *)srcs[0])[i];
      for (int k = 1; k < nsrc; k++) {
        int64_t x = ((const int64_t *)srcs[k])[i];
        a = x > a ? x : a;
      }
      dst[i] = a;
    } else if (op == MR_RED_SUM) {
      uint64_t a = (uint64_t)((const int64_t *)srcs[0])[i];
      for (int k = 1; k < nsrc; k++)
        a += (uint64_t)((const int64_t *)srcs[k])[i];
      dst[i] = (int64_t)a;
    } else {
      __extension__ __int128 a = ((const int64_t *)srcs[0])[i];
      for (int k = 1; k < nsrc; k++)
        a += ((const int64_t *)srcs[k])[i];
      dst[i] = (int64_t)(a / nsrc);
    }
  }
}

int mr__reduce(enum mr_dtype dt, enum mr_red_op op, void *dst,
               const void *const *srcs, int nsrc, size_t count) {
  switch (dt) {
  case MR_F32:
    reduce_f32(op, dst, srcs, nsrc, count);
    return 0;
  case MR_BF16:
  case MR_F16:
    reduce_half(dt, op, dst, srcs, nsrc, count);
    return 0;
  case MR_I32:
    reduce_i32(op, dst, srcs, nsrc, count);
    return 0;
  case MR_I64:
    reduce_i64(op, dst, srcs, nsrc, count);
    return 0;
  default:
    return mr_error_set(MR_ENOTSUP, "comm: no reduction for dtype %s",
                        mr_dtype_name(dt));
  }
}
