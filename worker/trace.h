/* trace.h - a rank's timeline of chosen steps, in the Trace Event Format
 * (the JSON that chrome://tracing and Perfetto open).
 *
 * The rank is a process (pid = rank) and each stream a thread: compute
 * (every instruction of the rank program, inside a slice per step), comm
 * (every operation on a group, from its start to its wait, as async
 * slices carrying the group, the bytes and the operation's number on the
 * group) and checkpoint (the writer thread's files).  Timestamps are the
 * coordinator's monotonic clock in microseconds: the rank's own clock
 * plus the offset measured against the coordinator when it joined
 * (mr_clock_offset), so the ranks of every node share one clock.
 *
 * Recording is bounded (MESHRUN_TRACE_MAX_MB of events; beyond it events
 * are counted, not kept) and never stops the training: a file that cannot
 * be written is reported once.  The file, DIR/rank-N.json, is written once
 * the last chosen step ends (or when the trace is freed, for a run that
 * stopped inside the range); meshrun launch merges the ranks' files into
 * DIR/trace.json when the job ends. */
#ifndef MR_TRACE_H
#define MR_TRACE_H

#include <stddef.h>
#include <stdint.h>

struct mr_trace;

struct mr_trace_opts {
  const char *dir;          // the folder (created if missing)
  int rank, world_size;
  int64_t first, last;      // the steps recorded, inclusive
  int64_t clock_offset_ns;  // coordinator clock - this rank's clock
  uint64_t clock_error_ns;  // the offset's bound (half the best round trip)
  const char *host;         // the rank's host, for its process name
  int max_mb;               // events kept, MiB (MESHRUN_TRACE_MAX_MB)
};

/* A recorder for o (copied).  Never fails the caller: returns NULL (and
 * says why on the log) when it cannot record. */
struct mr_trace *mr_trace_new(const struct mr_trace_opts *o);

/* Writes the file if it was not written yet, and frees; NULL is a no-op. */
void mr_trace_free(struct mr_trace *t);

/* Step boundaries (the training thread): events are kept between the
 * begin and end of a chosen step; the end of the last one writes the
 * file.  While a trace records, it is the process's comm tracer. */
void mr_trace_step_begin(struct mr_trace *t, int64_t step);
void mr_trace_step_end(struct mr_trace *t, int64_t step);

/* Work begun inside a chosen step and running past it on another thread
 * (a checkpoint's writer): while held, that thread's slices are kept and
 * the file waits for them.  mr_trace_hold returns 1 when it held (then
 * release once, from any thread), 0 when nothing is recorded now. */
int mr_trace_hold(struct mr_trace *t);
void mr_trace_release(struct mr_trace *t);

/* Whether events are being kept now (t may be NULL). */
int mr_trace_recording(const struct mr_trace *t);

/* The trace clock: this rank's monotonic clock in ns. */
int64_t mr_trace_now(void);

enum mr_trace_tid { MR_TRACE_COMPUTE = 1, MR_TRACE_COMM = 2, MR_TRACE_CHECKPOINT = 3 };

/* A complete slice on thread tid from t0 to t1 (mr_trace_now values);
 * args is "" or JSON members ("\"micro\": 1, \"bytes\": 64").  Safe from
 * any thread; a no-op unless recording (or, for the checkpoint thread,
 * held). */
void mr_trace_slice(struct mr_trace *t, enum mr_trace_tid tid, const char *cat,
                    const char *name, int64_t t0, int64_t t1, const char *args);

/* One round trip of a clock probe: t0 and t1 this side's clock when sent
 * and answered, peer the other side's clock when it answered. */
struct mr_clock_sample {
  int64_t t0, peer, t1;
};

/* The offset peer - local from n samples (the one with the shortest round
 * trip: its midpoint is nearest the peer's reading), and its bound, half
 * that round trip.  Returns -1 when no sample is usable. */
int mr_clock_offset(const struct mr_clock_sample *s, int n, int64_t *offset_ns,
                    uint64_t *error_ns);

#endif
