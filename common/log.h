/* log.h - the one logger.
 *
 * Lines look like `[launcher] warn rpc: closed connection 3: bad frame` or
 * `[rank 2] info comm: ...`.  The prefix is set once per process; the level
 * comes from MESHRUN_LOG_LEVEL (error, warn, info, debug; default info).
 * Thread-safe: each line is written with a single write(2). */
#ifndef MR_LOG_H
#define MR_LOG_H

enum mr_log_level {
  MR_LOG_ERROR = 0,
  MR_LOG_WARN = 1,
  MR_LOG_INFO = 2,
  MR_LOG_DEBUG = 3,
};

/* Sets the process prefix, e.g. "launcher" or "rank 3".  Copies it. */
void mr_log_set_prefix(const char *prefix);

/* Overrides the level read from the environment. */
void mr_log_set_level(enum mr_log_level level);

/* True when a message at level would be written. */
int mr_log_enabled(enum mr_log_level level);

/* Writes one line to stderr: prefix, level, subsystem, message. */
void mr_log(enum mr_log_level level, const char *subsys, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define MR_ERROR(subsys, ...) mr_log(MR_LOG_ERROR, subsys, __VA_ARGS__)
#define MR_WARN(subsys, ...) mr_log(MR_LOG_WARN, subsys, __VA_ARGS__)
#define MR_INFO(subsys, ...) mr_log(MR_LOG_INFO, subsys, __VA_ARGS__)
#define MR_DEBUG(subsys, ...)                                                \
  do {                                                                       \
    if (mr_log_enabled(MR_LOG_DEBUG))                                        \
      mr_log(MR_LOG_DEBUG, subsys, __VA_ARGS__);                             \
  } while (0)

#endif
