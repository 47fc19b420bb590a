/* trace_merge.h - `meshrun launch --trace DIR`: which steps each group
 * traces, and the ranks' timelines (worker/trace.h) merged into one file.
 *
 * Every rank writes DIR/rank-N.json (the Trace Event Format, one event a
 * line, on the coordinator's clock); when the job ends node 0 merges
 * those it sees into DIR/trace.json, ranks as processes. */
#ifndef MR_TRACE_MERGE_H
#define MR_TRACE_MERGE_H

#include <stdint.h>

#define MR_TRACE_DEFAULT_STEPS 3 // traced by default, from a group's third step

/* The steps a group resuming after step done (0: from the start) of a job
 * of `steps` traces: want_first..want_last, or when want_first is 0 a few
 * after its warm-up.  Returns 1 and sets first/last when any are left to
 * run, else 0. */
int mr_trace_steps_for(int64_t want_first, int64_t want_last, int64_t done, int64_t steps,
                       int64_t *first, int64_t *last);

/* Removes DIR/rank-*.json and DIR/trace.json left by an earlier run. */
void mr_trace_clear(const char *dir);

/* Merges DIR/rank-*.json into DIR/trace.json (written atomically).  A rank
 * file that is not one of ours is skipped with a warning.  Returns the
 * ranks merged (0: none found), or a negative code with a message. */
int mr_trace_merge(const char *dir);

#endif
