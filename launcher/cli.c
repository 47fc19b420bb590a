/* cli.c - helpers shared by the subcommands. */
#include "launcher/cli.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/ckpt.h"
#include "common/error.h"
#include "common/file.h"
#include "common/job.h"
#include "common/jsonv.h"
#include "common/tunable.h"
#include "compiler/planner/cluster.h"

int mr_cli_int(const char *cmd, const char *flag, const char *value, long min, long max,
               long *out) {
  char *end;
  errno = 0;
  long v = value != NULL ? strtol(value, &end, 10) : 0;
  if (value == NULL || errno != 0 || end == value || *end != '\0' || v < min || v > max) {
    fprintf(stderr, "meshrun %s: %s: expected an integer in [%ld, %ld], got \"%s\"\n", cmd,
            flag, min, max, value != NULL ? value : "");
    return -1;
  }
  *out = v;
  return 0;
}

int mr_cli_num(const char *cmd, const char *flag, const char *value, double min,
               double max, double *out) {
  char *end;
  errno = 0;
  double v = value != NULL ? strtod(value, &end) : 0;
  if (value == NULL || errno != 0 || end == value || *end != '\0' || !(v >= min && v <= max)) {
    fprintf(stderr, "meshrun %s: %s: expected a number in [%g, %g], got \"%s\"\n", cmd, flag,
            min, max, value != NULL ? value : "");
    return -1;
  }
  *out = v;
  return 0;
}

int mr_parse_bytes(const char *value, uint64_t *out) {
  static const struct {
    const char *unit;
    double scale;
  } units[] = {{"", 1},           {"B", 1},      {"KB", 1e3},         {"MB", 1e6},
               {"GB", 1e9},       {"TB", 1e12},  {"KIB", 1024.0},     {"MIB", 1048576.0},
               {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  char *end;
  errno = 0;
  double v = strtod(value, &end);
  if (end == value || errno != 0 || !(v >= 0))
    return MR_EINVAL;
  char unit[8];
  size_t n = strlen(end);
  if (n >= sizeof unit)
    return MR_EINVAL;
  for (size_t i = 0; i <= n; i++)
    unit[i] = (char)toupper((unsigned char)end[i]);
  for (size_t i = 0; i < sizeof units / sizeof *units; i++) {
    double b = v * units[i].scale;
    if (strcmp(unit, units[i].unit) == 0 && b < 1.8e19) {
      *out = (uint64_t)b;
      return 0;
    }
  }
  return MR_EINVAL;
}

int mr_cli_host_port(const char *value, char *host, unsigned long hn, int *port) {
  const char *colon = strrchr(value, ':');
  char *end;
  long p = colon != NULL ? strtol(colon + 1, &end, 10) : 0;
  const char *h = value, *he = colon;
  if (colon != NULL && value[0] == '[' && colon > value && colon[-1] == ']') {
    h = value + 1;
    he = colon - 1;
  }
  if (colon == NULL || he <= h || (unsigned long)(he - h) >= hn || colon[1] == '\0' ||
      *end != '\0' || p < 1 || p > 65535)
    return mr_error_set(MR_EINVAL, "expected HOST:PORT with a port of 1..65535");
  memcpy(host, h, (size_t)(he - h));
  host[he - h] = '\0';
  *port = (int)p;
  return 0;
}

const char *mr_default_cluster(void) {
  const char *name = mr_tunable_str(MR_TUNABLE_CLUSTER);
  return name != NULL && name[0] != '\0' ? name : "cpu-local";
}

int mr_cli_cache_dir(char *buf, size_t len) {
  const char *x = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
  if (x != NULL && x[0] == '/')
    snprintf(buf, len, "%s/meshrun", x);
  else if (home != NULL && home[0] != '\0')
    snprintf(buf, len, "%s/.cache/meshrun", home);
  else
    return mr_error_set(MR_ENOENT, "the cache folder: neither XDG_CACHE_HOME nor HOME is set");
  return mr_mkdir_p(buf);
}

void mr_cli_job_defaults(struct mr_job *job) {
  if (job->strategy.grad_accum_in_op < 0)
    job->strategy.grad_accum_in_op = mr_tunable_int(MR_TUNABLE_GRAD_ACCUM_IN_OP) != 0;
}

int mr_cluster_load(const char *path, struct mr_cluster *out) {
  cJSON *root = NULL;
  int rc = mr_json_load(path, &root);
  if (rc == MR_EJOB)
    rc = MR_EFORMAT;
  if (rc < 0)
    return rc;
  rc = mr_cluster_parse(root, path, out);
  cJSON_Delete(root);
  return rc;
}

void mr_cli_say_complete(const struct mr_job *job, const char *dir, long long step) {
  printf("meshrun: the job is complete: %s is of step %lld, and train.steps is %lld (raise "
         "it to train on)\n", dir, step, (long long)job->train.steps);
  fflush(stdout);
}

int mr_cli_job_complete(const struct mr_job *job) {
  char dir[4096];
  int64_t step;
  if (job->checkpoint.dir == NULL ||
      mr_ckpt_find_latest(job->checkpoint.dir, dir, sizeof dir, &step) != 1 ||
      step < job->train.steps)
    return 0;
  mr_cli_say_complete(job, dir, (long long)step);
  return 1;
}
