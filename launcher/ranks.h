/* ranks.h - the worker processes of one job: spawning them with their
 * environment, their output (prefixed on the console, copied to per-rank
 * logs, the last lines kept for failure messages), their exits, and the
 * job's progress line.  The coordinator decides; this module carries out.
 *
 * A set holds n ranks, base .. base + n - 1, of which this process spawns
 * the first `local`; the others are remote (the launchers of other nodes
 * start them) and are known only by their connections. */
#ifndef MR_RANKS_H
#define MR_RANKS_H

#include <stdint.h>
#include <stdio.h>
#include <uv.h>

#include "meshrun.pb-c.h"

struct mr_conn;
struct mr_ranks;

#define MR_TAIL_LINES_MAX 64

struct mr_line_buf {
  char buf[4096];
  size_t len;
};

struct mr_rank {
  struct mr_ranks *set;
  int rank;
  uv_process_t proc;
  uv_pipe_t out, err;
  struct mr_line_buf obuf, ebuf;
  int handles_open;        // process and pipe handles not yet closed
  int running;             // spawned and not yet exited
  int exited;
  int64_t exit_status;
  int term_signal;
  int pid;
  struct mr_conn *conn;    // borrowed; NULL until registered and after it left
  int remote;              // another node runs it: no process here
  int registered;          // has said Hello in this group
  int done;                // reported its job finished
  int64_t spawn_ms;
  int64_t last_seen_ms;    // last message of any kind
  int64_t step;
  uint64_t peak_memory;    // bytes, as the job reports it in its metrics
  uint64_t rss_peak;       // bytes, resident size seen in heartbeats
  int64_t oom_kills;       // the kernel's out-of-memory kills when it started
  char error[256];         // last error it reported
  FILE *log;               // log_dir/rank-N.log
  char tail[MR_TAIL_LINES_MAX][256];
  int tail_n, tail_pos;
  int64_t last_done, waiting_on; // from heartbeats: instruction ids
  char waiting_detail[160];
  int64_t progress_ms;     // when step, last_done, checkpoint_bytes or comm_done
                           // last changed
  uint64_t checkpoint_bytes; // from heartbeats: its checkpoint writer's bytes so far
  uint64_t comm_done;      // from heartbeats: communication operations seen to end
  int checkpoint_waiting;  // the training waits for its own checkpoint write
  int starting;            // lowering, opening communication: not yet at step 1
  int stage;               // its pipeline stage, from its metrics
  double busy_s;           // its work per step (step time less the time it
  int busy_n;              //   waited on communication), a moving average,
  double step_s;           //   and of its step time
  double micro_s;          //   and of the part its micro-batches do
  int slow_streak;         // checks in a row it was slow
  int slow_named;          // named slow in this group
};

struct mr_spawn_env {
  const char *worker_bin;
  const char *coord_address;  // "unix:PATH" or "tcp:HOST:PORT"
  const char *master_addr;
  int master_port;
  const char *job_id;
  int token_fd;               // inherited as descriptor 3
  int restart;
  int threads;
  const char *log_dir;
  int world;                  // WORLD_SIZE
};

struct mr_ranks {
  uv_loop_t *loop;
  int n;                   // ranks in the set now
  int cap;                 // entries allocated
  int local;               // the first `local` entries are spawned here
  struct mr_rank *r;       // cap entries, owned; r[i].rank = base + i
  const char *log_dir;     // borrowed
  void *ctx;
  void (*on_exit)(void *ctx, int rank, int64_t status, int signal);
  int tty;                 // stdout is a terminal: progress line in place
  int progress_shown;      // a progress line is on screen (tty)
  int64_t start_ms;
  int64_t steps_total;
  Meshrun__Metrics last;   // rank 0's last metrics
  int have_last;
};

/* Prepares ranks base .. base + n - 1, the first `local` of them spawned
 * here; opens nothing yet.  on_exit is called once per worker exit, with
 * the index of the rank in the set.  Returns 0 or MR_ENOMEM. */
int mr_ranks_init(struct mr_ranks *s, uv_loop_t *loop, int n, int local, int base,
                  const char *log_dir, void *ctx, void (*on_exit)(void *, int, int64_t, int));

/* The set from now on: ranks base .. base + n - 1 (n at most what init
 * prepared; every process of the set exited).  An elastic job's group may
 * have fewer ranks than the last, and a node another place in it. */
void mr_ranks_renumber(struct mr_ranks *s, int n, int base);

/* Frees what init allocated; every handle must be closed already. */
void mr_ranks_close(struct mr_ranks *s);

/* Spawns every local rank and expects the remote ones anew (not
 * registered, their registration clock started).  Returns 0, or an error
 * (the caller stops those already started). */
int mr_ranks_spawn_all(struct mr_ranks *s, const struct mr_spawn_env *env);

/* The processes the kernel's out-of-memory killer has killed since boot
 * (/proc/vmstat oom_kill, Linux 4.13 on; a cgroup's kills count too), or
 * -1 where that cannot be read. */
int64_t mr_oom_kill_count(void);

/* Moves every rank's clocks (spawned, last heard from, last progress)
 * ms later: the time the coordinator was not running does not count as
 * the ranks' silence. */
void mr_ranks_credit(struct mr_ranks *s, int64_t ms);

/* Sends sig to rank i / to every running rank. */
void mr_ranks_signal(struct mr_ranks *s, int i, int sig);
void mr_ranks_signal_all(struct mr_ranks *s, int sig);

/* Sends a Control message to every registered rank. */
void mr_ranks_send_control(struct mr_ranks *s, Meshrun__Control__Kind kind);

/* Closes every rank's RPC connection. */
void mr_ranks_close_conns(struct mr_ranks *s);

/* True when no rank process is running and no remote rank is still
 * connected / when every handle is closed. */
int mr_ranks_all_exited(const struct mr_ranks *s);
int mr_ranks_all_closed(const struct mr_ranks *s);

/* Describes where every rank is: what it completed and what it waits on,
 * one line per place, the ranks there listed as ranges ("ranks 0-2,5:
 * ..."), so a thousand ranks read in a few lines.  Writes into buf
 * (NUL-terminated; "..." at the end when cut short). */
void mr_ranks_describe_positions(const struct mr_ranks *s, char *buf, size_t n);

/* Records a heartbeat's position. */
void mr_ranks_heartbeat(struct mr_ranks *s, int rank, const Meshrun__Heartbeat *hb);

/* Shows rank 0's step metrics as the job's progress. */
void mr_ranks_progress(struct mr_ranks *s, const Meshrun__Metrics *m, uint64_t peak,
                       int64_t steps_total, int64_t log_interval);

/* Prints the final failure: what failed, and the failed rank's last log
 * lines, on stderr. */
void mr_ranks_report_failure(struct mr_ranks *s, int rank, const char *failure,
                             int max_restarts);

/* Prints the job's closing summary (training jobs): with n > 0 the median
 * step time measured over n steps, beside the planner's prediction when
 * predicted_s > 0, and a hint when they are more than 2x apart (for steps
 * of 10 ms or more). */
void mr_ranks_print_summary(struct mr_ranks *s, double median_s, int n, double predicted_s);

#endif
