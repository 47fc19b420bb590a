/* job.c - the job file: parse, validate as a whole, resolve paths. */
#include "common/job.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <math.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/jsonv.h"

#define BIG ((int64_t)1 << 40)

static char *resolve(const char *dir, const char *path) {
  if (path[0] == '/' || dir == NULL || dir[0] == '\0')
    return strdup(path);
  size_t n = strlen(dir) + strlen(path) + 2;
  char *out = malloc(n);
  if (out != NULL)
    snprintf(out, n, "%s/%s", dir, path);
  return out;
}

/* The job file's folder as an absolute path, so the paths it resolves mean
 * the same to a worker started elsewhere. */
static char *dir_of(const char *path) {
  const char *slash = strrchr(path, '/');
  char *dir = slash == NULL ? strdup(".") : slash == path ? strdup("/")
                                                          : strndup(path, (size_t)(slash - path));
  if (dir == NULL)
    return NULL;
  char *abs = realpath(dir, NULL);
  if (abs != NULL) {
    free(dir);
    return abs;
  }
  return dir;
}

/* Shard(d) with d a small non-negative integer, Replicate(), Partial(op). */
static int placement_ok(const char *s) {
  int d, n = -1;
  if (sscanf(s, "Shard(%d)%n", &d, &n) == 1 && n == (int)strlen(s) && d >= 0 && d < 8)
    return 1;
  return strcmp(s, "Replicate()") == 0 || strcmp(s, "Partial(sum)") == 0 ||
         strcmp(s, "Partial(avg)") == 0 || strcmp(s, "Partial(max)") == 0 ||
         strcmp(s, "Partial()") == 0;
}

static void parse_train(struct mr_jv *jv, const cJSON *t, struct mr_job *job) {
  static const char *const keys[] = {
      "steps", "global_batch", "seq_len", "lr", "schedule", "warmup_steps",
      "min_lr", "weight_decay", "betas", "eps", "grad_clip", "seed", "init",
      "eval_interval_steps", "eval_batches", "log_interval_steps", NULL};
  static const char *const schedules[] = {"constant", "cosine", NULL};
  struct mr_train_config *c = &job->train;
  const char *p = "train";
  mr_jv_only_keys(jv, t, p, keys);
  mr_jv_int(jv, t, p, "steps", 1, BIG, &c->steps);
  mr_jv_int(jv, t, p, "global_batch", 1, BIG, &c->global_batch);
  mr_jv_int(jv, t, p, "seq_len", 1, BIG, &c->seq_len);
  mr_jv_num(jv, t, p, "lr", 0, 1e3, &c->lr);
  int sched = (int)c->schedule;
  if (mr_jv_enum(jv, t, p, "schedule", schedules, &sched) == 1)
    c->schedule = (enum mr_schedule)sched;
  mr_jv_int(jv, t, p, "warmup_steps", 0, BIG, &c->warmup_steps);
  mr_jv_num(jv, t, p, "min_lr", 0, 1e3, &c->min_lr);
  mr_jv_num(jv, t, p, "weight_decay", 0, 1e3, &c->weight_decay);
  const cJSON *betas = cJSON_GetObjectItemCaseSensitive(t, "betas");
  if (betas != NULL) {
    if (!cJSON_IsArray(betas) || cJSON_GetArraySize(betas) != 2 ||
        !cJSON_IsNumber(cJSON_GetArrayItem(betas, 0)) ||
        !cJSON_IsNumber(cJSON_GetArrayItem(betas, 1))) {
      mr_jv_error(jv, p, "betas", "expected two numbers [beta1, beta2]");
    } else {
      c->beta1 = cJSON_GetArrayItem(betas, 0)->valuedouble;
      c->beta2 = cJSON_GetArrayItem(betas, 1)->valuedouble;
      if (!(c->beta1 >= 0 && c->beta1 < 1 && c->beta2 >= 0 && c->beta2 < 1))
        mr_jv_error(jv, p, "betas", "expected each in [0, 1), got [%g, %g]",
                    c->beta1, c->beta2);
    }
  }
  mr_jv_num(jv, t, p, "eps", 0, 1, &c->eps);
  mr_jv_num(jv, t, p, "grad_clip", 0, 1e9, &c->grad_clip);
  int64_t seed = (int64_t)c->seed;
  if (mr_jv_int(jv, t, p, "seed", 0, ((int64_t)1 << 53), &seed) == 1)
    c->seed = (uint64_t)seed;
  const char *init = NULL;
  if (mr_jv_str(jv, t, p, "init", &init) == 1 && strcmp(init, "random") != 0) {
    free(c->init);
    c->init = resolve(job->dir, init);
  }
  mr_jv_int(jv, t, p, "eval_interval_steps", 0, BIG, &c->eval_interval_steps);
  mr_jv_int(jv, t, p, "eval_batches", 1, BIG, &c->eval_batches);
  mr_jv_int(jv, t, p, "log_interval_steps", 1, BIG, &c->log_interval_steps);
  if (c->warmup_steps > c->steps)
    mr_jv_error(jv, p, "warmup_steps", "expected at most train.steps (%lld), got %lld",
                (long long)c->steps, (long long)c->warmup_steps);
  if (c->min_lr > c->lr)
    mr_jv_error(jv, p, "min_lr", "expected at most train.lr (%g), got %g", c->lr,
                c->min_lr);
}

static void parse_degree(struct mr_jv *jv, const cJSON *s, const char *key,
                         const char *const *extra, int *degree,
                         const cJSON **obj_out) {
  const cJSON *o = NULL;
  char path[64];
  snprintf(path, sizeof path, "strategy.%s", key);
  if (mr_jv_obj(jv, s, "strategy", key, &o) != 1)
    return;
  const char *keys[8] = {"degree"};
  int n = 1;
  for (int i = 0; extra != NULL && extra[i] != NULL && n < 7; i++)
    keys[n++] = extra[i];
  keys[n] = NULL;
  mr_jv_only_keys(jv, o, path, keys);
  int64_t d;
  if (mr_jv_int(jv, o, path, "degree", 1, 1 << 20, &d) == 1)
    *degree = (int)d;
  if (obj_out != NULL)
    *obj_out = o;
}

/* An array of positive counts at obj.key (path names obj), one per `what`,
 * n_want of them (`why` says why that many): into a malloc'd *out and
 * *n_out.  Errors name the entry. */
static void parse_counts(struct mr_jv *jv, const cJSON *obj, const char *path, const char *key,
                         const char *what, const char *count, int n_want, const char *why,
                         int **out, int *n_out) {
  const cJSON *a = cJSON_GetObjectItemCaseSensitive(obj, key);
  int n = cJSON_IsArray(a) ? cJSON_GetArraySize(a) : 0;
  if (n == 0) {
    mr_jv_error(jv, path, key, "expected an array of %s counts, one per %s", count, what);
    return;
  }
  if (n != n_want) {
    mr_jv_error(jv, path, key, "expected %d entries (%s), got %d", n_want, why, n);
    return;
  }
  int *v = malloc((size_t)n * sizeof *v);
  if (v == NULL) {
    mr_jv_error(jv, path, key, "out of memory");
    return;
  }
  for (int i = 0; i < n; i++) {
    const cJSON *x = cJSON_GetArrayItem(a, i);
    if (!cJSON_IsNumber(x) || !(x->valuedouble >= 1 && x->valuedouble <= 1e6) ||
        x->valuedouble != floor(x->valuedouble)) {
      char shown[96], at[48];
      snprintf(at, sizeof at, "%s[%d]", key, i);
      mr_jv_error(jv, path, at, "expected a positive %s count, got %s", count,
                  mr_jv_show(x, shown, sizeof shown));
      free(v);
      return;
    }
    v[i] = (int)x->valuedouble;
  }
  *out = v;
  *n_out = n;
}

/* pipeline_parallel.layers: the decoder layers of each pipeline chunk, one
 * entry per chunk (degree x virtual stages), which fixes both.  Checked
 * against the model's layer count once the whole job is read. */
static void parse_chunk_layers(struct mr_jv *jv, const cJSON *pp, struct mr_strategy_hint *h) {
  const char *path = "strategy.pipeline_parallel";
  if (cJSON_GetObjectItemCaseSensitive(pp, "layers") == NULL)
    return;
  if (h->pp == 0) {
    mr_jv_error(jv, path, "layers", "the layers of each chunk need a fixed degree");
    return;
  }
  int v = h->virtual_stages > 0 ? h->virtual_stages : 1;
  char why[96];
  snprintf(why, sizeof why, "degree %d x virtual_stages %d", h->pp, v);
  parse_counts(jv, pp, path, "layers", "pipeline chunk", "layer", h->pp * v, why,
               &h->chunk_layers, &h->n_chunk_layers);
  if (h->n_chunk_layers > 0)
    h->virtual_stages = v;
}

/* data_parallel.micro_batches: the micro-batches each data-parallel rank
 * runs a step, so that a slower one can take fewer (they add up to degree x
 * micro-batches; checked when the strategy is lowered). */
static void parse_dp_micro(struct mr_jv *jv, const cJSON *dp, struct mr_strategy_hint *h) {
  const char *path = "strategy.data_parallel";
  if (cJSON_GetObjectItemCaseSensitive(dp, "micro_batches") == NULL)
    return;
  if (h->dp == 0) {
    mr_jv_error(jv, path, "micro_batches", "the micro-batches of each rank need a fixed degree");
    return;
  }
  parse_counts(jv, dp, path, "micro_batches", "data-parallel rank", "micro-batch", h->dp,
               "one per data-parallel rank", &h->dp_micro, &h->n_dp_micro);
}

static void parse_strategy(struct mr_jv *jv, const cJSON *s, struct mr_strategy_hint *h) {
  static const char *const keys[] = {
      "auto_mode", "data_parallel", "tensor_parallel", "pipeline_parallel",
      "sequence_parallel", "sharding", "recompute", "amp",
      "gradient_accumulation_steps", "gradient_accumulation_in_op", "mesh_mapping", NULL};
  static const char *const modes[] = {"full", "semi", "manual", NULL};
  static const char *const pp_keys[] = {"schedule", "micro_batches", "virtual_stages", "layers",
                                       NULL};
  static const char *const pp_schedules[] = {"1f1b", "gpipe", "interleaved", NULL};
  static const char *const grans[] = {"full", "selective", NULL};
  static const char *const amps[] = {"fp32", "bf16", "fp16", NULL};
  static const char *const mappings[] = {"tp,dp,pp", "tp,pp,dp", NULL};
  mr_jv_only_keys(jv, s, "strategy", keys);
  int mode = (int)h->auto_mode;
  if (mr_jv_enum(jv, s, "strategy", "auto_mode", modes, &mode) == 1)
    h->auto_mode = (enum mr_auto_mode)mode;
  static const char *const dp_keys[] = {"micro_batches", NULL};
  const cJSON *dpo = NULL;
  parse_degree(jv, s, "data_parallel", dp_keys, &h->dp, &dpo);
  if (dpo != NULL)
    parse_dp_micro(jv, dpo, h);
  parse_degree(jv, s, "tensor_parallel", NULL, &h->tp, NULL);
  const cJSON *pp = NULL;
  parse_degree(jv, s, "pipeline_parallel", pp_keys, &h->pp, &pp);
  if (pp != NULL) {
    const char *path = "strategy.pipeline_parallel";
    int sched = 0;
    if (mr_jv_enum(jv, pp, path, "schedule", pp_schedules, &sched) == 1) {
      h->pp_schedule = (enum mr_pp_schedule)sched;
      h->pp_schedule_set = 1;
    }
    int64_t v;
    if (mr_jv_int(jv, pp, path, "micro_batches", 1, 1 << 20, &v) == 1)
      h->micro_batches = (int)v;
    if (mr_jv_int(jv, pp, path, "virtual_stages", 1, 1024, &v) == 1)
      h->virtual_stages = (int)v;
    if (h->virtual_stages > 1 && h->pp_schedule_set &&
        h->pp_schedule != MR_PP_INTERLEAVED)
      mr_jv_error(jv, path, "virtual_stages",
                  "more than one virtual stage needs schedule \"interleaved\", got \"%s\"",
                  pp_schedules[h->pp_schedule]);
    if (h->pp_schedule_set && h->pp_schedule == MR_PP_INTERLEAVED && h->pp == 1)
      mr_jv_error(jv, path, "schedule",
                  "\"interleaved\" needs a pipeline degree of at least 2, got 1");
    parse_chunk_layers(jv, pp, h);
  }
  const cJSON *o = NULL;
  if (mr_jv_obj(jv, s, "strategy", "sequence_parallel", &o) == 1) {
    static const char *const k[] = {"enable", NULL};
    mr_jv_only_keys(jv, o, "strategy.sequence_parallel", k);
    mr_jv_bool(jv, o, "strategy.sequence_parallel", "enable", &h->sequence_parallel);
    if (h->sequence_parallel == 1 && h->tp == 1)
      mr_jv_error(jv, "strategy.sequence_parallel", "enable",
                  "sequence parallelism shards along the tensor-parallel group; "
                  "it needs tensor_parallel.degree > 1, got 1");
  }
  if (mr_jv_obj(jv, s, "strategy", "sharding", &o) == 1) {
    static const char *const k[] = {"stage", "offload", NULL};
    mr_jv_only_keys(jv, o, "strategy.sharding", k);
    int64_t st;
    if (mr_jv_int(jv, o, "strategy.sharding", "stage", 0, 3, &st) == 1)
      h->zero_stage = (int)st;
    mr_jv_bool(jv, o, "strategy.sharding", "offload", &h->offload);
    if (h->offload == 1 && h->zero_stage == 0)
      mr_jv_error(jv, "strategy.sharding", "offload",
                  "offload moves sharded optimizer states: it needs stage >= 1, got 0");
  }
  if (mr_jv_obj(jv, s, "strategy", "recompute", &o) == 1) {
    static const char *const k[] = {"enable", "granularity", "checkpoint_every_n_layers", NULL};
    mr_jv_only_keys(jv, o, "strategy.recompute", k);
    mr_jv_bool(jv, o, "strategy.recompute", "enable", &h->recompute);
    int g = 0;
    if (mr_jv_enum(jv, o, "strategy.recompute", "granularity", grans, &g) == 1)
      h->recompute_granularity = (enum mr_recompute_granularity)g;
    int64_t n;
    if (mr_jv_int(jv, o, "strategy.recompute", "checkpoint_every_n_layers", 1, 100000, &n) == 1)
      h->recompute_every_n_layers = (int)n;
  }
  if (mr_jv_obj(jv, s, "strategy", "amp", &o) == 1) {
    static const char *const k[] = {"dtype", "init_loss_scaling", NULL};
    mr_jv_only_keys(jv, o, "strategy.amp", k);
    int a = 0;
    if (mr_jv_enum(jv, o, "strategy.amp", "dtype", amps, &a) == 1)
      h->amp_dtype = (enum mr_amp_dtype)a;
    mr_jv_num(jv, o, "strategy.amp", "init_loss_scaling", 1, 1e30, &h->init_loss_scaling);
  }
  int64_t ga;
  if (mr_jv_int(jv, s, "strategy", "gradient_accumulation_steps", 1, 1 << 20, &ga) == 1)
    h->grad_accum_steps = (int)ga;
  mr_jv_bool(jv, s, "strategy", "gradient_accumulation_in_op", &h->grad_accum_in_op);
  int map = 0;
  if (mr_jv_enum(jv, s, "strategy", "mesh_mapping", mappings, &map) == 1)
    h->mapping = map;
}

/* Roughly how many nodes regcomp builds for an extended regex: an atom
 * counts one, and a repetition copies what it repeats — glibc expands
 * "x+" to "xx*" and "x{m,n}" to n copies — so stacked or nested
 * repetitions multiply ("a+++…" doubles per "+").  Bracket expressions and
 * escapes are one atom; what regcomp would refuse is left to it.  More
 * than two operators in a row ("a***", cubic time in regcomp) count as
 * too many. */
#define REGEX_MAX_NODES 4096.0
#define REGEX_MAX_CHARS 1024
static double regex_nodes(const char *re) {
  double outer[32], cur = 0, last = 0; /* a group's total before it; the last element */
  int depth = 0, run = 0;
  if (strlen(re) > REGEX_MAX_CHARS)
    return INFINITY;
  for (const char *p = re; *p != '\0'; p++) {
    run = strchr("*+?{", *p) != NULL ? run + 1 : 0;
    if (run > 2)
      return INFINITY;
    switch (*p) {
    case '\\':
      p += p[1] != '\0';
      cur += 1, last = 1;
      break;
    case '[': {
      const char *q = p + 1;
      q += *q == '^';
      q += *q == ']';
      while (*q != '\0' && *q != ']')
        q += (*q == '[' && (q[1] == ':' || q[1] == '.' || q[1] == '=')) ? 2 : 1;
      if (*q == '\0')
        return cur + 1;
      p = q;
      cur += 1, last = 1;
      break;
    }
    case '(':
      if (depth == 32)
        return INFINITY;
      outer[depth++] = cur;
      cur = 0;
      break;
    case ')':
      if (depth > 0) {
        last = cur;
        cur = outer[--depth] + last;
      }
      break;
    case '+':
      cur += last, last *= 2;
      break;
    case '{': {
      double m = (double)strtol(p + 1, (char **)&p, 10), n = m;
      if (*p == ',')
        n = p[1] == '}' ? m + 1 : (double)strtol(p + 1, (char **)&p, 10);
      if (*p != '}' && (p = strchr(p, '}')) == NULL)
        return cur;
      double k = n > m ? n : m;
      k = k < 1 ? 1 : k;
      cur += last * (k - 1), last *= k;
      break;
    }
    case '*':
    case '?':
    case '|':
      break;
    default:
      cur += 1, last = 1;
    }
  }
  while (depth > 0)
    cur += outer[--depth];
  return cur;
}

static void parse_shard_rules(struct mr_jv *jv, const cJSON *arr, struct mr_job *job) {
  if (!cJSON_IsArray(arr)) {
    mr_jv_error(jv, "", "shard_rules", "expected an array of {match, placements}");
    return;
  }
  int n = cJSON_GetArraySize(arr);
  job->shard_rules = calloc((size_t)(n > 0 ? n : 1), sizeof *job->shard_rules);
  if (job->shard_rules == NULL)
    return;
  for (int i = 0; i < n; i++) {
    const cJSON *r = cJSON_GetArrayItem(arr, i);
    char path[64];
    snprintf(path, sizeof path, "shard_rules[%d]", i);
    if (!cJSON_IsObject(r)) {
      mr_jv_error(jv, path, NULL, "expected an object {match, placements}");
      continue;
    }
    static const char *const keys[] = {"match", "placements", NULL};
    mr_jv_only_keys(jv, r, path, keys);
    struct mr_shard_rule *rule = &job->shard_rules[job->n_shard_rules++];
    const char *match = NULL;
    if (mr_jv_str(jv, r, path, "match", &match) == 1) {
      regex_t re;
      double nodes = regex_nodes(match);
      int rc = nodes <= REGEX_MAX_NODES ? regcomp(&re, match, REG_EXTENDED | REG_NOSUB) : 0;
      if (nodes > REGEX_MAX_NODES) {
        mr_jv_error(jv, path, "match", "expected a regex of at most %d characters and %.0f "
                    "atoms with its repetitions expanded (\"x+\" is x twice, \"x{n}\" n times; "
                    "at most two operators in a row), got %s%.4g", REGEX_MAX_CHARS,
                    REGEX_MAX_NODES, isinf(nodes) ? "more than " : "about ",
                    isinf(nodes) ? REGEX_MAX_NODES : nodes);
      } else if (rc != 0) {
        char msg[128];
        regerror(rc, &re, msg, sizeof msg);
        mr_jv_error(jv, path, "match", "expected a POSIX extended regex: %s", msg);
      } else {
        regfree(&re);
      }
      rule->match = strdup(match);
    } else if (cJSON_GetObjectItemCaseSensitive(r, "match") == NULL) {
      mr_jv_error(jv, path, "match", "missing (a regex on parameter names)");
    }
    const cJSON *pl = NULL;
    if (mr_jv_obj(jv, r, path, "placements", &pl) != 1) {
      if (cJSON_GetObjectItemCaseSensitive(r, "placements") == NULL)
        mr_jv_error(jv, path, "placements", "missing (mesh dim -> placement)");
      continue;
    }
    int np = cJSON_GetArraySize(pl);
    rule->placements = calloc((size_t)(np > 0 ? np : 1), sizeof *rule->placements);
    if (rule->placements == NULL)
      continue;
    char ppath[96];
    snprintf(ppath, sizeof ppath, "%s.placements", path);
    const cJSON *it;
    cJSON_ArrayForEach(it, pl) {
      if (!cJSON_IsString(it) || !placement_ok(it->valuestring)) {
        char shown[96];
        mr_jv_error(jv, ppath, it->string,
                    "expected \"Shard(d)\", \"Replicate()\" or \"Partial(sum|avg|max)\", got %s",
                    mr_jv_show(it, shown, sizeof shown));
        continue;
      }
      struct mr_shard_rule_placement *p = &rule->placements[rule->n_placements++];
      p->mesh_dim = strdup(it->string);
      p->placement = strdup(it->valuestring);
    }
  }
}

static void set_defaults(struct mr_job *job) {
  struct mr_train_config *t = &job->train;
  t->steps = 200;
  t->global_batch = 8;
  t->seq_len = 256;
  t->lr = 1e-3;
  t->schedule = MR_SCHEDULE_CONSTANT;
  t->weight_decay = 0.01;
  t->beta1 = 0.9;
  t->beta2 = 0.999;
  t->eps = 1e-8;
  t->grad_clip = 1.0;
  t->eval_interval_steps = 0;
  t->eval_batches = 4;
  t->log_interval_steps = 1;
  struct mr_strategy_hint *s = &job->strategy;
  s->auto_mode = MR_AUTO_FULL;
  s->sequence_parallel = -1;
  s->zero_stage = -1;
  s->offload = -1;
  s->recompute = -1;
  s->mapping = -1;
  s->grad_accum_in_op = -1;
  s->recompute_granularity = MR_RECOMPUTE_FULL;
  s->amp_dtype = MR_AMP_FP32;
  s->init_loss_scaling = 1024;
  job->checkpoint.keep_last = 3;
}

cJSON *mr_job_model_object(const struct mr_job *job) {
  if (job->model_json != NULL)
    return cJSON_Parse(job->model_json);
  char *text = mr_model_config_to_json(&job->model); /* a job built in code */
  cJSON *o = text ? cJSON_Parse(text) : NULL;
  free(text);
  return o ? o : cJSON_CreateNull();
}

static cJSON *job_to_json(const struct mr_job *job, const cJSON *src) {
  cJSON *out = cJSON_Duplicate(src, 1);
  if (out == NULL)
    return NULL;
  cJSON_DeleteItemFromObjectCaseSensitive(out, "model");
  cJSON_AddItemToObject(out, "model", mr_job_model_object(job));
  cJSON *data = cJSON_GetObjectItemCaseSensitive(out, "data");
  cJSON_DeleteItemFromObjectCaseSensitive(data, "train");
  cJSON_AddStringToObject(data, "train", job->data_train);
  if (job->data_val != NULL) {
    cJSON_DeleteItemFromObjectCaseSensitive(data, "val");
    cJSON_AddStringToObject(data, "val", job->data_val);
  }
  cJSON *train = cJSON_GetObjectItemCaseSensitive(out, "train");
  if (train != NULL && job->train.init != NULL) {
    cJSON_DeleteItemFromObjectCaseSensitive(train, "init");
    cJSON_AddStringToObject(train, "init", job->train.init);
  }
  cJSON *ck = cJSON_GetObjectItemCaseSensitive(out, "checkpoint");
  if (ck != NULL && job->checkpoint.dir != NULL) {
    cJSON_DeleteItemFromObjectCaseSensitive(ck, "dir");
    cJSON_AddStringToObject(ck, "dir", job->checkpoint.dir);
  }
  cJSON_DeleteItemFromObjectCaseSensitive(out, "trace"); /* how it is watched, not what */
  if (job->cluster != NULL) {
    cJSON_DeleteItemFromObjectCaseSensitive(out, "cluster");
    cJSON_AddStringToObject(out, "cluster", job->cluster);
  }
  if (job->n_plugins > 0) {
    cJSON_DeleteItemFromObjectCaseSensitive(out, "plugins");
    cJSON_AddItemToObject(out, "plugins",
                          cJSON_CreateStringArray((const char *const *)job->plugins,
                                                  job->n_plugins));
  }
  return out;
}

/* "model": a config.json path or the object itself. */
static void parse_model(struct mr_jv *jv, const cJSON *root, const char *name,
                        struct mr_job *job) {
  const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
  if (model == NULL) {
    mr_jv_error(jv, "", "model", "missing (a Hugging Face config.json path, or the object)");
  } else if (cJSON_IsString(model)) {
    job->model_path = resolve(job->dir, model->valuestring);
    cJSON *obj = NULL;
    if (mr_model_config_load_json(job->model_path, &job->model, &obj) < 0)
      mr_jv_error(jv, "", "model", "%s", mr_error_message());
    else
      job->model_json = cJSON_PrintUnformatted(obj);
    cJSON_Delete(obj);
  } else if (cJSON_IsObject(model)) {
    char where[512];
    snprintf(where, sizeof where, "%s: model", name);
    if (mr_model_config_parse(model, where, &job->model) < 0)
      mr_jv_error(jv, "", "model", "%s", mr_error_message());
    else
      job->model_json = cJSON_PrintUnformatted(model);
  } else {
    char shown[96];
    mr_jv_error(jv, "", "model", "expected a path or an object, got %s",
                mr_jv_show(model, shown, sizeof shown));
  }
}

/* "data": the train and optional val token files. */
static void parse_data(struct mr_jv *jv, const cJSON *root, struct mr_job *job) {
  const cJSON *data = NULL;
  if (mr_jv_obj(jv, root, "", "data", &data) == 1) {
    static const char *const dkeys[] = {"train", "val", NULL};
    mr_jv_only_keys(jv, data, "data", dkeys);
    const char *s = NULL;
    if (mr_jv_str(jv, data, "data", "train", &s) == 1)
      job->data_train = resolve(job->dir, s);
    else if (cJSON_GetObjectItemCaseSensitive(data, "train") == NULL)
      mr_jv_error(jv, "data", "train", "missing (a token file)");
    if (mr_jv_str(jv, data, "data", "val", &s) == 1)
      job->data_val = resolve(job->dir, s);
  } else if (cJSON_GetObjectItemCaseSensitive(root, "data") == NULL) {
    mr_jv_error(jv, "", "data", "missing (an object with train and optional val)");
  }
}

static void parse_checkpoint(struct mr_jv *jv, const cJSON *o, struct mr_job *job) {
  static const char *const ckeys[] = {"dir", "save_interval_steps", "keep_last", NULL};
  mr_jv_only_keys(jv, o, "checkpoint", ckeys);
  const char *s = NULL;
  if (mr_jv_str(jv, o, "checkpoint", "dir", &s) == 1)
    job->checkpoint.dir = resolve(job->dir, s);
  mr_jv_int(jv, o, "checkpoint", "save_interval_steps", 0, BIG,
            &job->checkpoint.save_interval_steps);
  mr_jv_int(jv, o, "checkpoint", "keep_last", 1, 1000000, &job->checkpoint.keep_last);
}

static void parse_trace(struct mr_jv *jv, const cJSON *o, struct mr_job *job) {
  static const char *const tkeys[] = {"dir", "steps", NULL};
  mr_jv_only_keys(jv, o, "trace", tkeys);
  const char *s = NULL;
  if (mr_jv_str(jv, o, "trace", "dir", &s) == 1)
    job->trace.dir = resolve(job->dir, s);
  else if (cJSON_GetObjectItemCaseSensitive(o, "dir") == NULL)
    mr_jv_error(jv, "trace", "dir", "missing (the folder the ranks' timelines go to)");
  if (mr_jv_str(jv, o, "trace", "steps", &s) == 1 &&
      mr_job_steps_range(NULL, s, job->train.steps, &job->trace.first,
                         &job->trace.last) < 0)
    mr_jv_error(jv, "trace", "steps", "%s", mr_error_message());
}

static void check_whole(struct mr_jv *jv, struct mr_job *job) {
  if (jv->n_errors == 0 && job->model.family == MR_MODEL_GPT2 &&
      job->train.seq_len > job->model.max_position_embeddings)
    mr_jv_error(jv, "train", "seq_len",
                "expected at most the model's n_positions (%lld), got %lld",
                (long long)job->model.max_position_embeddings,
                (long long)job->train.seq_len);
  if (jv->n_errors == 0 && mr_model_check_seq(&job->model, job->train.seq_len) < 0)
    mr_jv_error(jv, "train", "seq_len", "%lld: the model's %s", (long long)job->train.seq_len,
                mr_error_message());
  if (jv->n_errors == 0 && job->strategy.n_chunk_layers > 0) {
    int64_t sum = 0;
    for (int i = 0; i < job->strategy.n_chunk_layers; i++)
      sum += job->strategy.chunk_layers[i];
    if (sum != job->model.num_hidden_layers)
      mr_jv_error(jv, "strategy.pipeline_parallel", "layers",
                  "expected counts adding up to the model's %lld layers, got %lld",
                  (long long)job->model.num_hidden_layers, (long long)sum);
  }
}

/* "plugins": ["lib.so", ...], each a path resolved against the job's folder. */
static void parse_plugins(struct mr_jv *jv, const cJSON *a, struct mr_job *job) {
  enum { MAX_PLUGINS = 16 };
  char shown[96];
  int n = cJSON_IsArray(a) ? cJSON_GetArraySize(a) : -1;
  if (n < 0 || n > MAX_PLUGINS) {
    mr_jv_error(jv, "", "plugins", "expected an array of at most %d shared-object paths, got %s",
                MAX_PLUGINS, mr_jv_show(a, shown, sizeof shown));
    return;
  }
  job->plugins = calloc((size_t)n + 1, sizeof *job->plugins);
  if (job->plugins == NULL) {
    mr_jv_error(jv, "", "plugins", "out of memory");
    return;
  }
  for (int i = 0; i < n; i++) {
    const cJSON *e = cJSON_GetArrayItem(a, i);
    if (!cJSON_IsString(e) || e->valuestring[0] == '\0') {
      char field[32];
      snprintf(field, sizeof field, "plugins[%d]", i);
      mr_jv_error(jv, "", field, "expected a shared-object path, got %s",
                  mr_jv_show(e, shown, sizeof shown));
      continue;
    }
    job->plugins[job->n_plugins++] = resolve(job->dir, e->valuestring);
  }
}

int mr_job_parse(const char *text, const char *name, const char *dir,
                 struct mr_job *job) {
  memset(job, 0, sizeof *job);
  job->path = strdup(name);
  job->dir = strdup(dir != NULL ? dir : ".");
  set_defaults(job);
  cJSON *root;
  int rc = mr_json_parse(text, name, &root);
  if (rc < 0) {
    mr_job_close(job);
    return rc;
  }
  struct mr_jv jv;
  mr_jv_init(&jv, name);
  if (!cJSON_IsObject(root)) {
    mr_jv_error(&jv, "", NULL, "expected a JSON object with at least model and data");
    goto done;
  }
  static const char *const keys[] = {"model", "data", "train", "strategy", "shard_rules",
                                     "checkpoint", "cluster", "plugins", "trace", NULL};
  mr_jv_only_keys(&jv, root, "", keys);
  parse_model(&jv, root, name, job);
  parse_data(&jv, root, job);
  const cJSON *o = NULL;
  if (mr_jv_obj(&jv, root, "", "train", &o) == 1)
    parse_train(&jv, o, job);
  if (mr_jv_obj(&jv, root, "", "strategy", &o) == 1)
    parse_strategy(&jv, o, &job->strategy);
  const cJSON *rules = cJSON_GetObjectItemCaseSensitive(root, "shard_rules");
  if (rules != NULL)
    parse_shard_rules(&jv, rules, job);
  if (mr_jv_obj(&jv, root, "", "checkpoint", &o) == 1)
    parse_checkpoint(&jv, o, job);
  const char *cluster = NULL;
  if (mr_jv_str(&jv, root, "", "cluster", &cluster) == 1)
    job->cluster = resolve(job->dir, cluster);
  const cJSON *plugins = cJSON_GetObjectItemCaseSensitive(root, "plugins");
  if (plugins != NULL)
    parse_plugins(&jv, plugins, job);
  if (mr_jv_obj(&jv, root, "", "trace", &o) == 1)
    parse_trace(&jv, o, job);
  check_whole(&jv, job);
  if (jv.n_errors == 0) {
    cJSON *canon = job_to_json(job, root);
    job->text = canon ? cJSON_PrintUnformatted(canon) : NULL;
    cJSON_Delete(canon);
    if (job->text == NULL)
      mr_jv_error(&jv, "", NULL, "out of memory");
  }
done:
  cJSON_Delete(root);
  rc = 0;
  if (jv.n_errors > 0) {
    rc = mr_error_set(MR_EJOB, "%s", jv.errors);
    mr_job_close(job);
  }
  mr_jv_close(&jv);
  return rc;
}

int mr_job_load(const char *path, struct mr_job *job) {
  memset(job, 0, sizeof *job);
  char *text;
  MR_TRY(mr_read_file(path, &text, NULL));
  char *dir = dir_of(path);
  int rc = mr_job_parse(text, path, dir, job);
  free(dir);
  free(text);
  return rc;
}

void mr_job_close(struct mr_job *job) {
  free(job->path);
  free(job->dir);
  free(job->model_path);
  cJSON_free(job->model_json);
  free(job->data_train);
  free(job->data_val);
  free(job->train.init);
  for (int i = 0; i < job->n_shard_rules; i++) {
    struct mr_shard_rule *r = &job->shard_rules[i];
    for (int j = 0; j < r->n_placements; j++) {
      free(r->placements[j].mesh_dim);
      free(r->placements[j].placement);
    }
    free(r->placements);
    free(r->match);
  }
  free(job->shard_rules);
  free(job->strategy.chunk_layers);
  free(job->strategy.dp_micro);
  free(job->checkpoint.dir);
  free(job->cluster);
  for (int i = 0; i < job->n_plugins; i++)
    free(job->plugins[i]);
  free(job->plugins);
  free(job->trace.dir);
  free(job->text);
  memset(job, 0, sizeof *job);
}

int mr_job_steps_range(const char *what, const char *text, int64_t steps, int64_t *first,
                       int64_t *last) {
  const char *w = what != NULL ? what : "", *sep = what != NULL ? ": " : "";
  long long a = 0, b = 0;
  int used = 0;
  if (sscanf(text, "%lld:%lld%n", &a, &b, &used) == 2 && text[used] == '\0') {
    /* A:B */
  } else if (sscanf(text, "%lld%n", &a, &used) == 1 && text[used] == '\0') {
    b = a;
  } else {
    return mr_error_set(MR_EINVAL, "%s%sexpected FIRST:LAST (steps, e.g. 5:7), got \"%s\"",
                        w, sep, text);
  }
  if (a < 1 || b < a)
    return mr_error_set(MR_EINVAL, "%s%sexpected 1 <= FIRST <= LAST, got \"%s\"", w, sep,
                        text);
  if (b > steps)
    return mr_error_set(MR_EINVAL, "%s%s\"%s\" is outside the run: it trains steps 1 to %lld",
                        w, sep, text, (long long)steps);
  *first = a, *last = b;
  return 0;
}
