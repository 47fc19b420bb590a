/* coordinator.h - `meshrun launch`: spawn one worker per rank, authenticate
 * and register them, send the plan, supervise.
 *
 * The coordinator is one libuv loop.  It listens on a Unix socket (local
 * workers) and a TCP socket (loopback by default, for remote nodes), spawns
 * N `meshrun-worker` processes with the environment torchrun gives
 * (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
 * MASTER_PORT) and the job token on an inherited descriptor, prefixes
 * their output with `[rank N]` on the console and copies it to per-rank log
 * files, and watches them: a worker that exits non-zero or by a signal, or
 * that falls silent past the heartbeat timeout, fails the group; the group
 * is stopped and restarted up to max_restarts times (torchrun's semantics),
 * after which the launcher exits non-zero naming the rank, its status and
 * the last lines of its log.  SIGINT/SIGTERM stop every worker; workers die
 * with the launcher (PR_SET_PDEATHSIG, and the closed connection).
 *
 * Across nodes, this launcher is node 0: it plans, spawns ranks 0 ..
 * node_ranks - 1 and coordinates; the launcher of node K (launcher/agent.h)
 * connects over TCP with the job token, and is told to start its ranks
 * whenever a group (re)starts and to stop them when it stops.  A remote
 * rank is known by its connection: it fails the group when it closes
 * before the rank finished, or when the rank does not register within the
 * join timeout. */
#ifndef MR_COORDINATOR_H
#define MR_COORDINATOR_H

#include <stdint.h>

#include "common/job.h"
#include "common/discovery.h"

struct mr_launch_opts {
  int nproc;                    // ranks of the job, on every node
  int nnodes;                   // nodes (0 or 1: this one only)
  int min_nodes;                // fewer than nnodes: elastic — a group goes on
                                // with the nodes there are (at least this
                                // many), the strategy planned again
  int node_ranks;               // ranks per node; this node runs ranks
                                // 0 .. node_ranks - 1 (0: all nproc)
  double join_timeout_s;        // how long other nodes' ranks may take to
                                // register in a group
  const char *token_file;       // the job token other nodes read (0600;
                                // written when missing); NULL: a fresh one
  const char *master_host;      // what the ranks get as MASTER_ADDR; NULL:
                                // the address bound
  int max_restarts;             // group restarts allowed
  const char *log_dir;          // per-rank logs, coordinator.json, metrics
  double heartbeat_timeout_s;   // silence that fails a rank
  double hang_timeout_s;        // no rank progressing this long: a hang
  const char *bind;             // TCP listen address, "HOST:PORT"
  const char *worker_bin;       // path of meshrun-worker
  int threads;                  // compute threads per rank
  int selfcheck;                // run the built-in check instead of the job
  const struct mr_job *job;     // borrowed; NULL only with selfcheck
  const char *metrics_path;     // JSON lines; NULL: log_dir/metrics.jsonl
  const struct mr_devices *devices; // borrowed
  const uint64_t *program_digests; // [nproc] each rank's program as the
                                   // launcher checked it; NULL: unchecked
  double predicted_step_s;      // the planner's step time for the job's plan
  double peak_device_s;         // a step's model FLOPs over one device's peak
                                //   FLOP/s (MFU = this / (step time x ranks))
                                // (0: none); the closing summary sets the
                                // measured one beside it
  const char *trace_dir;        // every rank's timeline into this folder,
                                // merged into trace.json at the end; NULL none
  int64_t trace_first, trace_last; // the steps traced; 0: a few after each
                                   // group's first (launcher/trace_merge.h)
};

/* Splits a --bind value "HOST:PORT" (an IPv4 or IPv6 address, "[::1]"
 * bracketed; port 0..65535, 0: any) into host[hn] and *port.  Returns 0 or
 * MR_EINVAL naming the value. */
int mr_bind_parse(const char *bind, char *host, size_t hn, int *port);

/* Runs the job to completion.  Returns the process exit code: 0 when every
 * rank finished, 1 when the group failed past its restarts, 130/143 when
 * stopped by SIGINT/SIGTERM. */
int mr_coordinator_run(const struct mr_launch_opts *opts);

#endif
