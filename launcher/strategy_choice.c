/* strategy_choice.c - planning a launch within what the runtime executes. */
#include "launcher/strategy_choice.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/configs.h"
#include "common/discovery.h"
#include "common/error.h"
#include "launcher/cli.h"
#include "compiler/planner/cluster.h"
#include "compiler/spmd/lower.h"

/* The job with strategy s written in, parsed. */
static int job_with(const struct mr_job *job, const struct mr_strategy *st, struct mr_job *out) {
  memset(out, 0, sizeof *out);
  char *text = mr_strategy_apply(job, st);
  if (text == NULL)
    return MR_ENOMEM;
  int rc = mr_job_parse(text, job->path, "/", out);
  free(text);
  return rc;
}

/* Whether st lowers to rank programs whose communication fits together;
 * their digests into digests[world] when not NULL. */
static int runs(const struct mr_job *job, const struct mr_strategy *st, int world,
                uint64_t *digests) {
  struct mr_job j;
  MR_TRY(job_with(job, st, &j));
  int rc = mr_lower_check_all(&j, world, digests);
  mr_job_close(&j);
  return rc;
}

/* The job's micro-batches per data rank, when they apply to the chosen
 * strategy, as "3,1" into out->dp_split. */
static void note_split(const struct mr_job *job, struct mr_strategy_choice *out) {
  const struct mr_strategy_hint *h = &job->strategy;
  size_t at = 0;
  for (int d = 0; h->n_dp_micro == out->chosen.strategy.dp && d < h->n_dp_micro &&
                  at + 16 < sizeof out->dp_split; d++)
    at += (size_t)snprintf(out->dp_split + at, sizeof out->dp_split - at, "%s%d", d ? "," : "",
                           h->dp_micro[d]);
}

int mr_strategy_choose(const struct mr_job *job, int world, struct mr_strategy_choice *out) {
  memset(out, 0, sizeof *out);
  const char *name = job->cluster != NULL ? job->cluster : mr_default_cluster();
  if (mr_configs_cluster_path(name, out->cluster_path, sizeof out->cluster_path) < 0)
    return mr_error_set(MR_ENOENT, "cluster \"%s\": no such spec", name);
  struct mr_cluster cluster;
  MR_TRY(mr_cluster_load(out->cluster_path, &cluster));
  out->program_digests = calloc((size_t)(world > 0 ? world : 1), sizeof *out->program_digests);
  if (out->program_digests == NULL)
    return MR_ENOMEM;
  /* A spec of one CPU host (cpu-local, or this machine measured) describes
   * the host the ranks run on: more ranks than its cores share them, and
   * they share the memory this process may use (RAM, or a container's
   * limit). */
  int host_spec = mr_cluster_share_host(&cluster, world);
  if (host_spec && world > 0)
    cluster.memory_bytes = fmin(cluster.memory_bytes, (double)mr_host_memory_bytes() / world);
  struct mr_plan_request req = {.model = &job->model, .train = &job->train,
                                .hint = &job->strategy, .cluster = &cluster,
                                .world = world, .top_k = MR_PLAN_TOP_MAX};
  if (job->strategy.auto_mode == MR_AUTO_MANUAL) {
    MR_TRY(mr_plan_choose(&req, &out->chosen));
    out->best = out->chosen;
    out->have_best = 1;
    note_split(job, out);
    return runs(job, &out->chosen.strategy, world, out->program_digests);
  }
  struct mr_plan_result *res = calloc(1, sizeof *res);
  if (res == NULL)
    return MR_ENOMEM;
  int rc = mr_plan_search(&req, res);
  if (rc < 0) {
    free(res);
    return rc;
  }
  /* the fastest candidate the runtime can lower (more than 64 virtual
   * stages cannot, for one) */
  rc = MR_ENOFIT;
  char first_err[512] = "";
  for (int i = 0; i < res->n_top; i++) {
    int r = runs(job, &res->top[i].strategy, world, out->program_digests);
    if (r == 0) {
      out->chosen = res->top[i];
      out->best = res->top[0];
      out->have_best = 1;
      rc = 0;
      break;
    }
    if (first_err[0] == '\0')
      snprintf(first_err, sizeof first_err, "%s", mr_error_message());
  }
  free(res);
  if (rc < 0)
    return mr_error_set(MR_ENOFIT, "none of the planner's best strategies can be run: %s",
                        first_err);
  note_split(job, out);
  return 0;
}

void mr_strategy_choice_close(struct mr_strategy_choice *c) {
  free(c->program_digests);
  c->program_digests = NULL;
}

cJSON *mr_strategy_json(const struct mr_strategy *s, double init_loss_scaling,
                        const struct mr_workload *w) {
  static const char *const schedules[] = {"1f1b", "gpipe", "interleaved"};
  static const char *const amps[] = {"fp32", "bf16", "fp16"};
  cJSON *st = cJSON_CreateObject();
  if (st == NULL)
    return NULL;
  cJSON_AddStringToObject(st, "auto_mode", "manual");
  cJSON *dp = cJSON_AddObjectToObject(st, "data_parallel");
  cJSON_AddNumberToObject(dp, "degree", s->dp);
  if (w->dp_micro != NULL && w->n_dp_micro == s->dp)
    cJSON_AddItemToObject(dp, "micro_batches", cJSON_CreateIntArray(w->dp_micro, w->n_dp_micro));
  cJSON_AddNumberToObject(cJSON_AddObjectToObject(st, "tensor_parallel"), "degree", s->tp);
  cJSON *pp = cJSON_AddObjectToObject(st, "pipeline_parallel");
  cJSON_AddNumberToObject(pp, "degree", s->pp);
  int v = s->virtual_stages > 1 ? s->virtual_stages : 1;
  enum mr_pp_schedule sched = v > 1 ? MR_PP_INTERLEAVED : s->schedule;
  if (sched == MR_PP_INTERLEAVED && (s->pp < 2 || v < 2))
    sched = MR_PP_1F1B; /* one chunk per stage: interleaving is plain 1F1B */
  cJSON_AddStringToObject(pp, "schedule", schedules[sched]);
  cJSON_AddNumberToObject(pp, "virtual_stages", v);
  cJSON_AddNumberToObject(pp, "micro_batches", s->micro_batches > 0 ? s->micro_batches : 1);
  if (w->chunk_layers != NULL && w->n_chunk_layers == s->pp * v)
    cJSON_AddItemToObject(pp, "layers", cJSON_CreateIntArray(w->chunk_layers, w->n_chunk_layers));
  cJSON_AddStringToObject(st, "mesh_mapping",
                          s->mapping == MR_MAP_TP_PP_DP ? "tp,pp,dp" : "tp,dp,pp");
  cJSON_AddBoolToObject(cJSON_AddObjectToObject(st, "sequence_parallel"), "enable",
                        s->sequence_parallel && s->tp > 1);
  cJSON *rc = cJSON_AddObjectToObject(st, "recompute");
  cJSON_AddBoolToObject(rc, "enable", s->recompute != MR_RECOMPUTE_NONE);
  if (s->recompute != MR_RECOMPUTE_NONE) {
    cJSON_AddStringToObject(rc, "granularity",
                            s->recompute == MR_RECOMPUTE_MODE_SELECTIVE ? "selective" : "full");
    cJSON_AddNumberToObject(rc, "checkpoint_every_n_layers",
                            s->recompute_every_n > 0 ? s->recompute_every_n : 1);
  }
  cJSON *sh = cJSON_AddObjectToObject(st, "sharding");
  cJSON_AddNumberToObject(sh, "stage", s->zero_stage);
  cJSON_AddBoolToObject(sh, "offload", s->offload);
  cJSON *amp = cJSON_AddObjectToObject(st, "amp");
  cJSON_AddStringToObject(amp, "dtype", amps[s->amp_dtype]);
  if (init_loss_scaling > 0)
    cJSON_AddNumberToObject(amp, "init_loss_scaling", init_loss_scaling);
  cJSON_AddNumberToObject(st, "gradient_accumulation_steps",
                          s->grad_accum_steps > 0 ? s->grad_accum_steps : 1);
  return st;
}

char *mr_strategy_apply(const struct mr_job *job, const struct mr_strategy *s) {
  cJSON *o = cJSON_Parse(job->text);
  struct mr_workload w = mr_workload_of(&job->model, &job->train, &job->strategy);
  cJSON *st = mr_strategy_json(s, job->strategy.init_loss_scaling, &w);
  if (o == NULL || st == NULL) {
    cJSON_Delete(o), cJSON_Delete(st);
    return NULL;
  }
  if (job->strategy.grad_accum_in_op >= 0)
    cJSON_AddBoolToObject(st, "gradient_accumulation_in_op", job->strategy.grad_accum_in_op);
  cJSON_DeleteItemFromObjectCaseSensitive(o, "strategy");
  cJSON_AddItemToObject(o, "strategy", st);
  char *text = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  return text;
}

static void describe(const struct mr_plan_candidate *c, char *buf, size_t n) {
  const struct mr_strategy *s = &c->strategy;
  static const char *const rcs[] = {"", ", selective recompute", ", full recompute"};
  snprintf(buf, n, "dp%d x tp%d x pp%d%s%s, ZeRO-%d%s%s, micro-batch %d x %d, %s; predicted "
           "%.3g s/step, %.0f tokens/s, %.1f%% MFU, %.0f MiB per rank",
           s->dp, s->tp, s->pp,
           s->pp > 1 ? (s->virtual_stages > 1 ? " (interleaved)"
                        : s->schedule == MR_PP_GPIPE ? " (gpipe)" : " (1f1b)") : "",
           s->sequence_parallel && s->tp > 1 ? ", sequence parallel" : "", s->zero_stage,
           s->offload ? " offload" : "", rcs[s->recompute], s->micro_batch_size,
           s->micro_batches * (s->grad_accum_steps > 0 ? s->grad_accum_steps : 1),
           s->amp_dtype == MR_AMP_BF16 ? "bf16" : s->amp_dtype == MR_AMP_FP16 ? "fp16" : "fp32",
           c->cost.step_time_s, c->cost.tokens_per_s, 100 * c->cost.mfu,
           (double)c->cost.mem.total / 1048576.0);
}

void mr_strategy_print(const struct mr_strategy_choice *c, FILE *f) {
  char line[512];
  describe(&c->chosen, line, sizeof line);
  fprintf(f, "meshrun: strategy: %s\n", line);
  if (c->dp_split[0] != '\0')
    fprintf(f, "meshrun: micro-batches by data-parallel rank: %s "
            "(strategy.data_parallel.micro_batches; the step paced by the busiest)\n",
            c->dp_split);
  if (c->have_best && memcmp(&c->best.strategy, &c->chosen.strategy, sizeof c->best.strategy)) {
    describe(&c->best, line, sizeof line);
    fprintf(f, "meshrun: the planner's best, which this job cannot run: %s\n", line);
  }
  fprintf(f, "meshrun: cluster spec: %s\n", c->cluster_path);
}

int mr_plan_dump_rank(const struct mr_job *job, const struct mr_strategy *s, int world, int rank,
                      FILE *f) {
  if (rank >= world) {
    fprintf(stderr, "meshrun plan: --rank %d: expected a rank below the world size %d\n", rank,
            world);
    return 2;
  }
  struct mr_job j;
  struct mr_lowered L;
  struct mr_rank_program p;
  memset(&j, 0, sizeof j);
  int rc = job_with(job, s, &j);
  if (rc == 0 && (rc = mr_lower_check_all(&j, world, NULL)) == 0 &&
      (rc = mr_lower_graph(&j, world, &L)) == 0) {
    if ((rc = mr_rank_program_build(&L, rank, &p)) == 0) {
      fprintf(f, "\ncommunication check: every rank's program fits together (%d ranks)\n",
              world);
      char *text = mr_rank_program_format(&p);
      if (text != NULL)
        fputs(text, f);
      else
        rc = mr_error_set(MR_ENOMEM, "out of memory for rank %d's program text", rank);
      free(text);
      mr_rank_program_close(&p);
    }
    mr_lowered_close(&L);
  }
  mr_job_close(&j);
  if (rc < 0) {
    fprintf(stderr, "meshrun plan: --dump: %s\n", mr_error_message());
    return 1;
  }
  return 0;
}
