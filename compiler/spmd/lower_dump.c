/* lower_dump.c - checking every rank's programs together, and printing
 * one. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "common/error.h"
#include "common/text.h"
#include "compiler/fit.h"
#include "compiler/ops.h"
#include "compiler/spmd/lower_internal.h"

static void put_i64(XXH3_state_t *h, int64_t v) { XXH3_64bits_update(h, &v, sizeof v); }

uint64_t mr_rank_program_digest(const struct mr_rank_program *p) {
  XXH3_state_t *h = XXH3_createState();
  if (h == NULL)
    return 1; /* no memory to hash with: nothing to compare */
  XXH3_64bits_reset(h);
  const int64_t regions[] = {p->rank, p->param_bytes, p->acc_bytes, p->optim_bytes,
                             p->arena_bytes, p->send_bytes, p->zero_tmp_bytes,
                             p->scratch_bytes, p->grad_stage_bytes, p->n_step, p->n_ev,
                             p->n_params};
  for (size_t i = 0; i < sizeof regions / sizeof regions[0]; i++)
    put_i64(h, regions[i]);
  for (int i = 0; i < p->n_step; i++) {
    const struct mr_ins *in = &p->step[i];
    const int64_t f[] = {in->kind, in->pass, in->micro, in->slot, in->op,
                         in->edge, in->tensor, in->peer};
    XXH3_64bits_update(h, f, sizeof f);
  }
  for (int i = 0; i < p->n_ev; i++) {
    const struct mr_comm_event *e = &p->ev[i];
    const int64_t f[] = {e->kind, e->n_ranks, e->peer, e->count, e->dtype, e->root, e->batch};
    XXH3_64bits_update(h, f, sizeof f);
    XXH3_64bits_update(h, e->group, strlen(e->group));
    for (int k = 0; k < e->n_ranks; k++)
      put_i64(h, e->ranks[k]);
  }
  for (int i = 0; i < p->n_params; i++) {
    const struct mr_param_plan *pp = &p->params[i];
    const int64_t f[] = {pp->tensor, pp->numel, pp->begin, pp->len, pp->store_offset,
                         pp->acc_offset, pp->state_offset};
    XXH3_64bits_update(h, f, sizeof f);
    size_t nd = (size_t)p->L->model.graph.tensors[pp->tensor].ndim;
    XXH3_64bits_update(h, pp->goff, nd * sizeof *pp->goff);
    XXH3_64bits_update(h, pp->glen, nd * sizeof *pp->glen);
  }
  uint64_t d = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  return d != 0 ? d : 1;
}

int mr_lower_check_all(const struct mr_job *job, int world, uint64_t *digests) {
  struct mr_lowered L;
  MR_TRY(mr_lower_graph(job, world, &L));
  struct mr_rank_program *ps = calloc((size_t)world, sizeof *ps);
  struct mr_comm_trace *tr = calloc((size_t)world, sizeof *tr);
  int rc = MR_ENOMEM, built = 0;
  if (!ps || !tr)
    goto out;
  for (; built < world; built++) {
    MR_TRY_GOTO(rc, mr_rank_program_build(&L, built, &ps[built]), out);
    if (digests != NULL)
      digests[built] = mr_rank_program_digest(&ps[built]);
  }
  for (int eval = 0; eval < 2; eval++) {
    for (int r = 0; r < world; r++)
      tr[r] = mr_rank_program_trace(&ps[r], eval);
    MR_TRY_GOTO(rc, mr_comm_check(tr, world), out);
  }
  rc = 0;
out:
  for (int r = 0; ps && r < built; r++)
    mr_rank_program_close(&ps[r]);
  free(ps);
  free(tr);
  mr_lowered_close(&L);
  return rc;
}

static const char *const kind_names[MR_INS_KIND_COUNT] = {
    "recv", "load", "seed", "gather", "reshard", "kernel", "loss", "grad",
    "grad_wait", "send", "sync_wait", "optimizer", "param_sync", "step_end"};

const char *mr_ins_kind_name(enum mr_ins_kind k) {
  return k >= 0 && k < MR_INS_KIND_COUNT ? kind_names[k] : "?";
}

void mr_ins_describe(const struct mr_rank_program *p, const struct mr_ins *in, char *buf,
                     size_t n) {
  const struct mr_graph *g = &p->L->model.graph;
  int k = 0;
  if (in->pass >= 0)
    k = snprintf(buf, n, "%s c%d m%d ", p->passes[in->pass].backward ? "B" : "F",
                 p->passes[in->pass].chunk, in->micro);
  if (k < 0 || (size_t)k >= n)
    return;
  k += snprintf(buf + k, n - (size_t)k, "%s", kind_names[in->kind]);
  if ((size_t)k >= n)
    return;
  switch (in->kind) {
  case MR_INS_KERNEL:
    snprintf(buf + k, n - (size_t)k, " %s -> %s", mr_op_def(g->ops[in->op].kind)->name,
             g->tensors[g->ops[in->op].out[0]].name);
    break;
  case MR_INS_RECV:
  case MR_INS_SEND:
    snprintf(buf + k, n - (size_t)k, " %s %s rank %d", p->local.tensors[in->tensor].name,
             in->kind == MR_INS_SEND ? "to" : "from", in->peer);
    break;
  case MR_INS_RESHARD: {
    const struct mr_reshard_edge *e = &p->L->dg.edges[in->edge];
    char a[96], c[96];
    mr_dist_format(&e->src, a, sizeof a);
    mr_dist_format(&e->dst, c, sizeof c);
    snprintf(buf + k, n - (size_t)k, " %s %s -> %s", g->tensors[e->tensor].name, a, c);
    break;
  }
  case MR_INS_GATHER:
  case MR_INS_GRAD:
    snprintf(buf + k, n - (size_t)k, " %s", g->tensors[in->tensor].name);
    break;
  default:
    break;
  }
}

char *mr_rank_program_format(const struct mr_rank_program *p) {
  struct mr_text t = {0};
  struct mr_text *f = &t;
  const struct mr_lowered *L = p->L;
  char lay[256];
  mr_lowered_format(L, lay, sizeof lay);
  mr_text_add(f, "rank %d of %d: pipeline stage %d, data %d, model %d\nlayout: %s\n", p->rank,
          L->lay.world, p->pipe, p->data, p->model, lay);
  mr_text_add(f, "groups: %s %s %s\n", p->pipe_group.name, p->data_group.name, p->model_group.name);
  if (L->dp_micro != NULL)
    mr_text_add(f, "micro-batches: %d a step, slices %d..%d of the step's batch\n", p->n_micro,
            p->first_slice, p->first_slice + p->n_micro - 1);
  if (p->n_slots > p->n_micro)
    mr_text_add(f, "phantom slots: %d..%d (the ZeRO collectives of the busiest data rank's "
            "micro-batches, with no data)\n", p->n_micro, p->n_slots - 1);
  mr_text_add(f, "program digest: %016llx\n", (unsigned long long)mr_rank_program_digest(p));
  mr_text_add(f, "chunks:");
  for (int c = p->pipe; c < L->n_chunks; c += L->lay.pp)
    mr_text_add(f, " %d (layers %d..%d, %d micro-batches in flight, %lld bytes each)", c,
            L->chunk_first_layer[c], L->chunk_first_layer[c + 1] - 1, p->stash_slots[c],
            (long long)p->stash_bytes[c]);
  mr_text_add(f, "\nmemory (bytes): parameters %lld, gradients %lld, optimizer %lld%s, "
          "activations kept %lld, arena %lld, send buffers %lld, reshard staging %lld, "
          "ZeRO blocks %lld, gradient staging %lld; peak %lld\n",
          (long long)p->param_bytes, (long long)p->acc_bytes, (long long)p->optim_bytes,
          L->lay.offload ? " (offloaded)" : "",
          (long long)(mr_rank_program_peak_bytes(p) - p->param_bytes - p->acc_bytes -
                      (L->lay.offload ? 0 : p->optim_bytes) - p->arena_bytes -
                      p->send_bytes - 3 * p->scratch_bytes - p->zero_tmp_bytes -
                      p->grad_stage_bytes),
          (long long)p->arena_bytes, (long long)p->send_bytes, (long long)(3 * p->scratch_bytes),
          (long long)p->zero_tmp_bytes, (long long)p->grad_stage_bytes,
          (long long)mr_rank_program_peak_bytes(p));
  mr_text_add(f, "step: %d instructions, %d communication events\n", p->n_step, p->n_ev_step);
  for (int i = 0; i < p->n_step; i++) {
    char d[400];
    mr_ins_describe(p, &p->step[i], d, sizeof d);
    mr_text_add(f, "%5d  %s", i, d);
    for (int e = p->step[i].ev; e >= 0 && e < p->step[i].ev + p->step[i].n_ev; e++)
      mr_text_add(f, "%s%s %s count %lld", e == p->step[i].ev ? "  [" : "; ",
              mr_comm_event_kind_name(p->ev[e].kind), p->ev[e].group, (long long)p->ev[e].count);
    mr_text_add(f, "%s\n", p->step[i].n_ev > 0 ? "]" : "");
  }
  return mr_text_take(&t);
}
