/* kernels.h - the CPU backend's compute kernels: matmuls (OpenBLAS, split
 * across our pool), the transformer ops forward and backward, AdamW, the
 * gradient norm and the mixed-precision conversions.
 *
 * Conventions, common to every kernel here:
 *  - fp32 data, row-major.  Activations are [N, C] with N = B*T rows.  Linear
 *    weights are [out, in] as in Hugging Face (y = x W^T + b).  Attention q is
 *    [B, T, H, D], k and v are [B, T, Hkv, D], the output [B, T, H, D].
 *  - Every pointer is borrowed; kernels allocate nothing the caller sees.  No
 *    alignment is required (64 bytes is best).  Output buffers must not overlap
 *    inputs unless the contract says in-place is allowed.
 *  - `pool` is required (a 1-thread pool is serial); see pool.h.
 *  - Parameter gradients (dw, db, dtable) are always ACCUMULATED (+=), so
 *    micro-batches add up; the caller zeroes them before the first one.
 *    Activation gradients (dx, ...) take `accum`: 0 overwrites, 1 adds.
 *  - Results do not depend on the number of threads: every reduction uses a
 *    partition fixed by the shape, never by the thread count, so 1 and N
 *    threads give bitwise equal output (tested).  The matmuls use our own
 *    AVX-512 sgemm where the CPU has it (sgemm.h), else split C into row
 *    blocks, each one single-threaded OpenBLAS sgemm.
 *  - Sizes are int (elements), shapes are validated: a negative size, a
 *    token id or target out of range, or D odd for RoPE returns MR_EINVAL or
 *    MR_ERANGE with a message (mr_error_message()); 0 on success.
 *
 *  - Workspace: none to plan.  Kernels that need tiles or partial sums take
 *    them from the pool's per-thread scratch (grown on first use, kept for
 *    the pool's life: attention needs about 4*D*64 + 2*64*64 + (H/Hkv)*T
 *    floats per thread, or with AVX-512 2*D*T + 3*T*max(D, 64) + 2*64*T;
 *    the AVX-512 matmul packs op(B), K*N floats, into the pool's shared
 *    scratch).  What the caller keeps between forward and
 *    backward is explicit: rmsnorm rstd[N]; layernorm mean[N], rstd[N];
 *    attention lse[B*H*T] plus its output o; xent lse[N]; RoPE tables
 *    cos/sin[P*D/2] (shared by all layers).
 *  - Pool lifetime: one pool per rank, made once (mr_pool_new or the CPU
 *    backend) and kept for the run.  Making a pool sets OpenBLAS to one
 *    thread for the whole process.  Kernels return when done (synchronous).
 *  - GPT-2's Conv1D weights are [in, out] (y = x W + b): use mr_cpu_gemm
 *    with tb = false, then mr_cpu_bias_add; or transpose them at load.
 *
 * Signatures here are stable; a change is announced in this comment. */
#ifndef MR_CPU_KERNELS_H
#define MR_CPU_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "worker/backend/backend.h"
#include "worker/backend/cpu/pool.h"

/* ---- matmuls ----------------------------------------------------------- */

/* Row-major C = alpha * op(A) op(B) + beta * C, op(X) = X or X^T (ta, tb).
 * op(A) is [M, K], op(B) is [K, N], C is [M, N] with leading dimensions lda,
 * ldb, ldc (elements).  beta == 0 overwrites C (NaNs in C are ignored).  With
 * AVX2 or AVX-512: rectangles of C from op(B) packed once (sgemm.h);
 * otherwise OpenBLAS on blocks of rows of C at multiples of 24 rows (fewer
 * than 48 rows: one thread).
 * Either way the result is bitwise independent of the thread count. */
int mr_cpu_gemm(struct mr_pool *pool, bool ta, bool tb, int M, int N, int K,
                float alpha, const float *A, int lda, const float *B, int ldb,
                float beta, float *C, int ldc);

/* mr_cpu_gemm with op(A) and op(B) rounded to bf16 (round to nearest
 * even) and their products summed in fp32: the matmul of `--amp bf16`,
 * on AVX512_BF16 (bgemm.h), the rounding done while packing.  K >= 1.
 * Returns MR_ENOTSUP where the CPU lacks it (mr_cpu_has_bf16_gemm). */
int mr_cpu_gemm_bf16(struct mr_pool *pool, bool ta, bool tb, int M, int N, int K,
                     float alpha, const float *A, int lda, const float *B, int ldb,
                     float beta, float *C, int ldc);

/* 1 when mr_cpu_gemm_bf16 runs here. */
int mr_cpu_has_bf16_gemm(void);

/* What computes mr_cpu_gemm here, for reports: "AVX-512 sgemm", "AVX2
 * sgemm" or "OpenBLAS". */
const char *mr_cpu_gemm_kernel(void);

/* y[M, N] = x[M, K] w[N, K]^T + b[N]; b may be NULL.  Overwrites y. */
int mr_cpu_linear_fwd(struct mr_pool *pool, float *y, const float *x,
                      const float *w, const float *b, int M, int N, int K);

/* dx[M, K] (=|+=) dy[M, N] w[N, K]. */
int mr_cpu_linear_bwd_x(struct mr_pool *pool, float *dx, const float *dy,
                        const float *w, int M, int N, int K, bool accum);

/* dw[N, K] += dy[M, N]^T x[M, K]; db[N] += column sums of dy (db may be
 * NULL). */
int mr_cpu_linear_bwd_w(struct mr_pool *pool, float *dw, float *db,
                        const float *dy, const float *x, int M, int N, int K);

/* ---- elementwise and bias ---------------------------------------------- */

/* out[n] = a[n] + b[n]; out may be a or b (residual add, in place). */
int mr_cpu_add(struct mr_pool *pool, float *out, const float *a, const float *b,
               size_t n);

/* y[N, C] += b[C] on every row. */
int mr_cpu_bias_add(struct mr_pool *pool, float *y, const float *b, int N, int C);

/* db[C] += sum over rows of dy[N, C]. */
int mr_cpu_bias_grad(struct mr_pool *pool, float *db, const float *dy, int N,
                     int C);

/* x[n] *= s. */
int mr_cpu_scale(struct mr_pool *pool, float *x, size_t n, float s);

/* ---- embedding --------------------------------------------------------- */

/* out[N, C] = table[ids[i], :] for each of the N tokens.  Overwrites out.
 * An id outside [0, V) is MR_ERANGE naming the row. */
int mr_cpu_embedding_fwd(struct mr_pool *pool, float *out, const float *table,
                         const int32_t *ids, int N, int V, int C);

/* dtable[V, C] += dout[i, :] at row ids[i] (in token order, so repeated ids
 * sum deterministically).  Split by columns. */
int mr_cpu_embedding_bwd(struct mr_pool *pool, float *dtable, const float *dout,
                         const int32_t *ids, int N, int V, int C);

/* ---- normalization ----------------------------------------------------- */

/* LLaMA RMSNorm: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps), per row of
 * x[N, C].  Saves rstd[N] for the backward (rstd may be NULL when no
 * backward follows).  Overwrites y; y may be x. */
int mr_cpu_rmsnorm_fwd(struct mr_pool *pool, float *y, float *rstd,
                       const float *x, const float *w, int N, int C, float eps);

/* Given dy[N, C], x, w and the saved rstd: dx (=|+=), dw[C] +=. */
int mr_cpu_rmsnorm_bwd(struct mr_pool *pool, float *dx, float *dw,
                       const float *dy, const float *x, const float *w,
                       const float *rstd, int N, int C, bool accum);

/* GPT-2 LayerNorm: y = (x - mean) * rstd * w + b, rstd = 1/sqrt(var + eps)
 * (biased variance).  Saves mean[N] and rstd[N] (both NULL or both set).
 * Overwrites y; y may be x. */
int mr_cpu_layernorm_fwd(struct mr_pool *pool, float *y, float *mean,
                         float *rstd, const float *x, const float *w,
                         const float *b, int N, int C, float eps);

/* dx (=|+=), dw[C] +=, db[C] +=, from dy, x, w and the saved mean, rstd. */
int mr_cpu_layernorm_bwd(struct mr_pool *pool, float *dx, float *dw, float *db,
                         const float *dy, const float *x, const float *w,
                         const float *mean, const float *rstd, int N, int C,
                         bool accum);

/* ---- rotary position embedding (Hugging Face LLaMA, rotate_half) -------- */

/* The cos/sin tables these take: mr_rope_table (common/model_config.h). */

/* x is [B, T, H, D] with `ld` elements between consecutive tokens (ld = 0
 * means H*D), rotated in place:
 *   x'[i]     = x[i] cos - x[i+D/2] sin
 *   x'[i+D/2] = x[i+D/2] cos + x[i] sin,   i < D/2,
 * at the angle of position pos[b*T + t] (pos NULL: position t).  A position
 * outside [0, P) is MR_ERANGE.  Works for q (H heads) and k (Hkv heads). */
int mr_cpu_rope_fwd(struct mr_pool *pool, float *x, const float *cos_t,
                    const float *sin_t, const int32_t *pos, int B, int T,
                    int H, int D, int P, int ld);

/* The transpose: dx from dx' in place (rotation by -angle). */
int mr_cpu_rope_bwd(struct mr_pool *pool, float *dx, const float *cos_t,
                    const float *sin_t, const int32_t *pos, int B, int T,
                    int H, int D, int P, int ld);

/* ---- causal attention (flash style, grouped-query) ---------------------- */

struct mr_attn_shape {
  int B, T;        // batch, sequence
  int H, Hkv;      // query heads, key/value heads; Hkv divides H
  int D;           // head dim
  int ldq, ldk, ldv, ldo; // elements between consecutive tokens; 0: H*D for
                          // q and o, Hkv*D for k and v (a fused qkv buffer
                          // [B, T, (H+2Hkv)*D] is q, k, v with ld = that width)
  float scale;     // score scale, usually 1/sqrt(D); 0 means 1/sqrt(D)
  int window;      // > 0: query t sees keys (t - window, t] (sliding-window
                   // attention); 0: keys [0, t].  Needs AVX2 (the matmul
                   // path); MR_ENOTSUP on the portable one
  bool bf16;       // the products of --amp bf16 on AVX512_BF16: every operand
                   // (q, k, v, do and the probabilities and score gradients
                   // between them) rounded to bf16 as it is packed, sums,
                   // softmax and lse in fp32; MR_ENOTSUP where
                   // mr_cpu_has_bf16_gemm() is 0
};

/* o = softmax(scale * q k^T, causal) v per (batch, head), query head h reading
 * kv head h / (H/Hkv).  Keys are visited in blocks with an online softmax,
 * so no T x T matrix exists (with AVX-512: the scores of 64 queries at a
 * time, one matmul each, attention_gemm.c).  Saves lse[B, H, T] (natural log-sum-exp of
 * the scaled scores of each query row) for the backward; lse may be NULL
 * when no backward follows.  Overwrites o.  Threads over (b, h, query
 * block). */
int mr_cpu_attention_fwd(struct mr_pool *pool, float *o, float *lse,
                         const float *q, const float *k, const float *v,
                         const struct mr_attn_shape *s);

/* From do, the forward inputs, its output o and lse: dq, dk, dv, all
 * OVERWRITTEN (strides as in s: ldq for dq, ldk for dk, ldv for dv, ldo for
 * do and o); they must not overlap q, k, v, do or o, but may be the three
 * parts of one fused [B, T, (H+2Hkv)*D] gradient buffer.  Scores are recomputed blockwise from lse.  Threads over
 * (b, kv head), each task owning its dk, dv and the dq of its heads, so the
 * result is deterministic. */
int mr_cpu_attention_bwd(struct mr_pool *pool, float *dq, float *dk, float *dv,
                         const float *dout, const float *q, const float *k,
                         const float *v, const float *o, const float *lse,
                         const struct mr_attn_shape *s);

/* ---- activations -------------------------------------------------------- */

/* LLaMA MLP: out[n] = silu(gate[n]) * up[n], silu(g) = g / (1 + e^-g). */
int mr_cpu_swiglu_fwd(struct mr_pool *pool, float *out, const float *gate,
                      const float *up, size_t n);

/* dgate, dup (=|+=) from dout, gate, up. */
int mr_cpu_swiglu_bwd(struct mr_pool *pool, float *dgate, float *dup,
                      const float *dout, const float *gate, const float *up,
                      size_t n, bool accum);

/* GPT-2 gelu_new: out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
 * out may be x. */
int mr_cpu_gelu_fwd(struct mr_pool *pool, float *out, const float *x, size_t n);

/* dx (=|+=) from dout and x.  dx may be dout when accum is 0. */
int mr_cpu_gelu_bwd(struct mr_pool *pool, float *dx, const float *dout,
                    const float *x, size_t n, bool accum);

/* ---- cross-entropy fused with softmax ----------------------------------- */

/* logits[N, V], targets[N]: loss[i] = lse[i] - logits[i, targets[i]] with
 * lse[i] = log sum_j exp(logits[i, j]).  A target < 0 (e.g. -100) is ignored:
 * loss 0, lse still written.  A target >= V is MR_ERANGE.  loss and lse are
 * overwritten; *n_valid (may be NULL) gets the number of counted rows. */
int mr_cpu_xent_fwd(struct mr_pool *pool, float *loss, float *lse,
                    const float *logits, const int32_t *targets, int N, int V,
                    int *n_valid);

/* dlogits[i, j] = g_i (exp(logits[i, j] - lse[i]) - [j == targets[i]]) with
 * g_i = scale * (dloss ? dloss[i] : 1), 0 for ignored rows; for the mean loss
 * pass scale = loss_scale / n_valid.  Overwrites dlogits, which may be
 * logits itself (in place: no second [N, V] buffer is needed). */
int mr_cpu_xent_bwd(struct mr_pool *pool, float *dlogits, const float *logits,
                    const float *lse, const int32_t *targets,
                    const float *dloss, float scale, int N, int V);

/* ---- optimizer ---------------------------------------------------------- */

/* struct mr_adamw: the hyper-parameters, in worker/backend/backend.h */

/* torch.optim.AdamW defaults. */
struct mr_adamw mr_adamw_defaults(void);

/* One AdamW step t (1-based) on n parameters, exactly torch's order:
 *   g = grad * grad_scale
 *   p *= 1 - lr * wd
 *   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
 *   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
 * p, m, v are updated in place; grad is read only. */
int mr_cpu_adamw_step(struct mr_pool *pool, float *p, const float *grad,
                      float *m, float *v, size_t n, const struct mr_adamw *h,
                      int64_t t);

/* *out = sum of x[i]^2 in double, over fixed 4096-element chunks summed in
 * order (so the same for any thread count).  Global grad norm =
 * sqrt(sum over tensors and ranks); clip factor min(1, max_norm/(norm+1e-6))
 * as torch.nn.utils.clip_grad_norm_, applied via mr_adamw.grad_scale. */
int mr_cpu_sumsq(struct mr_pool *pool, double *out, const float *x, size_t n);

/* ---- mixed precision ----------------------------------------------------- */

/* Bulk conversions (round to nearest even; common/dtype.h semantics). */
int mr_cpu_to_bf16(struct mr_pool *pool, uint16_t *dst, const float *src, size_t n);
/* dst[i] = src[i] rounded to bf16 (nearest even) and back, across the pool:
 * the operands of a product that --amp bf16 rounds (dst may be src). */
int mr_cpu_round_bf16(struct mr_pool *pool, float *dst, const float *src, size_t n);
int mr_cpu_from_bf16(struct mr_pool *pool, float *dst, const uint16_t *src, size_t n);
int mr_cpu_to_f16(struct mr_pool *pool, uint16_t *dst, const float *src, size_t n);
int mr_cpu_from_f16(struct mr_pool *pool, float *dst, const uint16_t *src, size_t n);

/* *finite = no element of x is inf or NaN (the dynamic loss scaling check:
 * when false, skip the step and halve the scale).  f32, and 16-bit data
 * (dtype MR_F16 or MR_BF16, as in common/dtype.h). */
int mr_cpu_all_finite(struct mr_pool *pool, bool *finite, const float *x, size_t n);
int mr_cpu_all_finite_h16(struct mr_pool *pool, bool *finite, const uint16_t *x,
                          size_t n, int dtype);

#endif
