/* tb_events.c - TensorBoard event files (tb_events.h). */
#include "launcher/tb_events.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/error.h"
#include "common/log.h"
#include "tfevent.pb-c.h"

struct mr_tb_writer {
  FILE *f;
  char path[4096];
  int64_t last_step; // the last step written (or skipped as written before)
  int failed;        // a write failed: said once, no more writes
};

/* The reflected CRC32C polynomial; the table is built once. */
#define CRC32C_POLY 0x82f63b78u

static uint32_t crc_table[256];

static void crc_init(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++)
      c = (c >> 1) ^ (CRC32C_POLY & (0u - (c & 1u)));
    crc_table[i] = c;
  }
}

uint32_t mr_tb_masked_crc32c(const void *data, size_t n) {
  if (crc_table[1] == 0)
    crc_init();
  const uint8_t *p = data;
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < n; i++)
    c = crc_table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  c ^= 0xffffffffu;
  /* TFRecord's mask: a CRC of data holding CRCs stays informative */
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

static void put_le(uint8_t *b, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; i++)
    b[i] = (uint8_t)(v >> (8 * i));
}

/* One TFRecord: length, its masked CRC, the Event, its masked CRC. */
static int write_event(struct mr_tb_writer *w, const Meshrun__Tb__Event *ev) {
  size_t n = meshrun__tb__event__get_packed_size(ev);
  uint8_t *buf = malloc(n + 16);
  if (buf == NULL)
    return mr_error_set(MR_ENOMEM, "TensorBoard event file %s: out of memory", w->path);
  put_le(buf, n, 8);
  put_le(buf + 8, mr_tb_masked_crc32c(buf, 8), 4);
  meshrun__tb__event__pack(ev, buf + 12);
  put_le(buf + 12 + n, mr_tb_masked_crc32c(buf + 12, n), 4);
  int ok = fwrite(buf, 1, n + 16, w->f) == n + 16 && fflush(w->f) == 0;
  free(buf);
  if (!ok)
    return mr_error_set(mr_from_errno(errno), "TensorBoard event file %s: %s", w->path,
                        strerror(errno));
  return 0;
}

int mr_tb_open(const char *dir, int64_t written, struct mr_tb_writer **out) {
  *out = NULL;
  struct mr_tb_writer *w = calloc(1, sizeof *w);
  if (w == NULL)
    return mr_error_set(MR_ENOMEM, "TensorBoard event file: out of memory");
  char host[256] = "";
  gethostname(host, sizeof host - 1);
  for (char *p = host; *p != '\0'; p++) /* a name TensorBoard splits on dots */
    if (*p == '.' || *p == '/')
      *p = '_';
  snprintf(w->path, sizeof w->path, "%s/events.out.tfevents.%lld.%s.%d.meshrun", dir,
           (long long)time(NULL), host[0] != '\0' ? host : "host", (int)getpid());
  w->f = fopen(w->path, "wbx");
  if (w->f == NULL) {
    int rc = mr_error_set(mr_from_errno(errno), "TensorBoard event file %s: %s", w->path,
                          strerror(errno));
    free(w);
    return rc;
  }
  w->last_step = written;
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  Meshrun__Tb__Event ev = MESHRUN__TB__EVENT__INIT;
  ev.wall_time = (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
  ev.what_case = MESHRUN__TB__EVENT__WHAT_FILE_VERSION;
  ev.file_version = "brain.Event:2";
  int rc = write_event(w, &ev);
  if (rc < 0) {
    mr_tb_close(w);
    return rc;
  }
  *out = w;
  return 0;
}

int mr_tb_scalars(struct mr_tb_writer *w, int64_t step, double wall, const char *const *tags,
                  const double *values, int n) {
  if (w == NULL || w->failed || step <= w->last_step)
    return 0;
  Meshrun__Tb__Summary__Value *vals = calloc((size_t)n, sizeof *vals);
  Meshrun__Tb__Summary__Value **ptrs = calloc((size_t)n, sizeof *ptrs);
  int rc = 0;
  if (vals == NULL || ptrs == NULL) {
    rc = mr_error_set(MR_ENOMEM, "TensorBoard event file %s: out of memory", w->path);
  } else {
    for (int i = 0; i < n; i++) {
      meshrun__tb__summary__value__init(&vals[i]);
      vals[i].tag = (char *)tags[i];
      vals[i].value_case = MESHRUN__TB__SUMMARY__VALUE__VALUE_SIMPLE_VALUE;
      vals[i].simple_value = (float)values[i];
      ptrs[i] = &vals[i];
    }
    Meshrun__Tb__Summary sum = MESHRUN__TB__SUMMARY__INIT;
    sum.n_value = (size_t)n;
    sum.value = ptrs;
    Meshrun__Tb__Event ev = MESHRUN__TB__EVENT__INIT;
    ev.wall_time = wall;
    ev.step = step;
    ev.what_case = MESHRUN__TB__EVENT__WHAT_SUMMARY;
    ev.summary = &sum;
    rc = write_event(w, &ev);
  }
  free(vals);
  free(ptrs);
  if (rc < 0) {
    w->failed = 1; /* said once, by the caller; training goes on */
    return rc;
  }
  w->last_step = step;
  return 0;
}

const char *mr_tb_path(const struct mr_tb_writer *w) { return w->path; }

void mr_tb_close(struct mr_tb_writer *w) {
  if (w == NULL)
    return;
  if (w->f != NULL)
    fclose(w->f);
  free(w);
}

int64_t mr_tb_written(const char *dir, const char *metrics_path) {
  DIR *d = opendir(dir);
  if (d == NULL)
    return 0;
  int events = 0;
  struct dirent *e;
  while (!events && (e = readdir(d)) != NULL)
    events = strstr(e->d_name, "tfevents") != NULL;
  closedir(d);
  if (!events)
    return 0;
  FILE *f = fopen(metrics_path, "r");
  if (f == NULL)
    return 0;
  int64_t last = 0;
  char line[4096];
  while (fgets(line, sizeof line, f) != NULL) {
    const char *s = strstr(line, "{\"step\": ");
    long long step;
    if (s != NULL && sscanf(s + 9, "%lld", &step) == 1 && step > last)
      last = step;
  }
  fclose(f);
  return last;
}
