/* report.h - `meshrun report RUN_DIR`: a run folder read back and shown.
 *
 * A run folder is a launch's --log-dir: metrics.jsonl (a line per step of
 * rank 0), run.jsonl (the plan of each group, failures, restarts, memory
 * per rank, the end: launcher/run_log.h) and coordinator.json.  Reading it
 * (report_read.c) gives each step once, as the run's last record of it
 * holds it (a restarted group trains steps again), with the MFU and the
 * predicted step time of the plan its group ran; the groups with their
 * plans; the failures and restarts in order; and the run's state, which
 * may be running still.  Showing it (report.c) gives one self-contained
 * HTML page (inline SVG charts, launcher/report_svg.h: no script, nothing
 * fetched) or the same figures as Markdown text for a terminal. */
#ifndef MR_REPORT_H
#define MR_REPORT_H

#include <stdint.h>

#include "common/text.h"

struct mr_run_step {
  int64_t step;
  double loss, val_loss, lr, grad_norm; // NaN: not recorded (null, or no
  double tokens_per_s, step_time_s;     //   evaluation at this step)
  double comm_wait_s;
  double peak_memory_bytes;             // the largest rank's
  int restart;                          // the group's number (Metrics')
  int group;                            // index in mr_run.groups, -1: none known
  double mfu;                           // model FLOP/s over peak, NaN: unknown
  double predicted_s;                   // the group's plan's, NaN: unknown
};

/* A group as its plan event has it. */
struct mr_run_group {
  double time;          // seconds since the epoch
  int launch;           // which launch of the run (0: the first)
  int restart, world, nodes;
  int64_t steps;        // the job's (0: unknown)
  double predicted_s, peak_device_s; // 0: none
  int64_t metrics_at;   // bytes of metrics.jsonl before its steps
  int64_t first_step;   // its first step in metrics.jsonl, -1: none yet
  char mesh[160];       // "data 2 x model 1 x pipeline 1 (tp,dp,pp)"
  char schedule[256];   // schedule, micro-batches, ZeRO, recompute, dtype
  char **placements;    // [n_placements] in words, owned
  int n_placements;
};

enum mr_run_event_kind {
  MR_RUN_EV_START,
  MR_RUN_EV_FAILURE,
  MR_RUN_EV_RESTART,
  MR_RUN_EV_END,
};

/* What happened to the run, in order. */
struct mr_run_event {
  enum mr_run_event_kind kind;
  double time;          // seconds since the epoch
  int launch, restart;
  int rank;             // a failure's rank, -1: none
  char *text;           // a failure's reason, a restart's cause, an end's
                        //   outcome and reason; owned
};

enum mr_run_state {
  MR_RUN_RUNNING,  // the launcher still runs
  MR_RUN_DONE,     // trained to its last step
  MR_RUN_FAILED,   // failed past its restarts
  MR_RUN_STOPPED,  // stopped by a signal
  MR_RUN_VANISHED, // the launcher is gone without saying how it ended
};

struct mr_run {
  char dir[4096];
  char job_id[32];
  int world, nodes;         // the launch's (coordinator.json; 0: unknown)
  int have_log;             // run.jsonl was there
  struct mr_run_step *steps; // [n_steps] by step, each once
  int n_steps;
  int n_records;            // metrics lines read (steps trained again counted)
  struct mr_run_group *groups; // [n_groups] in order
  int n_groups;
  struct mr_run_event *events; // [n_events] in order
  int n_events;
  int n_failures, n_restarts;
  uint64_t *rank_peak, *rank_rss; // [n_ranks] bytes, the last memory event's
  int n_ranks;
  int64_t memory_step;      // the step of that event
  enum mr_run_state state;
  int exit_code;            // when ended
};

/* Reads the run folder dir into run (caller-allocated; free with
 * mr_run_close, also after a failure).  Returns 0; MR_ENOENT when dir is
 * not a folder or holds none of metrics.jsonl, run.jsonl and
 * coordinator.json; MR_EFORMAT for a line that is not what it should be
 * (the message names the file, its line, the field and what was
 * expected).  A last line without its newline (a run writing it now) is
 * left out. */
int mr_run_read(const char *dir, struct mr_run *run);

/* Frees what run holds; a zeroed run is fine. */
void mr_run_close(struct mr_run *run);

/* The state in words: "running", "done", "failed", "stopped", "ended
 * without a record". */
const char *mr_run_state_name(enum mr_run_state s);

/* The run as one HTML page, or as Markdown, appended to out. */
void mr_report_html(const struct mr_run *run, struct mr_text *out);
void mr_report_md(const struct mr_run *run, struct mr_text *out);

/* `meshrun report RUN_DIR [--format html|md] [--out FILE]`.  Returns the
 * exit code: 0, 2 on bad usage, a folder that is not a run's, a record
 * that does not read or an output that cannot be written. */
int mr_cmd_report(int argc, char **argv);

#endif
