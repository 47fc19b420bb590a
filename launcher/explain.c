/* explain.c - prints a completed distributed graph. */
#include "launcher/explain.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "common/error.h"
#include "compiler/mesh.h"
#include "compiler/model.h"
#include "compiler/ops.h"
#include "compiler/plugin.h"
#include "launcher/cli.h"
#include "compiler/spmd/completion.h"
#include "compiler/spmd/rules.h"

static const char *role_name(enum mr_tensor_role r) {
  static const char *const n[] = {"input", "param", "act", "grad", "opt"};
  return (unsigned)r < 5 ? n[r] : "?";
}

static void shape_str(const struct mr_tensor *t, char *buf, size_t n) {
  int len = snprintf(buf, n, "[");
  for (int d = 0; d < t->ndim; d++)
    len += snprintf(buf + len, n - (size_t)len, d ? ",%lld" : "%lld",
                    (long long)t->shape[d]);
  snprintf(buf + len, n - (size_t)len, "]");
}

static void print_plan(const struct mr_dist_graph *dg,
                       const struct mr_reshard_plan *p, FILE *out) {
  for (int s = 0; s < p->n_steps; s++) {
    const struct mr_reshard_step *st = &p->steps[s];
    fprintf(out, "      %s", mr_reshard_kind_name(st->kind));
    if (st->mesh_dim >= 0)
      fprintf(out, " on %s (%d ranks)", dg->mesh.names[st->mesh_dim],
              st->group_size);
    if (st->kind == MR_RS_ALL_TO_ALL)
      fprintf(out, " split dim %d gather dim %d", st->tdim2, st->tdim);
    else if (st->kind == MR_RS_SLICE || st->kind == MR_RS_ALL_GATHER ||
             st->kind == MR_RS_REDUCE_SCATTER)
      fprintf(out, " dim %d", st->tdim);
    fprintf(out, ": %lld bytes per rank\n", (long long)st->bytes);
  }
}

static const char *const phase_names[] = {"forward", "backward",
                                          "gradient sync", "loss"};

/* Per mesh dim, the collectives (steps that move bytes) by phase. */
static void print_per_dim(const struct mr_dist_graph *dg, FILE *out) {
  static const enum mr_reshard_kind kinds[] = {
      MR_RS_ALL_GATHER, MR_RS_ALL_REDUCE, MR_RS_REDUCE_SCATTER,
      MR_RS_ALL_TO_ALL, MR_RS_SEND_RECV};
  /* edge kind and backward flag of each phase */
  static const int ek[4] = {MR_EDGE_OPERAND, MR_EDGE_OPERAND,
                            MR_EDGE_GRAD_SYNC, MR_EDGE_LOSS};
  static const int bw[4] = {0, 1, -1, -1};
  fprintf(out, "\ncollectives per mesh dim:\n");
  for (int md = 0; md < dg->mesh.ndim; md++) {
    fprintf(out, "  %s:", dg->mesh.names[md]);
    int any = 0;
    for (int ph = 0; ph < 4; ph++) {
      int first = 1;
      for (size_t k = 0; k < MR_ARRAY_LEN(kinds); k++) {
        int n = mr_dist_graph_count(dg, ek[ph], kinds[k], md, bw[ph]);
        if (n == 0)
          continue;
        if (first)
          fprintf(out, "%s %s", any ? ";" : "", phase_names[ph]);
        fprintf(out, "%s %d %s", first ? "" : ",", n,
                mr_reshard_kind_name(kinds[k]));
        first = 0;
        any = 1;
      }
    }
    fprintf(out, "%s\n", any ? "" : " none");
  }
}

static void print_graph(const struct mr_dist_graph *dg, const struct mr_model *mo,
                        const char *rules, FILE *out) {
  const struct mr_graph *g = dg->g;
  char mesh[128], pl[160], sh[64];
  mr_mesh_format(&dg->mesh, mesh, sizeof mesh);
  fprintf(out, "mesh %s (%d ranks), %d tensors, %d ops, %d propagation "
          "sweeps\n", mesh, mr_mesh_size(&dg->mesh), g->n_tensors, g->n_ops,
          dg->iterations);
  fprintf(out, "shard rules: %s\n", rules);
  if (mo->loss_form == MR_LOSS_VOCAB_PARALLEL)
    fprintf(out, "loss: vocabulary-parallel cross-entropy (xent_max, "
            "xent_sumexp, xent_finish): the logits stay split by vocabulary\n");
  else
    fprintf(out, "loss: fused cross_entropy\n");
  fprintf(out, "\ntensors (name, role, global shape, placements, largest "
          "local bytes):\n");
  for (int t = 0; t < g->n_tensors; t++) {
    const struct mr_tensor *tt = &g->tensors[t];
    mr_dist_format(&dg->tensor[t], pl, sizeof pl);
    shape_str(tt, sh, sizeof sh);
    int64_t local = mr_dist_local_numel_max(&dg->mesh, &dg->tensor[t], tt->ndim,
                                            tt->shape) *
                    (int64_t)mr_dtype_size(tt->dtype);
    fprintf(out, "  %-44s %-5s %-12s %-36s %lld\n", tt->name, role_name(tt->role),
            sh, pl, (long long)local);
  }
  fprintf(out, "\nreshards (%d):\n", dg->n_edges);
  static const char *const kinds[] = {"operand", "grad sync", "loss"};
  for (int e = 0; e < dg->n_edges; e++) {
    const struct mr_reshard_edge *x = &dg->edges[e];
    char a[160], b[160];
    mr_dist_format(&x->src, a, sizeof a);
    mr_dist_format(&x->dst, b, sizeof b);
    fprintf(out, "  #%d %s %s%s", e, kinds[x->kind], g->tensors[x->tensor].name,
            x->backward ? " (backward)" : "");
    if (x->op >= 0)
      fprintf(out, " -> op %d %s input %d", x->op,
              mr_op_def(g->ops[x->op].kind)->name, x->slot);
    fprintf(out, ": %s -> %s, %lld bytes per rank\n", a, b,
            (long long)x->plan.bytes);
    print_plan(dg, &x->plan, out);
  }
  print_per_dim(dg, out);
  int nf = 0, nb = 0;
  for (int e = 0; e < dg->n_edges; e++)
    for (int s = 0; s < dg->edges[e].plan.n_steps; s++)
      if (dg->edges[e].plan.steps[s].bytes > 0)
        *(dg->edges[e].backward ? &nb : &nf) += 1;
  fprintf(out, "\ntotal: %d collectives forward, %d backward and gradient "
          "sync, %lld bytes per rank\n", nf, nb,
          (long long)mr_dist_graph_bytes(dg));
}

/* Megatron's tensor-parallel layout of a LLaMA block, which the cost
 * model's tensor parallelism assumes: column-parallel q/k/v and gate/up,
 * row-parallel o and down. */
static struct mr_shard_rule_placement megatron_col = {"model", "Shard(0)"};
static struct mr_shard_rule_placement megatron_row = {"model", "Shard(1)"};
static const struct mr_shard_rule megatron_llama[] = {
    {"q_proj|k_proj|v_proj|gate_proj|up_proj", &megatron_col, 1},
    {"o_proj|down_proj", &megatron_row, 1},
};

int mr_explain(const struct mr_job *job, const struct mr_mesh *m,
               int sequence_parallel, FILE *out) {
  struct mr_completion_opts o;
  memset(&o, 0, sizeof o);
  o.rules = job->shard_rules;
  o.n_rules = job->n_shard_rules;
  char rules[256];
  snprintf(rules, sizeof rules, "the job's (%d)", job->n_shard_rules);
  if (job->n_shard_rules == 0 && job->model.family == MR_MODEL_LLAMA) {
    o.rules = megatron_llama;
    o.n_rules = (int)MR_ARRAY_LEN(megatron_llama);
    snprintf(rules, sizeof rules, "Megatron's for LLaMA, as the job gives "
             "none (%s Shard(0), %s Shard(1) on model)", megatron_llama[0].match,
             megatron_llama[1].match);
  } else if (job->n_shard_rules == 0) {
    snprintf(rules, sizeof rules, "none");
  }
  o.data_dim = mr_mesh_dim(m, "data");
  o.seq_dim = sequence_parallel == 1 ? mr_mesh_dim(m, "model") : -1;
  struct mr_model mo;
  struct mr_dist_graph dg;
  MR_TRY(mr_spmd_complete_model(&job->model, job->train.global_batch,
                                job->train.seq_len, m, &o, &mo, &dg));
  print_graph(&dg, &mo, rules, out);
  mr_dist_graph_close(&dg);
  mr_model_close(&mo);
  return 0;
}

int mr_cmd_explain(int argc, char **argv) {
  struct mr_plugin_api api;
  mr_plugin_api_init(&api);
  char **args = calloc((size_t)argc + 2, sizeof *args);
  if (args == NULL)
    return 1;
  int n = 0;
  args[n++] = (char *)"plan";
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--plugin") != 0) {
      args[n++] = argv[i];
      continue;
    }
    if (i + 1 == argc) {
      fprintf(stderr, "meshrun explain: --plugin: expected a shared object "
              "path\n");
      free(args);
      return 2;
    }
    if (mr_plugin_load(argv[++i], &api) < 0) {
      fprintf(stderr, "meshrun explain: --plugin: %s\n", mr_error_message());
      free(args);
      return 2;
    }
  }
  args[n++] = (char *)"--explain";
  args[n] = NULL;
  int rc = mr_cmd_plan(n, args);
  free(args);
  return rc;
}
