/* simd.h - private to the CPU kernels: compiling one loop body twice, for
 * AVX2+FMA and for baseline x86-64, and picking one at run time; and an
 * exp that the compiler can vectorize.
 *
 * A kernel writes its loop as `MR_CPU_BODY void name_body(params)` and then
 * MR_CPU_DISPATCH(name, (params), (args)) defines `static void name(params)`
 * that calls the AVX2 copy where the CPU has AVX2 and FMA.  The body is
 * inlined into both copies, so the vectorizer sees each target. */
#ifndef MR_CPU_SIMD_H
#define MR_CPU_SIMD_H

#include <stdint.h>
#include <string.h>

#define MR_CPU_BODY static inline __attribute__((always_inline))

static inline int mr__cpu_has_avx2(void) {
  static int cached = -1;
  int c = __atomic_load_n(&cached, __ATOMIC_RELAXED);
  if (c < 0) {
    c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    __atomic_store_n(&cached, c, __ATOMIC_RELAXED);
  }
  return c;
}

#define MR_CPU_DISPATCH(name, params, args)                                  \
  __attribute__((target("avx2,fma"))) static void name##_avx2 params {      \
    name##_body args;                                                        \
  }                                                                          \
  static void name##_base params { name##_body args; }                       \
  static void name params {                                                  \
    if (mr__cpu_has_avx2())                                                  \
      name##_avx2 args;                                                      \
    else                                                                     \
      name##_base args;                                                      \
  }

/* e^x for float, Cephes' polynomial (about 1 ulp) with the exponent built
 * from bits; branch-free so loops over it vectorize.  x < -87.3 gives 0
 * (so exp(-inf) = 0), x > 88.7 gives 2^128-ish (inf after the multiply). */
MR_CPU_BODY float mr__expf(float x) {
  float xc = x > 88.7f ? 88.7f : x;
  xc = xc < -87.3f ? -87.3f : xc;
  /* n = round(x / ln 2) by the 1.5 * 2^23 trick */
  float t = xc * 1.44269504088896341f + 12582912.0f;
  float n = t - 12582912.0f;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t e = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &e, 4);
  float y = p * scale;
  return x < -87.3f ? 0.0f : y;
}

#endif
