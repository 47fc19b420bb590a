/* launch.c - `meshrun launch [flags] JOB.json`. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "common/ckpt.h"
#include "common/error.h"
#include "common/file.h"
#include "common/job.h"
#include "common/log.h"
#include "common/tokens.h"
#include "common/tunable.h"
#include "compiler/plugin.h"
#include "launcher/agent.h"
#include "launcher/cli.h"
#include "launcher/coordinator.h"
#include "launcher/slurm.h"
#include "launcher/strategy_choice.h"
#include "common/discovery.h"
#include "launcher/measure.h"
#include "launcher/trace_merge.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: meshrun launch [options] JOB.json\n"
          "       meshrun launch --selfcheck [options] [JOB.json]\n"
          "\n"
          "Starts one worker per rank, sends each the plan and supervises them.\n"
          "\n"
          "  --nproc N              ranks on this node (default: one per GPU, else cores /\n"
          "                         threads; under Slurm, those the allocation gives)\n"
          "  --devices 0,1,3        GPUs to use, among the visible ones (CUDA_VISIBLE_DEVICES\n"
          "                         applies); one rank each (default: all)\n"
          "  --device cpu|cuda      what ranks compute on (default MESHRUN_DEVICE, else cuda\n"
          "                         when every rank can have a GPU, else cpu)\n"
          "  --threads T            compute threads per CPU rank (default MESHRUN_THREADS or 1)\n"
          "  --max-restarts K       group restarts after a failure (default 0)\n"
          "  --log-dir DIR          per-rank logs and metrics (default runs/JOBNAME)\n"
          "  --metrics FILE         per-step metrics, JSON lines (default LOG_DIR/metrics.jsonl)\n"
          "  --heartbeat-timeout S  silence after which a rank is failed (default 30)\n"
          "  --hang-timeout S       no rank progressing this long is a hang: diagnose,\n"
          "                         then restart (default 300; 0 turns it off)\n"
          "  --bind HOST:PORT       TCP address for remote workers (default 127.0.0.1:0;\n"
          "                         0.0.0.0 and --master's port across nodes)\n"
          "  --trace DIR            a timeline of every rank (Chrome / Perfetto JSON):\n"
          "                         DIR/rank-N.json, merged into DIR/trace.json at the end\n"
          "  --trace-steps A:B      the steps traced (default: 3 after each group's warm-up)\n"
          "  --selfcheck            run the built-in end-to-end check instead of the job\n"
          "\n"
          "Across nodes (the same command on each; node 0 plans and coordinates):\n"
          "  --nnodes N             nodes of the job, each running --nproc ranks (default 1)\n"
          "  --nnodes MIN:MAX       elastic: a group goes on with the nodes there are, at\n"
          "                         least MIN, the strategy planned again for them\n"
          "  --node-rank K          this node, 0 .. N-1 (default JOB_COMPLETION_INDEX, a\n"
          "                         Kubernetes indexed Job's pod index, else 0)\n"
          "  --master HOST:PORT     where node 0's launcher listens\n"
          "  --token-file FILE      the job token on a file system every node sees: node 0\n"
          "                         writes it (mode 0600) when missing, the others read it\n"
          "  --join-timeout S       how long nodes wait for one another (default 600)\n"
          "Inside a Slurm step (srun --ntasks-per-node=1 meshrun launch JOB.json) what\n"
          "these flags leave unsaid comes from the step: its nodes, SLURM_NODEID, node 0's\n"
          "host at port 20000 + job id %% 20000, the token in ~/.cache/meshrun; node 0's\n"
          "host must resolve on every node (else --master HOST:PORT).\n");
}

/* A job whose model is a model folder (or the config.json in one) has its
 * absolute path recorded in the checkpoint root (MR_CKPT_MODEL_SOURCE).
 * Best effort: an export without it writes what the checkpoint holds. */
static void record_model_source(const struct mr_job *job) {
  const char *m = job->model_path;
  struct stat st;
  char folder[4096], abs[PATH_MAX], path[4200];
  if (m == NULL || stat(m, &st) != 0)
    return;
  snprintf(folder, sizeof folder, "%s", m);
  if (!S_ISDIR(st.st_mode)) {
    char *slash = strrchr(folder, '/');
    if (strcmp(slash != NULL ? slash + 1 : folder, "config.json") != 0)
      return; /* a config file of its own, not a model folder's */
    if (slash != NULL)
      *slash = '\0';
    else
      snprintf(folder, sizeof folder, ".");
  }
  if (realpath(folder, abs) == NULL)
    return;
  cJSON *o = cJSON_CreateObject();
  cJSON_AddStringToObject(o, "folder", abs);
  char *text = cJSON_Print(o);
  snprintf(path, sizeof path, "%s/%s", job->checkpoint.dir, MR_CKPT_MODEL_SOURCE);
  if (text == NULL || mr_file_write_text(path, text, MR_FILE_NEWLINE) < 0)
    MR_WARN("launch", "%s: %s (an export will not carry the tokenizer)", path,
            text == NULL ? "no memory" : mr_error_message());
  cJSON_free(text);
  cJSON_Delete(o);
}

/* The checkpoint folder, checked before any training rather than at the
 * first save hours in: it must be a folder this process can write in; a
 * warning says when its file system has no room for the checkpoints kept
 * (and the one being written): fp32 weights and AdamW's two moments, 12
 * bytes a parameter. */
static int check_checkpoint_dir(const struct mr_job *job) {
  const char *d = job->checkpoint.dir;
  if (d == NULL)
    return 0;
  if (mr_mkdir_p(d) < 0)
    return mr_error_set(MR_EINVAL, "%s: checkpoint.dir: %s", job->path, mr_error_message());
  char probe[4200];
  snprintf(probe, sizeof probe, "%s/.meshrun-write-test-%d", d, (int)getpid());
  int fd = open(probe, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    return mr_error_set(MR_EINVAL, "%s: checkpoint.dir: cannot write in %s: %s", job->path, d,
                        strerror(errno));
  close(fd);
  unlink(probe);
  struct statvfs v;
  double one = 12.0 * (double)mr_model_param_count(&job->model);
  double need = one * (double)(job->checkpoint.keep_last + 1);
  if (statvfs(d, &v) == 0 && (double)v.f_bavail * (double)v.f_frsize < need)
    fprintf(stderr, "meshrun launch: warning: checkpoint.dir %s has %.0f MiB free; a checkpoint "
            "of this model takes about %.0f MiB and %lld are kept (a save that does not fit "
            "fails the job)\n", d, (double)v.f_bavail * (double)v.f_frsize / 1048576.0,
            one / 1048576.0, (long long)job->checkpoint.keep_last);
  return 0;
}

/* The job's token files, checked as the ranks will open them (header,
 * size, every token below the vocabulary) before any rank starts: bad
 * data is the user's to fix, not a failure to restart from. */
static int check_data(const struct mr_job *job) {
  const char *files[2] = {job->data_train, job->data_val};
  for (int i = 0; i < 2; i++) {
    if (files[i] == NULL)
      continue;
    struct mr_tokens t;
    int rc = mr_tokens_open(&t, files[i], job->model.vocab_size);
    if (rc < 0)
      return mr_error_set(rc, "%s: data.%s: %s", job->path, i == 0 ? "train" : "val",
                          mr_error_of(rc));
    mr_tokens_close(&t);
  }
  return 0;
}

static char *job_stem(const char *path) {
  const char *base = strrchr(path, '/');
  base = base ? base + 1 : path;
  char *s = strdup(base);
  char *dot = s ? strrchr(s, '.') : NULL;
  if (dot != NULL && dot != s)
    *dot = '\0';
  return s;
}

/* What the command line (and the scheduler around it) asks for. */
struct launch_args {
  long nproc, threads, restarts, nnodes, min_nodes, node_rank;
  double hb, hang, join_timeout;
  const char *log_dir, *metrics, *bind, *master, *token_file;
  const char *devices_spec, *device, *job_path;
  const char *trace_dir, *trace_steps;
  int64_t trace_first, trace_last; // 0: the default
  char trace_buf[4096];
  int selfcheck, nnodes_given, rank_given;
  struct mr_slurm_step slurm;   // the Slurm step around us, if any
  char master_host[256];        // --master split
  int master_port;
  char bind_all[300], log_buf[4096];
};

/* The flags into a; returns -1 to go on, else the exit code (0: --help). */
/* One recognized flag c with its argument into a; returns -1, or 2 on a
 * bad value (said); 0 when c is none of them. */
static int take_flag(int c, const char *arg, struct launch_args *a) {
  switch (c) {
  case 'n':
    if (mr_cli_int("launch", "--nproc", arg, 1, 100000, &a->nproc) < 0)
      return 2;
    break;
  case 'D':
    a->devices_spec = arg;
    break;
  case 'V':
    if (strcmp(arg, "cpu") != 0 && strcmp(arg, "cuda") != 0) {
      fprintf(stderr, "meshrun launch: --device \"%s\": expected cpu or cuda\n", arg);
      return 2;
    }
    a->device = arg;
    break;
  case 't':
    if (mr_cli_int("launch", "--threads", arg, 1, 4096, &a->threads) < 0)
      return 2;
    break;
  case 'r':
    if (mr_cli_int("launch", "--max-restarts", arg, 0, 1000000, &a->restarts) < 0)
      return 2;
    break;
  case 'l':
    a->log_dir = arg;
    break;
  case 'm':
    a->metrics = arg;
    break;
  case 'h':
    if (mr_cli_num("launch", "--heartbeat-timeout", arg, 0.05, 1e6, &a->hb) < 0)
      return 2;
    break;
  case 'b':
    a->bind = arg;
    break;
  case 'H':
    if (mr_cli_num("launch", "--hang-timeout", arg, 0, 1e7, &a->hang) < 0)
      return 2;
    break;
  case 's':
    a->selfcheck = 1;
    break;
  case 'N': { /* N, or MIN:MAX (elastic) */
    char lo[32];
    const char *colon = strchr(arg, ':');
    snprintf(lo, sizeof lo, "%.*s", colon ? (int)(colon - arg) : (int)strlen(arg), arg);
    if (mr_cli_int("launch", "--nnodes", colon ? colon + 1 : arg, 1, 100000, &a->nnodes) < 0 ||
        mr_cli_int("launch", "--nnodes", lo, 1, a->nnodes, &a->min_nodes) < 0)
      return 2;
    a->nnodes_given = 1;
    break;
  }
  case 'K':
    if (mr_cli_int("launch", "--node-rank", arg, 0, 99999, &a->node_rank) < 0)
      return 2;
    a->rank_given = 1;
    break;
  case 'M':
    a->master = arg;
    break;
  case 'T':
    a->token_file = arg;
    break;
  case 'J':
    if (mr_cli_num("launch", "--join-timeout", arg, 0.1, 1e7, &a->join_timeout) < 0)
      return 2;
    break;
  case 'P':
    a->trace_dir = arg;
    break;
  case 'Q':
    a->trace_steps = arg;
    break;
  default:
    return 0;
  }
  return -1;
}

static int parse_flags(int argc, char **argv, struct launch_args *a) {
  static const struct option longopts[] = {
      {"nproc", required_argument, NULL, 'n'},
      {"devices", required_argument, NULL, 'D'},
      {"device", required_argument, NULL, 'V'},
      {"threads", required_argument, NULL, 't'},
      {"max-restarts", required_argument, NULL, 'r'},
      {"log-dir", required_argument, NULL, 'l'},
      {"metrics", required_argument, NULL, 'm'},
      {"heartbeat-timeout", required_argument, NULL, 'h'},
      {"bind", required_argument, NULL, 'b'},
      {"hang-timeout", required_argument, NULL, 'H'},
      {"selfcheck", no_argument, NULL, 's'},
      {"nnodes", required_argument, NULL, 'N'},
      {"node-rank", required_argument, NULL, 'K'},
      {"master", required_argument, NULL, 'M'},
      {"token-file", required_argument, NULL, 'T'},
      {"join-timeout", required_argument, NULL, 'J'},
      {"trace", required_argument, NULL, 'P'},
      {"trace-steps", required_argument, NULL, 'Q'},
      {"help", no_argument, NULL, '?'},
      {NULL, 0, NULL, 0}};
  optind = 1;
  opterr = 0;
  int c;
  while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
    int got = take_flag(c, optarg, a);
    if (got != 0) {
      if (got == 2)
        return 2;
      continue;
    }
    if (optopt == 0 && strcmp(argv[optind - 1], "--help") == 0) {
      usage(stdout);
      return 0;
    }
    fprintf(stderr, "meshrun launch: unknown or incomplete option \"%s\"\n", argv[optind - 1]);
    usage(stderr);
    return 2;
  }
  int rest = argc - optind;
  if (rest > 1 || (rest == 0 && !a->selfcheck)) {
    fprintf(stderr, rest == 0 ? "meshrun launch: missing JOB.json\n"
                              : "meshrun launch: expected one job file, got %d arguments\n",
            rest);
    usage(stderr);
    return 2;
  }
  a->job_path = rest == 1 ? argv[optind] : NULL;
  return -1;
}

/* Node 0's host as the Slurm step names it must resolve here: a node that
 * cannot find it would only time out, and node 0 wait for it.  Returns -1
 * when it resolves, else prints what to do and returns 2. */
static int slurm_host_unresolved(const struct launch_args *a) {
  const struct mr_slurm_step *slurm = &a->slurm;
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
  int e = EAI_AGAIN;
  for (int tries = 0; e == EAI_AGAIN && tries < 5; tries++) { /* a DNS server slow to answer */
    if (tries > 0)
      sleep(1);
    e = getaddrinfo(slurm->host, NULL, &hints, &res);
  }
  if (e == 0) {
    freeaddrinfo(res);
    return -1;
  }
  char self[256] = "";
  gethostname(self, sizeof self - 1);
  fprintf(stderr, "meshrun launch: node 0's host \"%s\" (the first node of Slurm's %s) does "
          "not resolve on node %ld (%s): %s.  Every node dials node 0 at that name: give "
          "every node an address of node 0 that they all reach with --master HOST:PORT "
          "(port %s is the one this job would use), or make \"%s\" resolve on every node\n",
          slurm->host, slurm->host_from, a->node_rank, self, gai_strerror(e),
          strrchr(slurm->master, ':') + 1, slurm->host);
  return 2;
}

/* Inside a Slurm step, or a Kubernetes indexed Job, what the flags leave
 * unsaid comes from it; returns -1 to go on, else the exit code. */
static int from_scheduler(struct launch_args *a) {
  struct mr_slurm_step *slurm = &a->slurm;
  int all_given = a->nnodes_given && a->rank_given && a->master != NULL && a->token_file != NULL;
  if (!all_given && mr_slurm_step(slurm) < 0) {
    fprintf(stderr, "meshrun launch: %s\n", mr_error_message());
    return 2;
  }
  if (slurm->in_step && slurm->nnodes > 1) {
    if (!a->nnodes_given)
      a->nnodes = a->min_nodes = slurm->nnodes;
    if (!a->rank_given)
      a->node_rank = slurm->node_rank;
    if (a->master == NULL)
      a->master = slurm->master;
    if (a->master == slurm->master && slurm_host_unresolved(a) >= 0)
      return 2;
    if (a->token_file == NULL && slurm->token_file[0] != '\0') {
      char dir[4096];
      snprintf(dir, sizeof dir, "%s", slurm->token_file);
      *strrchr(dir, '/') = '\0';
      if (mr_mkdir_p(dir) == 0)
        a->token_file = slurm->token_file;
    }
    /* node 0 writes the step's token afresh: a file of that name is left
     * by a launcher killed before it could remove it, with job ids reused
     * (a new controller) or of an earlier step, never this step's */
    if (a->token_file == slurm->token_file && a->node_rank == 0) {
      mr_slurm_clean_tokens(slurm);
      unlink(slurm->token_file);
    }
    printf("meshrun: Slurm job %ld: node %ld of %ld, node 0 at %s, job token in %s\n",
           slurm->job_id, a->node_rank, a->nnodes, a->master,
           a->token_file ? a->token_file : "(none)");
    fflush(stdout);
  } else if (!slurm->in_step && slurm->in_job_nodes > 1 && !a->nnodes_given) {
    fprintf(stderr, "meshrun launch: note: Slurm job %ld has %d nodes, but this is not an "
            "srun step: running on this node only (srun --ntasks-per-node=1 meshrun launch "
            "... runs a launcher on every node)\n", slurm->job_id, slurm->in_job_nodes);
  }
  /* a Kubernetes indexed Job: the pod's index is the node's */
  const char *pod = getenv("JOB_COMPLETION_INDEX");
  if (!a->rank_given && !slurm->in_step && a->nnodes > 1 && pod != NULL &&
      mr_cli_int("launch", "JOB_COMPLETION_INDEX", pod, 0, a->nnodes - 1, &a->node_rank) < 0)
    return 2;
  return -1;
}

/* This node's place among the nodes, node 0's address and the one to
 * listen on; returns -1 to go on, else the exit code. */
static int resolve_addresses(struct launch_args *a) {
  if (a->node_rank >= a->nnodes) {
    fprintf(stderr, "meshrun launch: --node-rank %ld: expected 0..%ld (--nnodes %ld)\n",
            a->node_rank, a->nnodes - 1, a->nnodes);
    return 2;
  }
  if (a->nnodes > 1 && (a->master == NULL || a->token_file == NULL)) {
    fprintf(stderr, "meshrun launch: --nnodes %ld: expected --master HOST:PORT (node 0's "
            "launcher) and --token-file FILE (the job token, on a file system every node "
            "sees)\n", a->nnodes);
    return 2;
  }
  if (a->master != NULL && mr_cli_host_port(a->master, a->master_host, sizeof a->master_host,
                                            &a->master_port) < 0) {
    fprintf(stderr, "meshrun launch: --master %s: %s\n", a->master, mr_error_message());
    return 2;
  }
  if (a->bind == NULL && a->nnodes > 1) { /* every interface, at the port the others dial */
    snprintf(a->bind_all, sizeof a->bind_all, "0.0.0.0:%d", a->master_port);
    a->bind = a->bind_all;
  }
  if (a->bind == NULL)
    a->bind = "127.0.0.1:0";
  char bind_host[64];
  int bind_port;
  if (mr_bind_parse(a->bind, bind_host, sizeof bind_host, &bind_port) < 0) {
    fprintf(stderr, "meshrun launch: %s\n", mr_error_message());
    return 2;
  }
  return -1;
}

/* The default --nproc held to what a Slurm allocation gives this node:
 * its GPUs for GPU ranks, its CPUs (--threads each) for CPU ranks.  An
 * allocation need not bind the launcher to its CPUs (task/none), so the
 * cores it can run on may be more than it was given. */
static void slurm_share(struct launch_args *a, const struct mr_devices *d) {
  const struct mr_slurm_step *s = &a->slurm;
  long n = a->nproc, have = 0;
  const char *what = "CPU", *var = s->cpus_var;
  if (d->gpus > 0 && s->gpus >= 1) {
    have = n = s->gpus < n ? s->gpus : n;
    what = "GPU", var = s->gpus_var;
  } else if (d->gpus == 0 && s->cpus > 0) {
    long k = s->cpus / (a->threads > 0 ? a->threads : 1);
    have = s->cpus;
    n = k < 1 ? 1 : k < n ? k : n;
  }
  if (n >= a->nproc)
    return;
  printf("meshrun: Slurm gives this node %ld %s%s (%s): %ld rank%s (--nproc N to choose)\n",
         have, what, have == 1 ? "" : "s", var, n, n == 1 ? "" : "s");
  fflush(stdout);
  a->nproc = n;
}

/* The GPUs the ranks see (--devices), the ranks on this node and what they
 * compute on (MESHRUN_DEVICE, set for the workers; *gpu_ranks); returns -1
 * to go on, else the exit code. */
static int choose_devices(struct launch_args *a, struct mr_devices *devices, int *gpu_ranks) {
  if (a->devices_spec != NULL) {
    /* like paddle.distributed.launch --devices: the ranks see exactly
     * these GPUs, rank i on the i-th */
    int idx[1024], n = 0;
    char env[8192];
    if (mr_devices_parse_list("--devices", a->devices_spec, devices->gpus, idx, 1024, &n) < 0 ||
        mr_devices_select(devices, idx, n, env, sizeof env) < 0) {
      fprintf(stderr, "meshrun launch: %s\n", mr_error_message());
      return 2;
    }
    if (a->nproc != 0 && a->nproc != n) {
      fprintf(stderr, "meshrun launch: --nproc %ld but --devices %s lists %d GPU%s: "
              "one rank per GPU\n", a->nproc, a->devices_spec, n, n == 1 ? "" : "s");
      return 2;
    }
    setenv("CUDA_VISIBLE_DEVICES", env, 1);
  }
  if (a->nproc == 0) {
    a->nproc = mr_devices_default_nproc(devices, (int)a->threads);
    slurm_share(a, devices);
  }
  if (devices->gpus > 0) {
    /* the weakest link between two of the GPUs the ranks will use */
    enum mr_gpu_link worst = MR_GPU_LINK_SELF;
    for (int i = 0; i < devices->gpus; i++)
      for (int j = 0; j < devices->gpus; j++) {
        enum mr_gpu_link l = mr_devices_link(devices, i, j);
        if (l == MR_GPU_LINK_UNKNOWN || (worst != MR_GPU_LINK_UNKNOWN && l > worst))
          worst = l;
      }
    printf("meshrun: %d GPU%s: %s, %.0f GiB%s; links %s\n", devices->gpus,
           devices->gpus > 1 ? "s" : "", devices->dev[0].name,
           (double)devices->dev[0].memory_bytes / (1 << 30), devices->gpus > 1 ? " each" : "",
           devices->gpus > 1 ? mr_gpu_link_name(worst) : "(one GPU)");
    fflush(stdout);
  }
  /* what the ranks compute on: the flag, else MESHRUN_DEVICE, else GPUs
   * where there are any; the workers read it from their environment */
  const char *dev_kind = a->device != NULL ? a->device : mr_tunable_str(MR_TUNABLE_DEVICE);
  if (dev_kind == NULL || dev_kind[0] == '\0') /* GPUs where each rank gets one */
    dev_kind = devices->gpus > 0 && a->nproc <= devices->gpus ? "cuda" : "cpu";
  if (strcmp(dev_kind, "cuda") == 0 && a->nproc > devices->gpus) {
    fprintf(stderr, "meshrun launch: --device cuda with %ld ranks, but %d GPU%s visible: one "
            "rank per GPU (or --device cpu)\n", a->nproc, devices->gpus,
            devices->gpus == 1 ? "" : "s");
    return 2;
  }
  setenv("MESHRUN_DEVICE", dev_kind, 1);
  *gpu_ranks = strcmp(dev_kind, "cuda") == 0;
  return -1;
}

/* Node 0's plan for world ranks: the machine measured when the job names
 * no cluster spec, the strategy chosen and written into job->text, the
 * checkpoint folder checked; returns -1 to go on, else the exit code. */
static int plan_job(struct launch_args *a, struct mr_job *job, const struct mr_devices *devices,
                    int gpu_ranks, long world, struct mr_strategy_choice *choice) {
  int rc = check_data(job);
  if (rc < 0) {
    fprintf(stderr, "meshrun launch: %s\n", mr_error_of(rc));
    return 2;
  }
  if (job->cluster == NULL && mr_tunable_str(MR_TUNABLE_CLUSTER)[0] == '\0') {
    /* no cluster spec given: plan for this machine, measured (once;
     * cached) — its GPUs where the ranks run on them, else its cores */
    char spec[4096];
    rc = gpu_ranks ? mr_gpu_cluster_spec(devices, spec, sizeof spec)
                       : mr_cpu_cluster_spec(spec, sizeof spec);
    if (rc == 0) {
      job->cluster = strdup(spec);
      printf("meshrun: measured %s: %s\n", gpu_ranks ? "GPUs" : "this machine", spec);
    } else if (rc < 0) {
      fprintf(stderr, "meshrun launch: warning: %s; planning with the shipped specs\n",
              mr_error_of(rc));
    }
  }
  rc = mr_strategy_choose(job, (int)world, choice);
  if (rc < 0) {
    fprintf(stderr, "meshrun launch: %s: %s\n", a->job_path, mr_error_of(rc));
    return 2;
  }
  char *text = mr_strategy_apply(job, &choice->chosen.strategy);
  if (text == NULL) {
    fprintf(stderr, "meshrun launch: out of memory\n");
    return 1;
  }
  free(job->text);
  job->text = text;
  mr_strategy_print(choice, stdout);
  fflush(stdout);
  if ((rc = check_checkpoint_dir(job)) < 0) {
    fprintf(stderr, "meshrun launch: %s\n", mr_error_of(rc));
    return 2;
  }
  if (job->checkpoint.dir != NULL)
    record_model_source(job);
  return -1;
}

/* The worker binary (MESHRUN_WORKER, else beside meshrun, else on PATH)
 * into worker and the log folder made (default runs/JOBNAME); returns -1
 * to go on, else the exit code. */
static int find_worker_and_logs(struct launch_args *a, char *worker, size_t n) {
  const char *wenv = getenv("MESHRUN_WORKER");
  if (wenv != NULL && wenv[0] != '\0')
    snprintf(worker, n, "%s", wenv);
  else if (mr_find_program("meshrun-worker", "worker", worker, n) < 0) {
    fprintf(stderr, "meshrun launch: cannot find meshrun-worker beside meshrun or on PATH\n");
    return 1;
  }
  if (a->log_dir == NULL) {
    char *stem = a->job_path != NULL ? job_stem(a->job_path) : strdup("selfcheck");
    snprintf(a->log_buf, sizeof a->log_buf, "runs/%s", stem != NULL ? stem : "job");
    free(stem);
    a->log_dir = a->log_buf;
  }
  if (mr_mkdir_p(a->log_dir) < 0) {
    fprintf(stderr, "meshrun launch: --log-dir: %s\n", mr_error_message());
    return 2;
  }
  return -1;
}

/* Another node's launcher: joins node 0's and runs the ranks it is told. */
static int run_agent(const struct launch_args *a, const char *worker) {
  struct mr_agent_opts ao = {
      .nnodes = (int)a->nnodes,
      .node_rank = (int)a->node_rank,
      .nproc = (int)a->nproc,
      .master = a->master,
      .token_file = a->token_file,
      .log_dir = a->log_dir,
      .worker_bin = worker,
      .threads = (int)a->threads,
      .join_timeout_s = a->join_timeout,
      .token_file_of_step = a->token_file != NULL && a->token_file == a->slurm.token_file,
  };
  return mr_agent_run(&ao);
}

/* The trace the flags (else the job's trace section) ask for, into a; -1
 * to go on, else the exit code.  A folder that cannot be made is said
 * once, and the job runs without a trace. */
static int trace_args(struct launch_args *a, const struct mr_job *job) {
  if (a->trace_steps != NULL && a->trace_dir == NULL && job->trace.dir == NULL) {
    fprintf(stderr, "meshrun launch: --trace-steps %s: expected --trace DIR too (or the job's "
            "trace.dir)\n", a->trace_steps);
    return 2;
  }
  if (a->trace_steps != NULL && job->text != NULL &&
      mr_job_steps_range("--trace-steps", a->trace_steps, job->train.steps, &a->trace_first,
                         &a->trace_last) < 0) {
    fprintf(stderr, "meshrun launch: %s\n", mr_error_message());
    return 2;
  }
  if (a->trace_steps == NULL)
    a->trace_first = job->trace.first, a->trace_last = job->trace.last;
  const char *dir = a->trace_dir != NULL ? a->trace_dir : job->trace.dir;
  a->trace_dir = NULL;
  if (dir == NULL || a->selfcheck || job->text == NULL)
    return -1;
  const char *why = NULL;
  if (mr_mkdir_p(dir) < 0)
    why = mr_error_message();
  else if (access(dir, W_OK) != 0 || realpath(dir, a->trace_buf) == NULL)
    why = strerror(errno);
  if (why != NULL) {
    fprintf(stderr, "meshrun launch: warning: --trace %s: %s; the job runs without a trace\n",
            dir, why);
    return -1;
  }
  a->trace_dir = a->trace_buf;
  return -1;
}

/* Node 0: the coordinator, with the plan made for world ranks. */
static int run_coordinator(const struct launch_args *a, const char *worker, struct mr_job *job,
                           const struct mr_devices *devices,
                           const struct mr_strategy_choice *choice, long world, int planned) {
  struct mr_launch_opts opts = {
      .nproc = (int)world,
      .nnodes = (int)a->nnodes,
      .min_nodes = (int)a->min_nodes,
      .node_ranks = (int)a->nproc,
      .join_timeout_s = a->join_timeout,
      .token_file = a->token_file,
      .master_host = a->nnodes > 1 ? a->master_host : NULL,
      .max_restarts = (int)a->restarts,
      .log_dir = a->log_dir,
      .heartbeat_timeout_s = a->hb,
      .hang_timeout_s = a->hang,
      .bind = a->bind,
      .worker_bin = worker,
      .threads = (int)a->threads,
      .selfcheck = a->selfcheck,
      .job = a->job_path != NULL ? job : NULL,
      .metrics_path = a->metrics,
      .devices = devices,
      .program_digests = choice->program_digests,
      .predicted_step_s = planned ? choice->chosen.cost.step_time_s : 0,
      .peak_device_s =
          planned ? choice->chosen.cost.mfu * choice->chosen.cost.step_time_s * (double)world : 0,
      .trace_dir = a->trace_dir,
      .trace_first = a->trace_first,
      .trace_last = a->trace_last,
  };
  if (a->trace_dir != NULL)
    mr_trace_clear(a->trace_dir);
  int code = mr_coordinator_run(&opts);
  if (a->trace_dir != NULL) {
    int n = mr_trace_merge(a->trace_dir);
    if (n < 0)
      fprintf(stderr, "meshrun launch: warning: the merged trace: %s\n", mr_error_message());
    else if (n > 0)
      printf("meshrun: trace of %d rank%s: %s/trace.json (chrome://tracing or "
             "ui.perfetto.dev)\n", n, n == 1 ? "" : "s", a->trace_dir);
  }
  /* the job's own token file (Slurm's default) goes with the job: every
   * node read it when it joined */
  if (a->token_file != NULL && a->token_file == a->slurm.token_file)
    unlink(a->token_file);
  return code;
}

/* meshrun launch: the flags and the scheduler's word, the job, the
 * devices, node 0's plan, then this node's launcher runs. */
int mr_cmd_launch(int argc, char **argv) {
  struct launch_args a = {.nnodes = 1, .min_nodes = 1, .hb = 30.0, .hang = 300.0,
                          .join_timeout = 600.0};
  int code;
  if ((code = parse_flags(argc, argv, &a)) >= 0 || (code = from_scheduler(&a)) >= 0 ||
      (code = resolve_addresses(&a)) >= 0)
    return code;
  struct mr_job job;
  memset(&job, 0, sizeof job);
  int rc = a.job_path != NULL ? mr_job_load(a.job_path, &job) : 0;
  if (rc < 0) {
    fprintf(stderr, "meshrun launch: %s\n", mr_error_of(rc));
    return 2;
  }
  if (a.job_path != NULL)
    mr_cli_job_defaults(&job);
  if ((rc = mr_plugin_load_job(&job)) < 0) {
    fprintf(stderr, "meshrun launch: %s\n", mr_error_of(rc));
    mr_job_close(&job);
    return 2;
  }
  if ((code = trace_args(&a, &job)) >= 0) {
    mr_job_close(&job);
    return code;
  }
  /* a finished job launched again exits before it plans or writes a
   * byte: on one node at once, on node k > 0 before it joins (node 0
   * of several says so to the nodes that joined, in its coordinator) */
  if ((a.node_rank > 0 || a.nnodes == 1) && a.job_path != NULL && mr_cli_job_complete(&job)) {
    mr_job_close(&job);
    return 0;
  }
  if (a.threads == 0)
    a.threads = (long)mr_tunable_int(MR_TUNABLE_THREADS);
  if (a.threads < 1)
    a.threads = 1;
  struct mr_strategy_choice choice;
  memset(&choice, 0, sizeof choice);
  struct mr_devices devices;
  if ((rc = mr_discover_devices(&devices)) < 0) {
    fprintf(stderr, "meshrun launch: device discovery failed: %s\n", mr_error_of(rc));
    mr_job_close(&job);
    return 1;
  }
  int gpu_ranks = 0;
  long world = 0;
  int plans = a.job_path != NULL && !a.selfcheck && a.node_rank == 0; /* node 0 plans */
  char worker[4096];
  if ((code = choose_devices(&a, &devices, &gpu_ranks)) >= 0)
    goto done;
  world = a.nnodes * a.nproc; /* every node runs nproc ranks */
  if (world > 1000000) {
    fprintf(stderr, "meshrun launch: --nnodes %ld x --nproc %ld: %ld ranks, expected at most "
            "1000000\n", a.nnodes, a.nproc, world);
    code = 2;
    goto done;
  }
  if ((plans && (code = plan_job(&a, &job, &devices, gpu_ranks, world, &choice)) >= 0) ||
      (code = find_worker_and_logs(&a, worker, sizeof worker)) >= 0)
    goto done;
  mr_log_set_prefix("launcher");
  code = a.node_rank > 0 ? run_agent(&a, worker)
                         : run_coordinator(&a, worker, &job, &devices, &choice, world, plans);
done:
  mr_strategy_choice_close(&choice);
  mr_devices_close(&devices);
  mr_job_close(&job);
  return code;
}
