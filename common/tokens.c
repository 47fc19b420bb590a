/* tokens.c - token files: mapping, validation, the row formulas, writing. */
#include "common/tokens.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/rng.h"

#define HEADER_BYTES (MR_TOKENS_HEADER_INTS * 4)

static uint32_t le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

static int ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), k = strlen(suffix);
  return n >= k && strcmp(s + n - k, suffix) == 0;
}

static const char *format_name(enum mr_tokens_format f) {
  switch (f) {
  case MR_TOKENS_LLMC_U16:
    return "llm.c uint16";
  case MR_TOKENS_LLMC_U32:
    return "llm.c uint32";
  default:
    return "raw uint16";
  }
}

/* Header and size checks once the file is mapped. */
static int check_layout(struct mr_tokens *t) {
  const uint8_t *p = t->map;
  size_t size = t->map_bytes;
  int force_raw = ends_with(t->path, ".u16") || ends_with(t->path, ".raw");
  uint32_t magic = size >= 4 ? le32(p) : 0;
  if (!force_raw &&
      (magic == MR_TOKENS_MAGIC_U16 || magic == MR_TOKENS_MAGIC_U32)) {
    int wide = magic == MR_TOKENS_MAGIC_U32;
    uint32_t want_version = wide ? MR_TOKENS_VERSION_U32 : MR_TOKENS_VERSION_U16;
    t->format = wide ? MR_TOKENS_LLMC_U32 : MR_TOKENS_LLMC_U16;
    t->elem_bytes = wide ? 4 : 2;
    if (size < HEADER_BYTES)
      return mr_error_set(MR_EFORMAT,
                          "%s: truncated: %zu bytes, an llm.c token file has a "
                          "%d-byte header",
                          t->path, size, HEADER_BYTES);
    uint32_t version = le32(p + 4);
    if (version != want_version)
      return mr_error_set(MR_EFORMAT,
                          "%s: header[1] (version) is %" PRIu32
                          ", expected %" PRIu32 " for magic %" PRIu32,
                          t->path, version, want_version, magic);
    int32_t count = (int32_t)le32(p + 8);
    if (count < 0)
      return mr_error_set(MR_EFORMAT,
                          "%s: header[2] (token count) is %" PRId32
                          ", expected a count >= 0",
                          t->path, count);
    uint64_t want = HEADER_BYTES + (uint64_t)count * (uint64_t)t->elem_bytes;
    if (size < want)
      return mr_error_set(MR_EFORMAT,
                          "%s: truncated: header[2] says %" PRId32
                          " tokens (%" PRIu64 " bytes), the file has %zu bytes",
                          t->path, count, want, size);
    if (size > want)
      return mr_error_set(MR_EFORMAT,
                          "%s: wrong count: header[2] says %" PRId32
                          " tokens (%" PRIu64 " bytes), the file has %zu bytes "
                          "(%" PRIu64 " tokens)",
                          t->path, count, want, size,
                          (uint64_t)(size - HEADER_BYTES) / (uint64_t)t->elem_bytes);
    t->data = p + HEADER_BYTES;
    t->n_tokens = count;
    return 0;
  }
  t->format = MR_TOKENS_RAW_U16;
  t->elem_bytes = 2;
  if (size % 2 != 0)
    return mr_error_set(MR_EFORMAT,
                        "%s: %zu bytes: not a raw uint16 token file (odd size) "
                        "and no llm.c magic (%d or %d) in header[0]",
                        t->path, size, MR_TOKENS_MAGIC_U16, MR_TOKENS_MAGIC_U32);
  t->data = p;
  t->n_tokens = (int64_t)(size / 2);
  return 0;
}

static int check_vocab(struct mr_tokens *t) {
  uint32_t max = 0;
  int64_t max_at = 0;
  for (int64_t i = 0; i < t->n_tokens; i++) {
    uint32_t v = mr_tokens_at(t, i);
    if (v > max) {
      max = v;
      max_at = i;
    }
  }
  t->max_token = t->n_tokens > 0 ? (int64_t)max : -1;
  if (t->vocab_size > 0 && t->n_tokens > 0 && (int64_t)max >= t->vocab_size)
    return mr_error_set(MR_ERANGE,
                        "%s: token %" PRId64 " is %" PRIu32
                        ", expected < vocab_size %" PRId64,
                        t->path, max_at, max, t->vocab_size);
  return 0;
}

int mr_tokens_open(struct mr_tokens *t, const char *path, int64_t vocab_size) {
  memset(t, 0, sizeof *t);
  t->max_token = -1;
  t->vocab_size = vocab_size > 0 ? vocab_size : 0;
  int rc;
  t->path = strdup(path);
  if (t->path == NULL)
    return mr_error_set(MR_ENOMEM, "%s: out of memory", path);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    rc = mr_error_set(mr_from_errno(errno), "%s: cannot open token file: %s",
                      path, strerror(errno));
    goto err;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    rc = mr_error_set(MR_EIO, "%s: not a regular file", path);
    goto err;
  }
  if (st.st_size == 0) {
    close(fd);
    rc = mr_error_set(MR_EFORMAT, "%s: empty file, expected tokens", path);
    goto err;
  }
  void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map == MAP_FAILED) {
    rc = mr_error_set(mr_from_errno(errno), "%s: mmap: %s", path,
                      strerror(errno));
    goto err;
  }
  t->map = map;
  t->map_bytes = (size_t)st.st_size;
  MR_TRY_GOTO(rc, check_layout(t), err);
  if (t->vocab_size > 0)
    MR_TRY_GOTO(rc, check_vocab(t), err);
  return 0;
err:
  mr_tokens_close(t);
  return rc;
}

void mr_tokens_close(struct mr_tokens *t) {
  if (t->map != NULL)
    munmap((void *)t->map, t->map_bytes);
  free(t->path);
  memset(t, 0, sizeof *t);
  t->max_token = -1;
}

static int check_row_args(const struct mr_tokens *t, int64_t a, int64_t b,
                          int64_t seq_len, const char *what) {
  if (seq_len <= 0 || a < 0 || b < 0)
    return mr_error_set(MR_EINVAL,
                        "%s: %s: expected non-negative indices and seq_len > 0 "
                        "(got %" PRId64 ", %" PRId64 ", seq_len %" PRId64 ")",
                        t->path, what, a, b, seq_len);
  if (t->n_tokens < seq_len + 1)
    return mr_error_set(MR_ERANGE,
                        "%s: %" PRId64 " tokens, expected at least seq_len + 1 "
                        "= %" PRId64,
                        t->path, t->n_tokens, seq_len + 1);
  return 0;
}

int64_t mr_tokens_batch_offset(const struct mr_tokens *t, uint64_t seed,
                               int64_t step, int64_t row, int64_t seq_len) {
  MR_TRY(check_row_args(t, step, row, seq_len, "training row"));
  uint64_t key64 = seed ^ MR_TOKENS_DATA_KEY;
  uint64_t r = (uint64_t)row, s = (uint64_t)step;
  const uint32_t ctr[4] = {(uint32_t)r, (uint32_t)(r >> 32), (uint32_t)s,
                           (uint32_t)(s >> 32)};
  const uint32_t key[2] = {(uint32_t)key64, (uint32_t)(key64 >> 32)};
  uint32_t w[4];
  mr_philox4x32_10(ctr, key, w);
  uint64_t h = (uint64_t)w[0] | (uint64_t)w[1] << 32;
  return (int64_t)(h % (uint64_t)(t->n_tokens - seq_len));
}

static int copy_row(const struct mr_tokens *t, int64_t off, int64_t seq_len,
                    int32_t *inputs, int32_t *targets) {
  for (int64_t k = 0; k <= seq_len; k++) {
    uint32_t v = mr_tokens_at(t, off + k);
    if (t->vocab_size > 0 && (int64_t)v >= t->vocab_size)
      return mr_error_set(MR_ERANGE,
                          "%s: token %" PRId64 " is %" PRIu32
                          ", expected < vocab_size %" PRId64,
                          t->path, off + k, v, t->vocab_size);
    if (v > INT32_MAX)
      return mr_error_set(MR_ERANGE,
                          "%s: token %" PRId64 " is %" PRIu32
                          ", expected < 2^31",
                          t->path, off + k, v);
    if (k < seq_len)
      inputs[k] = (int32_t)v;
    if (k > 0)
      targets[k - 1] = (int32_t)v;
  }
  return 0;
}

int mr_tokens_batch_row(const struct mr_tokens *t, uint64_t seed,
                        int64_t step, int64_t row, int64_t seq_len,
                        int32_t *inputs, int32_t *targets) {
  int64_t off = mr_tokens_batch_offset(t, seed, step, row, seq_len);
  if (off < 0)
    return (int)off;
  return copy_row(t, off, seq_len, inputs, targets);
}

int64_t mr_tokens_eval_windows(const struct mr_tokens *t, int64_t seq_len) {
  MR_TRY(check_row_args(t, 0, 0, seq_len, "evaluation windows"));
  return (t->n_tokens - 1) / seq_len;
}

int mr_tokens_eval_row(const struct mr_tokens *t, int64_t batch, int64_t row,
                       int64_t rows_per_batch, int64_t seq_len,
                       int32_t *inputs, int32_t *targets) {
  MR_TRY(check_row_args(t, batch, row, seq_len, "evaluation row"));
  if (rows_per_batch <= 0 || row >= rows_per_batch)
    return mr_error_set(MR_EINVAL,
                        "%s: evaluation row %" PRId64
                        ": expected 0 <= row < rows_per_batch (%" PRId64 ")",
                        t->path, row, rows_per_batch);
  uint64_t windows = (uint64_t)((t->n_tokens - 1) / seq_len);
  /* (b*R + r) mod W without overflow for any int64 b, R */
  uint64_t w = (((uint64_t)batch % windows) *
                    ((uint64_t)rows_per_batch % windows) % windows +
                (uint64_t)row % windows) %
               windows;
  return copy_row(t, (int64_t)w * seq_len, seq_len, inputs, targets);
}

/* ---- writing ---- */

#define WRITE_BUF_BYTES (4u << 20)

static int write_all(int fd, const uint8_t *p, size_t n, const char *path) {
  while (n > 0) {
    ssize_t k = write(fd, p, n);
    if (k < 0 && errno == EINTR)
      continue;
    if (k <= 0)
      return mr_error_set(MR_EIO, "%s: write: %s", path,
                          k < 0 ? strerror(errno) : "no progress");
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

int mr_tokens_writer_open(struct mr_tokens_writer *w, const char *path,
                          enum mr_tokens_format format) {
  memset(w, 0, sizeof *w);
  w->fd = -1;
  w->format = format;
  w->path = strdup(path);
  w->buf_cap = WRITE_BUF_BYTES;
  w->buf = malloc(w->buf_cap);
  size_t tn = strlen(path) + 32;
  w->tmp = malloc(tn);
  if (w->path == NULL || w->buf == NULL || w->tmp == NULL) {
    mr_tokens_writer_abort(w);
    return mr_error_set(MR_ENOMEM, "%s: out of memory", path);
  }
  /* written beside the path, renamed over it at close: a job reading the
   * file there keeps reading it whole, and a write that fails leaves it */
  snprintf(w->tmp, tn, "%s.partial-%d", path, (int)getpid());
  w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd < 0) {
    int rc = mr_error_set(mr_from_errno(errno), "%s: cannot create: %s", path,
                          strerror(errno));
    free(w->path);
    free(w->tmp);
    free(w->buf);
    memset(w, 0, sizeof *w);
    w->fd = -1;
    return rc;
  }
  if (format != MR_TOKENS_RAW_U16) {
    memset(w->buf, 0, HEADER_BYTES); /* the header is filled in at close */
    w->buf_used = HEADER_BYTES;
  }
  return 0;
}

static int flush(struct mr_tokens_writer *w) {
  int rc = write_all(w->fd, w->buf, w->buf_used, w->path);
  w->buf_used = 0;
  return rc;
}

int mr_tokens_writer_append(struct mr_tokens_writer *w, const uint32_t *tok,
                            size_t n) {
  int wide = w->format == MR_TOKENS_LLMC_U32;
  size_t eb = wide ? 4 : 2;
  if (w->format != MR_TOKENS_RAW_U16 &&
      (uint64_t)w->n_tokens + n > (uint64_t)INT32_MAX)
    return mr_error_set(MR_ERANGE,
                        "%s: more than 2^31-1 tokens do not fit an llm.c "
                        "header",
                        w->path);
  for (size_t i = 0; i < n; i++) {
    uint32_t v = tok[i];
    if (!wide && v > 0xffff)
      return mr_error_set(MR_ERANGE,
                          "%s: token %" PRId64 " is %" PRIu32
                          ", expected < 65536 for %s",
                          w->path, w->n_tokens + (int64_t)i, v,
                          format_name(w->format));
    if (w->buf_used + eb > w->buf_cap)
      MR_TRY(flush(w));
    uint8_t *p = w->buf + w->buf_used;
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    if (wide) {
      p[2] = (uint8_t)(v >> 16);
      p[3] = (uint8_t)(v >> 24);
    }
    w->buf_used += eb;
  }
  w->n_tokens += (int64_t)n;
  return 0;
}

static void put32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
  p[2] = (uint8_t)(v >> 16);
  p[3] = (uint8_t)(v >> 24);
}

int mr_tokens_writer_close(struct mr_tokens_writer *w) {
  int rc = flush(w);
  if (rc == 0 && w->format != MR_TOKENS_RAW_U16) {
    uint8_t h[12];
    int wide = w->format == MR_TOKENS_LLMC_U32;
    put32(h, wide ? MR_TOKENS_MAGIC_U32 : MR_TOKENS_MAGIC_U16);
    put32(h + 4, wide ? MR_TOKENS_VERSION_U32 : MR_TOKENS_VERSION_U16);
    put32(h + 8, (uint32_t)w->n_tokens);
    if (pwrite(w->fd, h, sizeof h, 0) != (ssize_t)sizeof h)
      rc = mr_error_set(MR_EIO, "%s: writing the header: %s", w->path,
                        strerror(errno));
  }
  if (rc == 0 && fsync(w->fd) != 0)
    rc = mr_error_set(MR_EIO, "%s: fsync: %s", w->path, strerror(errno));
  if (close(w->fd) != 0 && rc == 0)
    rc = mr_error_set(MR_EIO, "%s: close: %s", w->path, strerror(errno));
  w->fd = -1;
  if (rc == 0 && rename(w->tmp, w->path) != 0)
    rc = mr_error_set(mr_from_errno(errno), "%s: rename from %s: %s", w->path, w->tmp,
                      strerror(errno));
  if (rc < 0)
    unlink(w->tmp);
  free(w->tmp);
  free(w->path);
  free(w->buf);
  memset(w, 0, sizeof *w);
  w->fd = -1;
  return rc;
}

void mr_tokens_writer_abort(struct mr_tokens_writer *w) {
  if (w->fd >= 0) {
    close(w->fd);
    if (w->tmp != NULL)
      unlink(w->tmp);
  }
  free(w->tmp);
  free(w->path);
  free(w->buf);
  memset(w, 0, sizeof *w);
  w->fd = -1;
}
