/* slurm.c - the launch flags from a Slurm job step's environment, and
 * the job token files of steps that are gone. */
#include "launcher/slurm.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"

extern char **environ;

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

int mr_slurm_per_node(const char *list, long node, long *out) {
  static const char *const want = "expected counts a node such as 4(x2),2";
  const char *p = list;
  for (long first = 0;;) {
    char *end;
    errno = 0;
    long n = strtol(p, &end, 10), times = 1;
    if (end == p || n < 0 || errno != 0)
      return mr_error_set(MR_EINVAL, "\"%s\": %s", list, want);
    p = end;
    if (*p == '(') {
      if (p[1] != 'x')
        return mr_error_set(MR_EINVAL, "\"%s\": %s", list, want);
      times = strtol(p + 2, &end, 10);
      if (end == p + 2 || *end != ')' || times < 1 || times > 1000000)
        return mr_error_set(MR_EINVAL, "\"%s\": %s", list, want);
      p = end + 1;
    }
    if (node < first + times) {
      *out = n;
      return 0;
    }
    first += times;
    if (*p == '\0')
      return mr_error_set(MR_EINVAL, "\"%s\": no count for node %ld (the list has %ld)", list,
                          node, first);
    if (*p++ != ',')
      return mr_error_set(MR_EINVAL, "\"%s\": %s", list, want);
  }
}

/* The CPUs the allocation gives this launcher: a step's task its own
 * (SLURM_CPUS_PER_TASK; one launcher a node, so the node's share), else
 * the job's on this node. */
static int slurm_cpus(struct mr_slurm_step *out, long node) {
  static const char *const vars[] = {"SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"};
  for (size_t i = out->in_step ? 0 : 1; i < 2; i++) {
    long n = 0;
    MR_TRY(count_var(vars[i], NULL, 1, 100000000, &n));
    if (n > 0) {
      out->cpus = n, out->cpus_var = vars[i];
      return 0;
    }
  }
  const char *list = getenv("SLURM_JOB_CPUS_PER_NODE");
  if (list == NULL)
    return 0;
  if (mr_slurm_per_node(list, node, &out->cpus) < 0)
    return mr_error_set(MR_EINVAL, "Slurm's SLURM_JOB_CPUS_PER_NODE is %s", mr_error_message());
  out->cpus_var = "SLURM_JOB_CPUS_PER_NODE";
  return 0;
}

/* The GPUs the allocation gives this node: SLURM_GPUS_ON_NODE, else the
 * length of the step's (or job's) list of them; -1 where none is said. */
static int slurm_gpus(struct mr_slurm_step *out) {
  out->gpus = -1;
  out->gpus_var = "SLURM_GPUS_ON_NODE";
  MR_TRY(count_var(out->gpus_var, NULL, 0, 100000, &out->gpus));
  if (out->gpus >= 0)
    return 0;
  const char *list = getenv(out->gpus_var = "SLURM_STEP_GPUS");
  if (list == NULL)
    list = getenv(out->gpus_var = "SLURM_JOB_GPUS");
  if (list == NULL)
    return 0;
  out->gpus = list[0] != '\0';
  for (const char *p = list; *p != '\0'; p++)
    out->gpus += *p == ',';
  return 0;
}

/* The cluster's name where it can be part of a file name, else "". */
static const char *cluster_name(void) {
  const char *c = getenv("SLURM_CLUSTER_NAME");
  if (c == NULL || c[0] == '\0' || strlen(c) > 64)
    return "";
  for (const char *p = c; *p != '\0'; p++)
    if (!name_char(*p))
      return "";
  return c;
}

int mr_slurm_step(struct mr_slurm_step *out) {
  memset(out, 0, sizeof *out);
  out->step_id = out->gpus = -1;
  if (getenv("SLURM_JOB_ID") == NULL && getenv("SLURM_JOBID") == NULL)
    return 0;
  long nodes = 0, job = 0, rank = 0;
  MR_TRY(count_var("SLURM_JOB_ID", "SLURM_JOBID", 0, 0x7fffffffL, &job));
  MR_TRY(count_var("SLURM_JOB_NUM_NODES", "SLURM_NNODES", 1, 100000, &nodes));
  out->job_id = job;
  out->in_job_nodes = (int)nodes;
  out->in_step = getenv("SLURM_STEP_ID") != NULL || getenv("SLURM_STEPID") != NULL;
  if (!out->in_step) { /* the batch script: one node's shell */
    MR_TRY(count_var("SLURM_NODEID", NULL, 0, nodes > 0 ? nodes - 1 : 100000, &rank));
    MR_TRY(slurm_cpus(out, rank));
    return slurm_gpus(out);
  }
  long tasks = -1;
  rank = -1;
  MR_TRY(count_var("SLURM_STEP_ID", "SLURM_STEPID", 0, 0xffffffffL, &out->step_id));
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
  if (list == NULL)
    return mr_error_set(MR_EINVAL, "a Slurm step without SLURM_STEP_NODELIST: expected srun "
                        "to set it");
  if (mr_slurm_first_host(list, out->host, sizeof out->host) < 0)
    return mr_error_set(MR_EINVAL, "Slurm's %s is %s", var, mr_error_message());
  MR_TRY(slurm_cpus(out, rank));
  MR_TRY(slurm_gpus(out));
  snprintf(out->host_from, sizeof out->host_from, "%s \"%.200s\"", var, list);
  out->nnodes = nodes;
  out->node_rank = rank;
  snprintf(out->master, sizeof out->master, "%s:%ld", out->host,
           MR_SLURM_PORT_BASE + job % MR_SLURM_PORT_SPAN);
  const char *home = getenv("HOME"), *cluster = cluster_name();
  if (home != NULL && home[0] == '/')
    snprintf(out->token_file, sizeof out->token_file,
             "%s/.cache/meshrun/slurm-%s%s%ld.%ld.token", home, cluster,
             cluster[0] != '\0' ? "-" : "", job, out->step_id);
  return 0;
}

/* A token file's job and step from its name "slurm-PREFIXJOB.STEP.token"
 * (STEP -1 in the older "slurm-PREFIXJOB.token"); 0, or -1 when the name
 * is not one. */
static int token_name(const char *name, const char *prefix, long *job, long *step) {
  size_t n = strlen(prefix);
  if (strncmp(name, prefix, n) != 0 || !isdigit((unsigned char)name[n]))
    return -1;
  char *end;
  *job = strtol(name + n, &end, 10);
  *step = -1;
  if (*end == '.' && isdigit((unsigned char)end[1]))
    *step = strtol(end + 1, &end, 10);
  return strcmp(end, ".token") == 0 ? 0 : -1;
}

#define SQUEUE_TIMEOUT_MS 5000

/* The job ids of this user's live jobs, from `squeue`, into ids[max];
 * returns their count, or -1 where squeue cannot say. */
static int live_jobs(long *ids, int max) {
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0)
    return -1;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, pipefd[1], 1);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  char *argv[] = {"squeue", "--noheader", "--me", "--format=%A", NULL};
  pid_t pid;
  int e = posix_spawnp(&pid, "squeue", &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(pipefd[1]);
  if (e != 0) {
    close(pipefd[0]);
    return -1;
  }
  char buf[65536];
  size_t len = 0;
  int64_t deadline = mr_clock_ms() + SQUEUE_TIMEOUT_MS;
  for (;;) {
    int64_t left = deadline - mr_clock_ms();
    struct pollfd p = {.fd = pipefd[0], .events = POLLIN};
    int ready = left > 0 ? poll(&p, 1, (int)left) : 0;
    if (ready < 0 && errno == EINTR)
      continue;
    if (ready <= 0) { /* a controller that does not answer */
      kill(pid, SIGKILL);
      len = sizeof buf - 1;
      break;
    }
    ssize_t r = read(pipefd[0], buf + len, sizeof buf - 1 - len);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0 || (len += (size_t)r) == sizeof buf - 1)
      break;
  }
  close(pipefd[0]);
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0 || len == sizeof buf - 1)
    return -1;
  buf[len] = '\0';
  int n = 0;
  for (char *p = buf, *end;; p = end) {
    while (isspace((unsigned char)*p))
      p++;
    if (*p == '\0')
      return n;
    long id = strtol(p, &end, 10);
    if (end == p || n == max || (*end != '\0' && !isspace((unsigned char)*end)))
      return -1; /* not a list of job ids, or more than we can hold */
    ids[n++] = id;
  }
}

int mr_slurm_clean_tokens(const struct mr_slurm_step *s) {
  if (s->token_file[0] == '\0')
    return 0;
  char dir[4096], prefix[128];
  snprintf(dir, sizeof dir, "%s", s->token_file);
  char *slash = strrchr(dir, '/');
  *slash = '\0';
  const char *cluster = cluster_name();
  snprintf(prefix, sizeof prefix, "slurm-%s%s", cluster, cluster[0] != '\0' ? "-" : "");
  DIR *d = opendir(dir);
  if (d == NULL)
    return 0;
  long live[4096];
  int nlive = -2, removed = 0; /* -2: squeue not asked yet */
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    long job, step;
    if (token_name(e->d_name, prefix, &job, &step) < 0)
      continue;
    int stale = 0;
    if (job == s->job_id) {
      stale = step < s->step_id; /* an earlier step of this job */
    } else {
      if (nlive == -2)
        nlive = live_jobs(live, (int)(sizeof live / sizeof *live));
      stale = nlive >= 0;
      for (int i = 0; stale && i < nlive; i++)
        stale = live[i] != job;
    }
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    if (stale && unlink(path) == 0) {
      MR_INFO("launch", "removed %s: the job token of %s that has ended", path,
              job == s->job_id ? "an earlier step of this job" : "a Slurm job");
      removed++;
    }
  }
  closedir(d);
  return removed;
}
