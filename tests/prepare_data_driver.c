/* prepare_data_driver.c - `prepare_data_driver prepare-data ARGS...`: runs
 * the prepare-data command on its own, with the same argument shape as
 * `meshrun prepare-data`, for scripts/data/fortunes and the tests. */
#include <stdio.h>
#include <string.h>

#include "launcher/prepare_data.h"

int main(int argc, char **argv) {
  if (argc < 2 || strcmp(argv[1], "prepare-data") != 0) {
    fprintf(stderr, "usage: %s prepare-data TEXT... --out FILE ...\n", argv[0]);
    return 2;
  }
  return mr_cmd_prepare_data(argc - 1, argv + 1);
}
