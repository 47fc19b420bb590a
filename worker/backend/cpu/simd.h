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

/* 1 when the AVX2+FMA copies run: the CPU has both and MESHRUN_CPU_SIMD is
 * not "portable".  Decided once per process (pool.c). */
int mr__cpu_has_avx2(void);

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

/* Sum of 8 lanes in a fixed order.  Reductions keep 8 partial sums (lane l
 * takes elements l, l+8, ...), which the compiler can vectorize without
 * reassociating, and which give the same bits on every target. */
MR_CPU_BODY float mr__hsum8(const float *a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* e^x for float, Cephes' polynomial (about 1 ulp) with the exponent built
 * from bits; branch-free so loops over it vectorize.  x < -87.3 gives 0
 * (so exp(-inf) = 0), x > 88.7 gives inf, NaN stays NaN.  The clamps come
 * first so the float-to-int conversion is always in range.  The constants
 * are named for the copies written in intrinsics (attention_gemm.c). */
#define MR__EXP_LO -87.3f
#define MR__EXP_HI 88.7f
#define MR__EXP_LOG2E 1.44269504088896341f
#define MR__EXP_ROUND 12582912.0f /* 1.5 * 2^23: adding it rounds to an integer */
#define MR__EXP_LN2_HI 0.693359375f
#define MR__EXP_LN2_LO -2.12194440e-4f
#define MR__EXP_P0 1.9875691500e-4f
#define MR__EXP_P1 1.3981999507e-3f
#define MR__EXP_P2 8.3334519073e-3f
#define MR__EXP_P3 4.1665795894e-2f
#define MR__EXP_P4 1.6666665459e-1f
#define MR__EXP_P5 5.0000001201e-1f

MR_CPU_BODY float mr__expf(float x) {
  float xc = x > MR__EXP_LO ? x : MR__EXP_LO; /* NaN goes to LO here ... */
  xc = xc < MR__EXP_HI ? xc : MR__EXP_HI;
  /* n = round(x / ln 2) */
  float t = xc * MR__EXP_LOG2E + MR__EXP_ROUND;
  float n = t - MR__EXP_ROUND;
  float r = xc - n * MR__EXP_LN2_HI;
  r = r - n * MR__EXP_LN2_LO;
  float p = MR__EXP_P0;
  p = p * r + MR__EXP_P1;
  p = p * r + MR__EXP_P2;
  p = p * r + MR__EXP_P3;
  p = p * r + MR__EXP_P4;
  p = p * r + MR__EXP_P5;
  p = p * r * r + r + 1.0f;
  int32_t e = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &e, 4);
  float y = p * scale;
  y = x < MR__EXP_LO ? 0.0f : y;
  return x == x ? y : x; /* ... and comes back here */
}

#endif
