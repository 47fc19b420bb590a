/* rebalance.c - the layer split that is fastest at the stages' measured
 * speeds. */
#include "launcher/rebalance.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "launcher/planner/partition.h"
#include "launcher/spmd/lower.h"
#include "launcher/strategy_choice.h"

/* The work of chunk c holding n layers. */
static double chunk_work(const struct mr_rebalance_in *in, int c, int n) {
  int k = in->pp * in->vp;
  return n * in->layer + (c == 0 ? in->first : 0) + (c == k - 1 ? in->last : 0);
}

int mr_rebalance(const struct mr_rebalance_in *in, struct mr_rebalance_out *out) {
  int k = in->pp * in->vp, sum = 0;
  if (in->pp < 1 || in->vp < 1 || k > in->n_layers || !(in->layer > 0))
    return mr_error_set(MR_EINVAL, "rebalance: %d x %d chunks over %d layers", in->pp, in->vp,
                        in->n_layers);
  for (int c = 0; c < k; c++)
    sum += in->counts[c];
  if (sum != in->n_layers)
    return mr_error_set(MR_EINVAL, "rebalance: chunks hold %d layers, the model %d", sum,
                        in->n_layers);
  double fastest = INFINITY;
  for (int s = 0; s < in->pp; s++) {
    double work = 0;
    for (int c = s; c < k; c += in->pp)
      work += chunk_work(in, c, in->counts[c]);
    if (!(in->busy[s] > 0) || !(work > 0))
      return mr_error_set(MR_EINVAL, "rebalance: stage %d has no measured work", s);
    out->slowness[s] = in->busy[s] / work;
    fastest = fmin(fastest, out->slowness[s]);
  }
  for (int s = 0; s < in->pp; s++)
    out->slowness[s] /= fastest;
  double *item = malloc((size_t)in->n_layers * sizeof *item);
  double *speed = malloc((size_t)k * sizeof *speed);
  int *start = malloc((size_t)k * sizeof *start);
  int rc = MR_ENOMEM;
  if (item == NULL || speed == NULL || start == NULL)
    goto done;
  for (int i = 0; i < in->n_layers; i++)
    item[i] = in->layer;
  item[0] += in->first;
  item[in->n_layers - 1] += in->last;
  out->now = 0;
  for (int c = 0; c < k; c++) {
    speed[c] = out->slowness[c % in->pp];
    out->now = fmax(out->now, speed[c] * chunk_work(in, c, in->counts[c]));
  }
  out->then = mr_partition_dp(item, in->n_layers, k, speed, start);
  if (out->then < 0) {
    rc = (int)out->then;
    goto done;
  }
  for (int c = 0; c < k; c++)
    out->counts[c] = (c + 1 < k ? start[c + 1] : in->n_layers) - start[c];
  out->gain = 1.0 - out->then / out->now;
  rc = 0;
done:
  free(item), free(speed), free(start);
  return rc;
}

int mr_split_of_plan(const struct mr_job *job, const char *plan, int world, struct mr_split *out) {
  memset(out, 0, sizeof *out);
  struct mr_job j;
  MR_TRY(mr_job_parse(plan, job->path, "/", &j));
  struct mr_lowered L;
  int rc = mr_lower_graph(&j, world, &L);
  mr_job_close(&j);
  if (rc < 0)
    return rc;
  out->pp = L.lay.pp, out->vp = L.lay.vp;
  out->n_layers = L.chunk_first_layer[L.n_chunks];
  out->layer = L.layer_flops, out->first = L.first_flops, out->last = L.last_flops;
  if ((out->counts = malloc((size_t)L.n_chunks * sizeof *out->counts)) == NULL) {
    mr_lowered_close(&L);
    return MR_ENOMEM;
  }
  for (int c = 0; c < L.n_chunks; c++)
    out->counts[c] = L.chunk_first_layer[c + 1] - L.chunk_first_layer[c];
  mr_lowered_close(&L);
  return 0;
}

void mr_split_close(struct mr_split *s) {
  free(s->counts);
  memset(s, 0, sizeof *s);
}

char *mr_plan_with_split(const struct mr_job *job, const char *plan, int world,
                         const int *counts, int n, uint64_t *digests, double *step_s) {
  cJSON *o = cJSON_Parse(plan);
  cJSON *pp = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(o, "strategy"),
                                               "pipeline_parallel");
  if (!cJSON_IsObject(pp)) {
    cJSON_Delete(o);
    mr_error_set(MR_EINVAL, "%s: the plan has no pipeline", job->path);
    return NULL;
  }
  cJSON_DeleteItemFromObjectCaseSensitive(pp, "layers");
  cJSON_AddItemToObject(pp, "layers", cJSON_CreateIntArray(counts, n));
  if (job->cluster != NULL) { /* the spec the launch planned with (a GPU machine's, measured) */
    cJSON_DeleteItemFromObjectCaseSensitive(o, "cluster");
    cJSON_AddStringToObject(o, "cluster", job->cluster);
  }
  char *text = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  /* the plan's strategy is fixed (manual): choosing evaluates it — it
   * must fit the device's memory with its layers moved — and lowers and
   * checks every rank's program */
  struct mr_job j;
  struct mr_strategy_choice choice;
  int rc = text != NULL ? mr_job_parse(text, job->path, "/", &j) : MR_ENOMEM;
  if (rc == 0) {
    rc = mr_strategy_choose(&j, world, &choice);
    if (rc == 0)
      memcpy(digests, choice.program_digests, (size_t)world * sizeof *digests);
    if (rc == 0 && step_s != NULL)
      *step_s = choice.chosen.cost.step_time_s;
    mr_strategy_choice_close(&choice);
    mr_job_close(&j);
  }
  if (rc < 0) {
    free(text);
    return NULL;
  }
  return text;
}
