/* exec_extra.h - CPU kernels for the registered ops, bound into the op
 * registry by mr_cpu_kernels_register().
 *
 * Every kernel reads float32 (int32 for ids and targets) buffers laid out
 * row-major as the op's tensors and overwrites its outputs.  Matmuls go
 * through OpenBLAS.  Under mixed precision (ctx->amp) the operands of every
 * matmul and of attention are rounded to bf16 or fp16 first, as a GPU would
 * store them, and accumulate in float32. */
#ifndef MR_EXEC_EXTRA_H
#define MR_EXEC_EXTRA_H

#include <stddef.h>

enum mr_amp_mode { MR_AMP_NONE = 0, MR_AMP_ROUND_BF16 = 1, MR_AMP_ROUND_F16 = 2 };

struct mr_cpu_ctx {
  enum mr_amp_mode amp;
  int threads;            // matmul row split; 1 = none
  float *scratch;         // grown on demand, owned
  size_t scratch_floats;
};

/* Binds every CPU kernel into the registry; idempotent. */
void mr_cpu_kernels_register(void);

/* Frees the context's scratch. */
void mr_cpu_ctx_close(struct mr_cpu_ctx *ctx);

#endif
