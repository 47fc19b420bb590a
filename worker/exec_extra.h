/* exec_extra.h - binds the registry's ops to the CPU backend's kernels
 * (worker/backend/cpu/kernels.h), adapting tensor shapes to kernel
 * arguments, and holds the few ops that need no kernel of their own
 * (split3 / concat3 column copies).
 *
 * Under mixed precision (ctx->amp) the operands of every matmul and of
 * attention are rounded to bf16 or fp16 first (round to nearest even), as
 * a GPU would store them, and the kernels accumulate in float32. */
#ifndef MR_EXEC_EXTRA_H
#define MR_EXEC_EXTRA_H

#include <stddef.h>

struct mr_pool;

enum mr_amp_mode { MR_AMP_NONE = 0, MR_AMP_ROUND_BF16 = 1, MR_AMP_ROUND_F16 = 2 };

struct mr_cpu_ctx {
  enum mr_amp_mode amp;
  struct mr_pool *pool;   // owned
  float *scratch;         // grown on demand, owned
  size_t scratch_floats;
};

/* Binds every CPU kernel into the registry; idempotent. */
void mr_cpu_kernels_register(void);

/* Starts the context's thread pool (threads >= 1).  Returns 0 or an error. */
int mr_cpu_ctx_init(struct mr_cpu_ctx *ctx, int threads, enum mr_amp_mode amp);

/* Frees the pool and scratch; a zeroed context is fine. */
void mr_cpu_ctx_close(struct mr_cpu_ctx *ctx);

#endif
