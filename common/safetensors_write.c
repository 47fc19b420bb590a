/* safetensors_write.c - the streaming safetensors writer and the index of a
 * sharded checkpoint (see safetensors.h). */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/error.h"
#include "common/safetensors.h"
#include "common/safetensors_internal.h"
#include "common/checksum.h"
#include "common/clock.h"

/* Writes of at least this much go straight from the caller's memory; smaller
 * pieces are gathered in a staging buffer of the same size, so every write
 * call moves megabytes. */
#define STAGE_BYTES (8u << 20)
/* Bytes per write(2) call: small enough that a piece just hashed is still
 * in the cache when it is written, and that the disk can be started on
 * each piece as it lands (MR_ST_WRITE_FSYNC); large enough that the calls
 * cost nothing next to the copy. */
#define WRITE_BYTES (8u << 20)
/* MR_ST_WRITE_FSYNC: at most about this much written data waits for the
 * disk at any time (see write_behind). */
#define DIRTY_BYTES (64u << 20)

struct entry {
  char *name;
  enum mr_dtype file_dtype, src_dtype;
  int rank;
  int64_t shape[MR_ST_MAX_RANK];
  uint64_t numel;
  const void *data;    /* borrowed */
  uint64_t begin, end; /* set by finish */
};

struct kv {
  char *key, *value;
};

struct mr_st_writer {
  char *path;
  int flags;
  int finished;
  struct entry *entries;
  int n, cap;
  struct kv *meta;
  int n_meta, cap_meta;
  uint64_t data_bytes;
  /* while finishing */
  int fd;
  uint8_t *stage;   /* being filled: stage_mem, or a buffer of dio's ring */
  uint8_t *stage_mem;
  size_t stage_cap; /* bytes: STAGE_BYTES, or MR__ST_DIRECT_BYTES with dio */
  size_t staged;    /* bytes */
  struct mr__st_direct *dio; /* MR_ST_WRITE_DIRECT where the filesystem allows */
  uint64_t written; /* bytes of the file written so far */
  _Atomic uint64_t *count;  /* mr_st_writer_meter: bytes written, for a watcher */
  double limit_bps;         /* and the slowest disk to pretend to be (0: none) */
  int64_t limit_start_ns;
  int behind;       /* written behind (MR_ST_WRITE_FSYNC; see write_behind) */
  uint64_t started; /* [0, started) handed to the disk */
  uint64_t settled; /* [0, settled) on the disk and out of the page cache */
  struct mr_checksum sum; /* MR_ST_WRITE_CHECKSUM: of the bytes written */
  char sum_hex[MR_CHECKSUM_HEX]; /* set by a successful finish */
};

int mr_st_writer_new(const char *path, int flags, struct mr_st_writer **out) {
  *out = NULL;
  struct mr_st_writer *w = calloc(1, sizeof *w);
  if (w == NULL || (w->path = strdup(path)) == NULL) {
    free(w);
    return mr_error_set(MR_ENOMEM, "%s: out of memory", path);
  }
  w->flags = flags;
  w->fd = -1;
  *out = w;
  return 0;
}

void mr_st_writer_free(struct mr_st_writer *w) {
  if (w == NULL)
    return;
  for (int i = 0; i < w->n; i++)
    free(w->entries[i].name);
  free(w->entries);
  for (int i = 0; i < w->n_meta; i++) {
    free(w->meta[i].key);
    free(w->meta[i].value);
  }
  free(w->meta);
  mr__st_direct_close(w->dio);
  mr_checksum_abandon(&w->sum); /* a writer that did not finish */
  free(w->stage_mem);
  if (w->fd >= 0)
    close(w->fd);
  free(w->path);
  free(w);
}

static int grow(void **arr, int *cap, int need, size_t elem) {
  if (need <= *cap)
    return 0;
  int ncap = *cap ? *cap * 2 : 16;
  while (ncap < need)
    ncap *= 2;
  void *p = realloc(*arr, (size_t)ncap * elem);
  if (p == NULL)
    return MR_ENOMEM;
  *arr = p;
  *cap = ncap;
  return 0;
}

int mr_st_writer_add_converted(struct mr_st_writer *w, const char *name,
                               enum mr_dtype file_dtype, int rank,
                               const int64_t *shape, enum mr_dtype src_dtype,
                               const void *data) {
  const char *p = w->path;
  size_t len = strlen(name);
  if (w->finished)
    return mr_error_set(MR_EINVAL, "%s: tensor \"%s\" added after finish", p,
                        name);
  if (len == 0 || len > MR_ST_MAX_NAME || strcmp(name, "__metadata__") == 0)
    return mr_error_set(MR_EINVAL,
                        "%s: tensor name \"%.64s\": expected 1 to %d bytes, "
                        "not \"__metadata__\"",
                        p, name, MR_ST_MAX_NAME);
  if (rank < 0 || rank > MR_ST_MAX_RANK)
    return mr_error_set(MR_EINVAL,
                        "%s: tensor \"%s\": rank %d, expected 0 to %d", p,
                        name, rank, MR_ST_MAX_RANK);
  if ((unsigned)file_dtype >= MR_DTYPE_COUNT ||
      (unsigned)src_dtype >= MR_DTYPE_COUNT ||
      !mr__st_can_convert(src_dtype, file_dtype))
    return mr_error_set(MR_EINVAL,
                        "%s: tensor \"%s\": cannot store %s data as %s", p,
                        name, mr_dtype_safetensors_name(src_dtype),
                        mr_dtype_safetensors_name(file_dtype));
  uint64_t numel = 1;
  for (int k = 0; k < rank; k++) {
    if (shape[k] < 0 || (shape[k] > 0 && numel > (UINT64_C(1) << 53) /
                                                     (uint64_t)shape[k]))
      return mr_error_set(MR_EINVAL,
                          "%s: tensor \"%s\": shape[%d] = %" PRId64
                          ": expected >= 0 and at most 2^53 elements",
                          p, name, k, shape[k]);
    numel *= (uint64_t)shape[k];
  }
  if (numel > 0 && data == NULL)
    return mr_error_set(MR_EINVAL, "%s: tensor \"%s\": no data", p, name);
  for (int i = 0; i < w->n; i++) /* O(n^2) over a few thousand names */
    if (strcmp(w->entries[i].name, name) == 0)
      return mr_error_set(MR_EINVAL, "%s: tensor \"%s\" added twice", p, name);
  if (grow((void **)&w->entries, &w->cap, w->n + 1, sizeof *w->entries) != 0)
    return mr_error_set(MR_ENOMEM, "%s: out of memory", p);
  struct entry *e = &w->entries[w->n];
  memset(e, 0, sizeof *e);
  if ((e->name = strdup(name)) == NULL)
    return mr_error_set(MR_ENOMEM, "%s: out of memory", p);
  e->file_dtype = file_dtype;
  e->src_dtype = src_dtype;
  e->rank = rank;
  for (int k = 0; k < rank; k++)
    e->shape[k] = shape[k];
  e->numel = numel;
  e->data = data;
  w->data_bytes += numel * mr_dtype_size(file_dtype);
  w->n++;
  return 0;
}

int mr_st_writer_add(struct mr_st_writer *w, const char *name,
                     enum mr_dtype dtype, int rank, const int64_t *shape,
                     const void *data) {
  return mr_st_writer_add_converted(w, name, dtype, rank, shape, dtype, data);
}

int mr_st_writer_add_metadata(struct mr_st_writer *w, const char *key,
                              const char *value) {
  for (int i = 0; i < w->n_meta; i++)
    if (strcmp(w->meta[i].key, key) == 0) {
      char *v = strdup(value);
      if (v == NULL)
        return mr_error_set(MR_ENOMEM, "%s: out of memory", w->path);
      free(w->meta[i].value);
      w->meta[i].value = v;
      return 0;
    }
  if (grow((void **)&w->meta, &w->cap_meta, w->n_meta + 1, sizeof *w->meta))
    return mr_error_set(MR_ENOMEM, "%s: out of memory", w->path);
  struct kv *e = &w->meta[w->n_meta];
  e->key = strdup(key);
  e->value = strdup(value);
  if (e->key == NULL || e->value == NULL) {
    free(e->key);
    free(e->value);
    return mr_error_set(MR_ENOMEM, "%s: out of memory", w->path);
  }
  w->n_meta++;
  return 0;
}

uint64_t mr_st_writer_data_bytes(const struct mr_st_writer *w) {
  return w->data_bytes;
}

/* Largest element first, then by name: each tensor lands aligned to its own
 * element size with no padding between tensors. */
static int cmp_layout(const void *a, const void *b) {
  const struct entry *x = a, *y = b;
  size_t sx = mr_dtype_size(x->file_dtype), sy = mr_dtype_size(y->file_dtype);
  if (sx != sy)
    return sx > sy ? -1 : 1;
  return strcmp(x->name, y->name);
}

static cJSON *raw_uint(uint64_t v) {
  char buf[32];
  snprintf(buf, sizeof buf, "%" PRIu64, v);
  return cJSON_CreateRaw(buf); /* exact: cJSON's doubles would round */
}

/* The header JSON, padded with spaces to a multiple of 8 bytes.  Owned by
 * the caller (free). */
static char *build_header(struct mr_st_writer *w, size_t *len) {
  cJSON *root = cJSON_CreateObject();
  if (root == NULL)
    return NULL;
  int ok = 1;
  if (w->n_meta > 0) {
    cJSON *m = cJSON_AddObjectToObject(root, "__metadata__");
    ok = m != NULL;
    for (int i = 0; ok && i < w->n_meta; i++)
      ok = cJSON_AddStringToObject(m, w->meta[i].key, w->meta[i].value) != NULL;
  }
  for (int i = 0; ok && i < w->n; i++) {
    const struct entry *e = &w->entries[i];
    cJSON *t = cJSON_AddObjectToObject(root, e->name);
    cJSON *shape = cJSON_CreateArray(), *offs = cJSON_CreateArray();
    ok = t != NULL && shape != NULL && offs != NULL;
    if (!ok) {
      cJSON_Delete(shape);
      cJSON_Delete(offs);
      break;
    }
    cJSON_AddItemToObject(t, "dtype",
                          cJSON_CreateString(mr_dtype_safetensors_name(
                              e->file_dtype)));
    cJSON_AddItemToObject(t, "shape", shape);
    cJSON_AddItemToObject(t, "data_offsets", offs);
    for (int k = 0; k < e->rank; k++)
      cJSON_AddItemToArray(shape, raw_uint((uint64_t)e->shape[k]));
    cJSON_AddItemToArray(offs, raw_uint(e->begin));
    cJSON_AddItemToArray(offs, raw_uint(e->end));
  }
  char *text = ok ? cJSON_PrintUnformatted(root) : NULL;
  cJSON_Delete(root);
  if (text == NULL)
    return NULL;
  size_t n = strlen(text), padded = (n + 7) & ~(size_t)7;
  char *out = malloc(padded + 1);
  if (out != NULL) {
    memcpy(out, text, n);
    memset(out + n, ' ', padded - n);
    out[padded] = '\0';
    *len = padded;
  }
  cJSON_free(text);
  return out;
}

/* A durable file (MR_ST_WRITE_FSYNC) is written behind: the disk is started
 * on each piece as soon as it is written, and once more than DIRTY_BYTES
 * wait, the older half is waited for and dropped from the page cache.  So
 * the disk works while the rest is hashed and copied, instead of all of it
 * waiting for the final fsync, and a checkpoint does not push gigabytes of
 * other files (the token files) out of the cache.  Errors are returned
 * here: a failed write-back reported to sync_file_range would no longer be
 * reported to the fsync that follows. */
static int write_behind(struct mr_st_writer *w) {
  int fd = w->fd;
  if (w->written > w->started) {
    if (sync_file_range(fd, (off_t)w->started, (off_t)(w->written - w->started),
                        SYNC_FILE_RANGE_WRITE) != 0)
      goto fail;
    w->started = w->written;
  }
  if (w->started - w->settled > DIRTY_BYTES) {
    uint64_t to = w->started - DIRTY_BYTES / 2;
    if (sync_file_range(fd, (off_t)w->settled, (off_t)(to - w->settled),
                        SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                            SYNC_FILE_RANGE_WAIT_AFTER) != 0)
      goto fail;
    (void)posix_fadvise(fd, (off_t)w->settled, (off_t)(to - w->settled),
                        POSIX_FADV_DONTNEED); /* advice: may be ignored */
    w->settled = to;
  }
  return 0;
fail:
  if (errno == ENOSYS || errno == ESPIPE || errno == EINVAL) {
    w->behind = 0; /* not supported here: the final fsync does it all */
    return 0;
  }
  return mr_error_set(MR_EIO, "%s: write-back: %s", w->path, strerror(errno));
}

void mr_st_writer_meter(struct mr_st_writer *w, _Atomic uint64_t *count, double bytes_per_s) {
  w->count = count;
  w->limit_bps = bytes_per_s > 0 ? bytes_per_s : 0;
  if (w->limit_bps > 0 && (w->flags & MR_ST_WRITE_DIRECT)) /* parts through write(2) */
    w->flags = (w->flags & ~MR_ST_WRITE_DIRECT) | MR_ST_WRITE_FSYNC;
}

/* n more bytes of the file are on their way to the disk: counted, and under
 * a limit, not before their time. */
static void count_written(struct mr_st_writer *w, size_t n) {
  w->written += n;
  if (w->limit_bps > 0) {
    if (w->limit_start_ns == 0)
      w->limit_start_ns = mr_clock_ns();
    int64_t due = w->limit_start_ns + (int64_t)((double)w->written / w->limit_bps * 1e9);
    int64_t wait = due - mr_clock_ns();
    if (wait > 0) {
      struct timespec ts = {wait / 1000000000, wait % 1000000000};
      nanosleep(&ts, NULL);
    }
  }
  if (w->count != NULL)
    atomic_fetch_add(w->count, n);
}

static int write_all(struct mr_st_writer *w, const uint8_t *p, size_t n) {
  size_t most = WRITE_BYTES;
  if (w->limit_bps > 0 && w->limit_bps / 10 < most)
    most = w->limit_bps / 10 > 1 ? (size_t)(w->limit_bps / 10) : 1;
  while (n > 0) {
    size_t part = n < most ? n : most;
    if (w->flags & MR_ST_WRITE_CHECKSUM)
      mr_checksum_update(&w->sum, p, part);
    for (size_t done = 0; done < part;) {
      ssize_t k = write(w->fd, p + done, part - done);
      if (k < 0 && errno == EINTR)
        continue;
      if (k <= 0)
        return mr_error_set(MR_EIO, "%s: write: %s", w->path,
                            k < 0 ? strerror(errno) : "no progress");
      done += (size_t)k;
    }
    p += part;
    n -= part;
    count_written(w, part);
    if (w->behind)
      MR_TRY(write_behind(w));
  }
  return 0;
}

/* Writes what is staged.  Direct I/O writes only full buffers, except at
 * the file's end (last = 1). */
static int flush_stage(struct mr_st_writer *w, int last) {
  if (w->dio != NULL) {
    if (w->staged < w->stage_cap && !(last && w->staged > 0))
      return 0;
    size_t n = w->staged;
    w->staged = 0;
    count_written(w, n);
    return mr__st_direct_submit(w->dio, n, &w->stage);
  }
  int rc = write_all(w, w->stage, w->staged);
  w->staged = 0;
  return rc;
}

/* Appends n bytes: gathered when small, written in place when large (with
 * direct I/O everything is gathered: the caller's memory is not aligned). */
static int put_bytes(struct mr_st_writer *w, const uint8_t *p, size_t n) {
  if (n == 0)
    return 0; /* an empty tensor may have no data pointer */
  if (w->dio != NULL) {
    while (n > 0) {
      size_t k = w->stage_cap - w->staged < n ? w->stage_cap - w->staged : n;
      memcpy(w->stage + w->staged, p, k);
      w->staged += k;
      p += k;
      n -= k;
      MR_TRY(flush_stage(w, 0));
    }
    return 0;
  }
  if (n >= STAGE_BYTES) {
    MR_TRY(flush_stage(w, 0));
    return write_all(w, p, n);
  }
  if (w->staged + n > STAGE_BYTES)
    MR_TRY(flush_stage(w, 0));
  memcpy(w->stage + w->staged, p, n);
  w->staged += n;
  return 0;
}

/* Converts in stage-sized pieces straight into the staging buffer. */
static int put_converted(struct mr_st_writer *w, const struct entry *e) {
  size_t ss = mr_dtype_size(e->src_dtype), ds = mr_dtype_size(e->file_dtype);
  const uint8_t *src = e->data;
  uint64_t left = e->numel;
  while (left > 0) {
    size_t room = (w->stage_cap - w->staged) / ds;
    if (room == 0 && w->dio != NULL && w->staged < w->stage_cap) {
      uint8_t one[8]; /* an element across two direct-I/O buffers */
      mr__st_convert(e->file_dtype, one, e->src_dtype, src, 1);
      MR_TRY(put_bytes(w, one, ds));
      src += ss;
      left--;
      continue;
    }
    if (room == 0) {
      MR_TRY(flush_stage(w, 0));
      continue;
    }
    size_t k = left < room ? (size_t)left : room;
    mr__st_convert(e->file_dtype, w->stage + w->staged, e->src_dtype, src, k);
    w->staged += k * ds;
    src += k * ss;
    left -= k;
  }
  return 0;
}

/* The tensors in file order, each given its byte range. */
static void lay_out(struct mr_st_writer *w) {
  if (w->n > 0)
    qsort(w->entries, (size_t)w->n, sizeof *w->entries, cmp_layout);
  uint64_t at = 0;
  for (int i = 0; i < w->n; i++) {
    struct entry *e = &w->entries[i];
    e->begin = at;
    at += e->numel * mr_dtype_size(e->file_dtype);
    e->end = at;
  }
}

/* Creates tmp (O_DIRECT where asked and the filesystem takes it) with
 * its staging buffer and checksum; *direct says which it got.  Returns
 * 0, or an error with w->fd closed or never opened. */
static int open_partial(struct mr_st_writer *w, const char *tmp, int *direct) {
  const char *p = w->path;
  const int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
  *direct = (w->flags & MR_ST_WRITE_DIRECT) != 0;
  w->fd = open(tmp, flags | (*direct ? O_DIRECT : 0), 0644);
  if (*direct && (w->fd >= 0 ? !mr__st_direct_usable(w->fd) : errno == EINVAL)) {
    *direct = 0; /* not on this filesystem: through the page cache */
    if (w->fd >= 0)
      close(w->fd);
    w->fd = open(tmp, flags, 0644);
  }
  if (w->fd < 0)
    return mr_error_set(mr_from_errno(errno), "%s: cannot create: %s", p, strerror(errno));
  int rc = 0;
  if ((w->flags & MR_ST_WRITE_CHECKSUM) && (rc = mr_checksum_init(&w->sum)) < 0)
    return rc;
  if (*direct) {
    MR_TRY(mr__st_direct_open(w->fd, w->flags & MR_ST_WRITE_CHECKSUM ? &w->sum : NULL, p,
                              &w->dio, &w->stage));
    w->stage_cap = MR__ST_DIRECT_BYTES;
  } else if ((w->stage = w->stage_mem = malloc(STAGE_BYTES)) != NULL) {
    w->stage_cap = STAGE_BYTES;
  } else {
    return mr_error_set(MR_ENOMEM, "%s: out of memory", p);
  }
  w->behind = (w->flags & (MR_ST_WRITE_FSYNC | MR_ST_WRITE_DIRECT)) != 0 && !*direct;
  return 0;
}

/* The length, the header and every tensor's bytes, all on disk when it
 * returns 0 where the writer is durable. */
static int write_body(struct mr_st_writer *w, const char *header, size_t hlen, int direct) {
  const char *p = w->path;
  uint8_t len8[8];
  for (int i = 0; i < 8; i++)
    len8[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
  MR_TRY(put_bytes(w, len8, 8));
  MR_TRY(put_bytes(w, (const uint8_t *)header, hlen));
  for (int i = 0; i < w->n; i++) {
    const struct entry *e = &w->entries[i];
    MR_TRY(e->src_dtype == e->file_dtype ? put_bytes(w, e->data, (size_t)(e->end - e->begin))
                                         : put_converted(w, e));
  }
  MR_TRY(flush_stage(w, 1));
  if (direct) {
    MR_TRY(mr__st_direct_drain(w->dio));
    mr__st_direct_close(w->dio);
    w->dio = NULL;
    if (w->written % MR__ST_DIRECT_ALIGN != 0 && ftruncate(w->fd, (off_t)w->written) != 0)
      return mr_error_set(MR_EIO, "%s: truncate: %s", p, strerror(errno));
  }
  int durable = (w->flags & (MR_ST_WRITE_FSYNC | MR_ST_WRITE_DIRECT)) != 0;
  if (durable && fsync(w->fd) != 0)
    return mr_error_set(MR_EIO, "%s: fsync: %s", p, strerror(errno));
  if (w->behind) /* the tail, now clean, leaves the cache as the rest did */
    (void)posix_fadvise(w->fd, (off_t)w->settled, 0, POSIX_FADV_DONTNEED);
  return 0;
}

int mr_st_writer_finish(struct mr_st_writer *w) {
  const char *p = w->path;
  if (w->finished)
    return mr_error_set(MR_EINVAL, "%s: writer finished twice", p);
  w->finished = 1;
  lay_out(w);
  size_t hlen = 0;
  char *header = build_header(w, &hlen);
  if (header == NULL)
    return mr_error_set(MR_ENOMEM, "%s: out of memory for the header", p);
  if (hlen > MR_ST_MAX_HEADER) {
    free(header);
    return mr_error_set(MR_ETOOBIG, "%s: header of %zu bytes exceeds %llu", p,
                        hlen, (unsigned long long)MR_ST_MAX_HEADER);
  }
  /* written beside the path and renamed over it once whole: a file there
   * already (a previous run's weights) stays until then, and one that a
   * failed write never replaces */
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.partial-%d", p, (int)getpid());
  int direct;
  int rc = open_partial(w, tmp, &direct);
  if (rc == 0)
    rc = write_body(w, header, hlen, direct);
  free(header);
  if (rc < 0) {
    mr__st_direct_close(w->dio);
    w->dio = NULL;
    if (w->fd >= 0)
      close(w->fd);
    w->fd = -1;
    unlink(tmp);
    return rc;
  }
  int fd = w->fd;
  w->fd = -1;
  if (close(fd) != 0) {
    rc = mr_error_set(MR_EIO, "%s: close: %s", p, strerror(errno));
    unlink(tmp);
    return rc;
  }
  if (rename(tmp, p) != 0) {
    rc = mr_error_set(mr_from_errno(errno), "%s: rename from %s: %s", p, tmp, strerror(errno));
    unlink(tmp);
    return rc;
  }
  if (w->flags & MR_ST_WRITE_CHECKSUM)
    mr_checksum_final(&w->sum, w->sum_hex);
  return 0;
}

int mr_st_writer_checksum(const struct mr_st_writer *w, char hex[33]) {
  if (!(w->flags & MR_ST_WRITE_CHECKSUM) || w->sum_hex[0] == '\0')
    return mr_error_set(MR_EINVAL, "%s: no checksum: the writer was not made with "
                        "MR_ST_WRITE_CHECKSUM or did not finish", w->path);
  memcpy(hex, w->sum_hex, MR_CHECKSUM_HEX);
  return 0;
}

/* ---- the index ---- */

struct mr_st_index {
  struct kv *map; /* (n) {tensor, file}, sorted by tensor */
  int n, cap;
  uint64_t total_size;
};

int mr_st_index_new(struct mr_st_index **out) {
  *out = calloc(1, sizeof **out);
  return *out != NULL ? 0 : mr_error_set(MR_ENOMEM, "index: out of memory");
}

void mr_st_index_free(struct mr_st_index *ix) {
  if (ix == NULL)
    return;
  for (int i = 0; i < ix->n; i++) {
    free(ix->map[i].key);
    free(ix->map[i].value);
  }
  free(ix->map);
  free(ix);
}

/* Position of name, or -(insertion point) - 1. */
static int index_search(const struct mr_st_index *ix, const char *name) {
  int lo = 0, hi = ix->n;
  while (lo < hi) {
    int mid = lo + (hi - lo) / 2, c = strcmp(ix->map[mid].key, name);
    if (c == 0)
      return mid;
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return -lo - 1;
}

int mr_st_index_add(struct mr_st_index *ix, const char *name,
                    const char *file) {
  int at = index_search(ix, name);
  if (at >= 0)
    return mr_error_set(MR_EINVAL,
                        "index: tensor \"%s\" mapped to both \"%s\" and "
                        "\"%s\"",
                        name, ix->map[at].value, file);
  at = -at - 1;
  if (grow((void **)&ix->map, &ix->cap, ix->n + 1, sizeof *ix->map) != 0)
    return mr_error_set(MR_ENOMEM, "index: out of memory");
  char *k = strdup(name), *v = strdup(file);
  if (k == NULL || v == NULL) {
    free(k);
    free(v);
    return mr_error_set(MR_ENOMEM, "index: out of memory");
  }
  memmove(&ix->map[at + 1], &ix->map[at],
          sizeof *ix->map * (size_t)(ix->n - at));
  ix->map[at] = (struct kv){k, v};
  ix->n++;
  return 0;
}

void mr_st_index_set_total_size(struct mr_st_index *ix, uint64_t bytes) {
  ix->total_size = bytes;
}

const char *mr_st_index_file(const struct mr_st_index *ix, const char *name) {
  int at = index_search(ix, name);
  return at >= 0 ? ix->map[at].value : NULL;
}

int mr_st_index_count(const struct mr_st_index *ix) { return ix->n; }

void mr_st_index_at(const struct mr_st_index *ix, int i, const char **name,
                    const char **file) {
  *name = ix->map[i].key;
  *file = ix->map[i].value;
}

uint64_t mr_st_index_total_size(const struct mr_st_index *ix) {
  return ix->total_size;
}

int mr_st_index_write(const struct mr_st_index *ix, const char *path) {
  cJSON *root = cJSON_CreateObject();
  cJSON *meta = root ? cJSON_AddObjectToObject(root, "metadata") : NULL;
  cJSON *wm = meta ? cJSON_AddObjectToObject(root, "weight_map") : NULL;
  int ok = wm != NULL;
  if (ok)
    cJSON_AddItemToObject(meta, "total_size", raw_uint(ix->total_size));
  for (int i = 0; ok && i < ix->n; i++)
    ok = cJSON_AddStringToObject(wm, ix->map[i].key, ix->map[i].value) != NULL;
  char *text = ok ? cJSON_Print(root) : NULL;
  cJSON_Delete(root);
  if (text == NULL)
    return mr_error_set(MR_ENOMEM, "%s: out of memory", path);
  size_t plen = strlen(path);
  char *tmp = malloc(plen + 5);
  int rc = 0;
  if (tmp == NULL) {
    cJSON_free(text);
    return mr_error_set(MR_ENOMEM, "%s: out of memory", path);
  }
  memcpy(tmp, path, plen);
  memcpy(tmp + plen, ".tmp", 5);
  FILE *fp = fopen(tmp, "wb");
  if (fp == NULL) {
    rc = mr_error_set(mr_from_errno(errno), "%s: cannot create: %s", tmp,
                      strerror(errno));
  } else {
    size_t n = strlen(text);
    int bad = fwrite(text, 1, n, fp) != n || fputc('\n', fp) == EOF;
    bad |= fclose(fp) != 0;
    if (bad)
      rc = mr_error_set(MR_EIO, "%s: write failed", tmp);
    else if (rename(tmp, path) != 0)
      rc = mr_error_set(MR_EIO, "%s: rename to %s: %s", tmp, path,
                        strerror(errno));
    if (rc < 0)
      unlink(tmp);
  }
  free(tmp);
  cJSON_free(text);
  return rc;
}

int mr_st_index_read(const char *path, struct mr_st_index **out) {
  *out = NULL;
  FILE *fp = fopen(path, "rb");
  if (fp == NULL)
    return mr_error_set(mr_from_errno(errno), "%s: cannot open: %s", path,
                        strerror(errno));
  struct stat st;
  if (fstat(fileno(fp), &st) != 0 || st.st_size > (off_t)MR_ST_MAX_HEADER) {
    fclose(fp);
    return mr_error_set(MR_EFORMAT, "%s: expected an index of at most %llu "
                        "bytes", path, (unsigned long long)MR_ST_MAX_HEADER);
  }
  size_t size = (size_t)st.st_size;
  char *text = malloc(size + 1);
  if (text == NULL || fread(text, 1, size, fp) != size) {
    fclose(fp);
    free(text);
    return mr_error_set(MR_EIO, "%s: read failed", path);
  }
  fclose(fp);
  text[size] = '\0';
  int rc = mr_st_index_parse(text, size, path, out);
  free(text);
  return rc;
}

int mr_st_index_parse(const char *text, size_t size, const char *path,
                      struct mr_st_index **out) {
  *out = NULL;
  cJSON *root = cJSON_ParseWithLength(text, size);
  int rc = 0;
  struct mr_st_index *ix = NULL;
  const cJSON *meta = cJSON_GetObjectItemCaseSensitive(root, "metadata");
  const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
  if (!cJSON_IsObject(root)) {
    rc = mr_error_set(MR_EFORMAT, "%s: expected a JSON object", path);
    goto out;
  }
  if (!cJSON_IsObject(wm)) {
    rc = mr_error_set(MR_EFORMAT,
                      "%s: \"weight_map\": expected an object {tensor: file}",
                      path);
    goto out;
  }
  MR_TRY_GOTO(rc, mr_st_index_new(&ix), out);
  if (meta != NULL) {
    const cJSON *ts = cJSON_GetObjectItemCaseSensitive(meta, "total_size");
    double d = cJSON_IsNumber(ts) ? ts->valuedouble : -1.0;
    if (ts != NULL && (!(d >= 0) || d != floor(d) || d > 9007199254740992.0)) {
      rc = mr_error_set(MR_EFORMAT,
                        "%s: \"metadata.total_size\": expected a "
                        "non-negative integer",
                        path);
      goto out;
    }
    if (ts != NULL)
      ix->total_size = (uint64_t)d;
  }
  const cJSON *e;
  cJSON_ArrayForEach(e, wm) {
    if (!cJSON_IsString(e)) {
      rc = mr_error_set(MR_EFORMAT,
                        "%s: \"weight_map.%s\": expected a file name string",
                        path, e->string);
      goto out;
    }
    if (mr_st_index_file(ix, e->string) != NULL) {
      rc = mr_error_set(MR_EFORMAT, "%s: \"weight_map\": \"%s\" appears twice",
                        path, e->string);
      goto out;
    }
    MR_TRY_GOTO(rc, mr_st_index_add(ix, e->string, e->valuestring), out);
  }
out:
  cJSON_Delete(root);
  if (rc < 0) {
    mr_st_index_free(ix);
    return rc;
  }
  *out = ix;
  return 0;
}
