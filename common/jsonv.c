/* jsonv.c - validated JSON field reading. */
#include "common/jsonv.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/error.h"

void mr_jv_init(struct mr_jv *jv, const char *file) {
  memset(jv, 0, sizeof *jv);
  jv->file = file;
}

void mr_jv_close(struct mr_jv *jv) {
  free(jv->errors);
  memset(jv, 0, sizeof *jv);
}

const char *mr_jv_join(char *buf, size_t n, const char *path, const char *key) {
  if (path == NULL || path[0] == '\0')
    snprintf(buf, n, "%s", key ? key : "(top level)");
  else if (key == NULL)
    snprintf(buf, n, "%s", path);
  else if (key[0] == '[')
    snprintf(buf, n, "%s%s", path, key);
  else
    snprintf(buf, n, "%s.%s", path, key);
  return buf;
}

void mr_jv_error(struct mr_jv *jv, const char *path, const char *key,
                 const char *fmt, ...) {
  char where[256], msg[512], line[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  int n = snprintf(line, sizeof line, "%s%s: %s: %s", jv->n_errors ? "\n" : "",
                   jv->file, mr_jv_join(where, sizeof where, path, key), msg);
  if (n < 0)
    return;
  size_t need = jv->len + (size_t)n + 1;
  if (need > jv->cap) {
    size_t cap = jv->cap ? jv->cap * 2 : 512;
    while (cap < need)
      cap *= 2;
    char *nb = realloc(jv->errors, cap);
    if (nb == NULL)
      return;
    jv->errors = nb;
    jv->cap = cap;
  }
  memcpy(jv->errors + jv->len, line, (size_t)n + 1);
  jv->len += (size_t)n;
  jv->n_errors++;
}

const char *mr_jv_show(const struct cJSON *v, char *buf, size_t n) {
  if (v == NULL)
    snprintf(buf, n, "nothing");
  else if (cJSON_IsString(v))
    snprintf(buf, n, "\"%.60s\"", v->valuestring);
  else if (cJSON_IsNumber(v))
    snprintf(buf, n, "%.17g", v->valuedouble);
  else if (cJSON_IsBool(v))
    snprintf(buf, n, "%s", cJSON_IsTrue(v) ? "true" : "false");
  else if (cJSON_IsNull(v))
    snprintf(buf, n, "null");
  else if (cJSON_IsArray(v))
    snprintf(buf, n, "an array");
  else
    snprintf(buf, n, "an object");
  return buf;
}

void mr_jv_only_keys(struct mr_jv *jv, const struct cJSON *obj,
                     const char *path, const char *const *keys) {
  const cJSON *it;
  cJSON_ArrayForEach(it, obj) {
    int known = 0;
    for (const char *const *k = keys; *k != NULL && !known; k++)
      known = strcmp(*k, it->string) == 0;
    if (!known) {
      char list[512] = "";
      size_t used = 0;
      for (const char *const *k = keys; *k != NULL; k++) {
        int w = snprintf(list + used, sizeof list - used, "%s%s",
                         used ? ", " : "", *k);
        if (w < 0 || (size_t)w >= sizeof list - used)
          break;
        used += (size_t)w;
      }
      mr_jv_error(jv, path, it->string, "unknown field (known here: %s)", list);
    }
  }
}

static const cJSON *field(const cJSON *obj, const char *key) {
  return cJSON_GetObjectItemCaseSensitive(obj, key);
}

int mr_jv_int(struct mr_jv *jv, const cJSON *obj, const char *path,
              const char *key, int64_t min, int64_t max, int64_t *out) {
  const cJSON *v = field(obj, key);
  if (v == NULL)
    return 0;
  char shown[96];
  double d = cJSON_IsNumber(v) ? v->valuedouble : NAN;
  if (!cJSON_IsNumber(v) || d != floor(d) || fabs(d) > 9.0e15) {
    const char *what = min >= 1 ? "a positive integer"
                       : min == 0 ? "a non-negative integer"
                                  : "an integer";
    mr_jv_error(jv, path, key, "expected %s, got %s", what,
                mr_jv_show(v, shown, sizeof shown));
    return -1;
  }
  if (d < (double)min || d > (double)max) {
    mr_jv_error(jv, path, key, "expected an integer in [%lld, %lld], got %s",
                (long long)min, (long long)max, mr_jv_show(v, shown, sizeof shown));
    return -1;
  }
  *out = (int64_t)d;
  return 1;
}

int mr_json_count(const cJSON *v, int64_t max, int64_t *out) {
  if (!cJSON_IsNumber(v))
    return 0;
  double d = v->valuedouble;
  if (!(d >= 0.0 && d <= (double)max) || d != floor(d))
    return 0;
  *out = (int64_t)d;
  return 1;
}

int mr_jv_num(struct mr_jv *jv, const cJSON *obj, const char *path,
              const char *key, double min, double max, double *out) {
  const cJSON *v = field(obj, key);
  if (v == NULL)
    return 0;
  char shown[96];
  if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble)) {
    mr_jv_error(jv, path, key, "expected a number, got %s",
                mr_jv_show(v, shown, sizeof shown));
    return -1;
  }
  if (v->valuedouble < min || v->valuedouble > max) {
    mr_jv_error(jv, path, key, "expected a number in [%g, %g], got %s", min, max,
                mr_jv_show(v, shown, sizeof shown));
    return -1;
  }
  *out = v->valuedouble;
  return 1;
}

int mr_jv_bool(struct mr_jv *jv, const cJSON *obj, const char *path,
               const char *key, int *out) {
  const cJSON *v = field(obj, key);
  if (v == NULL)
    return 0;
  if (!cJSON_IsBool(v)) {
    char shown[96];
    mr_jv_error(jv, path, key, "expected true or false, got %s",
                mr_jv_show(v, shown, sizeof shown));
    return -1;
  }
  *out = cJSON_IsTrue(v) ? 1 : 0;
  return 1;
}

int mr_jv_str(struct mr_jv *jv, const cJSON *obj, const char *path,
              const char *key, const char **out) {
  const cJSON *v = field(obj, key);
  if (v == NULL)
    return 0;
  if (!cJSON_IsString(v) || v->valuestring[0] == '\0') {
    char shown[96];
    mr_jv_error(jv, path, key, "expected a non-empty string, got %s",
                mr_jv_show(v, shown, sizeof shown));
    return -1;
  }
  *out = v->valuestring;
  return 1;
}

int mr_jv_enum(struct mr_jv *jv, const cJSON *obj, const char *path,
               const char *key, const char *const *choices, int *out) {
  const cJSON *v = field(obj, key);
  if (v == NULL)
    return 0;
  if (cJSON_IsString(v))
    for (int i = 0; choices[i] != NULL; i++)
      if (strcmp(v->valuestring, choices[i]) == 0) {
        *out = i;
        return 1;
      }
  char list[256] = "", shown[96];
  size_t used = 0;
  for (int i = 0; choices[i] != NULL; i++) {
    int w = snprintf(list + used, sizeof list - used, "%s\"%s\"",
                     i ? (choices[i + 1] ? ", " : " or ") : "", choices[i]);
    if (w < 0 || (size_t)w >= sizeof list - used)
      break;
    used += (size_t)w;
  }
  mr_jv_error(jv, path, key, "expected %s, got %s", list,
              mr_jv_show(v, shown, sizeof shown));
  return -1;
}

int mr_jv_obj(struct mr_jv *jv, const cJSON *obj, const char *path,
              const char *key, const cJSON **out) {
  const cJSON *v = field(obj, key);
  if (v == NULL)
    return 0;
  if (!cJSON_IsObject(v)) {
    char shown[96];
    mr_jv_error(jv, path, key, "expected an object, got %s",
                mr_jv_show(v, shown, sizeof shown));
    return -1;
  }
  *out = v;
  return 1;
}

int mr_read_file(const char *path, char **text, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (f == NULL)
    return mr_error_set(mr_from_errno(errno), "%s: %s", path, strerror(errno));
  struct stat st;
  if (fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) { /* fopen takes a folder */
    fclose(f);
    return mr_error_set(MR_EINVAL, "%s: is a folder; expected a JSON file", path);
  }
  size_t cap = 4096, n = 0;
  char *buf = malloc(cap);
  for (;;) {
    if (buf == NULL) {
      fclose(f);
      return mr_error_set(MR_ENOMEM, "%s: out of memory", path);
    }
    n += fread(buf + n, 1, cap - n - 1, f);
    if (n > MR_TEXT_FILE_MAX) { /* /dev/zero, a log given by mistake */
      free(buf);
      fclose(f);
      return mr_error_set(MR_EINVAL, "%s: expected a JSON file of at most %d MiB",
                          path, MR_TEXT_FILE_MAX >> 20);
    }
    if (n < cap - 1)
      break;
    cap *= 2;
    char *nb = realloc(buf, cap);
    if (nb == NULL)
      free(buf);
    buf = nb;
  }
  int err = ferror(f) ? errno : 0;
  fclose(f);
  if (err) {
    free(buf);
    return mr_error_set(MR_EIO, "%s: read error: %s", path, strerror(err));
  }
  buf[n] = '\0';
  *text = buf;
  if (len != NULL)
    *len = n;
  return 0;
}

static int cmp_key(const void *a, const void *b) {
  return strcmp((*(const cJSON *const *)a)->string, (*(const cJSON *const *)b)->string);
}

/* A key given twice in one object under v, its path into path
 * ("strategy.pipeline_parallel.degree"); 0 when there is none.  cJSON keeps
 * both and finds the first, so a job rewritten from it would read the
 * other: such a document is refused.  Keys are sorted, so a huge object
 * costs n log n. */
static int duplicate_key(const cJSON *v, char *path, size_t n, size_t at) {
  int count = 0;
  for (const cJSON *a = v->child; a != NULL; a = a->next)
    count++;
  if (cJSON_IsObject(v) && count > 1) {
    const cJSON **keys = malloc((size_t)count * sizeof *keys);
    if (keys == NULL)
      return 0;
    int k = 0;
    for (const cJSON *a = v->child; a != NULL; a = a->next)
      keys[k++] = a;
    qsort(keys, (size_t)count, sizeof *keys, cmp_key);
    for (k = 1; k < count && strcmp(keys[k - 1]->string, keys[k]->string) != 0; k++)
      ;
    if (k < count)
      snprintf(path + at, n - at, "%s%s", at ? "." : "", keys[k]->string);
    free(keys);
    if (k < count)
      return 1;
  }
  int i = 0;
  for (const cJSON *a = v->child; a != NULL; a = a->next, i++) {
    if (!cJSON_IsObject(a) && !cJSON_IsArray(a))
      continue;
    int w = cJSON_IsObject(v) ? snprintf(path + at, n - at, "%s%s", at ? "." : "", a->string)
                              : snprintf(path + at, n - at, "[%d]", i);
    size_t len = at + (size_t)(w > 0 ? w : 0);
    if (duplicate_key(a, path, n, len < n ? len : n - 1))
      return 1;
    path[at] = '\0';
  }
  return 0;
}

int mr_json_parse(const char *text, const char *name, cJSON **out) {
  const char *end = NULL;
  cJSON *obj = cJSON_ParseWithOpts(text, &end, 1);
  if (obj == NULL) {
    int line = 1, col = 1;
    const char *stop = end != NULL ? end : text;
    for (const char *p = text; *p != '\0' && p < stop; p++) {
      if (*p == '\n') {
        line++;
        col = 1;
      } else {
        col++;
      }
    }
    return mr_error_set(MR_EJOB, "%s: not valid JSON: line %d, column %d", name,
                        line, col);
  }
  char path[256] = "";
  if (duplicate_key(obj, path, sizeof path, 0)) {
    cJSON_Delete(obj);
    return mr_error_set(MR_EJOB, "%s: %s: given twice; expected each key once", name, path);
  }
  *out = obj;
  return 0;
}

int mr_json_load(const char *path, cJSON **out) {
  char *text;
  MR_TRY(mr_read_file(path, &text, NULL));
  int rc = mr_json_parse(text, path, out);
  free(text);
  return rc;
}
