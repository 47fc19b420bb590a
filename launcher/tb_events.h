/* tb_events.h - TensorBoard event files beside metrics.jsonl.
 *
 * The launcher writes a run's scalars (loss, lr, throughput, step times,
 * memory, restarts) as TensorBoard reads them: a file named
 * events.out.tfevents.SECONDS.HOST.PID.meshrun of TFRecords (a length, its
 * masked CRC32C, an Event protobuf, its masked CRC32C), flushed a step at a
 * time so that `tensorboard --logdir` shows a live run.  A step is written
 * once: the steps a restarted group trains again, and those an earlier
 * launch of the same run already wrote, are not written again.  A write
 * that fails is reported once and ends the file, never the training. */
#ifndef MR_TB_EVENTS_H
#define MR_TB_EVENTS_H

#include <stddef.h>
#include <stdint.h>

struct mr_tb_writer;

/* Opens a new event file in dir (which exists) and writes its first
 * record; steps up to `written` (those an earlier launch wrote) are
 * skipped.  Returns 0 with *out (free with mr_tb_close), or a negative
 * MR_E* code naming the file. */
int mr_tb_open(const char *dir, int64_t written, struct mr_tb_writer **out);

/* Writes step's scalars, tags[i] = values[i] for i < n, at wall time
 * `wall` (seconds since the epoch), and flushes; nothing for a step at or
 * before the last one written.  Returns 0, or a negative MR_E* code (the
 * writer is then closed to writes; later calls return 0). */
int mr_tb_scalars(struct mr_tb_writer *w, int64_t step, double wall, const char *const *tags,
                  const double *values, int n);

/* The file's path. */
const char *mr_tb_path(const struct mr_tb_writer *w);

/* Closes the file; NULL is a no-op. */
void mr_tb_close(struct mr_tb_writer *w);

/* The last step written to dir's event files by an earlier launch, as
 * the run's metrics file (written with them, step by step) records: 0
 * where dir holds no event file or there are no metrics. */
int64_t mr_tb_written(const char *dir, const char *metrics_path);

/* CRC32C (Castagnoli) of data[n], as TFRecord framing masks it. */
uint32_t mr_tb_masked_crc32c(const void *data, size_t n);

#endif
