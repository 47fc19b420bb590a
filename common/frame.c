/* frame.c - length-prefixed framing. */
#include "common/frame.h"

#include <stdlib.h>
#include <string.h>

#include "common/error.h"

void mr_frame_reader_init(struct mr_frame_reader *r, size_t max_frame) {
  memset(r, 0, sizeof *r);
  r->max_frame = max_frame;
}

void mr_frame_reader_close(struct mr_frame_reader *r) {
  free(r->buf);
  memset(r, 0, sizeof *r);
}

int mr_frame_reader_feed(struct mr_frame_reader *r, const void *data,
                         size_t n) {
  if (n == 0)
    return 0;
  if (r->head > 0) { /* compact: frames already handed out are dead */
    memmove(r->buf, r->buf + r->head, r->len - r->head);
    r->len -= r->head;
    r->head = 0;
  }
  if (r->len + n > r->cap) {
    size_t cap = r->cap ? r->cap : 4096;
    while (cap < r->len + n)
      cap *= 2;
    uint8_t *nb = realloc(r->buf, cap);
    if (nb == NULL)
      return MR_ENOMEM;
    r->buf = nb;
    r->cap = cap;
  }
  memcpy(r->buf + r->len, data, n);
  r->len += n;
  return 0;
}

int mr_frame_reader_next(struct mr_frame_reader *r, const uint8_t **payload,
                         size_t *len) {
  size_t avail = r->len - r->head;
  if (avail < MR_FRAME_HEADER_BYTES)
    return 0;
  uint32_t n = mr_frame_get_header(r->buf + r->head);
  if (n > r->max_frame)
    return mr_error_set(MR_ETOOBIG, "frame of %u bytes exceeds the %zu-byte limit",
                        n, r->max_frame);
  if (avail - MR_FRAME_HEADER_BYTES < n)
    return 0;
  *payload = r->buf + r->head + MR_FRAME_HEADER_BYTES;
  *len = n;
  r->head += MR_FRAME_HEADER_BYTES + n;
  return 1;
}

size_t mr_frame_reader_pending(const struct mr_frame_reader *r) {
  return r->len - r->head;
}

void mr_frame_put_header(uint8_t header[MR_FRAME_HEADER_BYTES], uint32_t len) {
  header[0] = (uint8_t)(len & 0xff);
  header[1] = (uint8_t)((len >> 8) & 0xff);
  header[2] = (uint8_t)((len >> 16) & 0xff);
  header[3] = (uint8_t)((len >> 24) & 0xff);
}

uint32_t mr_frame_get_header(const uint8_t header[MR_FRAME_HEADER_BYTES]) {
  return (uint32_t)header[0] | (uint32_t)header[1] << 8 |
         (uint32_t)header[2] << 16 | (uint32_t)header[3] << 24;
}
