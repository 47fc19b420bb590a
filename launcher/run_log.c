/* run_log.c - run.jsonl, one event a line (run_log.h). */
#include "launcher/run_log.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "common/log.h"

struct mr_run_log {
  FILE *f;
  char path[4096];
  uint64_t *peak, *rss; // [n] the last memory event's (rss in MiB)
  int n;
};

int mr_run_log_open(const char *dir, struct mr_run_log **out) {
  *out = NULL;
  struct mr_run_log *l = calloc(1, sizeof *l);
  if (l == NULL)
    return mr_error_set(MR_ENOMEM, "out of memory");
  snprintf(l->path, sizeof l->path, "%s/" MR_RUN_LOG, dir);
  if ((l->f = fopen(l->path, "a")) == NULL) {
    int rc = mr_error_set(MR_EIO, "%s: %s", l->path, strerror(errno));
    free(l);
    return rc;
  }
  *out = l;
  return 0;
}

void mr_run_log_close(struct mr_run_log *l) {
  if (l == NULL)
    return;
  if (l->f != NULL)
    fclose(l->f);
  free(l->peak), free(l->rss);
  free(l);
}

/* A new event object with its name and the wall time. */
static cJSON *event(const char *name) {
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "event", name);
  cJSON_AddNumberToObject(o, "time", (double)t.tv_sec + (double)t.tv_nsec * 1e-9);
  return o;
}

/* Writes o as one line, flushed, and frees it; the first failure closes
 * the log with a warning. */
static void put(struct mr_run_log *l, cJSON *o) {
  char *text = o != NULL ? cJSON_PrintUnformatted(o) : NULL;
  cJSON_Delete(o);
  if (l->f != NULL && (text == NULL || fputs(text, l->f) < 0 || fputc('\n', l->f) < 0 ||
                       fflush(l->f) != 0)) {
    MR_WARN("launch", "%s: %s: no more of the run's events recorded (training goes on)", l->path,
            text == NULL ? "out of memory" : strerror(errno));
    fclose(l->f);
    l->f = NULL;
  }
  free(text);
}

void mr_run_log_start(struct mr_run_log *l, const char *job_id, int world, int nodes,
                      int max_restarts) {
  if (l == NULL)
    return;
  cJSON *o = event("start");
  cJSON_AddStringToObject(o, "job_id", job_id);
  cJSON_AddNumberToObject(o, "world", world);
  cJSON_AddNumberToObject(o, "nodes", nodes);
  cJSON_AddNumberToObject(o, "max_restarts", max_restarts);
  put(l, o);
}

static int num_at(const cJSON *o, const char *a, const char *b, int dflt) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, a);
  if (b != NULL)
    v = cJSON_GetObjectItemCaseSensitive(v, b);
  return cJSON_IsNumber(v) ? v->valueint : dflt;
}

static int true_at(const cJSON *o, const char *a, const char *b) {
  return cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(o, a), b));
}

/* Where the plan puts a step's batch, weights, gradients and optimizer
 * state, in words: one line per mesh dim that splits anything. */
static cJSON *placements(const cJSON *job, const cJSON *st) {
  cJSON *a = cJSON_CreateArray();
  int dp = num_at(st, "data_parallel", "degree", 1);
  int tp = num_at(st, "tensor_parallel", "degree", 1);
  int pp = num_at(st, "pipeline_parallel", "degree", 1);
  int zero = num_at(st, "sharding", "stage", 0);
  char line[1024];
  static const char *const zero_what[] = {
      "weights, gradients and optimizer state Replicate",
      "optimizer state Shard(0), weights and gradients Replicate",
      "gradients and optimizer state Shard(0), weights Replicate",
      "weights, gradients and optimizer state Shard(0)"};
  snprintf(line, sizeof line, "data (%d): the batch Shard(0); %s%s", dp,
           zero_what[zero >= 0 && zero <= 3 ? zero : 0],
           true_at(st, "sharding", "offload") ? " (optimizer state in host memory)" : "");
  cJSON_AddItemToArray(a, cJSON_CreateString(line));
  if (tp > 1) {
    const cJSON *rules = cJSON_GetObjectItemCaseSensitive(job, "shard_rules"), *r;
    int n = snprintf(line, sizeof line, "model (%d): ", tp);
    if (cJSON_GetArraySize(rules) == 0)
      n += snprintf(line + n, sizeof line - (size_t)n,
                    "Megatron's layout: column-parallel projections in, row-parallel out, "
                    "the embedding and the head split by vocabulary");
    cJSON_ArrayForEach(r, rules) {
      const cJSON *m = cJSON_GetObjectItemCaseSensitive(r, "match"), *p;
      cJSON_ArrayForEach(p, cJSON_GetObjectItemCaseSensitive(r, "placements")) {
        const cJSON *dim = cJSON_GetObjectItemCaseSensitive(p, "mesh_dim");
        const cJSON *pl = cJSON_GetObjectItemCaseSensitive(p, "placement");
        if (n < (int)sizeof line && cJSON_IsString(m) && cJSON_IsString(pl))
          n += snprintf(line + n, sizeof line - (size_t)n, "%s%s %s on %s",
                        r == rules->child ? "" : "; ", m->valuestring, pl->valuestring,
                        cJSON_IsString(dim) ? dim->valuestring : "model");
      }
    }
    if (true_at(st, "sequence_parallel", "enable") && n < (int)sizeof line)
      snprintf(line + n, sizeof line - (size_t)n, "; sequence parallel: the activations "
               "between blocks split by sequence");
    cJSON_AddItemToArray(a, cJSON_CreateString(line));
  }
  if (pp > 1) {
    int v = num_at(st, "pipeline_parallel", "virtual_stages", 1);
    const cJSON *layers =
        cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(st, "pipeline_parallel"),
                                         "layers");
    int n = snprintf(line, sizeof line, "pipeline (%d): %d chunk%s a stage, layers per chunk ", pp,
                     v, v == 1 ? "" : "s");
    const cJSON *x;
    cJSON_ArrayForEach(x, layers) if (n < (int)sizeof line) n += snprintf(
        line + n, sizeof line - (size_t)n, "%s%d", x == layers->child ? "" : ",", x->valueint);
    if (cJSON_GetArraySize(layers) == 0 && n < (int)sizeof line)
      snprintf(line + n, sizeof line - (size_t)n, "balanced by FLOPs");
    cJSON_AddItemToArray(a, cJSON_CreateString(line));
  }
  return a;
}

void mr_run_log_plan(struct mr_run_log *l, const struct mr_run_log_plan *p) {
  if (l == NULL)
    return;
  cJSON *o = event("plan");
  cJSON_AddNumberToObject(o, "restart", p->restart);
  cJSON_AddNumberToObject(o, "world", p->world);
  cJSON_AddNumberToObject(o, "nodes", p->nodes);
  cJSON *job = p->plan_text != NULL ? cJSON_Parse(p->plan_text) : NULL;
  cJSON *st = cJSON_DetachItemFromObjectCaseSensitive(job, "strategy");
  if (st != NULL) {
    cJSON_AddItemToObject(o, "placements", placements(job, st));
    cJSON_AddItemToObject(o, "strategy", st);
  }
  const cJSON *steps = cJSON_GetObjectItemCaseSensitive(
      cJSON_GetObjectItemCaseSensitive(job, "train"), "steps");
  if (cJSON_IsNumber(steps))
    cJSON_AddNumberToObject(o, "steps", steps->valuedouble);
  cJSON_Delete(job);
  cJSON_AddNumberToObject(o, "predicted_step_s", isfinite(p->predicted_s) ? p->predicted_s : 0);
  cJSON_AddNumberToObject(o, "peak_device_s", isfinite(p->peak_device_s) ? p->peak_device_s : 0);
  cJSON_AddNumberToObject(o, "metrics_at", (double)p->metrics_at);
  put(l, o);
}

void mr_run_log_memory(struct mr_run_log *l, int restart, int64_t step, const uint64_t *peak,
                       const uint64_t *rss, int n) {
  if (l == NULL || n <= 0)
    return;
  if (n != l->n) {
    uint64_t *a = calloc((size_t)n, sizeof *a), *b = calloc((size_t)n, sizeof *b);
    if (a == NULL || b == NULL) {
      free(a), free(b);
      return;
    }
    free(l->peak), free(l->rss);
    l->peak = a, l->rss = b, l->n = n;
  }
  int moved = 0;
  for (int i = 0; i < n; i++) {
    moved |= peak[i] != l->peak[i] || rss[i] >> 20 != l->rss[i];
    l->peak[i] = peak[i], l->rss[i] = rss[i] >> 20;
  }
  if (!moved)
    return;
  cJSON *o = event("memory");
  cJSON_AddNumberToObject(o, "restart", restart);
  cJSON_AddNumberToObject(o, "step", (double)step);
  cJSON *pa = cJSON_AddArrayToObject(o, "peak_memory_bytes");
  cJSON *ra = cJSON_AddArrayToObject(o, "rss_peak_bytes");
  for (int i = 0; i < n; i++) {
    cJSON_AddItemToArray(pa, cJSON_CreateNumber((double)peak[i]));
    cJSON_AddItemToArray(ra, cJSON_CreateNumber((double)rss[i]));
  }
  put(l, o);
}

void mr_run_log_failure(struct mr_run_log *l, int restart, int rank, const char *reason,
                        int exited, int64_t status, int signal) {
  if (l == NULL)
    return;
  cJSON *o = event("failure");
  cJSON_AddNumberToObject(o, "restart", restart);
  cJSON_AddNumberToObject(o, "rank", rank);
  cJSON_AddStringToObject(o, "reason", reason != NULL ? reason : "");
  if (exited) {
    cJSON_AddNumberToObject(o, "exit_status", (double)status);
    cJSON_AddNumberToObject(o, "signal", signal);
  }
  put(l, o);
}

void mr_run_log_restart(struct mr_run_log *l, int restart, const char *cause, int failures,
                        int max_restarts, double stopped_s) {
  if (l == NULL)
    return;
  cJSON *o = event("restart");
  cJSON_AddNumberToObject(o, "restart", restart);
  cJSON_AddStringToObject(o, "cause", cause);
  cJSON_AddNumberToObject(o, "failures", failures);
  cJSON_AddNumberToObject(o, "max_restarts", max_restarts);
  cJSON_AddNumberToObject(o, "stopped_s", stopped_s);
  put(l, o);
}

void mr_run_log_end(struct mr_run_log *l, int exit_code, int restart, int failures,
                    const char *reason) {
  if (l == NULL)
    return;
  cJSON *o = event("end");
  cJSON_AddStringToObject(o, "outcome", exit_code == 0    ? "done"
                                        : exit_code > 128 ? "stopped"
                                                          : "failed");
  cJSON_AddNumberToObject(o, "exit_code", exit_code);
  cJSON_AddNumberToObject(o, "restart", restart);
  cJSON_AddNumberToObject(o, "failures", failures);
  cJSON_AddStringToObject(o, "reason", reason != NULL ? reason : "");
  put(l, o);
}
