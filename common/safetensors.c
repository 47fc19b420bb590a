/* safetensors.c - the safetensors reader: header validation, lookup and
 * slice reads over a read-only mapping.  The writer and the index are in
 * safetensors_write.c. */
#include "common/safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/safetensors_internal.h"

#define CONVERT_CHUNK 1024 /* elements staged per conversion step */

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.c assumes a little-endian host"
#endif

struct meta_entry {
  char *key, *value;
};

struct mr_st_file {
  char *path;                   /* owned */
  const uint8_t *base;          /* whole file */
  size_t size;                  /* bytes */
  int mapped;                   /* base is our mmap */
  const uint8_t *data;          /* data buffer, inside base */
  uint64_t data_bytes;
  int n_tensors;
  struct mr_st_tensor *tensors; /* (n_tensors), sorted by name */
  int n_meta;
  struct meta_entry *meta;      /* (n_meta), sorted by key */
};

/* A JSON number that is an integer in [0, 2^53]: the only values shapes and
 * offsets may take (larger ones are not exact in cJSON's doubles). */
static int json_uint(const cJSON *v, uint64_t *out) {
  if (!cJSON_IsNumber(v))
    return -1;
  double d = v->valuedouble;
  if (!(d >= 0.0) || d > 9007199254740992.0 || d != floor(d))
    return -1;
  *out = (uint64_t)d;
  return 0;
}

static int cmp_tensor_name(const void *a, const void *b) {
  return strcmp(((const struct mr_st_tensor *)a)->name,
                ((const struct mr_st_tensor *)b)->name);
}

static int cmp_meta_key(const void *a, const void *b) {
  return strcmp(((const struct meta_entry *)a)->key,
                ((const struct meta_entry *)b)->key);
}

struct span {
  uint64_t begin, end;
  int index;
};

static int cmp_span(const void *a, const void *b) {
  const struct span *x = a, *y = b;
  if (x->begin != y->begin)
    return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end)
    return x->end < y->end ? -1 : 1;
  return 0;
}

static int parse_dtype(const char *s, enum mr_dtype *out) {
  for (int i = 0; i < MR_DTYPE_COUNT; i++)
    if (strcmp(s, mr_dtype_safetensors_name((enum mr_dtype)i)) == 0) {
      *out = (enum mr_dtype)i;
      return 0;
    }
  return -1;
}

static int parse_metadata(struct mr_st_file *f, const cJSON *obj) {
  const char *p = f->path;
  if (f->meta != NULL)
    return mr_error_set(MR_EFORMAT, "%s: \"__metadata__\" appears twice", p);
  if (!cJSON_IsObject(obj))
    return mr_error_set(MR_EFORMAT,
                        "%s: \"__metadata__\": expected an object of strings",
                        p);
  int n = cJSON_GetArraySize(obj);
  f->meta = calloc((size_t)n + 1, sizeof *f->meta);
  if (f->meta == NULL)
    return mr_error_set(MR_ENOMEM, "%s: out of memory", p);
  const cJSON *kv;
  cJSON_ArrayForEach(kv, obj) {
    if (!cJSON_IsString(kv))
      return mr_error_set(MR_EFORMAT,
                          "%s: \"__metadata__\": key \"%s\": expected a "
                          "string value",
                          p, kv->string);
    struct meta_entry *e = &f->meta[f->n_meta];
    e->key = strdup(kv->string);
    e->value = strdup(kv->valuestring);
    if (e->key == NULL || e->value == NULL) {
      free(e->key);
      free(e->value);
      return mr_error_set(MR_ENOMEM, "%s: out of memory", p);
    }
    f->n_meta++;
  }
  qsort(f->meta, (size_t)f->n_meta, sizeof *f->meta, cmp_meta_key);
  for (int i = 1; i < f->n_meta; i++)
    if (strcmp(f->meta[i - 1].key, f->meta[i].key) == 0)
      return mr_error_set(MR_EFORMAT,
                          "%s: \"__metadata__\": duplicate key \"%s\"", p,
                          f->meta[i].key);
  return 0;
}

/* Fills t from one header entry; t->name is already set. */
static int parse_tensor(struct mr_st_file *f, const cJSON *obj,
                        struct mr_st_tensor *t) {
  const char *p = f->path, *name = t->name;
  if (!cJSON_IsObject(obj))
    return mr_error_set(MR_EFORMAT,
                        "%s: tensor \"%s\": expected an object with dtype, "
                        "shape, data_offsets",
                        p, name);
  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(obj, "dtype");
  const cJSON *sh = cJSON_GetObjectItemCaseSensitive(obj, "shape");
  const cJSON *of = cJSON_GetObjectItemCaseSensitive(obj, "data_offsets");
  if (!cJSON_IsString(dt))
    return mr_error_set(MR_EFORMAT,
                        "%s: tensor \"%s\": \"dtype\": expected a string", p,
                        name);
  if (parse_dtype(dt->valuestring, &t->dtype) != 0)
    return mr_error_set(MR_EFORMAT,
                        "%s: tensor \"%s\": unsupported dtype \"%s\", expected "
                        "one of F32, BF16, F16, F64, I64, I32, U16, U8",
                        p, name, dt->valuestring);
  if (!cJSON_IsArray(sh))
    return mr_error_set(MR_EFORMAT,
                        "%s: tensor \"%s\": \"shape\": expected an array of "
                        "integers",
                        p, name);
  int rank = cJSON_GetArraySize(sh);
  if (rank > MR_ST_MAX_RANK)
    return mr_error_set(MR_EFORMAT,
                        "%s: tensor \"%s\": rank %d, expected at most %d", p,
                        name, rank, MR_ST_MAX_RANK);
  t->rank = rank;
  uint64_t numel = 1;
  const cJSON *d;
  int k = 0;
  cJSON_ArrayForEach(d, sh) {
    uint64_t v;
    if (json_uint(d, &v) != 0)
      return mr_error_set(MR_EFORMAT,
                          "%s: tensor \"%s\": shape[%d]: expected a "
                          "non-negative integer",
                          p, name, k);
    t->shape[k++] = (int64_t)v;
    if (v != 0 && numel > (UINT64_C(1) << 53) / v)
      return mr_error_set(MR_EFORMAT,
                          "%s: tensor \"%s\": shape has more than 2^53 "
                          "elements",
                          p, name);
    numel *= v;
  }
  t->numel = (int64_t)numel;
  uint64_t range[2];
  if (!cJSON_IsArray(of) || cJSON_GetArraySize(of) != 2 ||
      json_uint(cJSON_GetArrayItem(of, 0), &range[0]) != 0 ||
      json_uint(cJSON_GetArrayItem(of, 1), &range[1]) != 0)
    return mr_error_set(MR_EFORMAT,
                        "%s: tensor \"%s\": \"data_offsets\": expected "
                        "[begin, end], two non-negative integers",
                        p, name);
  t->begin = range[0];
  t->end = range[1];
  if (t->begin > t->end)
    return mr_error_set(MR_EFORMAT,
                        "%s: tensor \"%s\": data_offsets [%" PRIu64
                        ", %" PRIu64 "]: expected begin <= end",
                        p, name, t->begin, t->end);
  if (t->end > f->data_bytes)
    return mr_error_set(MR_EFORMAT,
                        "%s: tensor \"%s\": data_offsets [%" PRIu64
                        ", %" PRIu64 "] out of range: the data buffer has "
                        "%" PRIu64 " bytes",
                        p, name, t->begin, t->end, f->data_bytes);
  uint64_t want = numel * mr_dtype_size(t->dtype);
  if (t->end - t->begin != want)
    return mr_error_set(MR_EFORMAT,
                        "%s: tensor \"%s\": %s with %" PRIu64
                        " elements needs %" PRIu64 " bytes, data_offsets "
                        "[%" PRIu64 ", %" PRIu64 "] give %" PRIu64,
                        p, name, dt->valuestring, numel, want, t->begin,
                        t->end, t->end - t->begin);
  return 0;
}

/* The tensors must tile [0, data_bytes) exactly. */
static int check_tiling(struct mr_st_file *f) {
  int n = f->n_tensors;
  struct span *order = malloc(sizeof *order * ((size_t)n + 1));
  if (order == NULL)
    return mr_error_set(MR_ENOMEM, "%s: out of memory", f->path);
  for (int i = 0; i < n; i++)
    order[i] = (struct span){f->tensors[i].begin, f->tensors[i].end, i};
  qsort(order, (size_t)n, sizeof *order, cmp_span);
  uint64_t at = 0;
  int rc = 0;
  const struct mr_st_tensor *prev = NULL;
  for (int i = 0; i < n && rc == 0; i++) {
    const struct mr_st_tensor *t = &f->tensors[order[i].index];
    if (t->begin < at)
      rc = mr_error_set(MR_EFORMAT,
                        "%s: tensor \"%s\": data_offsets [%" PRIu64
                        ", %" PRIu64 "] overlap tensor \"%s\" [%" PRIu64
                        ", %" PRIu64 "]",
                        f->path, t->name, t->begin, t->end, prev->name,
                        prev->begin, prev->end);
    else if (t->begin > at)
      rc = mr_error_set(MR_EFORMAT,
                        "%s: tensor \"%s\": data_offsets [%" PRIu64
                        ", %" PRIu64 "] leave a hole: bytes [%" PRIu64
                        ", %" PRIu64 ") belong to no tensor",
                        f->path, t->name, t->begin, t->end, at, t->begin);
    at = t->end;
    prev = t;
  }
  free(order);
  if (rc == 0 && at != f->data_bytes)
    rc = mr_error_set(MR_EFORMAT,
                      "%s: the data buffer has %" PRIu64
                      " bytes but the tensors cover %" PRIu64
                      ": expected them to end where the file ends",
                      f->path, f->data_bytes, at);
  return rc;
}

static int is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static int parse_header(struct mr_st_file *f) {
  const char *p = f->path;
  if (f->size < 8)
    return mr_error_set(MR_EFORMAT,
                        "%s: %zu bytes, expected at least 8 (the header "
                        "length)",
                        p, f->size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--)
    n = n << 8 | f->base[i];
  if (n > MR_ST_MAX_HEADER)
    return mr_error_set(MR_EFORMAT,
                        "%s: header length %" PRIu64
                        " bytes, expected at most %llu",
                        p, n, (unsigned long long)MR_ST_MAX_HEADER);
  if (n > f->size - 8)
    return mr_error_set(MR_EFORMAT,
                        "%s: header length %" PRIu64
                        " runs beyond the file (%zu bytes)",
                        p, n, f->size);
  if (n < 2 || f->base[8] != '{')
    return mr_error_set(MR_EFORMAT,
                        "%s: header: expected a JSON object starting with '{'",
                        p);
  f->data = f->base + 8 + n;
  f->data_bytes = (uint64_t)f->size - 8 - n;
  /* A NUL-terminated copy, so the JSON parser cannot run off the end. */
  char *text = malloc((size_t)n + 1);
  if (text == NULL)
    return mr_error_set(MR_ENOMEM, "%s: out of memory for the header", p);
  memcpy(text, f->base + 8, (size_t)n);
  text[n] = '\0';
  const char *end = NULL;
  cJSON *root = cJSON_ParseWithLengthOpts(text, (size_t)n, &end, 0);
  int rc = 0;
  if (root == NULL) {
    rc = mr_error_set(MR_EFORMAT,
                      "%s: header: malformed JSON near byte %td of %" PRIu64,
                      p, end != NULL ? end - text : (ptrdiff_t)0, n);
    goto out;
  }
  for (const char *q = end; q < text + n; q++)
    if (!is_space(*q)) {
      rc = mr_error_set(MR_EFORMAT,
                        "%s: header: unexpected bytes after the JSON object "
                        "at byte %td (only space padding may follow)",
                        p, q - text);
      goto out;
    }
  if (!cJSON_IsObject(root)) {
    rc = mr_error_set(MR_EFORMAT, "%s: header: expected a JSON object", p);
    goto out;
  }
  int count = cJSON_GetArraySize(root);
  f->tensors = calloc((size_t)count + 1, sizeof *f->tensors);
  if (f->tensors == NULL) {
    rc = mr_error_set(MR_ENOMEM, "%s: out of memory", p);
    goto out;
  }
  const cJSON *item;
  cJSON_ArrayForEach(item, root) {
    const char *name = item->string;
    if (strcmp(name, "__metadata__") == 0) {
      MR_TRY_GOTO(rc, parse_metadata(f, item), out);
      continue;
    }
    size_t len = strlen(name);
    if (len == 0 || len > MR_ST_MAX_NAME) {
      rc = mr_error_set(MR_EFORMAT,
                        "%s: tensor name of %zu bytes, expected 1 to %d", p,
                        len, MR_ST_MAX_NAME);
      goto out;
    }
    struct mr_st_tensor *t = &f->tensors[f->n_tensors];
    t->name = strdup(name);
    if (t->name == NULL) {
      rc = mr_error_set(MR_ENOMEM, "%s: out of memory", p);
      goto out;
    }
    f->n_tensors++;
    MR_TRY_GOTO(rc, parse_tensor(f, item, t), out);
  }
  qsort(f->tensors, (size_t)f->n_tensors, sizeof *f->tensors,
        cmp_tensor_name);
  for (int i = 1; i < f->n_tensors; i++)
    if (strcmp(f->tensors[i - 1].name, f->tensors[i].name) == 0) {
      rc = mr_error_set(MR_EFORMAT, "%s: tensor \"%s\" is defined twice", p,
                        f->tensors[i].name);
      goto out;
    }
  rc = check_tiling(f);
out:
  cJSON_Delete(root);
  free(text);
  return rc;
}

int mr_st_open_memory(const void *data, size_t size, const char *name,
                      struct mr_st_file **out) {
  *out = NULL;
  struct mr_st_file *f = calloc(1, sizeof *f);
  if (f == NULL || (f->path = strdup(name)) == NULL) {
    free(f);
    return mr_error_set(MR_ENOMEM, "%s: out of memory", name);
  }
  f->base = data;
  f->size = size;
  int rc = parse_header(f);
  if (rc < 0) {
    mr_st_free(f);
    return rc;
  }
  *out = f;
  return 0;
}

int mr_st_open(const char *path, struct mr_st_file **out) {
  *out = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return mr_error_set(mr_from_errno(errno), "%s: cannot open: %s", path,
                        strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return mr_error_set(MR_EIO, "%s: not a regular file", path);
  }
  struct mr_st_file *f = calloc(1, sizeof *f);
  if (f == NULL || (f->path = strdup(path)) == NULL) {
    close(fd);
    free(f);
    return mr_error_set(MR_ENOMEM, "%s: out of memory", path);
  }
  f->size = (size_t)st.st_size;
  if (f->size > 0) {
    void *map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      int rc = mr_error_set(mr_from_errno(errno), "%s: mmap: %s", path,
                            strerror(errno));
      close(fd);
      mr_st_free(f);
      return rc;
    }
    f->base = map;
    f->mapped = 1;
  } else {
    f->base = (const uint8_t *)"";
  }
  close(fd);
  int rc = parse_header(f);
  if (rc < 0) {
    mr_st_free(f);
    return rc;
  }
  *out = f;
  return 0;
}

void mr_st_free(struct mr_st_file *f) {
  if (f == NULL)
    return;
  if (f->mapped)
    munmap((void *)f->base, f->size);
  for (int i = 0; i < f->n_tensors; i++)
    free((char *)f->tensors[i].name);
  free(f->tensors);
  for (int i = 0; i < f->n_meta; i++) {
    free(f->meta[i].key);
    free(f->meta[i].value);
  }
  free(f->meta);
  free(f->path);
  free(f);
}

const char *mr_st_path(const struct mr_st_file *f) { return f->path; }

int mr_st_count(const struct mr_st_file *f) { return f->n_tensors; }

const struct mr_st_tensor *mr_st_tensor_at(const struct mr_st_file *f, int i) {
  return i >= 0 && i < f->n_tensors ? &f->tensors[i] : NULL;
}

const struct mr_st_tensor *mr_st_find(const struct mr_st_file *f,
                                      const char *name) {
  if (f->n_tensors == 0)
    return NULL;
  struct mr_st_tensor key = {.name = name};
  return bsearch(&key, f->tensors, (size_t)f->n_tensors, sizeof key,
                 cmp_tensor_name);
}

const void *mr_st_data(const struct mr_st_file *f,
                       const struct mr_st_tensor *t) {
  return f->data + t->begin;
}

int mr_st_metadata_count(const struct mr_st_file *f) { return f->n_meta; }

void mr_st_metadata_at(const struct mr_st_file *f, int i, const char **key,
                       const char **value) {
  *key = f->meta[i].key;
  *value = f->meta[i].value;
}

const char *mr_st_metadata(const struct mr_st_file *f, const char *key) {
  if (f->n_meta == 0)
    return NULL;
  struct meta_entry k = {.key = (char *)key};
  const struct meta_entry *e =
      bsearch(&k, f->meta, (size_t)f->n_meta, sizeof k, cmp_meta_key);
  return e != NULL ? e->value : NULL;
}

/* ---- conversions ---- */

static int is_float(enum mr_dtype t) {
  return t == MR_F32 || t == MR_BF16 || t == MR_F16 || t == MR_F64;
}

int mr__st_can_convert(enum mr_dtype src, enum mr_dtype dst) {
  return src == dst || (is_float(src) && is_float(dst));
}

/* Through float: exact from BF16/F16, one rounding from F64. */
static void to_f32(float *out, enum mr_dtype src, const uint8_t *in, size_t n) {
  if (src == MR_F32) {
    memcpy(out, in, n * 4);
  } else if (src == MR_F64) {
    for (size_t i = 0; i < n; i++) {
      double v;
      memcpy(&v, in + i * 8, 8);
      out[i] = (float)v;
    }
  } else {
    uint16_t h[CONVERT_CHUNK];
    memcpy(h, in, n * 2);
    if (src == MR_BF16)
      mr_bf16_to_f32_n(out, h, n);
    else
      mr_f16_to_f32_n(out, h, n);
  }
}

static void from_f32(uint8_t *out, enum mr_dtype dst, const float *in,
                     size_t n) {
  if (dst == MR_F32) {
    memcpy(out, in, n * 4);
  } else if (dst == MR_F64) {
    for (size_t i = 0; i < n; i++) {
      double v = in[i];
      memcpy(out + i * 8, &v, 8);
    }
  } else {
    uint16_t h[CONVERT_CHUNK];
    if (dst == MR_BF16)
      mr_f32_to_bf16_n(h, in, n);
    else
      mr_f32_to_f16_n(h, in, n);
    memcpy(out, h, n * 2);
  }
}

void mr__st_convert(enum mr_dtype dst_dtype, void *dst, enum mr_dtype src_dtype,
                    const void *src, size_t n) {
  if (src_dtype == dst_dtype) {
    memcpy(dst, src, n * mr_dtype_size(src_dtype));
    return;
  }
  /* staged through aligned buffers: src and dst may be unaligned */
  const uint8_t *in = src;
  uint8_t *out = dst;
  size_t ss = mr_dtype_size(src_dtype), ds = mr_dtype_size(dst_dtype);
  float tmp[CONVERT_CHUNK];
  while (n > 0) {
    size_t k = n < CONVERT_CHUNK ? n : CONVERT_CHUNK;
    to_f32(tmp, src_dtype, in, k);
    from_f32(out, dst_dtype, tmp, k);
    in += k * ss;
    out += k * ds;
    n -= k;
  }
}

/* ---- slices ---- */

int mr_st_read_slice(const struct mr_st_file *f, const struct mr_st_tensor *t,
                     const int64_t *start, const int64_t *count,
                     enum mr_dtype dst_dtype, void *dst) {
  int rank = t->rank;
  if (!mr__st_can_convert(t->dtype, dst_dtype))
    return mr_error_set(MR_ENOTSUP,
                        "%s: tensor \"%s\": cannot convert %s to %s", f->path,
                        t->name, mr_dtype_safetensors_name(t->dtype),
                        mr_dtype_safetensors_name(dst_dtype));
  int64_t stride[MR_ST_MAX_RANK + 1]; /* elements */
  stride[rank] = 1;
  for (int k = rank - 1; k >= 0; k--)
    stride[k] = stride[k + 1] * t->shape[k];
  for (int k = 0; k < rank; k++) {
    if (start[k] < 0 || count[k] < 0 || start[k] > t->shape[k] ||
        count[k] > t->shape[k] - start[k])
      return mr_error_set(MR_ERANGE,
                          "%s: tensor \"%s\": slice dim %d [%" PRId64
                          ", +%" PRId64 ") outside [0, %" PRId64 ")",
                          f->path, t->name, k, start[k], count[k],
                          t->shape[k]);
    if (count[k] == 0)
      return 0;
  }
  /* The innermost dims taken whole merge into one contiguous run. */
  int d = rank - 1;
  while (d >= 0 && count[d] == t->shape[d])
    d--;
  int64_t run = d >= 0 ? count[d] * stride[d + 1] : t->numel; /* elements */
  size_t ssize = mr_dtype_size(t->dtype), dsize = mr_dtype_size(dst_dtype);
  int64_t idx[MR_ST_MAX_RANK] = {0}; /* odometer over dims [0, d) */
  uint8_t *out = dst;
  for (;;) {
    int64_t off = d >= 0 ? start[d] * stride[d + 1] : 0;
    for (int k = 0; k < d; k++)
      off += (start[k] + idx[k]) * stride[k + 1];
    mr__st_convert(dst_dtype, out, t->dtype,
                   f->data + t->begin + (size_t)off * ssize, (size_t)run);
    out += (size_t)run * dsize;
    int k = d - 1;
    while (k >= 0 && ++idx[k] == count[k])
      idx[k--] = 0;
    if (k < 0)
      break;
  }
  return 0;
}

int mr_st_read_rows(const struct mr_st_file *f, const struct mr_st_tensor *t,
                    int64_t row_begin, int64_t n_rows,
                    enum mr_dtype dst_dtype, void *dst) {
  if (t->rank == 0)
    return mr_error_set(MR_EINVAL,
                        "%s: tensor \"%s\": a scalar has no rows", f->path,
                        t->name);
  int64_t start[MR_ST_MAX_RANK] = {0}, count[MR_ST_MAX_RANK];
  for (int k = 0; k < t->rank; k++)
    count[k] = t->shape[k];
  start[0] = row_begin;
  count[0] = n_rows;
  return mr_st_read_slice(f, t, start, count, dst_dtype, dst);
}

int mr_st_read(const struct mr_st_file *f, const struct mr_st_tensor *t,
               enum mr_dtype dst_dtype, void *dst) {
  int64_t start[MR_ST_MAX_RANK] = {0};
  return mr_st_read_slice(f, t, start, t->shape, dst_dtype, dst);
}
