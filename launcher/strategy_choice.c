/* strategy_choice.c - planning a launch within what the runtime executes. */
#include "launcher/strategy_choice.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "launcher/cli.h"
#include "launcher/planner/cluster.h"

static int runnable(const struct mr_strategy_hint *h, int world) {
  if (h->tp > 1)
    return mr_error_set(MR_ENOTSUP, "strategy.tensor_parallel.degree = %d: this runtime "
                        "executes data parallelism only (tensor parallelism: not yet)", h->tp);
  if (h->pp > 1)
    return mr_error_set(MR_ENOTSUP, "strategy.pipeline_parallel.degree = %d: this runtime "
                        "executes data parallelism only (pipelines: not yet)", h->pp);
  if (h->dp > 0 && h->dp != world)
    return mr_error_set(MR_ENOTSUP, "strategy.data_parallel.degree = %d, but %d ranks run: "
                        "data parallelism must span every rank", h->dp, world);
  if (h->sequence_parallel == 1)
    return mr_error_set(MR_ENOTSUP, "strategy.sequence_parallel.enable: not yet executed");
  if (h->zero_stage > 1)
    return mr_error_set(MR_ENOTSUP, "strategy.sharding.stage = %d: ZeRO stages 0 and 1 run "
                        "today", h->zero_stage);
  if (h->offload == 1)
    return mr_error_set(MR_ENOTSUP, "strategy.sharding.offload: not yet executed");
  if (h->recompute == 1)
    return mr_error_set(MR_ENOTSUP, "strategy.recompute.enable: not yet executed");
  return 0;
}

int mr_strategy_choose(const struct mr_job *job, int world, struct mr_strategy_choice *out) {
  memset(out, 0, sizeof *out);
  MR_TRY(runnable(&job->strategy, world));
  const char *name = job->cluster != NULL ? job->cluster : "cpu-local";
  if (mr_plan_cluster_path(name, out->cluster_path, sizeof out->cluster_path) < 0)
    return mr_error_set(MR_ENOENT, "cluster \"%s\": no such spec", name);
  struct mr_cluster cluster;
  MR_TRY(mr_cluster_load(out->cluster_path, &cluster));
  /* More CPU ranks than the spec's cores: ranks share the cores, each
   * getting its fraction of their compute and memory bandwidth. */
  int devices = cluster.nodes * cluster.devices_per_node;
  if (job->cluster == NULL && world > devices && cluster.nodes == 1) {
    double share = (double)devices / (double)world;
    for (int i = 0; i < 3; i++)
      cluster.peak_flops[i] *= share;
    cluster.memory_bandwidth *= share;
    cluster.memory_bytes *= share;
    cluster.devices_per_node = world;
  }
  struct mr_plan_request req = {.model = &job->model, .train = &job->train,
                                .hint = &job->strategy, .cluster = &cluster,
                                .world = world, .top_k = 1};
  struct mr_plan_result *res = calloc(1, sizeof *res);
  if (res == NULL)
    return MR_ENOMEM;
  if (job->strategy.auto_mode != MR_AUTO_MANUAL && mr_plan_search(&req, res) == 0) {
    out->best = res->top[0];
    out->have_best = 1;
  }
  /* within what runs: every rank data-parallel, the rest as the job says */
  struct mr_strategy_hint h = job->strategy;
  h.dp = world;
  h.tp = 1;
  h.pp = 1;
  h.sequence_parallel = 0;
  h.offload = 0;
  h.recompute = 0;
  h.micro_batches = 1;
  h.virtual_stages = 1;
  if (h.auto_mode == MR_AUTO_FULL)
    h.auto_mode = MR_AUTO_SEMI;
  int rc = MR_ENOFIT;
  struct mr_plan_candidate best;
  int found = 0;
  for (int stage = 0; stage <= 1; stage++) {
    if (h.zero_stage >= 0 && h.zero_stage != stage)
      continue;
    struct mr_strategy_hint hs = h;
    hs.zero_stage = stage;
    req.hint = &hs;
    struct mr_plan_candidate c;
    int r = mr_plan_choose(&req, &c);
    if (r == 0 && (!found || c.cost.step_time_s < best.cost.step_time_s)) {
      best = c;
      found = 1;
    } else if (r < 0 && !found) {
      rc = r;
    }
  }
  free(res);
  if (!found)
    return rc;
  out->chosen = best;
  return 0;
}

char *mr_strategy_apply(const struct mr_job *job, const struct mr_strategy *s) {
  cJSON *o = cJSON_Parse(job->text);
  if (o == NULL)
    return NULL;
  cJSON_DeleteItemFromObjectCaseSensitive(o, "strategy");
  cJSON *st = cJSON_AddObjectToObject(o, "strategy");
  cJSON_AddStringToObject(st, "auto_mode", "manual");
  cJSON_AddNumberToObject(cJSON_AddObjectToObject(st, "data_parallel"), "degree", s->dp);
  cJSON_AddNumberToObject(cJSON_AddObjectToObject(st, "tensor_parallel"), "degree", s->tp);
  cJSON_AddNumberToObject(cJSON_AddObjectToObject(st, "pipeline_parallel"), "degree", s->pp);
  cJSON *sh = cJSON_AddObjectToObject(st, "sharding");
  cJSON_AddNumberToObject(sh, "stage", s->zero_stage);
  cJSON_AddBoolToObject(sh, "offload", s->offload);
  static const char *const amps[] = {"fp32", "bf16", "fp16"};
  cJSON *amp = cJSON_AddObjectToObject(st, "amp");
  cJSON_AddStringToObject(amp, "dtype", amps[s->amp_dtype]);
  cJSON_AddNumberToObject(amp, "init_loss_scaling", job->strategy.init_loss_scaling);
  cJSON_AddNumberToObject(st, "gradient_accumulation_steps",
                          s->grad_accum_steps > 0 ? s->grad_accum_steps : 1);
  char *text = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  return text;
}

static void describe(const struct mr_plan_candidate *c, char *buf, size_t n) {
  const struct mr_strategy *s = &c->strategy;
  snprintf(buf, n, "dp%d x tp%d x pp%d, ZeRO-%d, micro-batch %d x %d, %s; predicted %.3f s/step, "
           "%.0f tokens/s, %.1f%% MFU, %.0f MiB per rank",
           s->dp, s->tp, s->pp, s->zero_stage, s->micro_batch_size,
           s->grad_accum_steps > 0 ? s->grad_accum_steps : 1,
           s->amp_dtype == MR_AMP_BF16 ? "bf16" : s->amp_dtype == MR_AMP_FP16 ? "fp16" : "fp32",
           c->cost.step_time_s, c->cost.tokens_per_s, 100 * c->cost.mfu,
           (double)c->cost.mem.total / 1048576.0);
}

void mr_strategy_print(const struct mr_strategy_choice *c, FILE *f) {
  char line[512];
  describe(&c->chosen, line, sizeof line);
  fprintf(f, "meshrun: strategy: %s\n", line);
  if (c->have_best && (c->best.strategy.tp != c->chosen.strategy.tp ||
                       c->best.strategy.pp != c->chosen.strategy.pp ||
                       c->best.strategy.zero_stage != c->chosen.strategy.zero_stage ||
                       c->best.strategy.sequence_parallel || c->best.strategy.recompute)) {
    describe(&c->best, line, sizeof line);
    fprintf(f, "meshrun: the planner's unconstrained best: %s (not all of it runs yet)\n", line);
  }
  fprintf(f, "meshrun: cluster spec: %s\n", c->cluster_path);
}
