/* cli.h - the `meshrun` subcommands.  Each takes argv after the subcommand
 * name and returns the process exit code: 0 success, 1 failure at run time,
 * 2 bad usage or bad input (a flag, a job file). */
#ifndef MR_CLI_H
#define MR_CLI_H

#include <stdint.h>

#include <stddef.h>

int mr_cmd_launch(int argc, char **argv);
int mr_cmd_plan(int argc, char **argv);
int mr_cmd_calibrate(int argc, char **argv);

/* Shared helpers for subcommands. */

struct mr_job;

/* A job launched again after it trained to train.steps: prints that it is
 * complete (its newest checkpoint `dir`, of `step`) and what to do. */
void mr_cli_say_complete(const struct mr_job *job, const char *dir, long long step);

/* Whether job's checkpoint folder holds a checkpoint of its last step (or
 * later): 1, having said so (mr_cli_say_complete); else 0.  Nodes other
 * than node 0 ask before they join, so that they exit with it. */
int mr_cli_job_complete(const struct mr_job *job);

/* Parses a positive (min..max) integer flag value; prints an error naming
 * the command and flag and returns -1 on failure. */
int mr_cli_int(const char *cmd, const char *flag, const char *value, long min, long max,
               long *out);

/* Parses a number flag value in [min, max]. */
int mr_cli_num(const char *cmd, const char *flag, const char *value, double min,
               double max, double *out);

/* Parses a byte count: a whole number of bytes, or a number with a unit
 * as transformers writes max_shard_size ("5GB", "500MB", "100KB", powers of
 * 1000; "2GiB", "512MiB", "64KiB", powers of 1024; "B" or none: bytes).
 * Returns 0, or MR_EINVAL (nothing printed). */
int mr_parse_bytes(const char *value, uint64_t *out);

/* Splits "HOST:PORT" (a name or address, an IPv6 one bracketed; port
 * 1..65535) into host[hn] (brackets removed) and *port.  Returns 0 or
 * MR_EINVAL with a message saying what was expected. */
int mr_cli_host_port(const char *value, char *host, unsigned long hn, int *port);

/* Reads and parses a cluster spec file (compiler/planner/cluster.h).
 * Returns 0, MR_ENOENT, MR_EIO or MR_EFORMAT with a message naming the
 * file. */
struct mr_cluster;
int mr_cluster_load(const char *path, struct mr_cluster *out);

/* Gives job what the environment sets for a job that does not set it
 * itself: strategy.gradient_accumulation_in_op from
 * MESHRUN_GRAD_ACCUM_IN_OP.  The plan carries it to the workers, so they
 * lower what the launcher checked whatever their own environment. */
struct mr_job;
void mr_cli_job_defaults(struct mr_job *job);

/* The cluster spec a job that names none is planned for: $MESHRUN_CLUSTER,
 * else "cpu-local".  (`meshrun launch` with MESHRUN_CLUSTER empty plans
 * instead for this machine, measured: calibrate.h.) */
const char *mr_default_cluster(void);

/* meshrun's cache folder, $XDG_CACHE_HOME/meshrun or ~/.cache/meshrun,
 * made if missing; written into buf.  Returns 0, MR_ENOENT when neither
 * variable is set, or mkdir's error. */
int mr_cli_cache_dir(char *buf, size_t len);

#endif
