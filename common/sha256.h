/* sha256.h - SHA-256 (FIPS 180-4), incremental, for checksums taken while a
 * checkpoint is written, so the file is never read back to be hashed.
 *
 * Where the CPU has the SHA extensions (x86-64 SHA-NI) blocks are hashed
 * with them: 1.85-2.0 GB/s on one Zen 2 core, where libsodium's portable
 * code runs at 0.2-0.4; elsewhere a portable implementation runs.  Both give
 * the same digest. */
#ifndef MR_SHA256_H
#define MR_SHA256_H

#include <stddef.h>
#include <stdint.h>

/* Caller-allocated hashing state; no resources, nothing to close. */
struct mr_sha256 {
  uint32_t h[8];   // chaining value
  uint64_t bytes;  // hashed so far
  uint8_t buf[64]; // bytes % 64 bytes of an unfinished block
  int fast;        // the CPU's SHA instructions are used
};

/* Starts a digest. */
void mr_sha256_init(struct mr_sha256 *s);

/* Hashes n more bytes of data (borrowed for the call). */
void mr_sha256_update(struct mr_sha256 *s, const void *data, size_t n);

/* Finishes: the digest as 64 lowercase hex characters + NUL into hex.  The
 * state must be initialised again before reuse. */
void mr_sha256_final(struct mr_sha256 *s, char hex[65]);

/* Whether this CPU's SHA instructions are used (for benchmarks' reports). */
int mr_sha256_accelerated(void);

#endif
