/* log.c - the one logger. */
#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/tunable.h"

static char log_prefix[64] = "meshrun";
static int log_level = -1;

static const char *const level_names[] = {"error", "warn", "info", "debug"};

void mr_log_set_prefix(const char *prefix) {
  snprintf(log_prefix, sizeof log_prefix, "%s", prefix);
}

void mr_log_set_level(enum mr_log_level level) { log_level = (int)level; }

static int current_level(void) {
  if (log_level < 0) {
    const char *s = mr_tunable_str(MR_TUNABLE_LOG_LEVEL);
    int level = MR_LOG_INFO;
    for (int i = 0; i < 4; i++)
      if (strcmp(s, level_names[i]) == 0)
        level = i;
    log_level = level;
  }
  return log_level;
}

int mr_log_enabled(enum mr_log_level level) {
  return (int)level <= current_level();
}

void mr_log(enum mr_log_level level, const char *subsys, const char *fmt,
            ...) {
  if (!mr_log_enabled(level))
    return;
  char line[2048];
  /* an empty prefix: the launcher adds `[rank N]` to our output itself */
  int n = log_prefix[0] != '\0'
              ? snprintf(line, sizeof line, "[%s] %s %s: ", log_prefix, level_names[level], subsys)
              : snprintf(line, sizeof line, "%s %s: ", level_names[level], subsys);
  if (n < 0)
    return;
  va_list ap, again;
  va_start(ap, fmt);
  va_copy(again, ap);
  int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
  va_end(ap);
  char *out = line;
  if (m >= 0 && (size_t)n + (size_t)m + 2 > sizeof line) { /* a long report: whole */
    char *big = malloc((size_t)n + (size_t)m + 2);
    if (big != NULL) {
      memcpy(big, line, (size_t)n);
      vsnprintf(big + n, (size_t)m + 1, fmt, again);
      out = big;
    }
  }
  va_end(again);
  if (m < 0)
    return;
  size_t len = (size_t)n + (size_t)m;
  if (out == line && len > sizeof line - 2)
    len = sizeof line - 2;
  out[len++] = '\n';
  ssize_t w = write(STDERR_FILENO, out, len);
  (void)w;
  if (out != line)
    free(out);
}
