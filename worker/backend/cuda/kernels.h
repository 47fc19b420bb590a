/* kernels.h - the CUDA module's device kernels, as C-callable launchers.
 *
 * Each launcher queues its kernel(s) on stream s and returns the launch's
 * cudaError_t (cudaSuccess, or the configuration error); it never waits.
 * Semantics match the CPU registry kernels (worker/exec_extra.c on
 * worker/backend/cpu/kernels.h): row-major float32, [N, C] activations,
 * Hugging Face layouts.  Bad data the host cannot see without waiting (a
 * token id or a target out of range) is recorded in the device status word
 * (the first error wins) and turned into an error at the backend's next
 * synchronization.  Reductions use partitions fixed by the shape, never by
 * the device, so results are reproducible run to run. */
#ifndef MR_CUDA_KERNELS_H
#define MR_CUDA_KERNELS_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The first error a kernel found, in device memory. */
struct mr__cuda_status {
  int code;            // enum mr__kerr, 0: none
  int pad;
  long long a, b, c;   // what, where, bound
};

enum mr__kerr {
  MR__KERR_NONE = 0,
  MR__KERR_EMBED_ID = 1,     // a: id, b: row, c: vocabulary
  MR__KERR_XENT_TARGET = 2,  // a: target, b: row, c: V
};

/* Rows of one partial sum in the column reductions (bias_grad, norm dw/db):
 * scratch needs ceil(N / MR__COLRED_ROWS) * C floats per output. */
#define MR__COLRED_ROWS 256

/* out[i] = table[ids[i] - lo] where that row lies in [0, V), else zeros;
 * ids outside [0, all) are an error (all = V, lo = 0 for a whole table). */
cudaError_t mr__k_embedding_fwd(cudaStream_t s, float *out, const float *table,
                                const int32_t *ids, int64_t N, int64_t V,
                                int64_t C, int64_t lo, int64_t all,
                                struct mr__cuda_status *st);
/* dtable[V, C] = sum over tokens (in token order) of dout rows; overwrites,
 * or with accum adds to what dtable holds. */
cudaError_t mr__k_embedding_bwd(cudaStream_t s, float *dtable, const float *dout,
                                const int32_t *ids, int64_t N, int64_t V,
                                int64_t C, int64_t lo, int64_t all, int accum,
                                struct mr__cuda_status *st);

cudaError_t mr__k_add(cudaStream_t s, float *out, const float *a, const float *b,
                      int64_t n);
/* y[M, N] += b[N] on every row. */
cudaError_t mr__k_bias_add(cudaStream_t s, float *y, const float *b, int64_t M,
                           int64_t N);
/* db[N] = column sums of dy[M, N] (accum: +=); part: scratch (see
 * MR__COLRED_ROWS). */
cudaError_t mr__k_bias_grad(cudaStream_t s, float *db, const float *dy,
                            int64_t M, int64_t N, int accum, float *part);
/* dw[C] = sum_r dy (x - mean) rstd (mean NULL: 0); db[C] = sum_r dy when
 * db is not NULL; accum bit 0: dw +=, bit 1: db +=; part: scratch for two
 * outputs. */
cudaError_t mr__k_norm_dwdb(cudaStream_t s, float *dw, float *db, const float *dy,
                            const float *x, const float *mean, const float *rstd,
                            int64_t N, int64_t C, int accum, float *part);

cudaError_t mr__k_rmsnorm_fwd(cudaStream_t s, float *y, float *rstd, const float *x,
                              const float *w, int64_t N, int64_t C, float eps);
cudaError_t mr__k_rmsnorm_bwd_dx(cudaStream_t s, float *dx, const float *dy,
                                 const float *x, const float *w, const float *rstd,
                                 int64_t N, int64_t C);
cudaError_t mr__k_layernorm_fwd(cudaStream_t s, float *y, float *mean, float *rstd,
                                const float *x, const float *w, const float *b,
                                int64_t N, int64_t C, float eps);
cudaError_t mr__k_layernorm_bwd_dx(cudaStream_t s, float *dx, const float *dy,
                                   const float *x, const float *w,
                                   const float *mean, const float *rstd,
                                   int64_t N, int64_t C);

/* y = x rotated (rotate_half) at position row % T by the cos/sin tables
 * [T, D/2]; dir +1 forward, -1 the inverse.  y may be x. */
cudaError_t mr__k_rope(cudaStream_t s, float *y, const float *x, const float *cs,
                       const float *sn, int64_t rows, int T, int H, int D,
                       float dir);

cudaError_t mr__k_swiglu_fwd(cudaStream_t s, float *out, const float *g,
                             const float *u, int64_t n);
cudaError_t mr__k_swiglu_bwd(cudaStream_t s, float *dg, float *du, const float *d,
                             const float *g, const float *u, int64_t n);
cudaError_t mr__k_gelu_fwd(cudaStream_t s, float *out, const float *x, int64_t n);
cudaError_t mr__k_gelu_bwd(cudaStream_t s, float *dx, const float *d, const float *x,
                           int64_t n);

/* dst (16-bit, dtype 1 bf16 / 2 fp16) = src rounded to nearest even. */
cudaError_t mr__k_to_half(cudaStream_t s, void *dst, const float *src, int64_t n,
                          int dtype);

/* Cross-entropy: per-row loss and lse; then the mean into loss[0]
 * (denominator attr when > 0, else the rows whose target is >= 0). */
cudaError_t mr__k_xent_fwd(cudaStream_t s, float *loss_rows, float *lse,
                           const float *logits, const int32_t *t, int64_t N,
                           int64_t V, struct mr__cuda_status *st);
cudaError_t mr__k_xent_mean(cudaStream_t s, float *loss, const float *loss_rows,
                            const int32_t *t, int64_t N, double denom_attr);
/* *scale = dloss[0] / denominator, on the device. */
cudaError_t mr__k_xent_scale(cudaStream_t s, float *scale, const float *dloss,
                             const int32_t *t, int64_t N, double denom_attr);
/* dlogits = scale (softmax - onehot), rows with target < 0 zero; may be in
 * place (dlogits == logits). */
cudaError_t mr__k_xent_bwd(cudaStream_t s, float *dlogits, const float *logits,
                           const float *lse, const int32_t *t, const float *scale,
                           int64_t N, int64_t V, struct mr__cuda_status *st);

/* Cross-entropy over a vocabulary shard, the steps of
 * worker/backend/cpu/xent_vocab.h: the shard holds columns [lo, lo + V) of
 * a vocabulary of `vocab`; a target >= vocab is reported in st. */
cudaError_t mr__k_xv_max(cudaStream_t s, float *m, const float *logits, int64_t N,
                         int64_t V);
cudaError_t mr__k_xv_sumexp(cudaStream_t s, float *sum, float *tl, const float *logits,
                            const int32_t *t, const float *m, int64_t N, int64_t V,
                            int64_t lo, int64_t vocab, struct mr__cuda_status *st);
/* ds or dtl NULL: zero; may be in place (dlogits == logits). */
cudaError_t mr__k_xv_sumexp_bwd(cudaStream_t s, float *dlogits, const float *logits,
                                const int32_t *t, const float *m, const float *ds,
                                const float *dtl, int64_t N, int64_t V, int64_t lo,
                                int64_t vocab, struct mr__cuda_status *st);
cudaError_t mr__k_xv_finish(cudaStream_t s, float *loss, float *lse, const float *sum,
                            const float *tl, const float *m, const int32_t *t, int64_t N,
                            double rows);
/* scale: the device scalar dloss / denominator (mr__k_xent_scale); dlse
 * NULL: zero. */
cudaError_t mr__k_xv_finish_bwd(cudaStream_t s, float *ds, float *dtl, const float *scale,
                                const float *dlse, const float *sum, const int32_t *t,
                                int64_t N);

/* Causal attention, flash style: q [B*T, H*D], k and v [B*T, KH*D], o like
 * q, lse [B, H, T].  amp rounds q, k, v (and dout) to bf16 / fp16 as they
 * are read.  D <= 256.  tc: on the tensor cores (kernels_attn_tc.cu),
 * where mr__k_attn_tensor_ok(amp, D); else on the CUDA cores in fp32. */
cudaError_t mr__k_attn_fwd(cudaStream_t s, float *o, float *lse, const float *q,
                           const float *k, const float *v, int B, int T, int H,
                           int KH, int D, int amp, int tc);
/* dq, dk, dv overwritten; scratch: mr__k_attn_bwd_scratch(...) floats. */
cudaError_t mr__k_attn_bwd(cudaStream_t s, float *dq, float *dk, float *dv,
                           const float *dout, const float *q, const float *k,
                           const float *v, const float *o, const float *lse,
                           int B, int T, int H, int KH, int D, int amp, int tc,
                           float *scratch);
int64_t mr__k_attn_bwd_scratch(int B, int T, int H, int KH, int D, int tc);
/* Whether the tensor-core kernels take attention of head dim D under amp:
 * bf16, D a multiple of 16 up to 128. */
int mr__k_attn_tensor_ok(int amp, int D);

/* kernels_attn_tc.cu's entries (through mr__k_attn_fwd / _bwd): di holds
 * Di; parts, mr__k_attn_tc_parts floats (each group head's dK and dV
 * before they are summed; 0 without grouped heads). */
cudaError_t mr__k_attn_fwd_tc(cudaStream_t s, float *o, float *lse, const float *q,
                              const float *k, const float *v, int B, int T, int H,
                              int KH, int D);
cudaError_t mr__k_attn_bwd_tc(cudaStream_t s, float *dq, float *dk, float *dv,
                              const float *dout, const float *q, const float *k,
                              const float *v, const float *lse, const float *di,
                              int B, int T, int H, int KH, int D, float *parts);
int64_t mr__k_attn_tc_parts(int B, int T, int H, int KH, int D);

/* The runtime's entries. */
cudaError_t mr__k_axpby(cudaStream_t s, float *y, const float *x, float a, float b,
                        int64_t n);
/* part[i] = sum of squares of chunk i (4096 elements), in double, in the
 * CPU backend's order within the chunk. */
cudaError_t mr__k_sumsq_chunks(cudaStream_t s, double *part, const float *x,
                               int64_t n);
cudaError_t mr__k_adamw(cudaStream_t s, float *p, const float *g, float *m,
                        float *v, int64_t n, float decay, float b1, float b2,
                        float step_size, float bc2_sqrt, float eps, float gs);

/* The GEMM used where cuBLASLt offers no algorithm: row-major C[M,N] =
 * op(A) op(B) (accum: C +=), A and B of dtype (0 f32, 1 bf16, 2 fp16), fp32
 * math. */
cudaError_t mr__k_gemm_fallback(cudaStream_t s, int ta, int tb, int64_t M,
                                int64_t N, int64_t K, const void *A, int64_t lda,
                                const void *B, int64_t ldb, float *C, int64_t ldc,
                                int dtype, int accum);

/* x[i] /= divisor for int32 (dtype 3) or int64 (dtype 4), truncating: the
 * NCCL backend's integer average. */
cudaError_t mr__k_div_int(cudaStream_t s, void *x, int64_t n, int dtype,
                          int divisor);

#ifdef __cplusplus
}
#endif

#endif
