/* report_read.c - a run folder read back (report.h): metrics.jsonl,
 * run.jsonl and coordinator.json, every field checked. */
#include "launcher/report.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/jsonv.h"
#include "launcher/run_log.h"

/* One line of a JSON-lines file, as the readers below take it. */
struct line {
  const char *path;
  int number;     // from 1
  int64_t offset; // bytes before it
  struct mr_jv jv;
  char name[4200]; // "PATH:LINE", what the messages name
};

/* Calls each(ctx, obj, line) for every complete line of path (a missing
 * file has none: returns 0).  Stops at the first line that is not a JSON
 * object or that each() finds wrong, returning MR_EFORMAT with every
 * problem of that line in the message. */
static int each_line(const char *path, void *ctx,
                     int (*each)(void *ctx, const cJSON *o, struct line *l)) {
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return errno == ENOENT ? 0 : mr_error_set(MR_EIO, "%s: %s", path, strerror(errno));
  char *buf = NULL;
  size_t cap = 0;
  ssize_t len;
  struct line l = {.path = path};
  int rc = 0;
  for (int64_t next = 0; rc == 0 && (len = getline(&buf, &cap, f)) > 0; next += len) {
    if (buf[len - 1] != '\n') /* being written now */
      break;
    l.number++;
    l.offset = next;
    snprintf(l.name, sizeof l.name, "%s:%d", path, l.number);
    cJSON *o = cJSON_Parse(buf);
    mr_jv_init(&l.jv, l.name);
    if (!cJSON_IsObject(o))
      rc = mr_error_set(MR_EFORMAT, "%s: expected a JSON object on the line", l.name);
    else
      rc = each(ctx, o, &l);
    if (rc == 0 && l.jv.n_errors > 0)
      rc = mr_error_set(MR_EFORMAT, "%s", l.jv.errors);
    mr_jv_close(&l.jv);
    cJSON_Delete(o);
  }
  free(buf);
  if (rc == 0 && ferror(f))
    rc = mr_error_set(MR_EIO, "%s: %s", path, strerror(errno));
  fclose(f);
  return rc;
}

/* A number, JSON's null (NaN) or absent (NaN); anything else an error. */
static void num_or_null(struct line *l, const cJSON *o, const char *key, double *out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  *out = NAN;
  if (v != NULL && !cJSON_IsNull(v))
    mr_jv_num(&l->jv, o, "", key, -INFINITY, INFINITY, out);
}

static int int_field(struct line *l, const cJSON *o, const char *key, int64_t min, int64_t max,
                     int required, int64_t *out) {
  int got = mr_jv_int(&l->jv, o, "", key, min, max, out);
  if (got == 0 && required)
    mr_jv_error(&l->jv, "", key, "expected an integer, got nothing");
  return got;
}

/* A string, empty or not; *out borrowed. */
static void str_field(struct line *l, const cJSON *o, const char *key, const char **out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  char shown[96];
  if (cJSON_IsString(v))
    *out = v->valuestring;
  else
    mr_jv_error(&l->jv, "", key, "expected a string, got %s", mr_jv_show(v, shown, sizeof shown));
}

/* Appends n bytes of each at *arr (count *n). */
static void *grow(void *arr, int *n, size_t each) {
  char *p = realloc(arr, (size_t)(*n + 1) * each);
  if (p == NULL)
    return NULL;
  memset(p + (size_t)*n * each, 0, each);
  (*n)++;
  return p;
}

/* ---- metrics.jsonl ------------------------------------------------------ */

struct records {
  struct mr_run_step *r;
  int64_t *at; // [n] each record's byte offset
  int n;
};

static int on_metric(void *ctx, const cJSON *o, struct line *l) {
  struct records *rs = ctx;
  struct mr_run_step s = {.group = -1, .mfu = NAN, .predicted_s = NAN};
  int64_t v = 0;
  int_field(l, o, "step", 0, INT64_C(1) << 53, 1, &s.step);
  if (int_field(l, o, "restart", 0, INT32_MAX, 0, &v) == 1)
    s.restart = (int)v;
  num_or_null(l, o, "loss", &s.loss);
  num_or_null(l, o, "val_loss", &s.val_loss);
  num_or_null(l, o, "lr", &s.lr);
  num_or_null(l, o, "grad_norm", &s.grad_norm);
  num_or_null(l, o, "tokens_per_s", &s.tokens_per_s);
  num_or_null(l, o, "step_time_s", &s.step_time_s);
  num_or_null(l, o, "comm_wait_s", &s.comm_wait_s);
  num_or_null(l, o, "peak_memory_bytes", &s.peak_memory_bytes);
  if (l->jv.n_errors > 0)
    return 0;
  int n = rs->n;
  struct mr_run_step *r = grow(rs->r, &n, sizeof *r);
  if (r == NULL)
    return MR_ENOMEM;
  rs->r = r;
  n = rs->n;
  int64_t *at = grow(rs->at, &n, sizeof *at);
  if (at == NULL)
    return MR_ENOMEM;
  rs->at = at;
  rs->r[rs->n] = s;
  rs->at[rs->n] = l->offset;
  rs->n = n;
  return 0;
}

static int by_step(const void *a, const void *b) {
  const struct mr_run_step *x = a, *y = b;
  return (x->step > y->step) - (x->step < y->step);
}

/* Each record to its group (the last one begun before it in the file),
 * with that plan's MFU and predicted step time; then each step once, as
 * its last record holds it. */
static void steps_of(struct mr_run *run, struct records *rs) {
  for (int i = 0, g = -1; i < rs->n; i++) {
    while (g + 1 < run->n_groups && run->groups[g + 1].metrics_at <= rs->at[i])
      g++;
    struct mr_run_step *s = &rs->r[i];
    s->group = g;
    if (g < 0)
      continue;
    struct mr_run_group *G = &run->groups[g];
    if (G->first_step < 0 || s->step < G->first_step)
      G->first_step = s->step;
    if (G->peak_device_s > 0 && G->world > 0 && s->step_time_s > 0)
      s->mfu = G->peak_device_s / (s->step_time_s * G->world);
    if (G->predicted_s > 0)
      s->predicted_s = G->predicted_s;
  }
  /* sorted by step, stably (insertion: the records are nearly in order),
   * so that a step's last record is the last of its run */
  struct mr_run_step *r = rs->r;
  for (int i = 1; i < rs->n; i++)
    for (int j = i; j > 0 && by_step(&r[j - 1], &r[j]) > 0; j--) {
      struct mr_run_step t = r[j];
      r[j] = r[j - 1], r[j - 1] = t;
    }
  int n = 0;
  for (int i = 0; i < rs->n; i++) {
    if (n > 0 && r[n - 1].step == r[i].step)
      n--;
    r[n++] = r[i];
  }
  run->steps = r, run->n_steps = n, run->n_records = rs->n;
  rs->r = NULL;
}

/* ---- run.jsonl ---------------------------------------------------------- */

static void describe_plan(struct mr_run_group *g, const cJSON *st) {
#define AT(a, b) cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(st, a), b)
#define NUM(a, b, d) (cJSON_IsNumber(AT(a, b)) ? AT(a, b)->valueint : (d))
#define STR(v, d) (cJSON_IsString(v) ? (v)->valuestring : (d))
  const cJSON *map = cJSON_GetObjectItemCaseSensitive(st, "mesh_mapping");
  snprintf(g->mesh, sizeof g->mesh, "data %d x model %d x pipeline %d (order %s)",
           NUM("data_parallel", "degree", 1), NUM("tensor_parallel", "degree", 1),
           NUM("pipeline_parallel", "degree", 1), STR(map, "tp,dp,pp"));
  const cJSON *ga = cJSON_GetObjectItemCaseSensitive(st, "gradient_accumulation_steps");
  int micro = NUM("pipeline_parallel", "micro_batches", 1);
  int accum = cJSON_IsNumber(ga) ? ga->valueint : 1;
  int virt = NUM("pipeline_parallel", "virtual_stages", 1), zero = NUM("sharding", "stage", 0);
  char rc[96] = "no recompute";
  if (cJSON_IsTrue(AT("recompute", "enable")))
    snprintf(rc, sizeof rc, "%s recompute every %d layer%s",
             STR(AT("recompute", "granularity"), "full"),
             NUM("recompute", "checkpoint_every_n_layers", 1),
             NUM("recompute", "checkpoint_every_n_layers", 1) == 1 ? "" : "s");
  char v[48] = "", acc[48] = "";
  if (virt > 1)
    snprintf(v, sizeof v, ", %d virtual stages", virt);
  if (accum > 1)
    snprintf(acc, sizeof acc, " (%d accumulated)", accum);
  snprintf(g->schedule, sizeof g->schedule,
           "%s%s, %d micro-batch%s a step%s, ZeRO-%d%s, %s, %s%s",
           STR(AT("pipeline_parallel", "schedule"), "1f1b"), v, micro, micro == 1 ? "" : "es",
           acc, zero, cJSON_IsTrue(AT("sharding", "offload")) ? " offload" : "", rc,
           STR(AT("amp", "dtype"), "fp32"),
           cJSON_IsTrue(AT("sequence_parallel", "enable")) ? ", sequence parallel" : "");
#undef AT
#undef NUM
#undef STR
}

static int on_plan(const cJSON *o, struct line *l, struct mr_run_group *g) {
  int64_t v;
  if (int_field(l, o, "restart", 0, INT32_MAX, 1, &v) == 1)
    g->restart = (int)v;
  if (int_field(l, o, "world", 1, INT32_MAX, 1, &v) == 1)
    g->world = (int)v;
  if (int_field(l, o, "nodes", 1, INT32_MAX, 1, &v) == 1)
    g->nodes = (int)v;
  int_field(l, o, "metrics_at", 0, INT64_C(1) << 53, 1, &g->metrics_at);
  int_field(l, o, "steps", 0, INT64_C(1) << 53, 0, &g->steps);
  mr_jv_num(&l->jv, o, "", "predicted_step_s", 0, INFINITY, &g->predicted_s);
  mr_jv_num(&l->jv, o, "", "peak_device_s", 0, INFINITY, &g->peak_device_s);
  const cJSON *st = NULL;
  mr_jv_obj(&l->jv, o, "", "strategy", &st);
  describe_plan(g, st);
  const cJSON *pl = cJSON_GetObjectItemCaseSensitive(o, "placements"), *p;
  cJSON_ArrayForEach(p, pl) {
    if (!cJSON_IsString(p)) {
      mr_jv_error(&l->jv, "", "placements", "expected an array of strings");
      break;
    }
    char **a = grow(g->placements, &g->n_placements, sizeof *a);
    if (a == NULL)
      return MR_ENOMEM;
    g->placements = a;
    if ((a[g->n_placements - 1] = strdup(p->valuestring)) == NULL)
      return MR_ENOMEM;
  }
  return 0;
}

/* The last memory event's arrays. */
static int on_memory(struct mr_run *run, const cJSON *o, struct line *l) {
  int_field(l, o, "step", 0, INT64_C(1) << 53, 1, &run->memory_step);
  const cJSON *pa = cJSON_GetObjectItemCaseSensitive(o, "peak_memory_bytes");
  const cJSON *ra = cJSON_GetObjectItemCaseSensitive(o, "rss_peak_bytes");
  int n = cJSON_GetArraySize(pa);
  if (!cJSON_IsArray(pa) || !cJSON_IsArray(ra) || cJSON_GetArraySize(ra) != n || n == 0) {
    mr_jv_error(&l->jv, "", "peak_memory_bytes", "expected it and rss_peak_bytes: arrays of a "
                "number per rank, as long as each other");
    return 0;
  }
  uint64_t *peak = calloc((size_t)n, sizeof *peak), *rss = calloc((size_t)n, sizeof *rss);
  if (peak == NULL || rss == NULL) {
    free(peak), free(rss);
    return MR_ENOMEM;
  }
  for (int i = 0; i < n; i++) {
    int64_t a = 0, b = 0;
    if (!mr_json_count(cJSON_GetArrayItem(pa, i), INT64_C(1) << 53, &a) ||
        !mr_json_count(cJSON_GetArrayItem(ra, i), INT64_C(1) << 53, &b)) {
      mr_jv_error(&l->jv, "", "peak_memory_bytes", "expected byte counts (whole numbers >= 0)");
      break;
    }
    peak[i] = (uint64_t)a, rss[i] = (uint64_t)b;
  }
  free(run->rank_peak), free(run->rank_rss);
  run->rank_peak = peak, run->rank_rss = rss, run->n_ranks = n;
  return 0;
}

static int on_event(void *ctx, const cJSON *o, struct line *l) {
  struct mr_run *run = ctx;
  static const char *const names[] = {"start", "failure", "restart", "end", "plan", "memory", NULL};
  int kind = -1;
  double time = 0;
  if (mr_jv_enum(&l->jv, o, "", "event", names, &kind) == 0)
    mr_jv_error(&l->jv, "", "event", "expected one of start, plan, memory, failure, restart, "
                "end, got nothing");
  mr_jv_num(&l->jv, o, "", "time", 0, INFINITY, &time);
  if (l->jv.n_errors > 0)
    return 0;
  int launch = 0;
  for (int i = 0; i < run->n_events; i++)
    launch += run->events[i].kind == MR_RUN_EV_START;
  if (kind == 4) {
    struct mr_run_group *g = grow(run->groups, &run->n_groups, sizeof *g);
    if (g == NULL)
      return MR_ENOMEM;
    run->groups = g;
    g += run->n_groups - 1;
    g->time = time, g->launch = launch > 0 ? launch - 1 : 0, g->first_step = -1;
    return on_plan(o, l, g);
  }
  if (kind == 5)
    return on_memory(run, o, l);
  struct mr_run_event e = {.kind = (enum mr_run_event_kind)kind, .time = time,
                           .launch = kind == MR_RUN_EV_START ? launch : launch - 1, .rank = -1};
  int64_t v = 0;
  const char *text = "", *reason = "";
  char buf[256] = "";
  switch (e.kind) {
  case MR_RUN_EV_START: {
    const char *id = "";
    int64_t world = 0, nodes = 0, max = 0;
    str_field(l, o, "job_id", &id);
    int_field(l, o, "world", 1, INT32_MAX, 1, &world);
    int_field(l, o, "nodes", 1, INT32_MAX, 1, &nodes);
    int_field(l, o, "max_restarts", 0, INT32_MAX, 1, &max);
    snprintf(buf, sizeof buf, "job %s: %lld ranks on %lld node%s, up to %lld restart%s", id,
             (long long)world, (long long)nodes, nodes == 1 ? "" : "s", (long long)max,
             max == 1 ? "" : "s");
    text = buf;
    break;
  }
  case MR_RUN_EV_FAILURE:
    if (int_field(l, o, "rank", -1, INT32_MAX, 1, &v) == 1)
      e.rank = (int)v;
    str_field(l, o, "reason", &text);
    run->n_failures++;
    break;
  case MR_RUN_EV_RESTART: {
    static const char *const causes[] = {"failure", "nodes", "balance", "dp_balance", "slow_node",
                                         NULL};
    static const char *const why[] = {
        "after a failure", "with the nodes that joined", "with the pipeline re-balanced",
        "with the data-parallel micro-batches re-balanced", "without the slow node"};
    int cause = 0;
    int64_t failures = 0, max = 0;
    double stopped = 0;
    mr_jv_enum(&l->jv, o, "", "cause", causes, &cause);
    int_field(l, o, "failures", 0, INT32_MAX, 1, &failures);
    int_field(l, o, "max_restarts", 0, INT32_MAX, 1, &max);
    mr_jv_num(&l->jv, o, "", "stopped_s", 0, INFINITY, &stopped);
    if (cause == 0)
      snprintf(buf, sizeof buf, "%s (%lld of %lld allowed; the group stopped in %.2f s)",
               why[cause], (long long)failures, (long long)max, stopped);
    else
      snprintf(buf, sizeof buf, "%s (the group stopped in %.2f s)", why[cause], stopped);
    text = buf;
    run->n_restarts++;
    break;
  }
  case MR_RUN_EV_END: {
    static const char *const outcomes[] = {"done", "failed", "stopped", NULL};
    int out = 0;
    if (mr_jv_enum(&l->jv, o, "", "outcome", outcomes, &out) == 1)
      text = outcomes[out];
    if (int_field(l, o, "exit_code", 0, 255, 1, &v) == 1)
      run->exit_code = (int)v;
    str_field(l, o, "reason", &reason);
    break;
  }
  }
  if (e.kind != MR_RUN_EV_START && int_field(l, o, "restart", 0, INT32_MAX, 1, &v) == 1)
    e.restart = (int)v;
  if (l->jv.n_errors > 0)
    return 0;
  size_t n = strlen(text) + strlen(reason) + 3;
  if ((e.text = malloc(n)) == NULL)
    return MR_ENOMEM;
  snprintf(e.text, n, "%s%s%s", text, reason[0] ? ": " : "", reason);
  struct mr_run_event *ev = grow(run->events, &run->n_events, sizeof *ev);
  if (ev == NULL) {
    free(e.text);
    return MR_ENOMEM;
  }
  run->events = ev;
  ev[run->n_events - 1] = e;
  return 0;
}

/* ---- the folder --------------------------------------------------------- */

/* coordinator.json: the job, its ranks and whether its launcher runs. */
static int read_coordinator(struct mr_run *run, const char *path, int *alive) {
  *alive = 0;
  if (access(path, F_OK) != 0)
    return 0;
  cJSON *o;
  MR_TRY(mr_json_load(path, &o));
  struct mr_jv jv;
  mr_jv_init(&jv, path);
  const char *id = NULL;
  int64_t pid = 0, world = 0, nodes = 0;
  mr_jv_str(&jv, o, "", "job_id", &id);
  mr_jv_int(&jv, o, "", "pid", 1, INT32_MAX, &pid);
  mr_jv_int(&jv, o, "", "world_size", 1, INT32_MAX, &world);
  mr_jv_int(&jv, o, "", "nodes", 1, INT32_MAX, &nodes);
  int rc = jv.n_errors > 0 ? mr_error_set(MR_EFORMAT, "%s", jv.errors) : 0;
  if (rc == 0) {
    if (id != NULL)
      snprintf(run->job_id, sizeof run->job_id, "%s", id);
    run->world = (int)world, run->nodes = (int)nodes;
    *alive = pid > 0 && (kill((pid_t)pid, 0) == 0 || errno == EPERM);
  }
  mr_jv_close(&jv);
  cJSON_Delete(o);
  return rc;
}

int mr_run_read(const char *dir, struct mr_run *run) {
  memset(run, 0, sizeof *run);
  snprintf(run->dir, sizeof run->dir, "%s", dir);
  struct stat sb;
  if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
    return mr_error_set(MR_ENOENT, "%s: %s", dir,
                        stat(dir, &sb) != 0 ? strerror(errno) : "not a folder");
  char metrics[4200], log[4200], coord[4200];
  snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", dir);
  snprintf(log, sizeof log, "%s/" MR_RUN_LOG, dir);
  snprintf(coord, sizeof coord, "%s/coordinator.json", dir);
  if (access(metrics, F_OK) != 0 && access(log, F_OK) != 0 && access(coord, F_OK) != 0)
    return mr_error_set(MR_ENOENT, "%s: not a run folder (no metrics.jsonl, " MR_RUN_LOG
                        " or coordinator.json: a `meshrun launch --log-dir`)", dir);
  int alive;
  MR_TRY(read_coordinator(run, coord, &alive));
  run->have_log = access(log, F_OK) == 0;
  MR_TRY(each_line(log, run, on_event));
  struct records rs = {0};
  int rc = each_line(metrics, &rs, on_metric);
  if (rc == 0)
    steps_of(run, &rs);
  free(rs.r), free(rs.at);
  if (rc < 0)
    return rc;
  /* the last launch's end, if it has one */
  run->state = alive ? MR_RUN_RUNNING : MR_RUN_VANISHED;
  for (int i = run->n_events - 1; i >= 0 && run->events[i].kind != MR_RUN_EV_START; i--)
    if (run->events[i].kind == MR_RUN_EV_END) {
      const char *t = run->events[i].text;
      run->state = strncmp(t, "done", 4) == 0     ? MR_RUN_DONE
                   : strncmp(t, "stopped", 7) == 0 ? MR_RUN_STOPPED
                                                   : MR_RUN_FAILED;
      break;
    }
  return 0;
}

void mr_run_close(struct mr_run *run) {
  for (int g = 0; g < run->n_groups; g++) {
    for (int i = 0; i < run->groups[g].n_placements; i++)
      free(run->groups[g].placements[i]);
    free(run->groups[g].placements);
  }
  for (int i = 0; i < run->n_events; i++)
    free(run->events[i].text);
  free(run->groups), free(run->events), free(run->steps);
  free(run->rank_peak), free(run->rank_rss);
  memset(run, 0, sizeof *run);
}

const char *mr_run_state_name(enum mr_run_state s) {
  static const char *const n[] = {[MR_RUN_RUNNING] = "running", [MR_RUN_DONE] = "done",
                                  [MR_RUN_FAILED] = "failed", [MR_RUN_STOPPED] = "stopped",
                                  [MR_RUN_VANISHED] = "ended without a record"};
  return n[s];
}
