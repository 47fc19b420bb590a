/* program.c - lowering a data-parallel training step to a rank program. */
#include "common/program.h"

#include <stdlib.h>
#include <string.h>

#include "common/autodiff.h"
#include "common/error.h"
#include "common/ops.h"

struct builder {
  struct mr_rank_program *p;
  int cap_ins, cap_ev;
  int rc;
};

static void emit(struct builder *b, struct mr_instr in) {
  if (b->rc < 0)
    return;
  if (b->p->n_ins == b->cap_ins) {
    int cap = b->cap_ins ? 2 * b->cap_ins : 256;
    struct mr_instr *n = realloc(b->p->ins, (size_t)cap * sizeof *n);
    if (n == NULL) {
      b->rc = MR_ENOMEM;
      return;
    }
    b->p->ins = n;
    b->cap_ins = cap;
  }
  b->p->ins[b->p->n_ins++] = in;
}

/* Adds an event on the data-parallel group and its start instruction;
 * returns the event's index (or -1 after a failure). */
static int event(struct builder *b, enum mr_comm_event_kind kind, int64_t count,
                 const char *what, int eval) {
  struct mr_rank_program *p = b->p;
  if (b->rc < 0)
    return -1;
  if (p->n_ev == b->cap_ev) {
    int cap = b->cap_ev ? 2 * b->cap_ev : 64;
    struct mr_comm_event *n = realloc(p->ev, (size_t)cap * sizeof *n);
    char **w = n != NULL ? realloc(p->what, (size_t)cap * sizeof *w) : NULL;
    if (n != NULL)
      p->ev = n;
    if (w == NULL) {
      b->rc = MR_ENOMEM;
      return -1;
    }
    p->what = w;
    b->cap_ev = cap;
  }
  int e = p->n_ev;
  p->what[e] = strdup(what);
  if (p->what[e] == NULL) {
    b->rc = MR_ENOMEM;
    return -1;
  }
  p->n_ev++;
  p->ev[e] = (struct mr_comm_event){.kind = kind, .group = p->group, .ranks = p->group_ranks,
                                    .n_ranks = p->dp, .peer = -1, .count = count,
                                    .dtype = MR_F32, .batch = -1, .what = p->what[e]};
  emit(b, (struct mr_instr){.kind = MR_INSTR_COMM_START, .comm = e, .eval = eval});
  p->ev[e].id = p->n_ins - 1;
  return e;
}

static void wait_for(struct builder *b, int e, int eval) {
  if (e >= 0)
    emit(b, (struct mr_instr){.kind = MR_INSTR_COMM_WAIT, .comm = e, .eval = eval});
}

/* The last op writing tensor t (several write a gradient that is
 * accumulated, e.g. a tied embedding's); the graph's last op if none. */
static int last_writer(const struct mr_graph *g, int t) {
  for (int o = g->n_ops - 1; o >= 0; o--)
    for (int k = 0; k < g->ops[o].n_out; k++)
      if (g->ops[o].out[k] == t)
        return o;
  return g->n_ops - 1;
}

static void forward(struct builder *b, int micro, int eval) {
  const struct mr_graph *g = &b->p->model.graph;
  emit(b, (struct mr_instr){.kind = MR_INSTR_LOAD_BATCH, .micro = micro, .eval = eval});
  for (int o = 0; o < g->n_forward_ops; o++)
    emit(b, (struct mr_instr){.kind = MR_INSTR_KERNEL, .micro = micro, .op = o, .eval = eval});
}

static void lower_step(struct builder *b) {
  struct mr_rank_program *p = b->p;
  const struct mr_graph *g = &p->model.graph;
  int sync = p->dp > 1;
  int n_params = 0;
  int *params = malloc((size_t)g->n_tensors * sizeof *params);
  int *started = calloc((size_t)g->n_tensors, sizeof *started);
  if (params == NULL || started == NULL) {
    b->rc = MR_ENOMEM;
    goto out;
  }
  for (int t = 0; t < g->n_tensors; t++)
    if (g->tensors[t].role == MR_ROLE_PARAM && g->tensors[t].grad >= 0)
      params[n_params++] = t;
  char what[160];
  for (int micro = 0; micro < p->accum; micro++) {
    forward(b, micro, 0);
    int last = micro == p->accum - 1;
    for (int o = g->n_forward_ops; o < g->n_ops; o++) {
      emit(b, (struct mr_instr){.kind = MR_INSTR_KERNEL, .micro = micro, .op = o});
      if (!last || !sync)
        continue;
      for (int i = 0; i < n_params; i++) {
        const struct mr_tensor *pt = &g->tensors[params[i]];
        if (last_writer(g, pt->grad) != o)
          continue;
        snprintf(what, sizeof what, "gradient of %s (average)", pt->name);
        started[i] = 1 + event(b, MR_CEV_ALL_REDUCE, mr_tensor_numel(pt), what, 0);
      }
    }
    if (!last)
      emit(b, (struct mr_instr){.kind = MR_INSTR_ACCUMULATE, .micro = micro});
  }
  if (p->accum > 1)
    emit(b, (struct mr_instr){.kind = MR_INSTR_ACCUMULATE, .micro = p->accum - 1});
  if (sync) {
    for (int i = 0; i < n_params; i++) {
      const struct mr_tensor *pt = &g->tensors[params[i]];
      if (started[i] == 0) {
        snprintf(what, sizeof what, "gradient of %s (average)", pt->name);
        started[i] = 1 + event(b, MR_CEV_ALL_REDUCE, mr_tensor_numel(pt), what, 0);
      }
      wait_for(b, started[i] - 1, 0);
    }
    wait_for(b, event(b, MR_CEV_ALL_REDUCE, 1, "the step's loss (average)", 0), 0);
  }
  emit(b, (struct mr_instr){.kind = MR_INSTR_OPTIMIZER});
  if (sync && p->zero_stage >= 1)
    for (int i = 0; i < n_params; i++) {
      const struct mr_tensor *pt = &g->tensors[params[i]];
      int64_t numel = mr_tensor_numel(pt);
      snprintf(what, sizeof what, "updated blocks of %s (ZeRO-1)", pt->name);
      wait_for(b, event(b, MR_CEV_ALL_GATHER, (numel + p->dp - 1) / p->dp, what, 0), 0);
    }
  /* the evaluation part, run after steps at the evaluation interval */
  for (int batch = 0; batch < p->eval_batches; batch++) {
    for (int micro = 0; micro < p->accum; micro++)
      forward(b, micro, 1);
    if (sync)
      wait_for(b, event(b, MR_CEV_ALL_REDUCE, 1, "an evaluation batch's loss (average)", 1), 1);
  }
  if (sync)
    wait_for(b, event(b, MR_CEV_ALL_REDUCE, 1, "checkpoint now? (agreement)", 0), 0);
  emit(b, (struct mr_instr){.kind = MR_INSTR_STEP_END});
  /* the communication of a step without evaluation */
  if (b->rc == 0 && !(p->ev_plain = malloc((size_t)(p->n_ev + 1) * sizeof *p->ev_plain)))
    b->rc = MR_ENOMEM;
  for (int e = 0; b->rc == 0 && e < p->n_ev; e++)
    if (!p->ins[p->ev[e].id].eval)
      p->ev_plain[p->n_ev_plain++] = p->ev[e];
out:
  free(params);
  free(started);
}

int mr_program_lower(const struct mr_job *job, int world, int rank,
                     struct mr_rank_program *p) {
  memset(p, 0, sizeof *p);
  const struct mr_strategy_hint *h = &job->strategy;
  if ((h->tp > 1) || (h->pp > 1))
    return mr_error_set(MR_ENOTSUP, "%s: strategy: this lowering covers data parallelism, "
                        "ZeRO-1 and accumulation (tensor_parallel.degree %d, "
                        "pipeline_parallel.degree %d)", job->path ? job->path : "job",
                        h->tp, h->pp);
  if (world < 1 || rank < 0 || rank >= world)
    return mr_error_set(MR_EINVAL, "rank %d of a world of %d", rank, world);
  int accum = h->grad_accum_steps > 1 ? h->grad_accum_steps : 1;
  if (job->train.global_batch % ((int64_t)world * accum) != 0)
    return mr_error_set(MR_EINVAL,
                        "%s: train.global_batch (%lld) must be a multiple of the data-parallel "
                        "degree (%d) times strategy.gradient_accumulation_steps (%d)",
                        job->path ? job->path : "job", (long long)job->train.global_batch,
                        world, accum);
  p->rank = rank;
  p->world = world;
  p->dp = world;
  p->dp_rank = rank;
  p->accum = accum;
  p->zero_stage = h->zero_stage > 0 ? h->zero_stage : 0;
  p->micro_rows = job->train.global_batch / world / accum;
  p->eval_batches = job->train.eval_interval_steps <= 0 ? 0
                    : job->train.eval_batches > 0      ? (int)job->train.eval_batches
                                                       : 1;
  /* named as the comm backend names groups: name{ranks} */
  int len = snprintf(p->group, sizeof p->group, "data{");
  for (int r = 0; r < world && len < (int)sizeof p->group; r++)
    len += snprintf(p->group + len, sizeof p->group - (size_t)len, "%s%d", r ? "," : "", r);
  if (len + 2 > (int)sizeof p->group)
    return mr_error_set(MR_ENOTSUP, "a data-parallel group of %d ranks: name too long", world);
  snprintf(p->group + len, sizeof p->group - (size_t)len, "}");
  int rc;
  p->group_ranks = malloc((size_t)world * sizeof *p->group_ranks);
  if (p->group_ranks == NULL)
    return MR_ENOMEM;
  for (int r = 0; r < world; r++)
    p->group_ranks[r] = r;
  if ((rc = mr_model_build(&job->model, p->micro_rows, job->train.seq_len, &p->model)) < 0)
    goto fail;
  int seed;
  if ((rc = mr_autodiff(&p->model.graph, p->model.loss, &seed)) < 0)
    goto fail;
  struct builder b = {.p = p};
  lower_step(&b);
  if ((rc = b.rc) < 0)
    goto fail;
  return 0;
fail:
  mr_program_close(p);
  return rc;
}

void mr_program_close(struct mr_rank_program *p) {
  for (int e = 0; e < p->n_ev; e++)
    free(p->what[e]);
  free(p->what);
  free(p->ev);
  free(p->ev_plain);
  free(p->ins);
  free(p->group_ranks);
  mr_model_close(&p->model);
  memset(p, 0, sizeof *p);
}

struct mr_comm_trace mr_program_trace(const struct mr_rank_program *p, int eval) {
  if (eval)
    return (struct mr_comm_trace){.ev = p->ev, .n = p->n_ev};
  return (struct mr_comm_trace){.ev = p->ev_plain, .n = p->n_ev_plain};
}

int mr_program_check_all(const struct mr_job *job, int world) {
  struct mr_rank_program *p = calloc((size_t)world, sizeof *p);
  struct mr_comm_trace *tr = calloc((size_t)world, sizeof *tr);
  int rc = p != NULL && tr != NULL ? 0 : MR_ENOMEM;
  int lowered = 0;
  for (; rc == 0 && lowered < world; lowered++)
    if ((rc = mr_program_lower(job, world, lowered, &p[lowered])) < 0)
      break;
  for (int eval = 0; eval <= 1 && rc == 0; eval++) {
    for (int r = 0; r < world; r++)
      tr[r] = mr_program_trace(&p[r], eval);
    rc = mr_comm_check(tr, world);
  }
  for (int r = 0; r < lowered && p != NULL; r++)
    mr_program_close(&p[r]);
  free(p);
  free(tr);
  return rc;
}

void mr_program_dump(const struct mr_rank_program *p, FILE *f) {
  const struct mr_graph *g = &p->model.graph;
  int n_eval = 0;
  for (int i = 0; i < p->n_ins; i++)
    n_eval += p->ins[i].eval;
  fprintf(f, "rank %d of %d: data-parallel rank %d of %d, ZeRO-%d, %d micro-batch%s of %lld "
          "rows; %d instructions per training step (E: %d more on evaluation steps)\n",
          p->rank, p->world, p->dp_rank, p->dp, p->zero_stage, p->accum,
          p->accum == 1 ? "" : "es", (long long)p->micro_rows, p->n_ins - n_eval, n_eval);
  for (int i = 0; i < p->n_ins; i++) {
    const struct mr_instr *in = &p->ins[i];
    fprintf(f, "%6d %c ", i, in->eval ? 'E' : ' ');
    switch (in->kind) {
    case MR_INSTR_LOAD_BATCH:
      fprintf(f, "load_batch    micro-batch %d: %lld rows from global row %lld\n", in->micro,
              (long long)p->micro_rows,
              (long long)(((int64_t)p->dp_rank * p->accum + in->micro) * p->micro_rows));
      break;
    case MR_INSTR_KERNEL: {
      const struct mr_op *op = &g->ops[in->op];
      const struct mr_tensor *out = &g->tensors[op->out[0]];
      fprintf(f, "kernel        %s %s -> %s [", op->backward ? "bwd" : "fwd",
              mr_op_def(op->kind)->name, out->name);
      for (int d = 0; d < out->ndim; d++)
        fprintf(f, "%s%lld", d ? "," : "", (long long)out->shape[d]);
      fprintf(f, "]\n");
      break;
    }
    case MR_INSTR_COMM_START:
    case MR_INSTR_COMM_WAIT: {
      const struct mr_comm_event *e = &p->ev[in->comm];
      fprintf(f, "%s #%d %s %lld %s on %s: %s\n",
              in->kind == MR_INSTR_COMM_START ? "comm_start " : "comm_wait  ", in->comm,
              mr_comm_event_kind_name(e->kind), (long long)e->count, mr_dtype_name(e->dtype),
              e->group, e->what);
      break;
    }
    case MR_INSTR_ACCUMULATE:
      fprintf(f, "accumulate    micro-batch %d's gradients\n", in->micro);
      break;
    case MR_INSTR_OPTIMIZER:
      fprintf(f, "optimizer     clip by the global norm, AdamW on %s\n",
              p->zero_stage >= 1 && p->dp > 1 ? "this rank's block of each parameter"
                                               : "every parameter");
      break;
    case MR_INSTR_STEP_END:
      fprintf(f, "step_end      report metrics; checkpoint if due or asked\n");
      break;
    }
  }
}
