/* exec.c - buffer planning and the op loop. */
#include "worker/exec.h"


#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/error.h"
#include "compiler/fit.h"
#include "common/log.h"
#include "compiler/ops.h"

#define ALIGN 64

static int persistent(const struct mr_graph *g, int id) {
  enum mr_tensor_role r = g->tensors[id].role;
  return r == MR_ROLE_PARAM || r == MR_ROLE_GRAD || r == MR_ROLE_OPT_STATE ||
         r == MR_ROLE_INPUT || id == g->loss;
}

int mr_exec_init(struct mr_exec *x, const struct mr_graph *g, int threads,
                 enum mr_amp_mode amp) {
  memset(x, 0, sizeof *x);
  x->g = g;
  mr_cpu_kernels_register();
  for (int i = 0; i < g->n_ops; i++)
    if (!mr_op_kernel(g->ops[i].kind, MR_BACKEND_CPU))
      return mr_error_set(MR_ENOTSUP, "op %s has no CPU kernel",
                          mr_op_def(g->ops[i].kind)->name);
  int nt = g->n_tensors, rc = mr_cpu_ctx_init(&x->cpu, threads, amp);
  if (rc < 0)
    return rc;
  rc = MR_ENOMEM;
  int *last = malloc((size_t)nt * sizeof *last);
  struct mr_fit fit = {malloc((size_t)(nt + 1) * sizeof(struct mr_fit_live)), 0};
  x->buf = calloc((size_t)nt, sizeof *x->buf);
  x->offset = malloc((size_t)nt * sizeof *x->offset);
  if (!last || !fit.lv || !x->buf || !x->offset)
    goto out;
  for (int i = 0; i < nt; i++) {
    last[i] = -1;
    x->offset[i] = -1;
  }
  for (int i = 0; i < g->n_ops; i++)
    for (int j = 0; j < g->ops[i].n_in; j++)
      if (g->ops[i].in[j] >= 0)
        last[g->ops[i].in[j]] = i;
  int64_t high = 0;
  for (int i = 0; i < g->n_ops; i++) {
    const struct mr_op *op = &g->ops[i];
    for (int j = 0; j < op->n_out; j++) {
      int t = op->out[j];
      if (persistent(g, t) || x->offset[t] >= 0)
        continue;
      int64_t size = (mr_tensor_bytes(&g->tensors[t]) + ALIGN - 1) / ALIGN * ALIGN;
      x->offset[t] = mr_fit_place(&fit, size, t);
      if (x->offset[t] + size > high)
        high = x->offset[t] + size;
      if (last[t] < 0)
        last[t] = g->n_ops; /* nobody reads it: keep it */
    }
    for (int j = 0; j < op->n_in; j++) {
      int t = op->in[j];
      if (t >= 0 && last[t] == i && x->offset[t] >= 0)
        mr_fit_release(&fit, t);
    }
  }
  x->arena_bytes = (uint64_t)high;
  if (high > 0 && !(x->arena = aligned_alloc(ALIGN, (size_t)high)))
    goto out;
  if (high > 0)
    memset(x->arena, 0, (size_t)high);
  for (int i = 0; i < nt; i++) {
    if (x->offset[i] >= 0) {
      x->buf[i] = (char *)x->arena + x->offset[i];
      continue;
    }
    size_t bytes = (size_t)mr_tensor_bytes(&g->tensors[i]);
    size_t al = (bytes + ALIGN - 1) / ALIGN * ALIGN;
    if (!(x->buf[i] = aligned_alloc(ALIGN, al)))
      goto out;
    memset(x->buf[i], 0, al);
    x->persistent_bytes += al;
  }
  rc = 0;
out:
  free(last);
  free(fit.lv);
  if (rc < 0)
    mr_exec_close(x);
  return rc;
}

void mr_exec_close(struct mr_exec *x) {
  if (x->buf && x->offset)
    for (int i = 0; i < x->g->n_tensors; i++)
      if (x->offset[i] < 0)
        free(x->buf[i]);
  free(x->buf);
  free(x->offset);
  free(x->arena);
  free(x->op_seconds);
  mr_cpu_ctx_close(&x->cpu);
  memset(x, 0, sizeof *x);
}

int mr_exec_run(struct mr_exec *x, int from, int to) {
  const struct mr_graph *g = x->g;
  void *bufs[MR_OP_MAX_IN + MR_OP_MAX_OUT];
  for (int i = from; i < to && i < g->n_ops; i++) {
    const struct mr_op *op = &g->ops[i];
    int n = 0;
    for (int j = 0; j < op->n_in; j++)
      bufs[n++] = op->in[j] >= 0 ? x->buf[op->in[j]] : NULL;
    for (int j = 0; j < op->n_out; j++)
      bufs[n++] = x->buf[op->out[j]];
    double t0 = x->op_seconds ? mr_clock_s() : 0;
    int rc = mr_op_kernel(op->kind, MR_BACKEND_CPU)(&x->cpu, g, op, bufs);
    if (rc < 0) {
      MR_ERROR("exec", "op %d (%s -> %s): %s", i, mr_op_def(op->kind)->name,
               g->tensors[op->out[0]].name, mr_error_message());
      return rc;
    }
    if (x->op_seconds)
      x->op_seconds[i] += mr_clock_s() - t0;
  }
  return 0;
}

int mr_exec_profile(struct mr_exec *x, int on) {
  free(x->op_seconds);
  x->op_seconds = NULL;
  if (on && !(x->op_seconds = calloc((size_t)x->g->n_ops, sizeof(double))))
    return MR_ENOMEM;
  return 0;
}

uint64_t mr_exec_peak_bytes(const struct mr_exec *x) {
  return x->persistent_bytes + x->arena_bytes;
}
