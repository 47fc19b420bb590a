/* dtype.c - element types and conversions. */
#include "common/dtype.h"

#include <string.h>

#include "common/error.h"

static const struct {
  const char *name;
  const char *st_name;
  size_t size;
} dtypes[MR_DTYPE_COUNT] = {
    [MR_F32] = {"float32", "F32", 4}, [MR_BF16] = {"bfloat16", "BF16", 2},
    [MR_F16] = {"float16", "F16", 2}, [MR_I32] = {"int32", "I32", 4},
    [MR_I64] = {"int64", "I64", 8},   [MR_U16] = {"uint16", "U16", 2},
    [MR_U8] = {"uint8", "U8", 1},     [MR_F64] = {"float64", "F64", 8},
};

size_t mr_dtype_size(enum mr_dtype t) {
  return (unsigned)t < MR_DTYPE_COUNT ? dtypes[t].size : 0;
}

const char *mr_dtype_name(enum mr_dtype t) {
  return (unsigned)t < MR_DTYPE_COUNT ? dtypes[t].name : "unknown";
}

const char *mr_dtype_safetensors_name(enum mr_dtype t) {
  return (unsigned)t < MR_DTYPE_COUNT ? dtypes[t].st_name : "unknown";
}

int mr_dtype_parse(const char *s, enum mr_dtype *out) {
  for (int i = 0; i < MR_DTYPE_COUNT; i++)
    if (strcmp(s, dtypes[i].name) == 0 || strcmp(s, dtypes[i].st_name) == 0) {
      *out = (enum mr_dtype)i;
      return 0;
    }
  return MR_EINVAL;
}

uint16_t mr_f32_to_f16(float f) {
  uint32_t u = mr__f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) /* NaN */
    return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
    return (uint16_t)(sign | 0x7c00u);
  if (a < 0x38800000u) { /* below the smallest normal half: subnormal or 0 */
    if (a < 0x33000000u) /* below half the smallest subnormal: zero */
      return (uint16_t)sign;
    uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    int shift = 126 - (int)(a >> 23); /* 14..24 */
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u)))
      q++;
    return (uint16_t)(sign | q);
  }
  /* normal: rebias the exponent, round the mantissa to 10 bits */
  uint32_t r = a - 0x38000000u; /* exponent 127 -> 15 */
  r += 0xfffu + ((r >> 13) & 1u);
  return (uint16_t)(sign | (r >> 13));
}

float mr_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f)
    return mr__bits_f32(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0)
      return mr__bits_f32(sign);
    /* subnormal: value = mant * 2^-24 */
    float v = (float)mant * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return mr__bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

void mr_f32_to_bf16_n(uint16_t *dst, const float *src, size_t n) {
  for (size_t i = 0; i < n; i++)
    dst[i] = mr_f32_to_bf16(src[i]);
}

void mr_bf16_to_f32_n(float *dst, const uint16_t *src, size_t n) {
  for (size_t i = 0; i < n; i++)
    dst[i] = mr_bf16_to_f32(src[i]);
}

void mr_f32_to_f16_n(uint16_t *dst, const float *src, size_t n) {
  for (size_t i = 0; i < n; i++)
    dst[i] = mr_f32_to_f16(src[i]);
}

void mr_f16_to_f32_n(float *dst, const uint16_t *src, size_t n) {
  for (size_t i = 0; i < n; i++)
    dst[i] = mr_f16_to_f32(src[i]);
}
