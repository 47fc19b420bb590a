/* main.c - the `meshrun` command: dispatches to a subcommand. */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/file.h"
#include "common/tunable.h"
#include "launcher/cli.h"
#include "launcher/export.h"
#include "launcher/prepare_data.h"
#include "launcher/report.h"
#include "launcher/explain.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: meshrun COMMAND [options]\n"
          "\n"
          "commands:\n"
          "  launch JOB.json     train: start and supervise one worker per rank\n"
          "  prepare-data TEXT... --out FILE\n"
          "                      text to byte-level token files (train/val split)\n"
          "  export CKPT --out DIR\n"
          "                      a checkpoint as a Hugging Face model directory\n"
          "  sample WEIGHTS --prompt TEXT\n"
          "                      generate text from trained weights\n"
          "  logits WEIGHTS --text TEXT --out FILE\n"
          "                      raw logits of trained weights on a text\n"
          "  report RUN_DIR      a run's curves, plan, memory and failures as one HTML\n"
          "                      page (--format md: as text)\n"
          "  plan JOB.json       choose, rank and explain a parallel strategy\n"
          "  calibrate           measure this machine, write a cluster spec\n"
          "  explain JOB.json --mesh data=2,model=4\n"
          "                      every tensor's placements and every reshard\n"
          "  env                 list the environment variables meshrun reads\n"
          "  version             print the version\n"
          "\n"
          "`meshrun COMMAND --help` describes a command.\n");
}

static int cmd_env(void) {
  for (int i = 0; i < MR_TUNABLE_COUNT; i++)
    printf("%-28s %-12s %s\n", mr_tunable_env((enum mr_tunable_id)i),
           mr_tunable_default((enum mr_tunable_id)i), mr_tunable_desc((enum mr_tunable_id)i));
  return 0;
}

/* Commands that run kernels belong to the worker binary: the launcher never
 * executes kernels. */
static int exec_worker(int argc, char **argv) {
  char worker[4096];
  if (mr_find_program("meshrun-worker", "worker", worker, sizeof worker) < 0) {
    fprintf(stderr, "meshrun %s: cannot find meshrun-worker beside meshrun or on PATH\n",
            argv[0]);
    return 1;
  }
  char **args = calloc((size_t)argc + 2, sizeof *args);
  if (args == NULL)
    return 1;
  args[0] = worker;
  for (int i = 0; i < argc; i++)
    args[i + 1] = argv[i];
  execv(worker, args);
  fprintf(stderr, "meshrun %s: cannot run %s: %s\n", argv[0], worker, strerror(errno));
  free(args);
  return 1;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  /* a worker that dies mid-write must not take the launcher with it */
  signal(SIGPIPE, SIG_IGN);
  /* a file past the size limit fails its write (EFBIG) with a message */
  signal(SIGXFSZ, SIG_IGN);
  const char *cmd = argv[1];
  if (strcmp(cmd, "launch") == 0)
    return mr_cmd_launch(argc - 1, argv + 1);
  if (strcmp(cmd, "prepare-data") == 0)
    return mr_cmd_prepare_data(argc - 1, argv + 1);
  if (strcmp(cmd, "export") == 0)
    return mr_cmd_export(argc - 1, argv + 1);
  if (strcmp(cmd, "sample") == 0 || strcmp(cmd, "logits") == 0)
    return exec_worker(argc - 1, argv + 1);
  if (strcmp(cmd, "report") == 0)
    return mr_cmd_report(argc - 1, argv + 1);
  if (strcmp(cmd, "plan") == 0)
    return mr_cmd_plan(argc - 1, argv + 1);
  if (strcmp(cmd, "calibrate") == 0)
    return mr_cmd_calibrate(argc - 1, argv + 1);
  if (strcmp(cmd, "explain") == 0)
    return mr_cmd_explain(argc - 1, argv + 1);
  if (strcmp(cmd, "env") == 0)
    return cmd_env();
  if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
    printf("meshrun %s\n", MESHRUN_VERSION);
    return 0;
  }
  if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) {
    usage(stdout);
    return 0;
  }
  fprintf(stderr, "meshrun: unknown command \"%s\"\n", cmd);
  usage(stderr);
  return 2;
}
