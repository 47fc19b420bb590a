/* cli.h - the `meshrun` subcommands.  Each takes argv after the subcommand
 * name and returns the process exit code: 0 success, 1 failure at run time,
 * 2 bad usage or bad input (a flag, a job file). */
#ifndef MR_CLI_H
#define MR_CLI_H

int mr_cmd_launch(int argc, char **argv);

/* Shared helpers for subcommands. */

/* Parses a positive (min..max) integer flag value; prints an error naming
 * the command and flag and returns -1 on failure. */
int mr_cli_int(const char *cmd, const char *flag, const char *value, long min, long max,
               long *out);

/* Parses a number flag value in [min, max]. */
int mr_cli_num(const char *cmd, const char *flag, const char *value, double min,
               double max, double *out);

/* The path of a program installed beside `meshrun` (e.g. meshrun-worker),
 * found next to our own executable, in the build tree, or on PATH.  Writes
 * into buf; returns 0 or -1. */
int mr_cli_find_sibling(const char *name, const char *build_subdir, char *buf,
                        unsigned long n);

/* mkdir -p.  Returns 0 or an MR_E code with a message. */
int mr_mkdir_p(const char *path);

#endif
