/* dtype.h - element types and conversions between them.
 *
 * bf16 and fp16 are stored as uint16_t (gcc 12 has no __bf16).  Both
 * conversions from float round to nearest, ties to even, and keep NaN a NaN
 * and infinities infinite; fp16 handles subnormals and overflows to inf. */
#ifndef MR_DTYPE_H
#define MR_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum mr_dtype {
  MR_F32 = 0,
  MR_BF16 = 1,
  MR_F16 = 2,
  MR_I32 = 3,
  MR_I64 = 4,
  MR_U16 = 5,
  MR_U8 = 6,
  MR_F64 = 7,
  MR_DTYPE_COUNT
};

/* Bytes per element. */
size_t mr_dtype_size(enum mr_dtype t);

/* "float32", "bfloat16", ...  and the safetensors spelling ("F32", "BF16"). */
const char *mr_dtype_name(enum mr_dtype t);
const char *mr_dtype_safetensors_name(enum mr_dtype t);

/* Parses either spelling; returns 0 or MR_EINVAL. */
int mr_dtype_parse(const char *s, enum mr_dtype *out);

static inline uint32_t mr__f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float mr__bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t mr_f32_to_bf16(float f) {
  uint32_t u = mr__f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet and a NaN */
    return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline float mr_bf16_to_f32(uint16_t h) {
  return mr__bits_f32((uint32_t)h << 16);
}

uint16_t mr_f32_to_f16(float f);
float mr_f16_to_f32(uint16_t h);

/* Bulk conversions; n elements. */
void mr_f32_to_bf16_n(uint16_t *dst, const float *src, size_t n);
void mr_bf16_to_f32_n(float *dst, const uint16_t *src, size_t n);
void mr_f32_to_f16_n(uint16_t *dst, const float *src, size_t n);
void mr_f16_to_f32_n(float *dst, const uint16_t *src, size_t n);

#endif
