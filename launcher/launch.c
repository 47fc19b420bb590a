/* launch.c - `meshrun launch [flags] JOB.json`. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "common/error.h"
#include "common/job.h"
#include "common/log.h"
#include "common/tunable.h"
#include "launcher/agent.h"
#include "launcher/cli.h"
#include "launcher/coordinator.h"
#include "launcher/slurm.h"
#include "launcher/strategy_choice.h"
#include "common/discovery.h"
#include "launcher/measure.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: meshrun launch [options] JOB.json\n"
          "       meshrun launch --selfcheck [options] [JOB.json]\n"
          "\n"
          "Starts one worker per rank, sends each the plan and supervises them.\n"
          "\n"
          "  --nproc N              ranks on this node (default: one per GPU, else cores /\n"
          "                         threads)\n"
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
          "host at port 20000 + job id %% 20000, the token in ~/.cache/meshrun.\n");
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

static char *job_stem(const char *path) {
  const char *base = strrchr(path, '/');
  base = base ? base + 1 : path;
  char *s = strdup(base);
  char *dot = s ? strrchr(s, '.') : NULL;
  if (dot != NULL && dot != s)
    *dot = '\0';
  return s;
}

int mr_cmd_launch(int argc, char **argv) {
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
      {"help", no_argument, NULL, '?'},
      {NULL, 0, NULL, 0}};
  long nproc = 0, threads = 0, restarts = 0, nnodes = 1, min_nodes = 1, node_rank = 0;
  double hb = 30.0, hang = 300.0, join_timeout = 600.0;
  const char *log_dir = NULL, *metrics = NULL, *bind = NULL;
  const char *master = NULL, *token_file = NULL;
  const char *devices_spec = NULL, *device = NULL;
  int selfcheck = 0, nnodes_given = 0, rank_given = 0;
  optind = 1;
  opterr = 0;
  int c;
  while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
    switch (c) {
    case 'n':
      if (mr_cli_int("launch", "--nproc", optarg, 1, 100000, &nproc) < 0)
        return 2;
      break;
    case 'D':
      devices_spec = optarg;
      break;
    case 'V':
      if (strcmp(optarg, "cpu") != 0 && strcmp(optarg, "cuda") != 0) {
        fprintf(stderr, "meshrun launch: --device \"%s\": expected cpu or cuda\n", optarg);
        return 2;
      }
      device = optarg;
      break;
    case 't':
      if (mr_cli_int("launch", "--threads", optarg, 1, 4096, &threads) < 0)
        return 2;
      break;
    case 'r':
      if (mr_cli_int("launch", "--max-restarts", optarg, 0, 1000000, &restarts) < 0)
        return 2;
      break;
    case 'l':
      log_dir = optarg;
      break;
    case 'm':
      metrics = optarg;
      break;
    case 'h':
      if (mr_cli_num("launch", "--heartbeat-timeout", optarg, 0.05, 1e6, &hb) < 0)
        return 2;
      break;
    case 'b':
      bind = optarg;
      break;
    case 'H':
      if (mr_cli_num("launch", "--hang-timeout", optarg, 0, 1e7, &hang) < 0)
        return 2;
      break;
    case 's':
      selfcheck = 1;
      break;
    case 'N': { /* N, or MIN:MAX (elastic) */
      char lo[32];
      const char *colon = strchr(optarg, ':');
      snprintf(lo, sizeof lo, "%.*s", colon ? (int)(colon - optarg) : (int)strlen(optarg), optarg);
      if (mr_cli_int("launch", "--nnodes", colon ? colon + 1 : optarg, 1, 100000, &nnodes) < 0 ||
          mr_cli_int("launch", "--nnodes", lo, 1, nnodes, &min_nodes) < 0)
        return 2;
      nnodes_given = 1;
      break;
    }
    case 'K':
      if (mr_cli_int("launch", "--node-rank", optarg, 0, 99999, &node_rank) < 0)
        return 2;
      rank_given = 1;
      break;
    case 'M':
      master = optarg;
      break;
    case 'T':
      token_file = optarg;
      break;
    case 'J':
      if (mr_cli_num("launch", "--join-timeout", optarg, 0.1, 1e7, &join_timeout) < 0)
        return 2;
      break;
    default:
      if (optopt == 0 && strcmp(argv[optind - 1], "--help") == 0) {
        usage(stdout);
        return 0;
      }
      fprintf(stderr, "meshrun launch: unknown or incomplete option \"%s\"\n",
              argv[optind - 1]);
      usage(stderr);
      return 2;
    }
  }
  /* inside a Slurm step, what the flags leave unsaid comes from it */
  struct mr_slurm_step slurm = {0};
  int all_given = nnodes_given && rank_given && master != NULL && token_file != NULL;
  if (!all_given && mr_slurm_step(&slurm) < 0) {
    fprintf(stderr, "meshrun launch: %s\n", mr_error_message());
    return 2;
  }
  if (slurm.in_step && slurm.nnodes > 1) {
    if (!nnodes_given)
      nnodes = min_nodes = slurm.nnodes;
    if (!rank_given)
      node_rank = slurm.node_rank;
    if (master == NULL)
      master = slurm.master;
    if (token_file == NULL && slurm.token_file[0] != '\0') {
      char dir[4096];
      snprintf(dir, sizeof dir, "%s", slurm.token_file);
      *strrchr(dir, '/') = '\0';
      if (mr_mkdir_p(dir) == 0)
        token_file = slurm.token_file;
    }
    printf("meshrun: Slurm job %ld: node %ld of %ld, node 0 at %s, job token in %s\n",
           slurm.job_id, node_rank, nnodes, master, token_file ? token_file : "(none)");
    fflush(stdout);
  } else if (!slurm.in_step && slurm.in_job_nodes > 1 && !nnodes_given) {
    fprintf(stderr, "meshrun launch: note: Slurm job %ld has %d nodes, but this is not an "
            "srun step: running on this node only (srun --ntasks-per-node=1 meshrun launch "
            "... runs a launcher on every node)\n", slurm.job_id, slurm.in_job_nodes);
  }
  /* a Kubernetes indexed Job: the pod's index is the node's */
  const char *pod = getenv("JOB_COMPLETION_INDEX");
  if (!rank_given && !slurm.in_step && nnodes > 1 && pod != NULL &&
      mr_cli_int("launch", "JOB_COMPLETION_INDEX", pod, 0, nnodes - 1, &node_rank) < 0)
    return 2;
  if (node_rank >= nnodes) {
    fprintf(stderr, "meshrun launch: --node-rank %ld: expected 0..%ld (--nnodes %ld)\n",
            node_rank, nnodes - 1, nnodes);
    return 2;
  }
  char master_host[256], bind_all[300];
  int master_port = 0;
  if (nnodes > 1 && (master == NULL || token_file == NULL)) {
    fprintf(stderr, "meshrun launch: --nnodes %ld: expected --master HOST:PORT (node 0's "
            "launcher) and --token-file FILE (the job token, on a file system every node "
            "sees)\n", nnodes);
    return 2;
  }
  if (master != NULL && mr_cli_host_port(master, master_host, sizeof master_host,
                                         &master_port) < 0) {
    fprintf(stderr, "meshrun launch: --master %s: %s\n", master, mr_error_message());
    return 2;
  }
  if (bind == NULL && nnodes > 1) { /* every interface, at the port the others dial */
    snprintf(bind_all, sizeof bind_all, "0.0.0.0:%d", master_port);
    bind = bind_all;
  }
  if (bind == NULL)
    bind = "127.0.0.1:0";
  char bind_host[64];
  int bind_port;
  if (mr_bind_parse(bind, bind_host, sizeof bind_host, &bind_port) < 0) {
    fprintf(stderr, "meshrun launch: %s\n", mr_error_message());
    return 2;
  }
  int rest = argc - optind;
  if (rest > 1 || (rest == 0 && !selfcheck)) {
    fprintf(stderr, rest == 0 ? "meshrun launch: missing JOB.json\n"
                              : "meshrun launch: expected one job file, got %d arguments\n",
            rest);
    usage(stderr);
    return 2;
  }
  const char *job_path = rest == 1 ? argv[optind] : NULL;

  struct mr_job job;
  memset(&job, 0, sizeof job);
  if (job_path != NULL && mr_job_load(job_path, &job) < 0) {
    fprintf(stderr, "meshrun launch: %s\n", mr_error_message());
    return 2;
  }
  if (job_path != NULL)
    mr_cli_job_defaults(&job);
  if (threads == 0)
    threads = (long)mr_tunable_int(MR_TUNABLE_THREADS);
  if (threads < 1)
    threads = 1;
  int code = 0;
  struct mr_strategy_choice choice;
  memset(&choice, 0, sizeof choice);
  struct mr_devices devices;
  if (mr_discover_devices(&devices) < 0) {
    fprintf(stderr, "meshrun launch: device discovery failed: %s\n", mr_error_message());
    mr_job_close(&job);
    return 1;
  }
  if (devices_spec != NULL) {
    /* like paddle.distributed.launch --devices: the ranks see exactly
     * these GPUs, rank i on the i-th */
    int idx[1024], n = 0;
    char env[8192];
    if (mr_devices_parse_list("--devices", devices_spec, devices.gpus, idx, 1024, &n) < 0 ||
        mr_devices_select(&devices, idx, n, env, sizeof env) < 0) {
      fprintf(stderr, "meshrun launch: %s\n", mr_error_message());
      code = 2;
      goto done;
    }
    if (nproc != 0 && nproc != n) {
      fprintf(stderr, "meshrun launch: --nproc %ld but --devices %s lists %d GPU%s: "
              "one rank per GPU\n", nproc, devices_spec, n, n == 1 ? "" : "s");
      code = 2;
      goto done;
    }
    setenv("CUDA_VISIBLE_DEVICES", env, 1);
  }
  if (nproc == 0)
    nproc = mr_devices_default_nproc(&devices, (int)threads);
  if (devices.gpus > 0) {
    /* the weakest link between two of the GPUs the ranks will use */
    enum mr_gpu_link worst = MR_GPU_LINK_SELF;
    for (int i = 0; i < devices.gpus; i++)
      for (int j = 0; j < devices.gpus; j++) {
        enum mr_gpu_link l = mr_devices_link(&devices, i, j);
        if (l == MR_GPU_LINK_UNKNOWN || (worst != MR_GPU_LINK_UNKNOWN && l > worst))
          worst = l;
      }
    printf("meshrun: %d GPU%s: %s, %.0f GiB%s; links %s\n", devices.gpus,
           devices.gpus > 1 ? "s" : "", devices.dev[0].name,
           (double)devices.dev[0].memory_bytes / (1 << 30), devices.gpus > 1 ? " each" : "",
           devices.gpus > 1 ? mr_gpu_link_name(worst) : "(one GPU)");
    fflush(stdout);
  }
  /* what the ranks compute on: the flag, else MESHRUN_DEVICE, else GPUs
   * where there are any; the workers read it from their environment */
  const char *dev_kind = device != NULL ? device : mr_tunable_str(MR_TUNABLE_DEVICE);
  if (dev_kind == NULL || dev_kind[0] == '\0') /* GPUs where each rank gets one */
    dev_kind = devices.gpus > 0 && nproc <= devices.gpus ? "cuda" : "cpu";
  if (strcmp(dev_kind, "cuda") == 0 && nproc > devices.gpus) {
    fprintf(stderr, "meshrun launch: --device cuda with %ld ranks, but %d GPU%s visible: one "
            "rank per GPU (or --device cpu)\n", nproc, devices.gpus, devices.gpus == 1 ? "" : "s");
    code = 2;
    goto done;
  }
  setenv("MESHRUN_DEVICE", dev_kind, 1);
  int gpu_ranks = strcmp(dev_kind, "cuda") == 0;
  long world = nnodes * nproc; /* every node runs nproc ranks */
  if (world > 1000000) {
    fprintf(stderr, "meshrun launch: --nnodes %ld x --nproc %ld: %ld ranks, expected at most "
            "1000000\n", nnodes, nproc, world);
    code = 2;
    goto done;
  }
  int plans = job_path != NULL && !selfcheck && node_rank == 0; /* node 0 plans */
  if (plans && job.cluster == NULL && mr_tunable_str(MR_TUNABLE_CLUSTER)[0] == '\0') {
    /* no cluster spec given: plan for this machine, measured (once;
     * cached) — its GPUs where the ranks run on them, else its cores */
    char spec[4096];
    int rc = gpu_ranks ? mr_gpu_cluster_spec(&devices, spec, sizeof spec)
                       : mr_cpu_cluster_spec(spec, sizeof spec);
    if (rc == 0) {
      job.cluster = strdup(spec);
      printf("meshrun: measured %s: %s\n", gpu_ranks ? "GPUs" : "this machine", spec);
    } else if (rc < 0) {
      fprintf(stderr, "meshrun launch: warning: %s; planning with the shipped specs\n",
              mr_error_message());
    }
  }

  if (plans) {
    if (mr_strategy_choose(&job, (int)world, &choice) < 0) {
      fprintf(stderr, "meshrun launch: %s: %s\n", job_path, mr_error_message());
      code = 2;
      goto done;
    }
    char *text = mr_strategy_apply(&job, &choice.chosen.strategy);
    if (text == NULL) {
      fprintf(stderr, "meshrun launch: out of memory\n");
      code = 1;
      goto done;
    }
    free(job.text);
    job.text = text;
    mr_strategy_print(&choice, stdout);
    fflush(stdout);
    if (check_checkpoint_dir(&job) < 0) {
      fprintf(stderr, "meshrun launch: %s\n", mr_error_message());
      code = 2;
      goto done;
    }
  }
  char worker[4096];
  const char *wenv = getenv("MESHRUN_WORKER");
  if (wenv != NULL && wenv[0] != '\0')
    snprintf(worker, sizeof worker, "%s", wenv);
  else if (mr_cli_find_sibling("meshrun-worker", "worker", worker, sizeof worker) < 0) {
    fprintf(stderr, "meshrun launch: cannot find meshrun-worker beside meshrun or on PATH\n");
    code = 1;
    goto done;
  }
  char dir_buf[4096];
  if (log_dir == NULL) {
    char *stem = job_path != NULL ? job_stem(job_path) : strdup("selfcheck");
    snprintf(dir_buf, sizeof dir_buf, "runs/%s", stem != NULL ? stem : "job");
    free(stem);
    log_dir = dir_buf;
  }
  if (mr_mkdir_p(log_dir) < 0) {
    fprintf(stderr, "meshrun launch: --log-dir: %s\n", mr_error_message());
    code = 2;
    goto done;
  }
  mr_log_set_prefix("launcher");
  if (node_rank > 0) {
    struct mr_agent_opts ao = {
        .nnodes = (int)nnodes,
        .node_rank = (int)node_rank,
        .nproc = (int)nproc,
        .master = master,
        .token_file = token_file,
        .log_dir = log_dir,
        .worker_bin = worker,
        .threads = (int)threads,
        .join_timeout_s = join_timeout,
    };
    code = mr_agent_run(&ao);
    goto done;
  }
  struct mr_launch_opts opts = {
      .nproc = (int)world,
      .nnodes = (int)nnodes,
      .min_nodes = (int)min_nodes,
      .node_ranks = (int)nproc,
      .join_timeout_s = join_timeout,
      .token_file = token_file,
      .master_host = nnodes > 1 ? master_host : NULL,
      .max_restarts = (int)restarts,
      .log_dir = log_dir,
      .heartbeat_timeout_s = hb,
      .hang_timeout_s = hang,
      .bind = bind,
      .worker_bin = worker,
      .threads = (int)threads,
      .selfcheck = selfcheck,
      .job = job_path != NULL ? &job : NULL,
      .metrics_path = metrics,
      .devices = &devices,
      .program_digests = choice.program_digests,
      .predicted_step_s = plans ? choice.chosen.cost.step_time_s : 0,
  };
  code = mr_coordinator_run(&opts);
  /* the job's own token file (Slurm's default) goes with the job: every
   * node read it when it joined */
  if (token_file != NULL && token_file == slurm.token_file)
    unlink(token_file);
done:
  mr_strategy_choice_close(&choice);
  mr_devices_close(&devices);
  mr_job_close(&job);
  return code;
}
