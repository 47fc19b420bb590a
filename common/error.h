/* error.h - meshrun's error codes, the MR_TRY check macro and a per-thread
 * error message.
 *
 * Every fallible function returns int: 0 (or a count) on success, a negative
 * MR_E* code on failure.  Where a failure has a story to tell (which file,
 * which field, what was expected) the function that detects it records one
 * line with mr_error_set(); the caller that finally reports the failure reads
 * it back with mr_error_message().  The message is per thread, so workers'
 * threads never see each other's errors. */
#ifndef MR_ERROR_H
#define MR_ERROR_H

#include <stddef.h>

/* One row per code: name, value, description.  Add new codes here only. */
#define MR_ERRNO_MAP(XX)                                                     \
  XX(EINVAL, -1, "invalid argument")                                        \
  XX(ENOMEM, -2, "out of memory")                                           \
  XX(EIO, -3, "input/output error")                                         \
  XX(ENOENT, -4, "no such file or directory")                               \
  XX(EPROTO, -5, "protocol error")                                          \
  XX(EAUTH, -6, "authentication failed")                                    \
  XX(ETOOBIG, -7, "message too large")                                      \
  XX(ETIMEDOUT, -8, "timed out")                                            \
  XX(ECLOSED, -9, "connection closed")                                      \
  XX(EJOB, -10, "invalid job file")                                         \
  XX(EFORMAT, -11, "malformed file")                                        \
  XX(ENOTSUP, -12, "not supported")                                         \
  XX(EAGAIN, -13, "resource temporarily unavailable")                       \
  XX(ESYS, -14, "system call failed")                                       \
  XX(EVERSION, -15, "protocol version mismatch")                            \
  XX(ESHAPE, -16, "shape mismatch")                                         \
  XX(EPEER, -17, "peer failed")                                             \
  XX(ENOFIT, -18, "does not fit in memory")                                 \
  XX(ECANCELED, -19, "operation canceled")                                  \
  XX(ERANGE, -20, "value out of range")                                     \
  XX(EPLAN, -21, "rank programs do not match")

enum mr_errno {
#define XX(name, value, desc) MR_##name = value,
  MR_ERRNO_MAP(XX)
#undef XX
};

/* Returns a static description of code (0 gives "success"). */
const char *mr_strerror(int code);

/* Returns the symbolic name of code, e.g. "MR_EPROTO". */
const char *mr_errname(int code);

/* Records a one-line message for the calling thread and returns code, so a
 * detector can write `return mr_error_set(MR_EJOB, "%s: %s: expected ...")`. */
int mr_error_set(int code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* The calling thread's last message, or mr_strerror(code) of the last code
 * when none was set.  Borrowed; valid until the next mr_error_set. */
const char *mr_error_message(void);

/* The message of a failure that returned code: the calling thread's last
 * message when it was recorded with that code, else mr_strerror(code) —
 * never a message left by an earlier, other failure (or a warning) when
 * the one reported returned a bare code.  Borrowed, like the above. */
const char *mr_error_of(int code);

/* Forgets the calling thread's message. */
void mr_error_clear(void);

/* Converts an errno value to an MR_E* code. */
int mr_from_errno(int err);

/* Logs where a failure passed through (file, line, expression). */
void mr__error_trace(const char *file, int line, const char *expr, int code);

/* Evaluates expr; on a negative result logs the site at debug level and
 * returns the code from the enclosing function, giving a backtrace of sorts
 * in the log without a debugger. */
#define MR_TRY(expr)                                                         \
  do {                                                                       \
    int mr_try_rc_ = (expr);                                                 \
    if (mr_try_rc_ < 0) {                                                    \
      mr__error_trace(__FILE__, __LINE__, #expr, mr_try_rc_);                \
      return mr_try_rc_;                                                     \
    }                                                                        \
  } while (0)

/* Like MR_TRY but jumps to a cleanup label with rc set. */
#define MR_TRY_GOTO(rc, expr, label)                                         \
  do {                                                                       \
    (rc) = (expr);                                                           \
    if ((rc) < 0) {                                                          \
      mr__error_trace(__FILE__, __LINE__, #expr, (rc));                      \
      goto label;                                                            \
    }                                                                        \
  } while (0)

#define MR_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

#endif
