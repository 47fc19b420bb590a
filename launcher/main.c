/* main.c - the `meshrun` command: dispatches to a subcommand. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/tunable.h"
#include "launcher/cli.h"
#include "launcher/explain.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: meshrun COMMAND [options]\n"
          "\n"
          "commands:\n"
          "  launch JOB.json     train: start and supervise one worker per rank\n"
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

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  const char *cmd = argv[1];
  if (strcmp(cmd, "launch") == 0)
    return mr_cmd_launch(argc - 1, argv + 1);
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
