/* safetensors.h - reading and writing safetensors files, and the Hugging
 * Face index of a sharded checkpoint.
 *
 * A safetensors file is: an 8-byte little-endian header length N; N bytes of
 * JSON, an object {name: {"dtype": "F32", "shape": [d0, ...], "data_offsets":
 * [begin, end]}, ..., "__metadata__": {string: string}}; then the data
 * buffer.  Offsets are bytes relative to the start of the data buffer; the
 * tensors tile it exactly (no overlaps, no holes, nothing after the last),
 * each row-major, little endian.
 *
 * Reading maps the file (mmap) and validates the whole header up front: any
 * defect is MR_EFORMAT with a message naming the file, the tensor and what
 * was expected.  Tensor data is then read in place, whole or as any
 * hyper-rectangle, touching only the pages the slice covers, so a rank that
 * needs one shard of a tensor never reads the rest.
 *
 * Writing collects tensor descriptors (data borrowed until finish), then
 * streams the header and the data with large sequential writes (no per-
 * element calls).  The header is padded with spaces so the data buffer
 * starts 8-byte aligned, and tensors are laid out by element size, largest
 * first, then by name, so every tensor is aligned to its element size with
 * no holes (the layout Hugging Face's writer uses; its reader accepts it).
 *
 * Limits: header at most MR_ST_MAX_HEADER bytes, rank at most MR_ST_MAX_RANK,
 * names at most MR_ST_MAX_NAME bytes. */
#ifndef MR_SAFETENSORS_H
#define MR_SAFETENSORS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"

#define MR_ST_MAX_HEADER 100000000ull /* bytes, as Hugging Face's reader */
#define MR_ST_MAX_RANK 8
#define MR_ST_MAX_NAME 1024           /* bytes */

/* One tensor of a file, as the header describes it.  Owned by the file. */
struct mr_st_tensor {
  const char *name;
  enum mr_dtype dtype;
  int rank;                      /* 0 for a scalar */
  int64_t shape[MR_ST_MAX_RANK]; /* elements per dim */
  int64_t numel;                 /* product of shape */
  uint64_t begin, end;           /* bytes, relative to the data buffer */
};

struct mr_st_file; /* opaque: an open, validated file */

/* Opens and validates path (read-only mmap).  On success *out is a new file
 * the caller frees with mr_st_free; on error a negative code (MR_ENOENT,
 * MR_EIO, MR_EFORMAT, ...) with a message naming path. */
int mr_st_open(const char *path, struct mr_st_file **out);

/* Like mr_st_open over bytes already in memory (size bytes at data, borrowed
 * and kept until mr_st_free); name is used in messages only. */
int mr_st_open_memory(const void *data, size_t size, const char *name,
                      struct mr_st_file **out);

/* Unmaps and frees; NULL is a no-op. */
void mr_st_free(struct mr_st_file *f);

/* The file's name as given to open.  Borrowed. */
const char *mr_st_path(const struct mr_st_file *f);

/* Number of tensors, and tensor i in name order.  Borrowed. */
int mr_st_count(const struct mr_st_file *f);
const struct mr_st_tensor *mr_st_tensor_at(const struct mr_st_file *f, int i);

/* The tensor called name, or NULL.  Borrowed. */
const struct mr_st_tensor *mr_st_find(const struct mr_st_file *f,
                                      const char *name);

/* The tensor's bytes inside the mapping (end - begin bytes), borrowed for
 * the life of f.  Aligned to the element size only if the file's layout is;
 * read through memcpy (or the read functions below) otherwise. */
const void *mr_st_data(const struct mr_st_file *f,
                       const struct mr_st_tensor *t);

/* Metadata entries ("__metadata__"): count, entry i (key and value borrowed,
 * in key order), and lookup by key (NULL when absent). */
int mr_st_metadata_count(const struct mr_st_file *f);
void mr_st_metadata_at(const struct mr_st_file *f, int i, const char **key,
                       const char **value);
const char *mr_st_metadata(const struct mr_st_file *f, const char *key);

/* Copies the hyper-rectangle start[k] <= i_k < start[k] + count[k] of tensor
 * t (rank t->rank; start and count have that many entries, NULL for a
 * scalar) into dst as a dense row-major array of shape count, converted to
 * dst_dtype.  Conversions: identity for every dtype; between F32, BF16, F16
 * and F64 (rounding to nearest even, as dtype.h).  A rectangle outside the
 * tensor is MR_ERANGE, an unsupported conversion MR_ENOTSUP, each with a
 * message naming the file and tensor.  dst is caller-owned, large enough
 * for prod(count) elements of dst_dtype. */
int mr_st_read_slice(const struct mr_st_file *f, const struct mr_st_tensor *t,
                     const int64_t *start, const int64_t *count,
                     enum mr_dtype dst_dtype, void *dst);

/* Rows [row_begin, row_begin + n_rows) along dim 0, all other dims whole:
 * the common case of mr_st_read_slice. */
int mr_st_read_rows(const struct mr_st_file *f, const struct mr_st_tensor *t,
                    int64_t row_begin, int64_t n_rows,
                    enum mr_dtype dst_dtype, void *dst);

/* The whole tensor, converted: mr_st_read_slice over its full extent. */
int mr_st_read(const struct mr_st_file *f, const struct mr_st_tensor *t,
               enum mr_dtype dst_dtype, void *dst);

/* ---- writing ---- */

struct mr_st_writer; /* opaque */

#define MR_ST_WRITE_FSYNC 1  /* fsync the file before finish returns */
#define MR_ST_WRITE_CHECKSUM 2 /* checksum the file while writing it */
#define MR_ST_WRITE_DIRECT 4 /* durable, bypassing the page cache */

/* Starts a file at path, written at finish beside it (PATH.partial-PID) and
 * renamed over it once whole, so a file already there is replaced only by
 * a complete one.  flags: 0 or
 * any of
 *   MR_ST_WRITE_FSYNC   durable: the disk is started on each piece as it
 *                       is written, written pieces leave the page cache,
 *                       and the file is fsynced;
 *   MR_ST_WRITE_DIRECT  durable, written with O_DIRECT by a second thread
 *                       from aligned staging buffers while the caller's
 *                       thread fills the next, where the filesystem
 *                       supports it (else as MR_ST_WRITE_FSYNC);
 *   MR_ST_WRITE_CHECKSUM  the file's checksum (common/checksum.h) is taken
 *                       from the bytes as they are written (see
 *                       mr_st_writer_checksum).
 * *out is freed by mr_st_writer_free. */
int mr_st_writer_new(const char *path, int flags, struct mr_st_writer **out);

/* Counts into *count (may be NULL) each byte of the file as it goes to the
 * disk, for a watcher in another thread, and writes no faster than
 * bytes_per_s (0: no limit; a limit writes through the page cache, in parts
 * of at most a tenth of a second's bytes: a slow disk, for tests).  Call
 * before finish; *count must outlive the writer's finish. */
void mr_st_writer_meter(struct mr_st_writer *w, _Atomic uint64_t *count, double bytes_per_s);

/* Adds a tensor whose data (numel * size(dtype) bytes, row-major) is stored
 * as is.  name and shape are copied; data is borrowed until finish.  A
 * duplicate or over-long name, a rank beyond MR_ST_MAX_RANK or a negative
 * dim is MR_EINVAL. */
int mr_st_writer_add(struct mr_st_writer *w, const char *name,
                     enum mr_dtype dtype, int rank, const int64_t *shape,
                     const void *data);

/* Like mr_st_writer_add, but the file stores file_dtype while data holds
 * src_dtype; converted in chunks while streaming (F32/BF16/F16/F64 among
 * themselves), so no full converted copy is ever made. */
int mr_st_writer_add_converted(struct mr_st_writer *w, const char *name,
                               enum mr_dtype file_dtype, int rank,
                               const int64_t *shape, enum mr_dtype src_dtype,
                               const void *data);

/* Adds a "__metadata__" entry (both copied; a repeated key replaces). */
int mr_st_writer_add_metadata(struct mr_st_writer *w, const char *key,
                              const char *value);

/* Total tensor bytes added so far (the data buffer's size). */
uint64_t mr_st_writer_data_bytes(const struct mr_st_writer *w);

/* Writes the file: header, then every tensor, in large writes.  Returns 0
 * or a negative code with a message; on error the partial file is removed
 * and a file that was at the path is left as it was.
 * The writer can only be freed afterwards. */
int mr_st_writer_finish(struct mr_st_writer *w);

/* After a successful finish of a writer made with MR_ST_WRITE_CHECKSUM: the
 * file's checksum (common/checksum.h: 32 hex digits + NUL) into hex
 * (caller-owned), with no second read of the file.  MR_EINVAL otherwise. */
int mr_st_writer_checksum(const struct mr_st_writer *w, char hex[33]);

/* Frees the writer (NULL is a no-op); an unfinished writer writes nothing. */
void mr_st_writer_free(struct mr_st_writer *w);

/* ---- the index of a sharded checkpoint (model.safetensors.index.json) ----
 * {"metadata": {"total_size": bytes}, "weight_map": {tensor: file}} */

struct mr_st_index; /* opaque */

/* An empty index; free with mr_st_index_free (NULL is a no-op). */
int mr_st_index_new(struct mr_st_index **out);
void mr_st_index_free(struct mr_st_index *ix);

/* Records that tensor name lives in file (a name relative to the index's
 * folder); a name already mapped is MR_EINVAL.  Both copied. */
int mr_st_index_add(struct mr_st_index *ix, const char *name,
                    const char *file);

/* Sets metadata.total_size (bytes of tensor data over all shards). */
void mr_st_index_set_total_size(struct mr_st_index *ix, uint64_t bytes);

/* Writes the index as JSON to path (via a temporary file and rename). */
int mr_st_index_write(const struct mr_st_index *ix, const char *path);

/* Reads an index file; a malformed one is MR_EFORMAT naming path and field. */
int mr_st_index_read(const char *path, struct mr_st_index **out);

/* The same from the file's text[size] (untrusted: the fuzzed entry);
 * path names it in errors. */
int mr_st_index_parse(const char *text, size_t size, const char *path,
                      struct mr_st_index **out);

/* The file holding tensor name, or NULL.  Borrowed. */
const char *mr_st_index_file(const struct mr_st_index *ix, const char *name);

/* Entries in name order: count and entry i (borrowed), and total_size. */
int mr_st_index_count(const struct mr_st_index *ix);
void mr_st_index_at(const struct mr_st_index *ix, int i, const char **name,
                    const char **file);
uint64_t mr_st_index_total_size(const struct mr_st_index *ix);

#endif
