/* host_symbols.c - the functions of meshrun that the CUDA module calls.
 *
 * The module links nothing of meshrun's and resolves these against the
 * executable that loads it (linked with --export-dynamic).  Taking their
 * addresses here keeps each of them in every executable that links this
 * file, whatever else it uses; a function the module starts to use must be
 * added here, or loading the module fails naming it (the gpu_module test
 * loads it on every machine). */
#include "common/dtype.h"
#include "common/error.h"
#include "common/log.h"
#include "compiler/ops.h"
#include "common/tunable.h"
#include "worker/comm/comm.h"

typedef void (*mr_any_fn)(void);

/* referenced, never called */
__attribute__((used)) static const mr_any_fn module_needs[] = {
    (mr_any_fn)mr_error_set,    (mr_any_fn)mr_error_message,
    (mr_any_fn)mr__error_trace, (mr_any_fn)mr_strerror,
    (mr_any_fn)mr_log,          (mr_any_fn)mr_log_enabled,
    (mr_any_fn)mr_tunable_int,  (mr_any_fn)mr_tunable_str,
    (mr_any_fn)mr_op_set_kernel, (mr_any_fn)mr_tensor_numel,
    (mr_any_fn)mr_dtype_size,   (mr_any_fn)mr_dtype_name,
    (mr_any_fn)mr_comm_cpu_ops, (mr_any_fn)mr_comm_stopping,
};
