/* run_log.h - run.jsonl: what happened to a run, beside what its steps
 * measured (metrics.jsonl).
 *
 * One JSON object a line, each with "event" and "time" (seconds since the
 * epoch):
 *
 *   start    a launch began: job id, ranks, nodes, --max-restarts
 *   plan     a group started: its restart number, ranks and nodes, the
 *            job's steps, the plan's strategy (the plan body's "strategy"), its placements
 *            in words, the predicted step time, the MFU input
 *            (peak_device_s: a step's model FLOPs over one device's peak
 *            FLOP/s, so MFU = peak_device_s / (step time x ranks)) and
 *            where in metrics.jsonl the group's steps begin (metrics_at,
 *            bytes)
 *   memory   every rank's peak memory and resident size, when they moved
 *   failure  what stopped a group: the rank (-1: none), the reason, and
 *            its exit status or signal once it has exited
 *   restart  a group starts again: after a failure (counted against
 *            --max-restarts) or to regroup (nodes, a re-balance)
 *   end      the launch ended: done, failed or stopped, the exit code and
 *            why
 *
 * A launch of the same run appends, as metrics.jsonl does.  Each line is
 * flushed as it is written, so a running run can be reported (`meshrun
 * report`, launcher/report.h).  A write that fails is warned of once and
 * ends the log, never the run. */
#ifndef MR_RUN_LOG_H
#define MR_RUN_LOG_H

#include <stdint.h>

#define MR_RUN_LOG "run.jsonl" // in the run's log folder

struct mr_run_log;

/* Opens dir/run.jsonl for appending.  Returns 0 with *out (free with
 * mr_run_log_close), or MR_EIO naming the file. */
int mr_run_log_open(const char *dir, struct mr_run_log **out);

/* Closes the log; NULL is a no-op. */
void mr_run_log_close(struct mr_run_log *l);

/* Each writes one event; every one is a no-op on a NULL log.  Strings are
 * borrowed. */
void mr_run_log_start(struct mr_run_log *l, const char *job_id, int world, int nodes,
                      int max_restarts);

struct mr_run_log_plan {
  int restart;          // the group's number (Metrics' restart)
  int world, nodes;
  const char *plan_text; // the plan body the workers get (a job's text)
  double predicted_s;   // the planner's step time (0: none)
  double peak_device_s; // the MFU input above (0: none)
  int64_t metrics_at;   // bytes of metrics.jsonl before the group's steps
};
void mr_run_log_plan(struct mr_run_log *l, const struct mr_run_log_plan *p);

/* Written when a rank's peak memory or its resident size (to the MiB)
 * moved since the last memory event; peak[n] and rss[n] in bytes. */
void mr_run_log_memory(struct mr_run_log *l, int restart, int64_t step, const uint64_t *peak,
                       const uint64_t *rss, int n);

/* exited: status (the exit code) and signal (0: none) are the rank's. */
void mr_run_log_failure(struct mr_run_log *l, int restart, int rank, const char *reason,
                        int exited, int64_t status, int signal);

/* cause: "failure", "nodes", "balance", "dp_balance" or "slow_node";
 * restart is the new group's number, stopped_s how long the stop took. */
void mr_run_log_restart(struct mr_run_log *l, int restart, const char *cause, int failures,
                        int max_restarts, double stopped_s);

/* The outcome follows exit_code: 0 done, 128 + a signal stopped, else
 * failed; reason may be NULL or "". */
void mr_run_log_end(struct mr_run_log *l, int exit_code, int restart, int failures,
                    const char *reason);

#endif
