/* explain.c - prints a completed distributed graph. */
#include "launcher/explain.h"

#include <stdlib.h>
#include <string.h>

#include "common/autodiff.h"
#include "common/dtype.h"
#include "common/error.h"
#include "common/mesh.h"
#include "common/model.h"
#include "common/ops.h"
#include "common/plugin.h"
#include "launcher/spmd/completion.h"
#include "launcher/spmd/rules.h"

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

static void print_graph(const struct mr_dist_graph *dg, FILE *out) {
  const struct mr_graph *g = dg->g;
  char mesh[128], pl[160], sh[64];
  mr_mesh_format(&dg->mesh, mesh, sizeof mesh);
  fprintf(out, "mesh %s (%d ranks), %d tensors, %d ops, %d propagation "
          "sweeps\n\ntensors (name, role, global shape, placements, largest "
          "local bytes):\n", mesh, mr_mesh_size(&dg->mesh), g->n_tensors,
          g->n_ops, dg->iterations);
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
  int nf = 0, nb = 0;
  for (int e = 0; e < dg->n_edges; e++)
    for (int s = 0; s < dg->edges[e].plan.n_steps; s++)
      if (dg->edges[e].plan.steps[s].bytes > 0)
        *(dg->edges[e].backward ? &nb : &nf) += 1;
  fprintf(out, "\ntotal: %d collectives forward, %d backward and gradient "
          "sync, %lld bytes per rank\n", nf, nb,
          (long long)mr_dist_graph_bytes(dg));
}

int mr_explain(const struct mr_job *job, const char *mesh_spec, FILE *out) {
  struct mr_mesh m;
  MR_TRY(mr_mesh_parse(mesh_spec, &m));
  struct mr_model mo;
  int rc = mr_model_build(&job->model, job->train.global_batch,
                          job->train.seq_len, &mo);
  int seed;
  if (rc == 0)
    rc = mr_autodiff(&mo.graph, mo.loss, &seed);
  struct mr_dist_graph dg;
  memset(&dg, 0, sizeof dg);
  if (rc == 0) {
    struct mr_completion_opts o;
    memset(&o, 0, sizeof o);
    o.rules = job->shard_rules;
    o.n_rules = job->n_shard_rules;
    o.data_dim = mr_mesh_dim(&m, "data");
    o.seq_dim = job->strategy.sequence_parallel == 1 ? mr_mesh_dim(&m, "model")
                                                     : -1;
    rc = mr_spmd_complete(&mo.graph, &m, &o, &dg);
  }
  if (rc == 0)
    print_graph(&dg, out);
  mr_dist_graph_close(&dg);
  mr_model_close(&mo);
  return rc;
}

int mr_cmd_explain(int argc, char **argv) {
  const char *job_path = NULL, *mesh = NULL;
  struct mr_plugin_api api;
  mr_plugin_api_init(&api);
  api.spmd_rule_register = mr_spmd_rule_register;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--mesh") && i + 1 < argc) {
      mesh = argv[++i];
    } else if (!strcmp(argv[i], "--plugin") && i + 1 < argc) {
      if (mr_plugin_load(argv[++i], &api) < 0) {
        fprintf(stderr, "meshrun explain: --plugin: %s\n", mr_error_message());
        return 2;
      }
    } else if (!strcmp(argv[i], "--help")) {
      printf("usage: meshrun explain JOB.json --mesh data=2,model=4 "
             "[--plugin lib.so]...\n"
             "prints every tensor's placements and every reshard\n");
      return 0;
    } else if (argv[i][0] != '-' && !job_path) {
      job_path = argv[i];
    } else {
      fprintf(stderr, "meshrun explain: unexpected argument \"%s\"\n", argv[i]);
      return 2;
    }
  }
  if (!job_path || !mesh) {
    fprintf(stderr, "usage: meshrun explain JOB.json --mesh data=2,model=4\n");
    return 2;
  }
  struct mr_job job;
  if (mr_job_load(job_path, &job) < 0) {
    fprintf(stderr, "meshrun explain: %s\n", mr_error_message());
    return 2;
  }
  int rc = mr_explain(&job, mesh, stdout);
  if (rc < 0)
    fprintf(stderr, "meshrun explain: %s\n", mr_error_message());
  mr_job_close(&job);
  return rc == 0 ? 0 : (rc == MR_EINVAL ? 2 : 1);
}
