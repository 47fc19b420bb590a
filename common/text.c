/* text.c - a growing string. */
#include "common/text.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

void mr_text_add(struct mr_text *t, const char *fmt, ...) {
  if (t->failed)
    return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    size_t room = t->cap - t->len;
    int n = vsnprintf(t->s != NULL ? t->s + t->len : NULL, room, fmt, ap);
    va_end(ap);
    if (n < 0) {
      t->failed = 1;
      return;
    }
    if ((size_t)n < room) {
      t->len += (size_t)n;
      return;
    }
    size_t cap = t->cap * 2 > t->len + (size_t)n + 1 ? t->cap * 2 : t->len + (size_t)n + 256;
    char *s = realloc(t->s, cap);
    if (s == NULL) {
      t->failed = 1;
      return;
    }
    t->s = s, t->cap = cap;
  }
}

char *mr_text_take(struct mr_text *t) {
  char *s = t->failed ? NULL : t->s;
  if (t->failed)
    free(t->s);
  else if (s == NULL)
    s = calloc(1, 1);
  t->s = NULL, t->len = t->cap = 0, t->failed = 0;
  return s;
}
