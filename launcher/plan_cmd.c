/* plan_cmd.c - `meshrun plan JOB.json`: the strategy search from the
 * command line, as text or JSON.  Needs no devices and no data files. */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/configs.h"
#include "common/clock.h"
#include "common/error.h"
#include "common/job.h"
#include "compiler/mesh.h"
#include "common/tunable.h"
#include "launcher/cli.h"
#include "launcher/explain.h"
#include "launcher/strategy_choice.h"
#include "compiler/plugin.h"
#include "compiler/planner/cluster.h"
#include "compiler/planner/cost.h"
#include "compiler/planner/partition.h"
#include "compiler/planner/search.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: meshrun plan [options] JOB.json\n"
          "\n"
          "Chooses the fastest parallel strategy that fits, for a cluster spec, and\n"
          "explains it.  Needs neither devices nor the job's data files.\n"
          "\n"
          "  --cluster SPEC   a spec file, a name in configs/clusters/, or NxNAME /\n"
          "                   Nx:NAME for N nodes of it (default: the job's cluster,\n"
          "                   else $MESHRUN_CLUSTER, else cpu-local)\n"
          "  --nproc N        ranks to plan for (default: every device of the spec;\n"
          "                   nodes are added to hold N, or on a CPU host's spec\n"
          "                   the ranks share its cores, as launch runs them)\n"
          "  --top K          alternatives to show (default 5, at most %d)\n"
          "  --json           machine-readable output\n"
          "  --mesh SPEC      a fixed mesh instead of the search over meshes, e.g.\n"
          "                   data=2,model=4: the data and tensor parallel degrees\n"
          "                   (no pipeline); the rest of the strategy is still chosen\n"
          "  --explain        also print, on that mesh or on the chosen strategy's\n"
          "                   data x model mesh, every tensor's placements and every\n"
          "                   reshard with its bytes (`meshrun explain` is this)\n"
          "  --dump           also print a rank's program for the chosen strategy: its\n"
          "                   buffers and every instruction with the communication it\n"
          "                   issues, after checking every rank's programs fit together\n"
          "  --rank R         the rank --dump prints (default 0)\n",
          MR_PLAN_TOP_MAX);
}

/* SPEC: a path, a NAME, or NxNAME / Nx:NAME. */
static int load_cluster(const char *spec, struct mr_cluster *out) {
  long nodes = 0;
  const char *name = spec;
  char *end = NULL;
  long v = strtol(spec, &end, 10);
  if (end != spec && end[0] == 'x') {
    if (v < 1 || v > (1 << 20)) {
      fprintf(stderr, "meshrun plan: --cluster %s: node count must be 1..%d\n", spec, 1 << 20);
      return MR_EINVAL;
    }
    nodes = v;
    name = end + 1 + (end[1] == ':');
  }
  char path[PATH_MAX + 128];
  int rc = mr_configs_cluster_path(name, path, sizeof path);
  if (rc < 0)
    return rc;
  rc = mr_cluster_load(path, out);
  if (rc < 0) {
    fprintf(stderr, "meshrun plan: %s\n", mr_error_message());
    return rc;
  }
  if (nodes > 0)
    out->nodes = (int)nodes;
  return 0;
}

static const char *sched_name(enum mr_pp_schedule s) {
  return s == MR_PP_GPIPE ? "gpipe" : s == MR_PP_INTERLEAVED ? "interleaved" : "1f1b";
}
static const char *amp_name(enum mr_amp_dtype d) {
  return d == MR_AMP_BF16 ? "bf16" : d == MR_AMP_FP16 ? "fp16" : "fp32";
}
static const char *rc_name(enum mr_recompute_mode r) {
  return r == MR_RECOMPUTE_MODE_FULL ? "full" : r == MR_RECOMPUTE_MODE_SELECTIVE ? "selective"
                                                                                : "none";
}

static cJSON *memory_json(const struct mr_memory *m) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddNumberToObject(o, "parameters", m->params);
  cJSON_AddNumberToObject(o, "gradients", m->grads);
  cJSON_AddNumberToObject(o, "optimizer", m->optimizer);
  cJSON_AddNumberToObject(o, "activations", m->activations);
  cJSON_AddNumberToObject(o, "buffers", m->buffers);
  cJSON_AddNumberToObject(o, "workspace", m->workspace);
  cJSON_AddNumberToObject(o, "total", m->total);
  cJSON_AddNumberToObject(o, "host", m->host);
  return o;
}

static void candidate_json(cJSON *o, const struct mr_plan_candidate *c,
                           const struct mr_workload *w, const struct mr_cluster *cl) {
  const struct mr_cost *k = &c->cost;
  cJSON_AddItemToObject(o, "strategy",
                        mr_strategy_json(&c->strategy, 0, w));
  static int counts[MR_PARTITION_MAX_ITEMS];
  int nk = mr_cost_partition(w, cl, &c->strategy, counts, MR_PARTITION_MAX_ITEMS);
  if (nk > 0)
    cJSON_AddItemToObject(o, "layers_per_chunk", cJSON_CreateIntArray(counts, nk));
  cJSON_AddNumberToObject(o, "micro_batch_size", c->strategy.micro_batch_size);
  cJSON_AddNumberToObject(o, "step_time_s", k->step_time_s);
  cJSON_AddNumberToObject(o, "tokens_per_s", k->tokens_per_s);
  cJSON_AddNumberToObject(o, "model_tflops_per_device", k->model_tflops_per_device);
  cJSON_AddNumberToObject(o, "mfu", k->mfu);
  cJSON_AddNumberToObject(o, "bubble_fraction", k->bubble_fraction);
  cJSON *b = cJSON_AddObjectToObject(o, "step_breakdown_s");
  cJSON_AddNumberToObject(b, "compute", k->compute_s);
  cJSON_AddNumberToObject(b, "tensor_parallel_comm", k->tp_comm_s);
  cJSON_AddNumberToObject(b, "recompute", k->recompute_s);
  cJSON_AddNumberToObject(b, "pipeline_bubble", k->bubble_s);
  cJSON_AddNumberToObject(b, "pipeline_sends", k->p2p_s);
  cJSON_AddNumberToObject(b, "gradient_sync", k->dp_comm_s);
  cJSON_AddNumberToObject(b, "optimizer", k->optimizer_s);
  cJSON_AddItemToObject(o, "memory_bytes", memory_json(&k->mem));
}

static void describe(const struct mr_strategy *s, char *buf, size_t n) {
  snprintf(buf, n,
           "dp %d x tp %d x pp %d (mesh %s), sequence parallel %s, ZeRO stage %d%s, "
           "recompute %s, micro-batch %d x %d%s, schedule %s%s, %s",
           s->dp, s->tp, s->pp, s->mapping == MR_MAP_TP_DP_PP ? "tp,dp,pp" : "tp,pp,dp",
           s->sequence_parallel ? "on" : "off", s->zero_stage, s->offload ? " + offload" : "",
           rc_name(s->recompute), s->micro_batch_size, s->micro_batches,
           s->grad_accum_steps > 1 ? " (accumulated)" : "", sched_name(s->schedule),
           s->virtual_stages > 1 ? (s->virtual_stages == 2   ? " v2"
                                    : s->virtual_stages == 3 ? " v3"
                                    : s->virtual_stages == 4 ? " v4"
                                    : s->virtual_stages == 6 ? " v6"
                                                             : " v8")
                                 : "",
           amp_name(s->amp_dtype));
}

static void print_memory(const struct mr_memory *m, double device) {
  const double g = 1073741824.0;
  printf("  memory per rank (GiB): parameters %.2f, gradients %.2f, optimizer %.2f, "
         "activations %.2f, buffers %.2f, workspace %.2f = %.2f of %.2f",
         m->params / g, m->grads / g, m->optimizer / g, m->activations / g, m->buffers / g,
         m->workspace / g, m->total / g, device / g);
  if (m->host > 0)
    printf(" (+%.2f in host memory)", m->host / g);
  printf("\n");
}

static void print_candidate(const struct mr_plan_candidate *c, double device) {
  const struct mr_cost *k = &c->cost;
  char d[512];
  describe(&c->strategy, d, sizeof d);
  printf("  %s\n", d);
  printf("  step %.4g s, %.4g tokens/s, %.1f model TFLOP/s per device, MFU %.1f%%\n",
         k->step_time_s, k->tokens_per_s, k->model_tflops_per_device, 100 * k->mfu);
  printf("  step = compute %.4g s (tensor-parallel comm %.3g, recompute %.3g) + bubble %.3g "
         "(%.1f%%) + pipeline sends %.3g + gradient sync %.3g + optimizer %.3g\n",
         k->compute_s, k->tp_comm_s, k->recompute_s, k->bubble_s, 100 * k->bubble_fraction,
         k->p2p_s, k->dp_comm_s, k->optimizer_s);
  print_memory(&k->mem, device);
}

/* --mesh SPEC: dims "data" and "model" only (the degrees the strategy
 * has names for), as many ranks as --nproc if given, and degrees the job
 * does not fix otherwise; then the job's hint takes them.  Prints why
 * not and returns -1. */
static int fix_mesh(const char *spec, long nproc, struct mr_strategy_hint *h,
                    struct mr_mesh *m) {
  if (mr_mesh_parse(spec, m) < 0) {
    fprintf(stderr, "meshrun plan: %s\n", mr_error_message());
    return -1;
  }
  for (int i = 0; i < m->ndim; i++)
    if (strcmp(m->names[i], "data") != 0 && strcmp(m->names[i], "model") != 0) {
      fprintf(stderr, "meshrun plan: --mesh \"%s\": dim \"%s\": expected the "
              "dims data and model, e.g. data=2,model=4\n", spec, m->names[i]);
      return -1;
    }
  int dd = mr_mesh_dim(m, "data"), md = mr_mesh_dim(m, "model");
  int dp = dd >= 0 ? m->shape[dd] : 1, tp = md >= 0 ? m->shape[md] : 1;
  if (nproc > 0 && nproc != mr_mesh_size(m)) {
    fprintf(stderr, "meshrun plan: --mesh \"%s\" has %d ranks but --nproc is "
            "%ld: expected the same world size\n", spec, mr_mesh_size(m), nproc);
    return -1;
  }
  static const char *const field[] = {"strategy.data_parallel.degree",
                                      "strategy.tensor_parallel.degree",
                                      "strategy.pipeline_parallel.degree"};
  const int want[3] = {dp, tp, 1}, has[3] = {h->dp, h->tp, h->pp};
  for (int i = 0; i < 3; i++)
    if (has[i] > 0 && has[i] != want[i]) {
      fprintf(stderr, "meshrun plan: --mesh \"%s\" gives %s %d but the job "
              "fixes it to %d: expected them to agree\n", spec, field[i],
              want[i], has[i]);
      return -1;
    }
  h->dp = dp;
  h->tp = tp;
  h->pp = 1;
  return 0;
}

/* --explain: the placements on the given mesh, or on s's data x model
 * mesh (s: the chosen strategy, or the least-memory one when none fits,
 * as `whose` says).  Returns the exit code: 0, 2 (a layout the mesh
 * cannot hold) or 1. */
static int explain_section(const struct mr_job *job, const struct mr_mesh *given,
                           const struct mr_strategy *s, const char *whose) {
  struct mr_mesh m;
  if (given != NULL) {
    m = *given;
  } else {
    char spec[64];
    snprintf(spec, sizeof spec, "data=%d,model=%d", s->dp, s->tp);
    if (mr_mesh_parse(spec, &m) < 0) {
      fprintf(stderr, "meshrun plan: --explain: %s\n", mr_error_message());
      return 1;
    }
  }
  char name[128];
  mr_mesh_format(&m, name, sizeof name);
  printf("\nplacements and reshards on mesh %s (", name);
  if (given != NULL)
    printf("given by --mesh");
  else
    printf("the %s data x model", whose);
  if (s->pp > 1)
    printf("; each of the %d pipeline stages holds such a mesh, the whole "
           "model is shown", s->pp);
  printf("):\n");
  fflush(stdout);
  int rc = mr_explain(job, &m, s->sequence_parallel, stdout);
  if (rc < 0) {
    fprintf(stderr, "meshrun plan: --explain on mesh %s: %s\n", name,
            mr_error_message());
    return rc == MR_EINVAL ? 2 : 1;
  }
  return 0;
}

struct plan_args {
  const char *cluster, *mesh, *job_path;
  long nproc, top, dump_rank;
  int json, explain, dump;
};

/* The flags into a; returns -1 to go on, else the exit code. */
static int parse_args(int argc, char **argv, struct plan_args *a) {
  static const struct option opts[] = {
      {"cluster", required_argument, NULL, 'c'}, {"nproc", required_argument, NULL, 'n'},
      {"top", required_argument, NULL, 'k'},     {"json", no_argument, NULL, 'j'},
      {"mesh", required_argument, NULL, 'm'},    {"explain", no_argument, NULL, 'e'},
      {"rank", required_argument, NULL, 'r'},    {"dump", no_argument, NULL, 'd'},
      {"help", no_argument, NULL, 'h'},          {NULL, 0, NULL, 0}};
  *a = (struct plan_args){.top = 5, .dump_rank = -1};
  int c;
  optind = 1;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (c) {
    case 'c': a->cluster = optarg; break;
    case 'n':
      if (mr_cli_int("plan", "--nproc", optarg, 1, 1 << 24, &a->nproc) < 0)
        return 2;
      break;
    case 'k':
      if (mr_cli_int("plan", "--top", optarg, 1, MR_PLAN_TOP_MAX, &a->top) < 0)
        return 2;
      break;
    case 'j': a->json = 1; break;
    case 'm': a->mesh = optarg; break;
    case 'e': a->explain = 1; break;
    case 'r':
      if (mr_cli_int("plan", "--rank", optarg, 0, 1 << 24, &a->dump_rank) < 0)
        return 2;
      break;
    case 'd': a->dump = 1; break;
    case 'h': usage(stdout); return 0;
    default: usage(stderr); return 2;
    }
  }
  if (optind != argc - 1) {
    fprintf(stderr, "meshrun plan: expected one job file\n");
    usage(stderr);
    return 2;
  }
  a->job_path = argv[optind];
  if (a->dump && a->dump_rank < 0)
    a->dump_rank = 0;
  if (a->dump_rank >= 0 && !a->dump) {
    fprintf(stderr, "meshrun plan: --rank R prints rank R's program: expected --dump too\n");
    return 2;
  }
  if (a->dump && a->json) {
    fprintf(stderr, "meshrun plan: --dump prints text: expected it without --json\n");
    return 2;
  }
  if (a->explain && a->json) {
    fprintf(stderr, "meshrun plan: --explain prints text: expected it without "
            "--json\n");
    return 2;
  }
  return -1;
}

/* The job as the flags leave it (--mesh fixing its degrees), and the
 * cluster planned for, grown to --nproc; returns -1 to go on, else the
 * exit code (the job closed). */
static int load_inputs(struct plan_args *a, struct mr_job *job, struct mr_mesh *given,
                       struct mr_cluster *cl) {
  if (mr_job_load(a->job_path, job) < 0) {
    fprintf(stderr, "meshrun plan: %s\n", mr_error_message());
    return 2;
  }
  mr_cli_job_defaults(job);
  int code = -1;
  if (mr_plugin_load_job(job) < 0) {
    fprintf(stderr, "meshrun plan: %s\n", mr_error_message());
    code = 2;
  } else if (a->mesh != NULL && fix_mesh(a->mesh, a->nproc, &job->strategy, given) < 0) {
    code = 2;
  } else {
    if (a->mesh != NULL)
      a->nproc = mr_mesh_size(given);
    const char *spec = a->cluster != NULL ? a->cluster
                       : job->cluster != NULL ? job->cluster
                                              : mr_default_cluster();
    if (load_cluster(spec, cl) < 0)
      code = 2;
  }
  if (code >= 0) {
    mr_job_close(job);
    return code;
  }
  /* more ranks than the spec's devices: a CPU host's share its cores, as
   * `meshrun launch` runs them; other specs grow by nodes */
  if (a->nproc > 0 && a->nproc > mr_cluster_devices(cl) &&
      !mr_cluster_share_host(cl, (int)a->nproc))
    cl->nodes = (int)((a->nproc + cl->devices_per_node - 1) / cl->devices_per_node);
  return -1;
}

/* The search, or under auto_mode manual the job's own strategy priced;
 * returns 0, MR_ENOFIT (res holds the least-memory plan) or an error. */
static int plan(const struct mr_job *job, const struct mr_cluster *cl, const struct plan_args *a,
                struct mr_plan_result *res) {
  struct mr_plan_request req = {&job->model, &job->train, &job->strategy, cl, (int)a->nproc,
                                (int)a->top};
  if (job->strategy.auto_mode != MR_AUTO_MANUAL)
    return mr_plan_search(&req, res);
  MR_TRY(mr_plan_manual(&req, &res->top[0].strategy));
  struct mr_workload w = mr_workload_of(&job->model, &job->train, &job->strategy);
  mr_cost_evaluate(&w, cl, &res->top[0].strategy, &res->top[0].cost);
  res->considered = 1;
  if (res->top[0].cost.fits) {
    res->n_top = 1;
    return 0;
  }
  res->least_memory = res->top[0];
  res->pruned_memory = 1;
  res->fits_with_offload = res->fits_with_recompute = res->fits_with_both = -1;
  return MR_ENOFIT;
}

/* What the search found, for both printers. */
struct plan_view {
  const struct mr_job *job;     // job->path: the file as given
  const struct mr_cluster *cl;
  const struct mr_plan_result *res;
  struct mr_workload wl;
  int world, fits;
  double params, search_s;
};

static void print_json(const struct plan_view *v) {
  const struct mr_plan_result *res = v->res;
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "job", v->job->path);
  cJSON_AddStringToObject(o, "cluster", v->cl->name);
  cJSON_AddNumberToObject(o, "world_size", v->world);
  cJSON_AddNumberToObject(o, "parameters", v->params);
  cJSON_AddBoolToObject(o, "fits", v->fits);
  if (v->fits) {
    candidate_json(o, &res->top[0], &v->wl, v->cl);
  } else {
    cJSON_AddNumberToObject(o, "least_memory_bytes", res->least_memory.cost.mem.total);
    cJSON *lm = cJSON_AddObjectToObject(o, "least_memory_plan");
    candidate_json(lm, &res->least_memory, &v->wl, v->cl);
    cJSON *wf = cJSON_AddObjectToObject(o, "would_fit_with");
    cJSON_AddNumberToObject(wf, "offload", res->fits_with_offload);
    cJSON_AddNumberToObject(wf, "recompute", res->fits_with_recompute);
    cJSON_AddNumberToObject(wf, "offload_recompute_any_zero", res->fits_with_both);
    cJSON_AddNumberToObject(wf, "devices", (double)res->devices_to_fit);
  }
  cJSON_AddNumberToObject(o, "search_time_s", v->search_s);
  cJSON_AddNumberToObject(o, "considered", (double)res->considered);
  cJSON_AddNumberToObject(o, "pruned_memory", (double)res->pruned_memory);
  cJSON *alts = cJSON_AddArrayToObject(o, "alternatives");
  for (int i = 1; i < res->n_top; i++) {
    cJSON *alt = cJSON_CreateObject();
    candidate_json(alt, &res->top[i], &v->wl, v->cl);
    char why[256];
    mr_plan_explain(&res->top[0], &res->top[i], why, sizeof why);
    cJSON_AddStringToObject(alt, "why_slower", why);
    cJSON_AddItemToArray(alts, alt);
  }
  char *text = cJSON_Print(o);
  if (text != NULL)
    printf("%s\n", text);
  free(text);
  cJSON_Delete(o);
}

/* No strategy fits: the least memory one needs, and what would help. */
static void print_no_fit(const struct plan_view *v) {
  const struct mr_plan_result *res = v->res;
  const double g = 1073741824.0;
  char d[512];
  describe(&res->least_memory.strategy, d, sizeof d);
  printf("does not fit: no strategy fits in %.2f GiB per device.\n", v->cl->memory_bytes / g);
  printf("least memory any plan needs: %.2f GiB per rank, with\n  %s\n",
         res->least_memory.cost.mem.total / g, d);
  print_memory(&res->least_memory.cost.mem, v->cl->memory_bytes);
  printf("what would make it fit:");
  int any = 0;
  if (res->fits_with_offload == 1)
    printf(" letting the planner offload optimizer states;"), any = 1;
  if (res->fits_with_recompute == 1)
    printf(" letting the planner recompute activations;"), any = 1;
  if (res->fits_with_both == 1 && !res->fits_with_offload && !res->fits_with_recompute)
    printf(" offload with recompute and any ZeRO stage;"), any = 1;
  if (res->devices_to_fit > 0)
    printf(" %lld devices (--nproc %lld);", (long long)res->devices_to_fit,
           (long long)res->devices_to_fit), any = 1;
  if (!any)
    printf(" nothing up to 64x the devices; a device with more memory");
  printf("\n");
}

static void print_text(const struct plan_view *v) {
  const struct mr_plan_result *res = v->res;
  printf("plan for %s: %.4g B parameters, batch %lld x %lld tokens, on %s: %d ranks "
         "(%d per node)\n",
         v->job->path, v->params / 1e9, (long long)v->job->train.global_batch,
         (long long)v->job->train.seq_len, v->cl->name, v->world, v->cl->devices_per_node);
  if (v->fits) {
    printf("chosen:\n");
    print_candidate(&res->top[0], v->cl->memory_bytes);
    if (res->n_top > 1)
      printf("runners-up:\n");
    for (int i = 1; i < res->n_top; i++) {
      char d[512], why[256];
      describe(&res->top[i].strategy, d, sizeof d);
      mr_plan_explain(&res->top[0], &res->top[i], why, sizeof why);
      printf("  %d. %s\n     %.4g s, %s\n", i + 1, d, res->top[i].cost.step_time_s, why);
    }
  } else {
    print_no_fit(v);
  }
  printf("searched %lld strategies (%lld too big for a device) in %.3f s\n",
         (long long)res->considered, (long long)res->pruned_memory, v->search_s);
}

/* meshrun plan: the flags, the job and cluster, the search, what it found
 * (text or JSON), then --explain and --dump. */
int mr_cmd_plan(int argc, char **argv) {
  struct plan_args a;
  struct mr_job job;
  struct mr_mesh given;
  struct mr_cluster cl;
  int code;
  if ((code = parse_args(argc, argv, &a)) >= 0 ||
      (code = load_inputs(&a, &job, &given, &cl)) >= 0)
    return code;
  int world = a.nproc > 0 ? (int)a.nproc : (int)mr_cluster_devices(&cl);
  struct mr_plan_result *res = calloc(1, sizeof *res);
  if (res == NULL) {
    mr_job_close(&job);
    return 1;
  }
  double t0 = mr_clock_s();
  int rc = plan(&job, &cl, &a, res);
  double search_s = mr_clock_s() - t0;
  if (rc < 0 && rc != MR_ENOFIT) {
    if (a.mesh != NULL)
      fprintf(stderr, "meshrun plan: %s: --mesh \"%s\": %s\n", a.job_path, a.mesh,
              mr_error_message());
    else
      fprintf(stderr, "meshrun plan: %s: %s\n", a.job_path, mr_error_message());
    free(res);
    mr_job_close(&job);
    return 2;
  }
  struct plan_view v = {&job, &cl, res,
                        mr_workload_of(&job.model, &job.train, &job.strategy), world, rc == 0,
                        (double)mr_model_param_count(&job.model), search_s};
  if (a.json)
    print_json(&v);
  else
    print_text(&v);
  int ex = 0;
  if (a.explain) /* what fits, else what needs the least memory */
    ex = explain_section(&job, a.mesh != NULL ? &given : NULL,
                         rc == 0 ? &res->top[0].strategy : &res->least_memory.strategy,
                         rc == 0 ? "chosen strategy's" : "least-memory strategy's");
  if (a.dump && rc == 0 && ex == 0)
    ex = mr_plan_dump_rank(&job, &res->top[0].strategy, world, (int)a.dump_rank, stdout);
  free(res);
  mr_job_close(&job);
  return ex != 0 ? ex : rc == 0 ? 0 : 1;
}
