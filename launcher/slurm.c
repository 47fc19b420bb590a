/* slurm.c - the launch flags from a Slurm job step's environment. */
#include "launcher/slurm.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

static int name_char(char c) {
  return isalnum((unsigned char)c) || c == '-' || c == '_' || c == '.';
}

int mr_slurm_first_host(const char *list, char *host, size_t n) {
  static const char *const want = "expected a Slurm host list such as gpu[07-09,12],cpu3";
  size_t len = 0;
  const char *p = list;
  for (; *p != '\0' && *p != ','; p++) {
    const char *take = p;
    size_t take_n = 1;
    if (*p == '[') {
      /* the first number of the first range; the rest only checked */
      const char *q = ++p;
      while (isdigit((unsigned char)*q))
        q++;
      if (q == p)
        return mr_error_set(MR_EINVAL, "\"%s\": a range without a number: %s", list, want);
      take = p, take_n = (size_t)(q - p);
      while (isdigit((unsigned char)*q) || *q == '-' || *q == ',')
        q++;
      if (*q != ']')
        return mr_error_set(MR_EINVAL, "\"%s\": an unclosed or malformed [range]: %s", list,
                            want);
      p = q;
    } else if (!name_char(*p)) {
      return mr_error_set(MR_EINVAL, "\"%s\": character '%c' in a host name: %s", list, *p,
                          want);
    }
    if (len + take_n >= n)
      return mr_error_set(MR_EINVAL, "\"%s\": a host name longer than %zu characters", list,
                          n - 1);
    memcpy(host + len, take, take_n);
    len += take_n;
  }
  if (len == 0)
    return mr_error_set(MR_EINVAL, "\"%s\": no host: %s", list, want);
  host[len] = '\0';
  return 0;
}

/* Variable `name` (or `alt` when it is unset) as a count in [min, max];
 * *out stays as it is when neither is set. */
static int count_var(const char *name, const char *alt, long min, long max, long *out) {
  const char *v = getenv(name);
  if (v == NULL && alt != NULL)
    v = getenv(name = alt);
  if (v == NULL)
    return 0;
  char *end;
  long x = strtol(v, &end, 10);
  if (end == v || *end != '\0' || x < min || x > max)
    return mr_error_set(MR_EINVAL, "Slurm's %s is \"%s\": expected a whole number in %ld..%ld",
                        name, v, min, max);
  *out = x;
  return 0;
}

int mr_slurm_step(struct mr_slurm_step *out) {
  memset(out, 0, sizeof *out);
  if (getenv("SLURM_JOB_ID") == NULL && getenv("SLURM_JOBID") == NULL)
    return 0;
  long nodes = 0, job = 0;
  MR_TRY(count_var("SLURM_JOB_ID", "SLURM_JOBID", 0, 0x7fffffffL, &job));
  MR_TRY(count_var("SLURM_JOB_NUM_NODES", "SLURM_NNODES", 1, 100000, &nodes));
  out->job_id = job;
  out->in_job_nodes = (int)nodes;
  if (getenv("SLURM_STEP_ID") == NULL && getenv("SLURM_STEPID") == NULL)
    return 0; /* the batch script: one node's shell */
  long tasks = -1, rank = -1;
  MR_TRY(count_var("SLURM_STEP_NUM_NODES", "SLURM_NNODES", 1, 100000, &nodes));
  MR_TRY(count_var("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", 1, 100000000, &tasks));
  MR_TRY(count_var("SLURM_NODEID", NULL, 0, nodes - 1, &rank));
  if (rank < 0)
    return mr_error_set(MR_EINVAL, "a Slurm step without SLURM_NODEID: expected srun to set it");
  if (tasks != -1 && tasks != nodes)
    return mr_error_set(MR_EINVAL, "this Slurm step runs %ld tasks on %ld node%s: meshrun "
                        "starts a node's ranks itself, so run one launcher a node (srun "
                        "--ntasks-per-node=1 meshrun launch ...)",
                        tasks, nodes, nodes == 1 ? "" : "s");
  const char *list = getenv("SLURM_STEP_NODELIST");
  const char *var = "SLURM_STEP_NODELIST";
  if (list == NULL)
    list = getenv(var = "SLURM_JOB_NODELIST");
  if (list == NULL)
    list = getenv(var = "SLURM_NODELIST");
  char host[256];
  if (list == NULL)
    return mr_error_set(MR_EINVAL, "a Slurm step without SLURM_STEP_NODELIST: expected srun "
                        "to set it");
  if (mr_slurm_first_host(list, host, sizeof host) < 0)
    return mr_error_set(MR_EINVAL, "Slurm's %s is %s", var, mr_error_message());
  out->in_step = 1;
  out->nnodes = nodes;
  out->node_rank = rank;
  snprintf(out->master, sizeof out->master, "%s:%ld", host,
           MR_SLURM_PORT_BASE + job % MR_SLURM_PORT_SPAN);
  const char *home = getenv("HOME");
  if (home != NULL && home[0] == '/')
    snprintf(out->token_file, sizeof out->token_file, "%s/.cache/meshrun/slurm-%ld.token",
             home, job);
  return 0;
}
