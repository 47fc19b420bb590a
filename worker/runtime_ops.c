/* runtime_ops.c - the runtime's instructions and the optimizer step. */
#include <math.h>
#include <stdlib.h>

#include "common/error.h"
#include "common/log.h"
#include "common/test_hooks.h"
#include "compiler/ops.h"
#include "worker/runtime_internal.h"

/* ---- instructions ---- */

/* Token inputs of micro-batch `micro`: this rank's rows of the flattened
 * [micro_seqs * T] inputs; sequence s of micro-batch m is row m *
 * micro_seqs + s of the step's global batch (or of evaluation batch
 * eval_batch when >= 0).  With micro-batches set per data rank, the
 * rank's micro-batch m is slice first_slice + m of the step's batch
 * (struct mr_rank_program), its sequences in order. */
int mr__rt_load(struct mr_runtime *rt, const struct mr_pass *ps, int slot, int64_t step,
                int micro, int64_t eval_batch) {
  const struct mr_lowered *L = rt->L;
  const struct mr_model *m = &L->model;
  int64_t T = m->seq;
  int64_t off[MR_MAX_DIMS], len[MR_MAX_DIMS];
  const struct mr_tensor *it = &m->graph.tensors[m->input_ids];
  mr_dist_local(&L->mesh, &L->dg.tensor[m->input_ids], 1, it->shape, rt->p.coord, off, len);
  int32_t seq_ids[8192], seq_lab[8192];
  int32_t *si = T <= 8192 ? seq_ids : malloc((size_t)T * sizeof *si);
  int32_t *sl = T <= 8192 ? seq_lab : malloc((size_t)T * sizeof *sl);
  if (!si || !sl)
    return MR_ENOMEM;
  int rc = 0;
  int64_t B = rt->job->train.global_batch;
  for (int64_t r = off[0]; r < off[0] + len[0] && rc == 0;) {
    int64_t s = r / T, pos = r % T, n = T - pos;
    if (r + n > off[0] + len[0])
      n = off[0] + len[0] - r;
    int64_t row = (int64_t)micro * L->lay.micro_seqs + s;
    if (L->dp_micro != NULL && eval_batch < 0) {
      int64_t per = L->lay.micro_seqs / L->lay.dp, in_slice = s - rt->p.data * per;
      if (in_slice < 0 || in_slice >= per) {
        rc = mr_error_set(MR_ENOTSUP, "runtime: micro-batches set per data-parallel rank need "
                          "the inputs split by data rank; this rank holds sequence %lld",
                          (long long)s);
        break;
      }
      row = (rt->p.first_slice + micro) * per + in_slice;
    }
    if (eval_batch < 0)
      rc = mr_tokens_batch_row(&rt->train, rt->job->train.seed, step, row, T, si, sl);
    else
      rc = mr_tokens_eval_row(rt->have_val ? &rt->val : &rt->train, eval_batch, row, B, T, si,
                              sl);
    for (int64_t i = 0; i < n; i++) {
      rt->host_ids[r - off[0] + i] = si[pos + i];
      rt->host_labels[r - off[0] + i] = sl[pos + i];
      rt->host_pos[r - off[0] + i] = (int32_t)(pos + i);
    }
    r += n;
  }
  if (si != seq_ids)
    free(si);
  if (sl != seq_lab)
    free(sl);
  MR_TRY(rc);
  int ts[3] = {m->input_ids, m->labels, m->position_ids};
  const int32_t *src[3] = {rt->host_ids, rt->host_labels, rt->host_pos};
  for (int i = 0; i < 3; i++) {
    if (ts[i] < 0)
      continue;
    void *dst = mr__rt_buf(rt, ts[i], ps, slot);
    if (dst != NULL)
      MR_TRY(rt->be->ops->copy(rt->be, NULL, dst, src[i], (size_t)len[0] * sizeof(int32_t),
                               MR_COPY_HOST_TO_DEVICE));
  }
  return 0;
}

int mr__rt_kernel(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps) {
  const struct mr_graph *lg = &rt->p.local;
  const struct mr_op *op = &lg->ops[in->op];
  void *bufs[MR_OP_MAX_IN + MR_OP_MAX_OUT];
  int n = 0;
  for (int j = 0; j < op->n_out; j++)
    if (rt->p.buf[op->out[j]].numel == 0)
      return 0; /* an empty shard computes nothing */
  for (int j = 0; j < op->n_in; j++)
    bufs[n++] = op->in[j] >= 0 ? mr__rt_buf(rt, op->in[j], ps, in->slot) : NULL;
  for (int j = 0; j < op->n_out; j++)
    bufs[n++] = mr__rt_buf(rt, op->out[j], ps, in->slot);
  /* a parameter gradient written into its accumulator: the first
   * micro-batch overwrites it, the later ones add into it */
  struct mr_op adding;
  if (in->micro > 0) {
    unsigned bits = 0;
    for (int j = 0; j < op->n_out; j++)
      if (rt->p.buf[op->out[j]].region == MR_REG_ACC)
        bits |= 1u << j;
    if ((bits & ~mr_op_def(op->kind)->accum_outs) != 0) /* the lowering's promise */
      return mr_error_set(MR_EINVAL, "op %d (%s) cannot add into its output %s", in->op,
                          mr_op_def(op->kind)->name, lg->tensors[op->out[0]].name);
    if (bits != 0) {
      adding = *op;
      adding.accum_out = bits;
      op = &adding;
    }
  }
  mr_kernel_fn fn = mr_op_kernel(op->kind, rt->be->ops->registry);
  if (fn == NULL)
    return mr_error_set(MR_ENOTSUP, "op %s has no %s kernel", mr_op_def(op->kind)->name,
                        rt->be->ops->name);
  double t0 = mr_hook_kernel_begin(&rt->slow);
  int rc = fn(rt->be->ops->kernel_ctx(rt->be), lg, op, bufs);
  mr_hook_kernel_end(&rt->slow, t0);
  if (rc < 0)
    MR_ERROR("exec", "op %d (%s -> %s): %s", in->op, mr_op_def(op->kind)->name,
             lg->tensors[op->out[0]].name, mr_error_message());
  return rc;
}

/* Runs plan (edge e's, or part of it) on e's tensor from src to dst; the
 * time it waits counts as communication wait. */
static int run_edge(struct mr_runtime *rt, const struct mr_reshard_edge *e,
                    const struct mr_reshard_plan *plan, const void *src, void *dst) {
  const struct mr_tensor *t = &rt->L->model.graph.tensors[e->tensor];
  rt->rs.wait_s = 0;
  int rc = mr_reshard_run(&rt->rs, plan, &e->src, t->ndim, t->shape, t->dtype, src, dst);
  rt->comm_wait_s += rt->rs.wait_s;
  return rc;
}

int mr__rt_reshard(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps) {
  const struct mr_reshard_edge *e = &rt->L->dg.edges[in->edge];
  return run_edge(rt, e, &e->plan, mr__rt_buf(rt, e->tensor, ps, in->slot),
                  mr__rt_buf(rt, in->tensor, ps, in->slot));
}

/* Phantom slot `micro`'s landing blocks in the ZeRO region (after the
 * passes' own set); slot n_slots is the zeros they reduce-scatter. */
static char *phantom_landing(const struct mr_runtime *rt, int micro) {
  return rt->zero_tmp + rt->p.zero_landing_bytes * (1 + micro - rt->p.n_micro);
}

/* This micro-batch's gradient of a parameter is final: accumulate it (the
 * mean over micro-batches), and on the last micro-batch start its
 * synchronisation; under ZeRO-2/3 reduce-scatter it now — zeros in a
 * phantom slot (past this rank's micro-batches: struct
 * mr_rank_program.n_slots), whose gradient nothing computed. */
int mr__rt_grad(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps) {
  const struct mr_lowered *L = rt->L;
  const struct mr_layout *lay = &L->lay;
  int pi = rt->p.param_of[in->tensor];
  const struct mr_param_plan *pp = &rt->p.params[pi];
  int gt = L->model.graph.tensors[in->tensor].grad;
  float *gr = mr__rt_buf(rt, gt, ps, in->slot);
  float *acc = (float *)(rt->acc + pp->acc_offset);
  struct mr_backend *be = rt->be;
  struct mr_comm_req *req;
  /* the gradient's synchronisation, if any */
  const struct mr_reshard_edge *sync = in->edge >= 0 ? &L->dg.edges[in->edge] : NULL;
  const struct mr_reshard_plan *plan = sync != NULL ? &sync->plan : NULL;
  if (in->micro >= rt->p.n_micro) { /* a phantom: zeros, landing apart, summed at sync_wait */
    rt->phantom_grad[pi] = 1;
    MR_TRY(mr_comm_reduce_scatter(rt->data_g, phantom_landing(rt, rt->p.n_slots),
                                  phantom_landing(rt, in->micro) + pp->zero_tmp_offset,
                                  (size_t)pp->block, MR_F32, MR_RED_SUM, &req));
    return mr__rt_push_req(rt, rt->step_req, &rt->n_step_req, req, pi);
  }
  if (pp->off_data) { /* to the parameter's shard first (slices, sums off data) */
    struct mr_reshard_plan off = *plan;
    off.n_steps = 0;
    for (int s = 0; s < plan->n_steps; s++)
      if (plan->steps[s].mesh_dim != L->data_dim)
        off.steps[off.n_steps++] = plan->steps[s];
    MR_TRY(run_edge(rt, sync, &off, gr, rt->gstage));
    gr = (float *)rt->gstage;
  }
  if (lay->zero >= 2) {
    int64_t padded = pp->block * lay->dp;
    if (padded > pp->numel)
      MR_TRY(be->ops->memset(be, NULL, gr + pp->numel, 0, (size_t)(padded - pp->numel) * 4));
    MR_TRY(mr_comm_reduce_scatter(rt->data_g, gr, rt->zero_tmp + pp->zero_tmp_offset,
                                  (size_t)pp->block, MR_F32, MR_RED_SUM, &req));
    MR_TRY(mr__rt_push_req(rt, rt->pass_req, &rt->n_pass_req, req, pi));
    if (pp->off_data) /* the staging buffer is needed again: land it now */
      return mr__rt_grad_wait(rt, in);
    return 0;
  }
  int last = in->micro == rt->p.n_micro - 1;
  float scale = last ? 1.0f / (float)lay->n_micro : 1.0f; /* the mean over the whole step's */
  if (gr != acc) /* unless the op wrote the accumulator itself */
    MR_TRY(be->ops->axpby(be, acc, gr, in->micro == 0 ? 0.0f : scale, scale,
                          (size_t)pp->numel));
  else if (last && lay->n_micro > 1) /* it added every micro-batch's: the mean */
    MR_TRY(be->ops->axpby(be, acc, acc, 0.0f, scale, (size_t)pp->numel));
  if (!last || plan == NULL || rt->data_g == NULL)
    return 0;
  /* the data-parallel sum, left in flight (or waited at once, to measure
   * what the overlap hides) */
  for (int s = 0; s < plan->n_steps; s++) {
    const struct mr_reshard_step *st = &plan->steps[s];
    if (st->mesh_dim != L->data_dim || st->group_size <= 1)
      continue;
    MR_TRY(mr_comm_all_reduce(rt->data_g, acc, acc, (size_t)pp->numel, MR_F32, MR_RED_SUM, &req));
    if (!rt->overlap)
      return mr__rt_wait_req(rt, req);
    return mr__rt_push_req(rt, rt->step_req, &rt->n_step_req, req, pi);
  }
  return 0;
}

/* ZeRO-2/3: the pass's reduce-scatters landed; add the blocks to the
 * accumulators. */
int mr__rt_grad_wait(struct mr_runtime *rt, const struct mr_ins *in) {
  const struct mr_layout *lay = &rt->L->lay;
  int n = rt->n_pass_req;
  int list[MAX_PENDING];
  for (int i = 0; i < n; i++)
    list[i] = rt->pass_req[i].param;
  MR_TRY(mr__rt_wait_all(rt, rt->pass_req, &rt->n_pass_req));
  int last = in->micro == rt->p.n_micro - 1;
  float scale = last ? 1.0f / (float)lay->n_micro : 1.0f;
  for (int i = 0; i < n; i++) {
    const struct mr_param_plan *pp = &rt->p.params[list[i]];
    MR_TRY(rt->be->ops->axpby(rt->be, (float *)(rt->acc + pp->acc_offset),
                              (const float *)(rt->zero_tmp + pp->zero_tmp_offset),
                              in->micro == 0 ? 0.0f : scale, scale, (size_t)pp->block));
  }
  return 0;
}

/* The phantom slots' reduce-scatters landed (sync_wait waited them): add
 * their blocks to the accumulators, at the step's mean scale. */
int mr__rt_phantom_sum(struct mr_runtime *rt) {
  float scale = 1.0f / (float)rt->L->lay.n_micro;
  for (int i = 0; i < rt->p.n_params && rt->p.n_slots > rt->p.n_micro; i++) {
    if (!rt->phantom_grad[i])
      continue;
    rt->phantom_grad[i] = 0;
    const struct mr_param_plan *pp = &rt->p.params[i];
    for (int m = rt->p.n_micro; m < rt->p.n_slots; m++)
      MR_TRY(rt->be->ops->axpby(rt->be, (float *)(rt->acc + pp->acc_offset),
                                (const float *)(phantom_landing(rt, m) + pp->zero_tmp_offset),
                                1.0f, scale, (size_t)pp->block));
  }
  return 0;
}

int mr__rt_send(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps) {
  const struct mr_lbuf *b = &rt->p.buf[in->tensor];
  char *slot = rt->send + ps->send_base + (int64_t)in->micro * ps->send_bytes +
               rt->p.send_off[in->tensor];
  size_t es = mr_dtype_size(rt->p.local.tensors[in->tensor].dtype);
  MR_TRY(rt->be->ops->copy2d(rt->be, slot, 0, mr__rt_buf(rt, in->tensor, ps, in->slot), 0,
                             (size_t)b->numel * es, 1));
  int peer_pipe, d, t;
  mr_lower_coords(&rt->L->lay, in->peer, &peer_pipe, &d, &t);
  struct mr_comm_req *req;
  MR_TRY(mr_comm_send(rt->pipe_g, slot, (size_t)b->numel, rt->p.local.tensors[in->tensor].dtype,
                      peer_pipe, &req));
  return mr__rt_push_req(rt, rt->step_req, &rt->n_step_req, req, -1);
}

int mr__rt_recv(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps) {
  const struct mr_lbuf *b = &rt->p.buf[in->tensor];
  int peer_pipe, d, t;
  mr_lower_coords(&rt->L->lay, in->peer, &peer_pipe, &d, &t);
  struct mr_comm_req *req;
  MR_TRY(mr_comm_recv(rt->pipe_g, mr__rt_buf(rt, in->tensor, ps, in->slot), (size_t)b->numel,
                      rt->p.local.tensors[in->tensor].dtype, peer_pipe, &req));
  return mr__rt_wait_req(rt, req);
}

/* The loss gradient: the loss scale where the loss is a whole value or
 * the first summand of a Partial(sum) one, zero on the other summands. */
int mr__rt_seed(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps) {
  const struct mr_dist_attr *da = &rt->L->dg.tensor[in->tensor];
  float v = (float)rt->scaler.scale;
  for (int d = 0; d < da->ndim; d++)
    if (da->p[d].kind == MR_PARTIAL && da->p[d].reduce == MR_REDUCE_SUM && rt->p.coord[d] != 0)
      v = 0.0f;
  return rt->be->ops->copy(rt->be, NULL, mr__rt_buf(rt, in->tensor, ps, in->slot), &v, sizeof v,
                           MR_COPY_HOST_TO_DEVICE);
}

int mr__rt_gather(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps) {
  const struct mr_param_plan *pp = &rt->p.params[rt->p.param_of[in->tensor]];
  struct mr_comm_req *req;
  void *full = mr__rt_buf(rt, in->tensor, ps, in->slot);
  if (rt->data_g == NULL)
    return rt->be->ops->copy2d(rt->be, full, 0, rt->param + pp->store_offset, 0,
                               (size_t)pp->numel * 4, 1);
  MR_TRY(mr_comm_all_gather(rt->data_g, rt->param + pp->store_offset, full, (size_t)pp->block,
                            NULL, MR_F32, &req));
  return mr__rt_wait_req(rt, req);
}

/* One float all-reduced over gs[0..n) in turn (NULL: a group of one),
 * with ops[i]. */
static int allreduce_seq(struct mr_runtime *rt, int n, struct mr_comm_group *const *gs,
                         const enum mr_red_op *ops, float *v) {
  float *dev = rt->scalar;
  int rc = rt->be->ops->copy(rt->be, NULL, dev, v, sizeof *v, MR_COPY_HOST_TO_DEVICE);
  for (int i = 0; i < n && rc == 0; i++) {
    if (gs[i] == NULL)
      continue;
    struct mr_comm_req *req;
    rc = mr_comm_all_reduce(gs[i], dev, dev, 1, MR_F32, ops[i], &req);
    if (rc == 0)
      rc = mr__rt_wait_req(rt, req);
  }
  if (rc == 0)
    rc = rt->be->ops->copy(rt->be, NULL, v, dev, sizeof *v, MR_COPY_DEVICE_TO_HOST);
  return rc;
}

/* Sum of one float over the model, data and pipe groups. */
int mr__rt_allreduce_all(struct mr_runtime *rt, float *v, enum mr_red_op op) {
  struct mr_comm_group *gs[3] = {rt->model_g, rt->data_g, rt->pipe_g};
  enum mr_red_op ops[3] = {op, op, op};
  return allreduce_seq(rt, 3, gs, ops, v);
}

int mr__rt_optimizer(struct mr_runtime *rt, int64_t step, struct mr_step_report *r) {
  const struct mr_lowered *L = rt->L;
  const struct mr_layout *lay = &L->lay;
  struct mr_backend *be = rt->be;
  if (step == rt->inject_step && rt->p.n_params > 0) { /* test hook: an overflow */
    float inf = INFINITY;
    MR_TRY(be->ops->copy(be, NULL, rt->acc + rt->p.params[0].acc_offset, &inf, sizeof inf,
                         MR_COPY_HOST_TO_DEVICE));
  }
  double ss = 0;
  for (int i = 0; i < rt->p.n_params; i++) {
    const struct mr_param_plan *pp = &rt->p.params[i];
    if (!pp->norm || pp->len == 0)
      continue;
    const float *acc = (const float *)(rt->acc + pp->acc_offset) + (lay->zero == 1 ? pp->begin : 0);
    double part;
    MR_TRY(be->ops->sumsq(be, acc, (size_t)pp->len, &part));
    ss += part;
  }
  float ssf = (float)ss;
  MR_TRY(mr__rt_allreduce_all(rt, &ssf, MR_RED_SUM));
  ss = ssf;
  double scale = rt->scaler.scale;
  r->loss_scale = scale;
  r->lr = mr_lr_at(&rt->job->train, step - 1);
  r->grad_norm = sqrt(ss) / scale;
  r->skipped = mr_loss_scaler_update(&rt->scaler, !isfinite(ss));
  if (r->skipped) {
    if (rt->p.rank == 0)
      MR_WARN("train", "step %lld: gradients not finite at loss scale %g; update skipped "
              "(%lld so far), scale now %g", (long long)step, scale,
              (long long)rt->scaler.skipped, rt->scaler.scale);
    return 0;
  }
  struct mr_adamw h = rt->adamw;
  h.lr = (float)r->lr;
  h.grad_scale = (float)(mr_clip_factor(r->grad_norm, rt->job->train.grad_clip) / scale);
  int64_t opt_step = step - rt->scaler.skipped;
  for (int i = 0; i < rt->p.n_params; i++) {
    const struct mr_param_plan *pp = &rt->p.params[i];
    if (pp->len == 0 || pp->replica_of >= 0)
      continue;
    float *param = (float *)(rt->param + pp->store_offset) + (lay->zero >= 3 ? 0 : pp->begin);
    const float *acc = (const float *)(rt->acc + pp->acc_offset) + (lay->zero == 1 ? pp->begin : 0);
    float *m = (float *)(rt->optim + pp->state_offset);
    float *v = (float *)((char *)m + mr_param_moment_stride(pp));
    if (rt->off_pool == NULL) {
      MR_TRY(be->ops->adamw(be, param, acc, m, v, (size_t)pp->len, &h, opt_step));
      continue;
    }
    /* offloaded on a device: the block and its gradient to the host, the
     * update there, the block back */
    MR_TRY(be->ops->copy(be, NULL, rt->off_param, param, (size_t)pp->len * 4,
                         MR_COPY_DEVICE_TO_HOST));
    MR_TRY(be->ops->copy(be, NULL, rt->off_grad, acc, (size_t)pp->len * 4,
                         MR_COPY_DEVICE_TO_HOST));
    MR_TRY(be->ops->synchronize(be, NULL));
    MR_TRY(mr_cpu_adamw_step(rt->off_pool, rt->off_param, rt->off_grad, m, v, (size_t)pp->len,
                             &h, opt_step));
    MR_TRY(be->ops->copy(be, NULL, param, rt->off_param, (size_t)pp->len * 4,
                         MR_COPY_HOST_TO_DEVICE));
    MR_TRY(be->ops->synchronize(be, NULL));
  }
  if (lay->zero == 1 || lay->zero == 2) /* every rank updated its block: gather */
    for (int i = 0; i < rt->p.n_params; i++) {
      const struct mr_param_plan *pp = &rt->p.params[i];
      if (pp->replica_of >= 0)
        continue;
      char *full = rt->param + pp->store_offset;
      char *mine = lay->zero == 2 ? rt->zero_tmp + pp->zero_tmp_offset : rt->zero_tmp;
      MR_TRY(be->ops->memset(be, NULL, mine, 0, (size_t)pp->block * 4));
      MR_TRY(be->ops->copy2d(be, mine, 0, full + pp->begin * 4, 0, (size_t)pp->len * 4, 1));
      struct mr_comm_req *req;
      MR_TRY(mr_comm_all_gather(rt->data_g, mine, full, (size_t)pp->block, NULL, MR_F32, &req));
      MR_TRY(mr__rt_wait_req(rt, req));
    }
  return 0;
}

/* Tied parameters: each owner sends its updated values to the stages
 * holding copies, which receive them (under ZeRO-3 its block, to the copy
 * at the same data coordinate). */
int mr__rt_param_sync(struct mr_runtime *rt) {
  int rc = 0;
  for (int i = 0; i < rt->p.n_params && rc == 0; i++) {
    const struct mr_param_plan *pp = &rt->p.params[i];
    void *buf = rt->param + pp->store_offset;
    size_t n = (size_t)mr_param_sync_count(&rt->L->lay, pp);
    struct mr_comm_req *req;
    int peer, d, t;
    if (pp->replica_of >= 0) {
      mr_lower_coords(&rt->L->lay, pp->replica_of, &peer, &d, &t);
      rc = mr_comm_recv(rt->pipe_g, buf, n, MR_F32, peer, &req);
      if (rc == 0)
        rc = mr__rt_wait_req(rt, req);
    }
    for (int k = 0; k < pp->n_replicas && rc == 0; k++) {
      mr_lower_coords(&rt->L->lay, pp->replicas[k], &peer, &d, &t);
      rc = mr_comm_send(rt->pipe_g, buf, n, MR_F32, peer, &req);
      if (rc == 0)
        rc = mr__rt_push_req(rt, rt->step_req, &rt->n_step_req, req, i);
    }
  }
  int r2 = mr__rt_wait_all(rt, rt->step_req, &rt->n_step_req);
  return rc < 0 ? rc : r2;
}

/* The loss made whole once a step (mr_lowered_loss_deferred): the loss of
 * a step (or an evaluation batch: lay.n_micro micro-batches on every rank)
 * from the sum of this rank's partial losses, the loss edge's steps run
 * once on it (all-reduces over its mesh dims, scalings), over the batch's
 * micro-batches.  Elsewhere (a loss made whole each micro-batch, and on
 * stages without the loss) *loss is left as it is. */
int mr__rt_step_loss(struct mr_runtime *rt, double partial_sum, float *loss) {
  const struct mr_lowered *L = rt->L;
  if (!mr_lowered_loss_deferred(L) || rt->p.pipe != L->lay.pp - 1)
    return 0;
  int le = mr_lowered_loss_edge(L);
  float v = (float)partial_sum;
  for (int s = 0; le >= 0 && s < L->dg.edges[le].plan.n_steps; s++) {
    const struct mr_reshard_step *st = &L->dg.edges[le].plan.steps[s];
    if (st->kind == MR_RS_SCALE) {
      v *= (float)st->factor;
      continue;
    }
    struct mr_comm_group *g = st->mesh_dim == L->data_dim ? rt->data_g
                              : st->mesh_dim == L->model_dim ? rt->model_g : NULL;
    enum mr_red_op op = mr_reshard_red_op(st->op);
    if (st->group_size > 1)
      MR_TRY(allreduce_seq(rt, 1, &g, &op, &v));
  }
  *loss = v / (float)L->lay.n_micro;
  return 0;
}

/* The loss of the last stage to every stage. */
int mr__rt_share_loss(struct mr_runtime *rt, float *loss) {
  if (rt->pipe_g == NULL)
    return 0;
  float *dev = rt->scalar;
  int rc = rt->be->ops->copy(rt->be, NULL, dev, loss, sizeof *loss, MR_COPY_HOST_TO_DEVICE);
  struct mr_comm_req *req;
  if (rc == 0)
    rc = mr_comm_broadcast(rt->pipe_g, dev, 1, MR_F32, rt->L->lay.pp - 1, &req);
  if (rc == 0)
    rc = mr__rt_wait_req(rt, req);
  if (rc == 0)
    rc = rt->be->ops->copy(rt->be, NULL, loss, dev, sizeof *loss, MR_COPY_DEVICE_TO_HOST);
  return rc;
}

