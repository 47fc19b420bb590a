/* rebalance.c - the layer split that is fastest at the stages' measured
 * speeds. */
#include "launcher/rebalance.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "compiler/planner/partition.h"
#include "compiler/spmd/lower.h"
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

/* Deals dp * n slices of q sequences, `unit` at a time, to the data rank
 * that would finish them first (fixed[d]: its per-step work, u[d]: its
 * time per sequence, bubble: the pipeline's fill and drain in slices);
 * the pace. */
static double deal(const struct mr_dp_rebalance_in *in, int n, double q, const double *fixed,
                   const double *u, int *counts) {
  int dp = in->dp, unit = in->unit > 1 ? in->unit : 1;
  double b = in->bubble;
  for (int d = 0; d < dp; d++)
    counts[d] = unit;
  for (int left = dp * n - dp * unit; left > 0; left -= unit) {
    int best = 0;
    for (int d = 1; d < dp; d++)
      if (fixed[d] + (counts[d] + unit + b) * q * u[d] <
          fixed[best] + (counts[best] + unit + b) * q * u[best])
        best = d;
    counts[best] += unit;
  }
  double pace = 0;
  for (int d = 0; d < dp; d++)
    pace = fmax(pace, fixed[d] + (counts[d] + b) * q * u[d]);
  return pace;
}

int mr_dp_rebalance(const struct mr_dp_rebalance_in *in, struct mr_dp_rebalance_out *out) {
  int dp = in->dp, sum = 0, unit = in->unit > 1 ? in->unit : 1;
  if (dp < 1 || in->n_micro < 1 || in->global_batch % ((int64_t)dp * in->n_micro) != 0 ||
      in->n_micro % unit != 0 || !(in->bubble >= 0))
    return mr_error_set(MR_EINVAL, "rebalance: %lld sequences do not split over %d data ranks "
                        "x %d micro-batches (%d at a time)", (long long)in->global_batch, dp,
                        in->n_micro, unit);
  for (int d = 0; d < dp; d++)
    sum += in->counts != NULL ? in->counts[d] : in->n_micro;
  if (sum != dp * in->n_micro)
    return mr_error_set(MR_EINVAL, "rebalance: data ranks hold %d micro-batches, the step %d",
                        sum, dp * in->n_micro);
  double *u = malloc((size_t)dp * sizeof *u), *fixed = malloc((size_t)dp * sizeof *fixed);
  int *trial = malloc((size_t)dp * sizeof *trial);
  if (u == NULL || fixed == NULL || trial == NULL) {
    free(u), free(fixed), free(trial);
    return MR_ENOMEM;
  }
  double q_now = (double)in->global_batch / ((double)dp * in->n_micro);
  out->now = 0;
  int rc = 0;
  for (int d = 0; d < dp && rc == 0; d++) {
    int k = in->counts != NULL ? in->counts[d] : in->n_micro;
    double micro = in->micro != NULL ? fmin(in->micro[d], in->busy[d]) : in->busy[d];
    if (!(in->busy[d] > 0) || !(micro > 0))
      rc = mr_error_set(MR_EINVAL, "rebalance: data rank %d has no measured work", d);
    fixed[d] = in->busy[d] - micro;
    u[d] = micro / (k * q_now); /* per sequence */
    out->now = fmax(out->now, in->busy[d] + in->bubble * q_now * u[d]);
  }
  /* the slices there are, unless there is one a rank and the job leaves
   * their number open: then the fewest micro-batches that save at least
   * 80% of what the best count saves */
  int lo = in->n_micro, hi = in->n_micro;
  if (in->n_micro == 1 && !in->fixed_micro)
    lo = 1, hi = (int)(in->global_batch / dp);
  double *pace = malloc((size_t)(hi - lo + 1) * sizeof *pace), best = INFINITY;
  if (pace == NULL && rc == 0)
    rc = MR_ENOMEM;
  for (int n = lo; n <= hi && rc == 0; n++) {
    pace[n - lo] = INFINITY; /* a count the batch does not divide into */
    if (in->global_batch % ((int64_t)dp * n) == 0 && n % unit == 0)
      pace[n - lo] = deal(in, n, (double)in->global_batch / ((double)dp * n), fixed, u, trial);
    best = fmin(best, pace[n - lo]);
  }
  for (int n = lo; n <= hi && rc == 0; n++)
    if (out->now - pace[n - lo] >= 0.8 * (out->now - best)) {
      out->n_micro = n;
      out->then = deal(in, n, (double)in->global_batch / ((double)dp * n), fixed, u, out->counts);
      break;
    }
  free(u), free(fixed), free(trial), free(pace);
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
  out->dp = L.lay.dp, out->tp = L.lay.tp, out->zero = L.lay.zero, out->n_micro = L.lay.n_micro;
  out->global_batch = job->train.global_batch;
  out->data_of = malloc((size_t)world * sizeof *out->data_of);
  if (L.dp_micro != NULL)
    out->dp_micro = malloc((size_t)L.lay.dp * sizeof *out->dp_micro);
  if (out->data_of == NULL || (L.dp_micro != NULL && out->dp_micro == NULL)) {
    mr_lowered_close(&L);
    mr_split_close(out);
    return MR_ENOMEM;
  }
  if (L.dp_micro != NULL)
    memcpy(out->dp_micro, L.dp_micro, (size_t)L.lay.dp * sizeof *out->dp_micro);
  for (int r = 0; r < world; r++) {
    int pipe, model;
    mr_lower_coords(&L.lay, r, &pipe, &out->data_of[r], &model);
  }
  mr_lowered_close(&L);
  return 0;
}

void mr_split_close(struct mr_split *s) {
  free(s->counts);
  free(s->dp_micro);
  free(s->data_of);
  memset(s, 0, sizeof *s);
}

/* plan with edit() applied to its JSON, evaluated, lowered for every rank
 * and checked: the new text, or NULL with a message. */
static char *plan_with(const struct mr_job *job, const char *plan, int world,
                       int (*edit)(cJSON *o, const void *arg), const void *arg,
                       uint64_t *digests, double *step_s) {
  cJSON *o = cJSON_Parse(plan);
  if (o == NULL || edit(o, arg) < 0) {
    if (o == NULL)
      mr_error_set(MR_EINVAL, "%s: the plan is not JSON", job->path);
    cJSON_Delete(o);
    return NULL;
  }
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

static cJSON *strategy_item(cJSON *o, const char *key) {
  return cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(o, "strategy"), key);
}

struct counts_arg {
  const int *counts;
  int n, n_micro;
  const char *path;
};

static int set_layers(cJSON *o, const void *arg) {
  const struct counts_arg *a = arg;
  cJSON *pp = strategy_item(o, "pipeline_parallel");
  if (!cJSON_IsObject(pp))
    return mr_error_set(MR_EINVAL, "%s: the plan has no pipeline", a->path);
  cJSON_DeleteItemFromObjectCaseSensitive(pp, "layers");
  cJSON_AddItemToObject(pp, "layers", cJSON_CreateIntArray(a->counts, a->n));
  return 0;
}

char *mr_plan_with_split(const struct mr_job *job, const char *plan, int world,
                         const int *counts, int n, uint64_t *digests, double *step_s) {
  struct counts_arg a = {counts, n, 0, job->path};
  return plan_with(job, plan, world, set_layers, &a, digests, step_s);
}

static int set_dp_micro(cJSON *o, const void *arg) {
  const struct counts_arg *a = arg;
  cJSON *st = cJSON_GetObjectItemCaseSensitive(o, "strategy");
  cJSON *dp = strategy_item(o, "data_parallel");
  if (!cJSON_IsObject(dp))
    return mr_error_set(MR_EINVAL, "%s: the plan has no data parallelism", a->path);
  cJSON_DeleteItemFromObjectCaseSensitive(dp, "micro_batches");
  cJSON_AddItemToObject(dp, "micro_batches", cJSON_CreateIntArray(a->counts, a->n));
  if (a->n_micro == 0) /* the count kept */
    return 0;
  cJSON *pp = strategy_item(o, "pipeline_parallel");
  if (cJSON_IsObject(pp)) { /* no pipeline: its micro-batches are accumulation's */
    cJSON_DeleteItemFromObjectCaseSensitive(pp, "micro_batches");
    cJSON_AddNumberToObject(pp, "micro_batches", 1);
  }
  cJSON_DeleteItemFromObjectCaseSensitive(st, "gradient_accumulation_steps");
  cJSON_AddNumberToObject(st, "gradient_accumulation_steps", a->n_micro);
  return 0;
}

char *mr_plan_with_dp_split(const struct mr_job *job, const char *plan, int world, int n_micro,
                            const int *counts, int dp, uint64_t *digests, double *step_s) {
  struct counts_arg a = {counts, dp, n_micro, job->path};
  return plan_with(job, plan, world, set_dp_micro, &a, digests, step_s);
}
