/* attention_gemm.h - private to the CPU kernels: causal attention as
 * matmuls (our AVX-512 sgemm, else OpenBLAS).  mr_cpu_attention_fwd/bwd
 * call these where mr__cpu_has_avx2(); same contracts as theirs
 * (kernels.h), with the shape already checked and its strides and scale
 * filled in. */
#ifndef MR_CPU_ATTENTION_GEMM_H
#define MR_CPU_ATTENTION_GEMM_H

#include "worker/backend/cpu/kernels.h"

int mr__attention_fwd_gemm(struct mr_pool *pool, float *o, float *lse,
                           const float *q, const float *k, const float *v,
                           const struct mr_attn_shape *s);

int mr__attention_bwd_gemm(struct mr_pool *pool, float *dq, float *dk,
                           float *dv, const float *dout, const float *q,
                           const float *k, const float *v, const float *o,
                           const float *lse, const struct mr_attn_shape *s);

#endif
