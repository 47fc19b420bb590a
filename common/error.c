/* error.c - error table, per-thread messages. */
#include "common/error.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/log.h"

static _Thread_local char last_message[1024];
static _Thread_local int last_code;

const char *mr_strerror(int code) {
  switch (code) {
  case 0:
    return "success";
#define XX(name, value, desc)                                                \
  case value:                                                                \
    return desc;
    MR_ERRNO_MAP(XX)
#undef XX
  default:
    return "unknown error";
  }
}

const char *mr_errname(int code) {
  switch (code) {
  case 0:
    return "MR_OK";
#define XX(name, value, desc)                                                \
  case value:                                                                \
    return "MR_" #name;
    MR_ERRNO_MAP(XX)
#undef XX
  default:
    return "MR_EUNKNOWN";
  }
}

int mr_error_set(int code, const char *fmt, ...) {
  /* formatted apart first: a message may wrap the last one
   * (mr_error_set(c, "%s: %s", what, mr_error_message())) */
  char buf[sizeof last_message];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  memcpy(last_message, buf, sizeof buf);
  last_code = code;
  return code;
}

const char *mr_error_message(void) {
  if (last_message[0] != '\0')
    return last_message;
  return mr_strerror(last_code);
}

const char *mr_error_of(int code) {
  if (last_message[0] != '\0' && last_code == code)
    return last_message;
  return mr_strerror(code);
}

void mr_error_clear(void) {
  last_message[0] = '\0';
  last_code = 0;
}

int mr_from_errno(int err) {
  switch (err) {
  case 0:
    return 0;
  case ENOMEM:
    return MR_ENOMEM;
  case ENOENT:
    return MR_ENOENT;
  case EINVAL:
    return MR_EINVAL;
  case EAGAIN:
    return MR_EAGAIN;
  case ETIMEDOUT:
    return MR_ETIMEDOUT;
  case EPIPE:
  case ECONNRESET:
    return MR_ECLOSED;
  case EIO:
    return MR_EIO;
  case ERANGE:
    return MR_ERANGE;
  default:
    return MR_ESYS;
  }
}

void mr__error_trace(const char *file, int line, const char *expr, int code) {
  mr_log(MR_LOG_DEBUG, "trace", "%s:%d: %s -> %s", file, line, expr,
         mr_errname(code));
}
