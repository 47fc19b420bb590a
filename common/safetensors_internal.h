/* safetensors_internal.h - what the safetensors reader and writer share. */
#ifndef MR_SAFETENSORS_INTERNAL_H
#define MR_SAFETENSORS_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/checksum.h"

/* Whether mr__st_convert handles src -> dst: identity for every dtype,
 * otherwise both among F32, BF16, F16, F64. */
int mr__st_can_convert(enum mr_dtype src, enum mr_dtype dst);

/* Converts n elements from src (src_dtype) to dst (dst_dtype); either
 * pointer may be unaligned.  Rounds to nearest even (via float). */
void mr__st_convert(enum mr_dtype dst_dtype, void *dst, enum mr_dtype src_dtype,
                    const void *src, size_t n);

/* ---- direct I/O (safetensors_direct.c) ----
 * A file open with O_DIRECT written from a ring of aligned staging buffers:
 * the caller fills one buffer at a time and submits it; an I/O thread
 * writes each submitted buffer at its place, and (given a hash) a hashing
 * thread hashes each, in order, at the same time, so copying, hashing and
 * the disk all work at once and nothing passes through the page cache.
 * Buffer i of the file (i = 0, 1, ...) is written at i *
 * MR__ST_DIRECT_BYTES; only the last may be less than full, and it is
 * written padded to MR__ST_DIRECT_ALIGN (the caller truncates the file). */
#define MR__ST_DIRECT_BYTES (2u << 20) /* per staging buffer */
#define MR__ST_DIRECT_ALIGN 4096u      /* of O_DIRECT addresses, offsets, sizes */

struct mr__st_direct;

/* Whether O_DIRECT I/O on fd (open with O_DIRECT) takes
 * MR__ST_DIRECT_ALIGN-aligned addresses, offsets and sizes. */
int mr__st_direct_usable(int fd);

/* Starts writing fd (borrowed, open with O_DIRECT); sha (borrowed,
 * initialised; NULL: no hashing) gets every byte submitted, and is the
 * caller's again after mr__st_direct_drain.  *first is the buffer to fill
 * first (MR__ST_DIRECT_BYTES).  path (borrowed) names the file in messages.
 * Returns 0 or MR_ENOMEM / MR_ESYS; *out is freed by mr__st_direct_close. */
int mr__st_direct_open(int fd, struct mr_checksum *sha, const char *path,
                       struct mr__st_direct **out, uint8_t **first);

/* Submits the first len bytes of the buffer last handed out; *next is the
 * buffer to fill next (waits until one is free).  Returns 0, or MR_EIO once
 * a write has failed. */
int mr__st_direct_submit(struct mr__st_direct *d, size_t len, uint8_t **next);

/* Waits until every submitted buffer is written and hashed.  Returns 0 or
 * MR_EIO. */
int mr__st_direct_drain(struct mr__st_direct *d);

/* Stops the threads once they are done with what was submitted, and frees
 * d.  NULL is a no-op. */
void mr__st_direct_close(struct mr__st_direct *d);

#endif
