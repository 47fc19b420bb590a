/* exec.h - runs a graph on the CPU device backend.
 *
 * Memory is planned before anything runs: parameters, their gradients,
 * optimizer state and inputs each get their own persistent buffer; every
 * other tensor lives in one arena from the op that produces it to its last
 * reader, placed first-fit, so the arena's size — and with it the peak
 * memory of a step — is known up front.  A tensor nobody reads stays live
 * to the end of the graph (the loss, a test's outputs). */
#ifndef MR_EXEC_H
#define MR_EXEC_H

#include <stdint.h>

#include "compiler/graph.h"
#include "worker/exec_extra.h"

struct mr_exec {
  const struct mr_graph *g;     // borrowed; must outlive the executor
  void **buf;                   // [n_tensors] pointer per tensor
  int64_t *offset;              // [n_tensors] arena offset in bytes, -1: own
  void *arena;
  uint64_t arena_bytes;
  uint64_t persistent_bytes;    // parameters, gradients, inputs
  struct mr_cpu_ctx cpu;
  double *op_seconds;           // [n_ops] accumulated time per op, or NULL
};

/* Plans and allocates buffers for g (every tensor, zero-filled).  threads
 * is the compute threads, amp the rounding mode.  Returns 0 or MR_ENOMEM /
 * MR_ENOTSUP (an op without a CPU kernel). */
int mr_exec_init(struct mr_exec *x, const struct mr_graph *g, int threads,
                 enum mr_amp_mode amp);

/* Frees everything the executor owns; a zeroed executor is fine. */
void mr_exec_close(struct mr_exec *x);

/* Runs ops [from, to) in order.  Returns 0 or the failing kernel's error,
 * with a message naming the op. */
int mr_exec_run(struct mr_exec *x, int from, int to);

/* Buffer of tensor id (float, or int32 for ids). */
static inline void *mr_exec_buf(const struct mr_exec *x, int id) {
  return x->buf[id];
}

/* Turns per-op timing (x->op_seconds) on or off (resetting it). */
int mr_exec_profile(struct mr_exec *x, int on);

/* Planned peak bytes: persistent buffers plus the arena. */
uint64_t mr_exec_peak_bytes(const struct mr_exec *x);

#endif
