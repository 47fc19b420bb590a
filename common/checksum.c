/* checksum.c - XXH3-128 through libxxhash. */
#include "common/checksum.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/error.h"

static void to_hex(XXH128_hash_t h, char hex[MR_CHECKSUM_HEX]) {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, h);
  static const char digits[] = "0123456789abcdef";
  for (size_t i = 0; i < sizeof c.digest; i++) {
    hex[2 * i] = digits[c.digest[i] >> 4];
    hex[2 * i + 1] = digits[c.digest[i] & 15];
  }
  hex[32] = '\0';
}

int mr_checksum_init(struct mr_checksum *c) {
  XXH3_state_t *s = XXH3_createState();
  if (s == NULL)
    return MR_ENOMEM;
  XXH3_128bits_reset(s);
  c->state = s;
  return 0;
}

void mr_checksum_update(struct mr_checksum *c, const void *p, size_t n) {
  if (n > 0)
    XXH3_128bits_update(c->state, p, n);
}

void mr_checksum_final(struct mr_checksum *c, char hex[MR_CHECKSUM_HEX]) {
  to_hex(XXH3_128bits_digest(c->state), hex);
  mr_checksum_abandon(c);
}

void mr_checksum_abandon(struct mr_checksum *c) {
  if (c->state != NULL)
    XXH3_freeState(c->state);
  c->state = NULL;
}

void mr_checksum_bytes(const void *p, size_t n, char hex[MR_CHECKSUM_HEX]) {
  to_hex(XXH3_128bits(p, n), hex);
}

int mr_checksum_file(const char *path, char hex[MR_CHECKSUM_HEX]) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return mr_error_set(MR_EIO, "%s: %s", path, strerror(errno));
  struct mr_checksum c;
  int rc = mr_checksum_init(&c);
  size_t cap = (size_t)8 << 20;
  char *buf = rc == 0 ? malloc(cap) : NULL;
  if (rc == 0 && buf == NULL)
    rc = MR_ENOMEM;
  for (ssize_t r; rc == 0 && (r = read(fd, buf, cap)) != 0;) {
    if (r < 0) {
      if (errno == EINTR)
        continue;
      rc = mr_error_set(MR_EIO, "%s: %s", path, strerror(errno));
      break;
    }
    mr_checksum_update(&c, buf, (size_t)r);
  }
  if (rc == 0)
    mr_checksum_final(&c, hex);
  else
    mr_checksum_abandon(&c);
  free(buf);
  close(fd);
  return rc;
}
