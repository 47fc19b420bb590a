/* tokens.h - token files, and which tokens each training row reads.
 *
 * A token file is mapped read-only (mmap) and never copied whole.  Formats:
 *   llm.c, GPT-2 flavour: 256 int32 header (little endian), header[0] =
 *     20240520, header[1] = 1, header[2] = token count; then uint16 tokens.
 *   llm.c, LLaMA-3 flavour: header[0] = 20240801, header[1] = 7, header[2] =
 *     token count; then uint32 tokens.
 *   raw uint16: no header, the whole file is little-endian uint16 tokens (as
 *     nanoGPT's train.bin).  A file whose name ends in ".u16" or ".raw" is
 *     always raw; any other file is llm.c when its first int32 is one of the
 *     two magics and raw otherwise.  (A raw file whose first two tokens are
 *     55432, 308 or 55713, 308 would read as llm.c: name it .u16.)
 * The file size must match the header's count exactly: a shorter file is
 * "truncated", a longer one has "a wrong count"; both are errors.
 *
 * The training-row formula (no hidden state: any rank computes any row, and
 * a resumed run reads the same rows).  For a file of n tokens, sequence
 * length T (n >= T + 1), seed S, step s >= 0 and row r >= 0 of the global
 * batch:
 *   {w0, w1, w2, w3} = Philox4x32-10(ctr = {lo(r), hi(r), lo(s), hi(s)},
 *                                    key = {lo(S ^ K), hi(S ^ K)}),
 *     K = 0x64617461746f6b73 ("datatoks", keeps the data stream apart from
 *     parameter initialisation under the same seed)
 *   offset(S, s, r) = (w0 | w1 << 32) mod (n - T)       in [0, n - T - 1]
 *   inputs  = tokens[offset .. offset + T)
 *   targets = tokens[offset + 1 .. offset + T + 1)
 * (The modulo bias is below (n - T) / 2^64: negligible.)  Data parallelism
 * gives rank d of dp the rows [d*B/dp, (d+1)*B/dp) of the global batch B, so
 * every strategy sees the same global batch at every step.
 *
 * The evaluation-row formula (sequential, no epochs, no randomness): the file
 * is cut into W = floor((n - 1) / T) windows of T tokens; row r of eval batch
 * b with R rows per batch reads window w = (b*R + r) mod W:
 *   offset = w * T, inputs = tokens[offset..offset+T),
 *   targets = tokens[offset+1..offset+T+1).
 * So eval batch b is the same whatever the world size, and running past the
 * end wraps to the start. */
#ifndef MR_TOKENS_H
#define MR_TOKENS_H

#include <stddef.h>
#include <stdint.h>

#define MR_TOKENS_MAGIC_U16 20240520 /* llm.c GPT-2: uint16 tokens */
#define MR_TOKENS_MAGIC_U32 20240801 /* llm.c LLaMA-3: uint32 tokens */
#define MR_TOKENS_VERSION_U16 1
#define MR_TOKENS_VERSION_U32 7
#define MR_TOKENS_HEADER_INTS 256
#define MR_TOKENS_DATA_KEY 0x64617461746f6b73ull /* "datatoks" */

enum mr_tokens_format {
  MR_TOKENS_LLMC_U16 = 0, /* llm.c header, uint16 tokens */
  MR_TOKENS_LLMC_U32 = 1, /* llm.c header, uint32 tokens */
  MR_TOKENS_RAW_U16 = 2,  /* no header, uint16 tokens */
};

/* An open token file.  Caller-allocated; fields are read-only to callers. */
struct mr_tokens {
  char *path;                   /* owned copy, for messages */
  enum mr_tokens_format format;
  const void *map;              /* whole file, mmap'd read-only */
  size_t map_bytes;             /* file size, bytes */
  const uint8_t *data;          /* first token, inside map */
  int elem_bytes;               /* 2 or 4 */
  int64_t n_tokens;
  int64_t vocab_size;           /* 0: not checked */
  int64_t max_token;            /* largest token, -1 when not scanned */
};

/* Opens path and checks its header and size.  When vocab_size > 0 every
 * token is checked at open (one sequential pass over the mapping) and a
 * token >= vocab_size is MR_ERANGE naming the file, the position, the token
 * and the vocabulary.  On error returns a negative code with a message and
 * leaves *t closed.  Close with mr_tokens_close. */
int mr_tokens_open(struct mr_tokens *t, const char *path, int64_t vocab_size);

/* Unmaps and frees; safe on a zeroed or already closed struct. */
void mr_tokens_close(struct mr_tokens *t);

/* Token i (0 <= i < n_tokens), unchecked. */
static inline uint32_t mr_tokens_at(const struct mr_tokens *t, int64_t i) {
  const uint8_t *p = t->data + (size_t)i * (size_t)t->elem_bytes;
  if (t->elem_bytes == 2)
    return (uint32_t)p[0] | (uint32_t)p[1] << 8;
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

/* The start offset of training row `row` of step `step` (formula above), or
 * a negative code when the file is shorter than seq_len + 1 tokens or an
 * argument is negative. */
int64_t mr_tokens_batch_offset(const struct mr_tokens *t, uint64_t seed,
                               int64_t step, int64_t row, int64_t seq_len);

/* Writes the seq_len inputs and seq_len targets of training row `row` of
 * step `step` into the caller's arrays (formula above).  Returns 0 or a
 * negative code with a message (file too short, negative arguments, a token
 * beyond the vocabulary when vocab_size > 0). */
int mr_tokens_batch_row(const struct mr_tokens *t, uint64_t seed,
                        int64_t step, int64_t row, int64_t seq_len,
                        int32_t *inputs, int32_t *targets);

/* Number of distinct evaluation windows W = floor((n - 1) / seq_len), or a
 * negative code when there is none. */
int64_t mr_tokens_eval_windows(const struct mr_tokens *t, int64_t seq_len);

/* Like mr_tokens_batch_row for row `row` of evaluation batch `batch` with
 * rows_per_batch rows (formula above). */
int mr_tokens_eval_row(const struct mr_tokens *t, int64_t batch, int64_t row,
                       int64_t rows_per_batch, int64_t seq_len,
                       int32_t *inputs, int32_t *targets);

/* A streaming writer of llm.c token files (MR_TOKENS_LLMC_U16 or _U32) or
 * raw uint16 files.  Tokens are buffered and written in large writes; the
 * header's count is filled in by mr_tokens_writer_close. */
struct mr_tokens_writer {
  int fd;
  char *path;                   /* owned copy, for messages */
  char *tmp;                    /* PATH.partial-PID, written, then renamed */
  enum mr_tokens_format format;
  uint8_t *buf;                 /* staging buffer, owned */
  size_t buf_used, buf_cap;     /* bytes */
  int64_t n_tokens;             /* appended so far */
};

/* Starts a file at path: written beside it and renamed over it at close,
 * so a file already there (one a running job has mapped) is replaced only
 * by a whole one.  Returns 0 or a negative code with a message. */
int mr_tokens_writer_open(struct mr_tokens_writer *w, const char *path,
                          enum mr_tokens_format format);

/* Appends n tokens; a token that does not fit the format (>= 65536 for the
 * uint16 formats) is MR_ERANGE.  Borrowed input. */
int mr_tokens_writer_append(struct mr_tokens_writer *w, const uint32_t *tok,
                            size_t n);

/* Flushes, writes the header count, fsyncs, closes and renames the file
 * into place.  Returns 0 or a negative code; on any error the partial file
 * is removed and a file at the path is left as it was.  Frees w's
 * resources either way. */
int mr_tokens_writer_close(struct mr_tokens_writer *w);

/* Abandons a writer: closes and removes the partial file (a file at the
 * path stays). */
void mr_tokens_writer_abort(struct mr_tokens_writer *w);

#endif
