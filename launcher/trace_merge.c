/* trace_merge.c - the traced steps, and the ranks' trace files merged
 * (trace_merge.h). */
#include "launcher/trace_merge.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"
#include "common/log.h"

int mr_trace_steps_for(int64_t want_first, int64_t want_last, int64_t done, int64_t steps,
                       int64_t *first, int64_t *last) {
  int64_t a = want_first, b = want_last;
  if (want_first <= 0) { /* the group's first two steps warm up */
    a = done + 3, b = a + MR_TRACE_DEFAULT_STEPS - 1;
    if (b > steps)
      b = steps, a = b - MR_TRACE_DEFAULT_STEPS + 1;
  }
  if (a <= done)
    a = done + 1;
  if (b > steps)
    b = steps;
  if (a > b)
    return 0;
  *first = a, *last = b;
  return 1;
}

/* N of "rank-N.json", else -1. */
static int rank_of(const char *name) {
  int r = -1, used = 0;
  if (sscanf(name, "rank-%d.json%n", &r, &used) != 1 || name[used] != '\0' || r < 0)
    return -1;
  return r;
}

void mr_trace_clear(const char *dir) {
  DIR *d = opendir(dir);
  if (d == NULL)
    return;
  char path[4200];
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    if (rank_of(e->d_name) >= 0 || strcmp(e->d_name, "trace.json") == 0) {
      snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
      unlink(path);
    }
  closedir(d);
}

static int cmp_int(const void *a, const void *b) {
  return (*(const int *)a > *(const int *)b) - (*(const int *)a < *(const int *)b);
}

/* The rank file's first line, `{"displayTimeUnit": ..., "otherData": {..},`:
 * its otherData as JSON text (malloc'd), or NULL when it is not ours. */
static char *other_data(char *line, int rank) {
  size_t n = strlen(line);
  while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == ','))
    line[--n] = '\0';
  char *text = malloc(n + 2);
  if (text == NULL)
    return NULL;
  memcpy(text, line, n);
  memcpy(text + n, "}", 2);
  cJSON *root = cJSON_Parse(text);
  free(text);
  cJSON *od = cJSON_GetObjectItemCaseSensitive(root, "otherData");
  cJSON *r = cJSON_GetObjectItemCaseSensitive(od, "rank");
  char *out = cJSON_IsNumber(r) && r->valueint == rank ? cJSON_PrintUnformatted(od) : NULL;
  cJSON_Delete(root);
  return out;
}

/* Copies rank file f's events into out, each line a JSON object; *first
 * says whether out has none yet.  Returns 0, or -1 when f is not ours. */
static int copy_events(FILE *f, FILE *out, int *first) {
  char *line = NULL;
  size_t cap = 0;
  ssize_t n = getline(&line, &cap, f);
  int rc = n > 0 && strncmp(line, "\"traceEvents\": [", 16) == 0 ? 0 : -1;
  while (rc == 0 && (n = getline(&line, &cap, f)) > 0) {
    while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == ','))
      line[--n] = '\0';
    if (strcmp(line, "]}") == 0)
      break;
    if (line[0] != '{' || line[n - 1] != '}') {
      rc = -1;
      break;
    }
    fprintf(out, "%s%s", *first ? "" : ",\n", line);
    *first = 0;
  }
  free(line);
  return rc;
}

int mr_trace_merge(const char *dir) {
  DIR *d = opendir(dir);
  if (d == NULL)
    return mr_error_set(MR_EIO, "%s: %s", dir, strerror(errno));
  int *ranks = NULL, n = 0, cap = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    int r = rank_of(e->d_name);
    if (r < 0)
      continue;
    if (n == cap) {
      int *p = realloc(ranks, (size_t)(cap = cap ? 2 * cap : 16) * sizeof *p);
      if (p == NULL) {
        closedir(d);
        free(ranks);
        return mr_error_set(MR_ENOMEM, "%s: out of memory", dir);
      }
      ranks = p;
    }
    ranks[n++] = r;
  }
  closedir(d);
  if (n == 0) {
    free(ranks);
    return 0;
  }
  qsort(ranks, (size_t)n, sizeof *ranks, cmp_int);
  char tmp[4200], dst[4200], path[4200];
  snprintf(dst, sizeof dst, "%s/trace.json", dir);
  snprintf(tmp, sizeof tmp, "%s/.trace.json.%d.tmp", dir, (int)getpid());
  FILE *out = fopen(tmp, "w");
  FILE *events = tmpfile(); /* the events, after the ranks' otherData */
  if (out == NULL || events == NULL) {
    int rc = mr_error_set(MR_EIO, "%s: %s", out == NULL ? tmp : "a temporary file",
                          strerror(errno));
    if (out != NULL)
      fclose(out), unlink(tmp);
    if (events != NULL)
      fclose(events);
    free(ranks);
    return rc;
  }
  fputs("{\"displayTimeUnit\": \"ms\", \"otherData\": {\"ranks\": [", out);
  int merged = 0, first = 1;
  for (int i = 0; i < n; i++) {
    snprintf(path, sizeof path, "%s/rank-%d.json", dir, ranks[i]);
    FILE *f = fopen(path, "r");
    char *line = NULL, *od = NULL;
    size_t lcap = 0;
    if (f != NULL && getline(&line, &lcap, f) > 0)
      od = other_data(line, ranks[i]);
    long mark = ftell(events);
    int was_first = first;
    if (od == NULL || copy_events(f, events, &first) < 0) {
      MR_WARN("trace", "%s: not a rank trace meshrun wrote; left out of %s", path, dst);
      fseek(events, mark, SEEK_SET); /* what it added is overwritten */
      first = was_first;
    } else {
      fprintf(out, "%s%s", merged ? ", " : "", od);
      merged++;
    }
    free(od);
    free(line);
    if (f != NULL)
      fclose(f);
  }
  free(ranks);
  long end = ftell(events);
  fputs("]},\n\"traceEvents\": [\n", out);
  rewind(events);
  char buf[1 << 16];
  for (long left = end; left > 0;) {
    size_t k = fread(buf, 1, left < (long)sizeof buf ? (size_t)left : sizeof buf, events);
    if (k == 0)
      break;
    fwrite(buf, 1, k, out);
    left -= (long)k;
  }
  fputs("\n]}\n", out);
  fclose(events);
  if (ferror(out) | (fclose(out) != 0) || rename(tmp, dst) != 0) {
    int rc = mr_error_set(MR_EIO, "%s: %s", dst, strerror(errno));
    unlink(tmp);
    return rc;
  }
  return merged;
}
