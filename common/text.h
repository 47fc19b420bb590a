/* text.h - a growing string: text made by pieces (a rank program's dump,
 * a report) without a stream.  Once an allocation fails the text stays
 * as it was and mr_text_take returns NULL. */
#ifndef MR_TEXT_H
#define MR_TEXT_H

#include <stddef.h>

struct mr_text {
  char *s;     // NUL-terminated, or NULL while empty
  size_t len, cap;
  int failed;  // an allocation failed
};

/* Appends printf-style text to t (zero-initialised to start). */
void mr_text_add(struct mr_text *t, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* The text, now the caller's to free (never NULL unless an allocation
 * failed); t is empty again. */
char *mr_text_take(struct mr_text *t);

#endif
