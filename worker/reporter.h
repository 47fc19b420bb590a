/* reporter.h - what a running job tells its coordinator, and what it may be
 * asked.
 *
 * The worker runtime (worker/main.c) owns the RPC connection and a
 * heartbeat thread; the job it runs (self-check, training) only calls these
 * functions, from any thread.  They never block on the network. */
#ifndef MR_REPORTER_H
#define MR_REPORTER_H

#include <stdatomic.h>
#include <stdint.h>

struct mr_step_report {
  int64_t step;                 // 1-based optimizer step just finished
  double loss;
  double lr;
  double grad_norm;
  double tokens_per_s;
  double loss_scale;            // 1 when no loss scaling
  double step_time_s;
  double comm_wait_s;           // time blocked on communication this step
  uint64_t peak_memory_bytes;   // rank's peak so far
  int skipped;                  // fp16 overflow: update skipped
  double val_loss;              // NaN when no evaluation ran
  int stage;                    // the rank's pipeline stage
  double micro_work_s;          // its micro-batches' work: the passes, less
                                // communication waits (the rest of the step
                                // is per step: gradient sync, optimizer)
};

struct mr_reporter {
  void *ctx;
  /* After every optimizer step. */
  void (*step)(void *ctx, const struct mr_step_report *r);
  /* Where the rank is in its program: last instruction completed, the one
   * waited on (-1: none) and a short description of it. */
  void (*progress)(void *ctx, int64_t step, int64_t last_done,
                   int64_t waiting_on, const char *waiting_detail);
  /* Nonzero once the coordinator asked the job to stop. */
  int (*stop_requested)(void *ctx);
  /* Nonzero once (and each time) the coordinator asked for a checkpoint;
   * reading it clears it. */
  int (*checkpoint_requested)(void *ctx);
  /* This rank's files of the checkpoint of `step` are durable: n names
   * (relative to the step's folder) with their checksums in hex
   * (common/checksum.h). */
  void (*checkpoint_written)(void *ctx, int64_t step, const char *const *files,
                             const char *const *checksum, int n);
  /* Where the checkpoint writer counts the bytes it writes (all saves; may
   * be NULL): the heartbeat reports them, so a long write is progress, not
   * a hang. */
  _Atomic uint64_t *checkpoint_bytes;
  /* Where the runtime counts the communication operations it has waited
   * for and seen end (may be NULL): the heartbeat reports them, so a long
   * gradient sync whose collectives keep completing is progress too. */
  _Atomic uint64_t *comm_done;
  /* The training waits (1) or no longer waits (0) for its own checkpoint
   * write to finish; may be NULL. */
  void (*checkpoint_wait)(void *ctx, int waiting);
  /* The rank's program is lowered, its runtime and communication are up
   * and its first step begins (until then it is starting, which the
   * launcher's hang check leaves alone); may be NULL. */
  void (*running)(void *ctx);
};

struct mr_trace;

/* Where a job runs: given to the job by the worker runtime. */
struct mr_run_env {
  int rank;
  int world_size;
  int local_rank;
  int threads;                  // compute threads for this rank
  const char *log_dir;          // per-job folder; never NULL
  const char *metrics_path;     // JSON lines, one per step; NULL: none
  const char *weights_out;      // final weights (safetensors); NULL: none
  struct mr_reporter *reporter; // never NULL
  const char *resume_dir;       // checkpoint folder to start from; NULL: none
  uint64_t program_digest;      // the launcher's digest of this rank's
                                // program; 0: not checked
  struct mr_trace *trace;       // the timeline of chosen steps; NULL: none
};

#endif
