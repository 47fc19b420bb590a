/* checksum.h - the checksum of checkpoint files: XXH3-128 (libxxhash).
 *
 * A checkpoint's completion marker names each file with its checksum, so a
 * file cut short or corrupted is never loaded.  The threat is the disk and
 * crashes, not an adversary (files come from the job's own ranks), so a
 * fast non-cryptographic 128-bit hash serves: it costs a small fraction of
 * a CPU core per GB written, where SHA-256 cost most of one and delayed
 * training while a save was in flight.  Hashes are written as 32 lowercase
 * hex digits. */
#ifndef MR_CHECKSUM_H
#define MR_CHECKSUM_H

#include <stddef.h>

#define MR_CHECKSUM_NAME "xxh3-128"
#define MR_CHECKSUM_HEX 33 /* 32 hex digits + NUL */

struct mr_checksum {
  void *state; /* the library's streaming state, owned */
};

/* Starts a checksum.  Returns 0 or MR_ENOMEM. */
int mr_checksum_init(struct mr_checksum *c);

/* Adds n bytes. */
void mr_checksum_update(struct mr_checksum *c, const void *p, size_t n);

/* Writes the checksum of everything added into hex and frees the state. */
void mr_checksum_final(struct mr_checksum *c, char hex[MR_CHECKSUM_HEX]);

/* Frees a started checksum without a result; a zeroed one is fine. */
void mr_checksum_abandon(struct mr_checksum *c);

/* The checksum of bytes [0, n). */
void mr_checksum_bytes(const void *p, size_t n, char hex[MR_CHECKSUM_HEX]);

/* The checksum of a file.  Returns 0 or MR_EIO naming the file. */
int mr_checksum_file(const char *path, char hex[MR_CHECKSUM_HEX]);

#endif
