/* ckpt_read.c - gathering slices of checkpoint tensors from their pieces. */
#include "common/ckpt_read.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/ckpt.h"
#include "common/error.h"
#include "common/jsonv.h"
#include "common/safetensors.h"

#define MAX_DIM (INT64_C(1) << 40)    // one dimension of a box
#define MAX_ELEMS (INT64_C(1) << 53)  // elements of a box, exact in a JSON double

struct piece {
  char *name;
  int file;
  const struct mr_st_tensor *t;
  int ndim;
  int64_t off[MR_CKPT_MAX_DIMS], len[MR_CKPT_MAX_DIMS];
  int64_t begin, count;
};

struct mr_ckpt_reader {
  struct mr_st_file **files;
  int n_files;
  struct piece *pieces;
  int n_pieces, cap_pieces;
};

void mr_ckpt_reader_free(struct mr_ckpt_reader *r) {
  if (r == NULL)
    return;
  for (int i = 0; i < r->n_files; i++)
    mr_st_free(r->files[i]);
  for (int i = 0; i < r->n_pieces; i++)
    free(r->pieces[i].name);
  free(r->files);
  free(r->pieces);
  free(r);
}

static int add_pieces(struct mr_ckpt_reader *r, int fi) {
  struct mr_st_file *f = r->files[fi];
  const char *meta = mr_st_metadata(f, "pieces");
  if (meta == NULL)
    return mr_error_set(MR_EFORMAT, "%s: __metadata__: no \"pieces\" entry", mr_st_path(f));
  cJSON *o = cJSON_Parse(meta);
  if (!cJSON_IsObject(o)) {
    cJSON_Delete(o);
    return mr_error_set(MR_EFORMAT, "%s: __metadata__.pieces: expected a JSON object",
                        mr_st_path(f));
  }
  int rc = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, o) {
    int n = cJSON_GetArraySize(e), nd = (n - 2) / 2;
    const struct mr_st_tensor *t = mr_st_find(f, e->string);
    if (!cJSON_IsArray(e) || n < 4 || (n - 2) % 2 != 0 || nd > MR_CKPT_MAX_DIMS || t == NULL ||
        t->rank != 1) {
      rc = mr_error_set(MR_EFORMAT, "%s: pieces.%s: expected [offsets, lengths, begin, count] "
                        "of a tensor of 1 to %d dims stored 1-D in the file", mr_st_path(f),
                        e->string, MR_CKPT_MAX_DIMS);
      break;
    }
    if (r->n_pieces == r->cap_pieces) {
      int cap = r->cap_pieces ? 2 * r->cap_pieces : 64;
      struct piece *p = realloc(r->pieces, (size_t)cap * sizeof *p);
      if (p == NULL) {
        rc = MR_ENOMEM;
        break;
      }
      r->pieces = p;
      r->cap_pieces = cap;
    }
    struct piece *p = &r->pieces[r->n_pieces];
    memset(p, 0, sizeof *p);
    p->ndim = nd;
    for (int d = 0; d < nd; d++) {
      const cJSON *a = cJSON_GetArrayItem(e, d), *b = cJSON_GetArrayItem(e, nd + d);
      if (!mr_json_count(a, MAX_DIM, &p->off[d]) || !mr_json_count(b, MAX_DIM, &p->len[d])) {
        rc = mr_error_set(MR_EFORMAT, "%s: pieces.%s: offsets and lengths must be whole "
                          "numbers in [0, 2^40]", mr_st_path(f), e->string);
        break;
      }
    }
    if (rc < 0)
      break;
    const cJSON *b = cJSON_GetArrayItem(e, 2 * nd), *c = cJSON_GetArrayItem(e, 2 * nd + 1);
    int64_t box = p->len[0];
    int over = 0;
    for (int d = 1; d < nd; d++)
      over |= __builtin_mul_overflow(box, p->len[d], &box);
    if (over || !mr_json_count(b, MAX_ELEMS, &p->begin) || !mr_json_count(c, MAX_ELEMS, &p->count) ||
        p->begin + p->count > box || p->count != t->shape[0]) {
      rc = mr_error_set(MR_EFORMAT, "%s: pieces.%s: the range [begin, begin + count) must lie "
                        "in the box and count must be the stored length", mr_st_path(f),
                        e->string);
      break;
    }
    p->file = fi;
    p->t = t;
    if ((p->name = strdup(e->string)) == NULL) {
      rc = MR_ENOMEM;
      break;
    }
    r->n_pieces++;
  }
  cJSON_Delete(o);
  return rc;
}

int mr_ckpt_reader_new(struct mr_ckpt_reader **out) {
  *out = calloc(1, sizeof **out);
  return *out != NULL ? 0 : MR_ENOMEM;
}

int mr_ckpt_reader_add_memory(struct mr_ckpt_reader *r, const void *data, size_t size,
                              const char *name) {
  struct mr_st_file **f = realloc(r->files, (size_t)(r->n_files + 1) * sizeof *f);
  if (f == NULL)
    return MR_ENOMEM;
  r->files = f;
  MR_TRY(mr_st_open_memory(data, size, name, &r->files[r->n_files]));
  r->n_files++;
  return add_pieces(r, r->n_files - 1);
}

int mr_ckpt_reader_open(const char *dir, struct mr_ckpt_reader **out) {
  *out = NULL;
  struct mr_ckpt_manifest m;
  MR_TRY(mr_ckpt_manifest_load(dir, &m));
  struct mr_ckpt_reader *r = calloc(1, sizeof *r);
  int rc = r != NULL ? 0 : MR_ENOMEM;
  size_t sfx = strlen(".safetensors");
  for (int i = 0; i < m.n && rc == 0; i++) {
    size_t len = strlen(m.names[i]);
    if (len <= sfx || strcmp(m.names[i] + len - sfx, ".safetensors") != 0)
      continue; /* the index, read by the caller */
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, m.names[i]);
    struct mr_st_file **f = realloc(r->files, (size_t)(r->n_files + 1) * sizeof *f);
    if (f == NULL) {
      rc = MR_ENOMEM;
      break;
    }
    r->files = f;
    if ((rc = mr_st_open(path, &r->files[r->n_files])) < 0)
      break;
    r->n_files++;
    rc = add_pieces(r, r->n_files - 1);
  }
  mr_ckpt_manifest_free(&m);
  if (rc == 0 && r->n_files == 0)
    rc = mr_error_set(MR_ENOENT, "%s/%s: lists no .safetensors file", dir, MR_CKPT_MARKER);
  if (rc < 0) {
    mr_ckpt_reader_free(r);
    return rc;
  }
  *out = r;
  return 0;
}

/* Orders pieces by box, then by range: pieces of one box side by side. */
static int box_cmp(const struct piece *a, const struct piece *b) {
  for (int d = 0; d < a->ndim; d++) {
    if (a->off[d] != b->off[d])
      return a->off[d] < b->off[d] ? -1 : 1;
    if (a->len[d] != b->len[d])
      return a->len[d] < b->len[d] ? -1 : 1;
  }
  return 0;
}

static int piece_cmp(const void *x, const void *y) {
  const struct piece *a = *(const struct piece *const *)x, *b = *(const struct piece *const *)y;
  int c = box_cmp(a, b);
  return c != 0 ? c : (a->begin > b->begin) - (a->begin < b->begin);
}

static int boxes_meet(const struct piece *a, const struct piece *b) {
  for (int d = 0; d < a->ndim; d++)
    if (a->off[d] + a->len[d] <= b->off[d] || b->off[d] + b->len[d] <= a->off[d])
      return 0;
  return 1;
}

int mr_ckpt_reader_covers(struct mr_ckpt_reader *r, const char *name, int ndim,
                          const int64_t *shape) {
  /* the pieces of name, then the first piece of each box */
  const struct piece **ps = malloc(2 * (size_t)(r->n_pieces + 1) * sizeof *ps);
  if (ps == NULL)
    return MR_ENOMEM;
  int k = 0, rc = 0;
  int64_t numel = 1, sum = 0;
  for (int d = 0; d < ndim; d++)
    numel *= shape[d];
  for (int i = 0; i < r->n_pieces && rc == 0; i++) {
    const struct piece *p = &r->pieces[i];
    if (strcmp(p->name, name) != 0)
      continue;
    int ok = p->ndim == ndim;
    for (int d = 0; ok && d < ndim; d++)
      ok = p->off[d] + p->len[d] <= shape[d];
    if (!ok)
      rc = mr_error_set(MR_EFORMAT, "%s: pieces.%s: a piece of another shape or outside the "
                        "tensor", mr_st_path(r->files[p->file]), name);
    ps[k++] = p;
    sum += p->count;
  }
  if (rc == 0 && sum != numel)
    rc = mr_error_set(MR_EFORMAT, "%s: the pieces hold %lld of its %lld elements (%s)", name,
                      (long long)sum, (long long)numel,
                      sum < numel ? "a rank file missing" : "a rank file twice, or stale");
  /* the same elements counted twice would hide a gap of as many: within a
   * box the ranges are apart, and distinct boxes do not meet */
  qsort(ps, (size_t)k, sizeof *ps, piece_cmp);
  const struct piece **firsts = ps + k;
  int n_boxes = 0;
  for (int i = 0; i < k && rc == 0; i++) {
    const struct piece *a = NULL, *b = ps[i];
    if (i > 0 && box_cmp(ps[i - 1], b) == 0) {
      if (ps[i - 1]->begin + ps[i - 1]->count > b->begin)
        a = ps[i - 1];
    } else {
      for (int j = 0; j < n_boxes && a == NULL; j++)
        if (boxes_meet(firsts[j], b))
          a = firsts[j];
      firsts[n_boxes++] = b;
    }
    if (a != NULL)
      rc = mr_error_set(MR_EFORMAT, "%s: pieces in %s and %s overlap", name,
                        mr_st_path(r->files[a->file]), mr_st_path(r->files[b->file]));
  }
  free(ps);
  return rc;
}

/* Copies the part of piece p overlapping the global row gr (the indices
 * of every dim but the last), columns [c0, c1), that also lies in its
 * stored range, to dst (column c0 at dst[0]); returns the elements copied
 * or an error. */
static int64_t from_piece(struct mr_ckpt_reader *r, const struct piece *p, const int64_t *gr,
                          int64_t c0, int64_t c1, float *dst) {
  int last = p->ndim - 1;
  int64_t prow = 0, coff = p->off[last], clen = p->len[last];
  for (int d = 0; d < last; d++) { /* the row's index within the piece's box */
    if (gr[d] < p->off[d] || gr[d] >= p->off[d] + p->len[d])
      return 0;
    prow = prow * p->len[d] + (gr[d] - p->off[d]);
  }
  int64_t x0 = c0 > coff ? c0 : coff, x1 = c1 < coff + clen ? c1 : coff + clen;
  if (x0 >= x1)
    return 0;
  int64_t f0 = prow * clen + (x0 - coff), f1 = prow * clen + (x1 - coff);
  if (f0 < p->begin)
    f0 = p->begin;
  if (f1 > p->begin + p->count)
    f1 = p->begin + p->count;
  if (f0 >= f1)
    return 0;
  int64_t start = f0 - p->begin, n = f1 - f0;
  int64_t col = f0 - prow * clen + coff; /* the first column copied */
  MR_TRY(mr_st_read_slice(r->files[p->file], p->t, &start, &n, MR_F32, dst + (col - c0)));
  return n;
}

int mr_ckpt_reader_read(struct mr_ckpt_reader *r, const char *name, int ndim,
                        const int64_t *shape, const int64_t *off, const int64_t *len,
                        int64_t begin, int64_t count, float *dst) {
  if (ndim < 1 || ndim > MR_CKPT_MAX_DIMS)
    return mr_error_set(MR_EFORMAT, "checkpoint: %s: tensors of 1 to %d dims are stored", name,
                        MR_CKPT_MAX_DIMS);
  for (int i = 0; i < r->n_pieces; i++) {
    const struct piece *p = &r->pieces[i];
    if (strcmp(p->name, name) != 0)
      continue;
    int ok = p->ndim == ndim;
    for (int d = 0; ok && d < ndim; d++)
      ok = p->off[d] + p->len[d] <= shape[d];
    if (!ok)
      return mr_error_set(MR_EFORMAT, "%s: pieces.%s: a piece of another rank or outside the "
                          "tensor's shape", mr_st_path(r->files[p->file]), name);
  }
  int64_t cols = len[ndim - 1], covered = 0;
  for (int64_t i = begin; i < begin + count;) {
    int64_t row = i / cols, c = i % cols;
    int64_t n = cols - c < begin + count - i ? cols - c : begin + count - i;
    int64_t gr[MR_CKPT_MAX_DIMS], gc = off[ndim - 1] + c;
    for (int d = ndim - 2; d >= 0; d--) { /* the row's indices in the tensor */
      gr[d] = off[d] + row % len[d];
      row /= len[d];
    }
    for (int k = 0; k < r->n_pieces; k++) {
      if (strcmp(r->pieces[k].name, name) != 0)
        continue;
      int64_t got = from_piece(r, &r->pieces[k], gr, gc, gc + n, dst + (i - begin));
      if (got < 0)
        return (int)got;
      covered += got;
    }
    i += n;
  }
  if (covered != count)
    return mr_error_set(MR_EFORMAT, "checkpoint: %s: the pieces cover %lld of the %lld elements "
                        "needed (missing or overlapping rank files)", name, (long long)covered,
                        (long long)count);
  return 0;
}

char *mr_ckpt_piece_json(int ndim, const int64_t *off, const int64_t *len, int64_t begin,
                         int64_t count) {
  char buf[256];
  int k = snprintf(buf, sizeof buf, "[");
  for (int d = 0; d < ndim; d++)
    k += snprintf(buf + k, sizeof buf - (size_t)k, "%lld,", (long long)off[d]);
  for (int d = 0; d < ndim; d++)
    k += snprintf(buf + k, sizeof buf - (size_t)k, "%lld,", (long long)len[d]);
  snprintf(buf + k, sizeof buf - (size_t)k, "%lld,%lld]", (long long)begin, (long long)count);
  return strdup(buf);
}
