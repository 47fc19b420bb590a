/* trace.c - a rank's timeline in the Trace Event Format (trace.h).
 *
 * Events are formatted as they happen, one JSON object a line, into a
 * growing text under a mutex (the training thread, the comm tracer and
 * the checkpoint writer all add to it); the file is that text between a
 * header and a footer, so the launcher merges ranks line by line. */
#include "worker/trace.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/file.h"
#include "common/log.h"
#include "common/text.h"
#include "worker/comm/comm.h"

#define INFLIGHT_CAP 16384 // operations in flight at once (a power of two)

struct inflight {
  const struct mr_comm_req *req; // NULL: free
  uint64_t id;
};

struct mr_trace {
  struct mr_trace_opts o;
  char *dir, *host;
  pthread_mutex_t lock;
  struct mr_text ev;          // event lines, each ending ",\n"
  size_t max_bytes;
  uint64_t dropped;           // events left out beyond max_bytes
  int recording;              // inside a chosen step
  int ended;                  // the last chosen step has ended
  int holds;                  // work begun in the range, still running
  int written;                // the file is written (or given up on)
  int64_t step;               // the step being recorded
  int64_t step_t0;
  uint64_t next_id;           // async ids: rank << 40 | count
  struct inflight fl[INFLIGHT_CAP];
  int n_fl;
  struct mr_comm_tracer tracer;
};

int64_t mr_trace_now(void) { return mr_clock_ns(); }

/* ns on this rank's clock -> µs on the coordinator's */
static double ts_us(const struct mr_trace *t, int64_t ns) {
  return (double)(ns + t->o.clock_offset_ns) * 1e-3;
}

/* Adds one event line (lock held). */
static void add_line(struct mr_trace *t, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void add_line(struct mr_trace *t, const char *fmt, ...) {
  if (t->ev.len >= t->max_bytes || t->ev.failed) {
    t->dropped++;
    return;
  }
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  mr_text_add(&t->ev, "%s,\n", buf);
}

int mr_trace_recording(const struct mr_trace *t) { return t != NULL && t->recording; }

void mr_trace_slice(struct mr_trace *t, enum mr_trace_tid tid, const char *cat,
                    const char *name, int64_t t0, int64_t t1, const char *args) {
  if (t == NULL)
    return;
  pthread_mutex_lock(&t->lock);
  if (t->recording || (tid == MR_TRACE_CHECKPOINT && t->holds > 0))
    add_line(t,
             "{\"ph\": \"X\", \"pid\": %d, \"tid\": %d, \"cat\": \"%s\", \"name\": \"%s\", "
             "\"ts\": %.3f, \"dur\": %.3f, \"args\": {\"step\": %" PRId64 "%s%s}}",
             t->o.rank, (int)tid, cat, name, ts_us(t, t0), (double)(t1 - t0) * 1e-3, t->step,
             args[0] ? ", " : "", args);
  pthread_mutex_unlock(&t->lock);
}

/* The in-flight table: open addressing on the request's address. */
static size_t slot_of(const struct mr_comm_req *r) {
  uintptr_t h = (uintptr_t)r;
  h ^= h >> 17;
  h *= UINT64_C(0x9e3779b97f4a7c15);
  return (size_t)(h >> 20) & (INFLIGHT_CAP - 1);
}

static void comm_start(void *ctx, const struct mr_comm_group *g, const char *op, size_t bytes,
                       int peer, uint64_t seq, const struct mr_comm_req *r, int64_t now) {
  struct mr_trace *t = ctx;
  pthread_mutex_lock(&t->lock);
  if (t->recording && t->n_fl < INFLIGHT_CAP / 2) {
    size_t i = slot_of(r);
    while (t->fl[i].req != NULL)
      i = (i + 1) & (INFLIGHT_CAP - 1);
    uint64_t id = ((uint64_t)t->o.rank << 40) | t->next_id++;
    t->fl[i] = (struct inflight){.req = r, .id = id};
    t->n_fl++;
    char p[48] = "";
    if (peer >= 0)
      snprintf(p, sizeof p, ", \"peer\": %d", peer);
    add_line(t,
             "{\"ph\": \"b\", \"pid\": %d, \"tid\": %d, \"cat\": \"comm\", \"name\": \"%s\", "
             "\"id\": \"0x%" PRIx64 "\", \"ts\": %.3f, \"args\": {\"step\": %" PRId64
             ", \"group\": \"%s\", \"seq\": %" PRIu64 ", \"bytes\": %zu%s}}",
             t->o.rank, MR_TRACE_COMM, op, id, ts_us(t, now), t->step,
             g->label != NULL ? g->label : "?", seq, bytes, p);
  }
  pthread_mutex_unlock(&t->lock);
}

/* Ends the operation in slot i at ns (lock held). */
static void end_slot(struct mr_trace *t, size_t i, int64_t ns, const char *extra) {
  add_line(t,
           "{\"ph\": \"e\", \"pid\": %d, \"tid\": %d, \"cat\": \"comm\", \"id\": \"0x%" PRIx64
           "\", \"ts\": %.3f%s}",
           t->o.rank, MR_TRACE_COMM, t->fl[i].id, ts_us(t, ns), extra);
  /* remove, moving back the entries of the probe run after it */
  t->fl[i].req = NULL;
  t->n_fl--;
  for (size_t j = (i + 1) & (INFLIGHT_CAP - 1); t->fl[j].req != NULL;
       j = (j + 1) & (INFLIGHT_CAP - 1)) {
    struct inflight e = t->fl[j];
    t->fl[j].req = NULL;
    size_t k = slot_of(e.req);
    while (t->fl[k].req != NULL)
      k = (k + 1) & (INFLIGHT_CAP - 1);
    t->fl[k] = e;
  }
}

static void comm_end(void *ctx, const struct mr_comm_req *r, int rc) {
  struct mr_trace *t = ctx;
  int64_t now = mr_clock_ns();
  pthread_mutex_lock(&t->lock);
  if (t->n_fl > 0 && !t->written) {
    for (size_t i = slot_of(r); t->fl[i].req != NULL; i = (i + 1) & (INFLIGHT_CAP - 1))
      if (t->fl[i].req == r) {
        end_slot(t, i, now, rc == 0 ? "" : ", \"args\": {\"failed\": true}");
        break;
      }
  }
  pthread_mutex_unlock(&t->lock);
}

/* JSON string contents: what a host name may hold, made safe. */
static void json_safe(char *dst, size_t n, const char *src) {
  size_t k = 0;
  for (; src != NULL && *src && k + 1 < n; src++)
    dst[k++] = (*src == '"' || *src == '\\' || (unsigned char)*src < 0x20) ? '_' : *src;
  dst[k] = '\0';
}

struct mr_trace *mr_trace_new(const struct mr_trace_opts *o) {
  struct mr_trace *t = calloc(1, sizeof *t);
  if (t == NULL) {
    MR_WARN("trace", "rank %d: no memory for a trace; training goes on without one", o->rank);
    return NULL;
  }
  t->o = *o;
  t->dir = strdup(o->dir);
  t->host = strdup(o->host != NULL ? o->host : "");
  if (t->dir == NULL || t->host == NULL || mr_mkdir_p(o->dir) < 0) {
    MR_WARN("trace", "rank %d: --trace %s: %s; training goes on without a trace", o->rank,
            o->dir, t->dir == NULL ? "out of memory" : mr_error_message());
    free(t->dir);
    free(t->host);
    free(t);
    return NULL;
  }
  t->o.dir = t->dir;
  t->o.host = t->host;
  t->max_bytes = (size_t)(o->max_mb > 0 ? o->max_mb : 1) << 20;
  pthread_mutex_init(&t->lock, NULL);
  t->tracer = (struct mr_comm_tracer){.ctx = t, .start = comm_start, .end = comm_end};
  char host[128];
  json_safe(host, sizeof host, t->host);
  int r = o->rank;
  add_line(t, "{\"ph\": \"M\", \"pid\": %d, \"name\": \"process_name\", \"args\": {\"name\": "
              "\"rank %d%s%s\"}}", r, r, host[0] ? " on " : "", host);
  add_line(t, "{\"ph\": \"M\", \"pid\": %d, \"name\": \"process_sort_index\", \"args\": "
              "{\"sort_index\": %d}}", r, r);
  static const char *const threads[] = {NULL, "compute", "comm", "checkpoint"};
  for (int k = 1; k <= 3; k++) {
    add_line(t, "{\"ph\": \"M\", \"pid\": %d, \"tid\": %d, \"name\": \"thread_name\", "
                "\"args\": {\"name\": \"%s\"}}", r, k, threads[k]);
    add_line(t, "{\"ph\": \"M\", \"pid\": %d, \"tid\": %d, \"name\": \"thread_sort_index\", "
                "\"args\": {\"sort_index\": %d}}", r, k, k);
  }
  return t;
}

/* Writes DIR/rank-N.json once (lock held). */
static void write_file(struct mr_trace *t) {
  if (t->written)
    return;
  t->written = 1;
  int64_t now = mr_clock_ns();
  while (t->n_fl > 0) /* still in flight: closed where the file ends */
    for (size_t i = 0; i < INFLIGHT_CAP; i++)
      if (t->fl[i].req != NULL) {
        end_slot(t, i, now, ", \"args\": {\"unfinished\": true}");
        break;
      }
  struct mr_text f = {0};
  mr_text_add(&f,
              "{\"displayTimeUnit\": \"ms\", \"otherData\": {\"rank\": %d, \"world_size\": %d, "
              "\"first_step\": %" PRId64 ", \"last_step\": %" PRId64
              ", \"clock_offset_ns\": %" PRId64 ", \"clock_error_ns\": %" PRIu64
              ", \"dropped_events\": %" PRIu64 "},\n\"traceEvents\": [\n",
              t->o.rank, t->o.world_size, t->o.first, t->o.last, t->o.clock_offset_ns,
              t->o.clock_error_ns, t->dropped);
  if (t->ev.len >= 2)
    t->ev.s[t->ev.len - 2] = '\0'; /* the last line's ",\n" */
  if (t->ev.s != NULL)
    mr_text_add(&f, "%s\n", t->ev.s);
  mr_text_add(&f, "]}\n");
  char *text = mr_text_take(&f);
  char path[4200];
  snprintf(path, sizeof path, "%s/rank-%d.json", t->dir, t->o.rank);
  int rc = text != NULL ? mr_file_write_text(path, text, MR_FILE_ATOMIC)
                        : mr_error_set(MR_ENOMEM, "%s: out of memory", path);
  if (rc < 0)
    MR_WARN("trace", "rank %d: %s; training goes on", t->o.rank, mr_error_message());
  else if (t->dropped > 0)
    MR_WARN("trace", "rank %d: %s holds the first %d MiB of events; %" PRIu64 " more were "
            "left out (MESHRUN_TRACE_MAX_MB)", t->o.rank, path, t->o.max_mb, t->dropped);
  free(text);
  free(mr_text_take(&t->ev));
}

void mr_trace_step_begin(struct mr_trace *t, int64_t step) {
  if (t == NULL || t->written || step < t->o.first || step > t->o.last)
    return;
  pthread_mutex_lock(&t->lock);
  t->recording = 1;
  t->step = step;
  t->step_t0 = mr_clock_ns();
  pthread_mutex_unlock(&t->lock);
  mr_comm_set_tracer(&t->tracer);
}

void mr_trace_step_end(struct mr_trace *t, int64_t step) {
  if (t == NULL || !t->recording)
    return;
  char name[48];
  snprintf(name, sizeof name, "step %" PRId64, step);
  mr_trace_slice(t, MR_TRACE_COMPUTE, "step", name, t->step_t0, mr_clock_ns(), "");
  pthread_mutex_lock(&t->lock);
  t->recording = 0;
  pthread_mutex_unlock(&t->lock);
  if (step >= t->o.last) {
    mr_comm_set_tracer(NULL);
    pthread_mutex_lock(&t->lock);
    t->ended = 1;
    if (t->holds == 0)
      write_file(t);
    pthread_mutex_unlock(&t->lock);
  }
}

int mr_trace_hold(struct mr_trace *t) {
  if (t == NULL)
    return 0;
  pthread_mutex_lock(&t->lock);
  int held = t->recording;
  t->holds += held;
  pthread_mutex_unlock(&t->lock);
  return held;
}

void mr_trace_release(struct mr_trace *t) {
  if (t == NULL)
    return;
  pthread_mutex_lock(&t->lock);
  if (--t->holds == 0 && t->ended)
    write_file(t);
  pthread_mutex_unlock(&t->lock);
}

void mr_trace_free(struct mr_trace *t) {
  if (t == NULL)
    return;
  if (mr__comm_tracer == &t->tracer)
    mr_comm_set_tracer(NULL);
  pthread_mutex_lock(&t->lock);
  if (t->recording) { /* stopped inside the range: what was recorded */
    t->recording = 0;
    t->o.last = t->step;
  }
  if (t->o.first <= t->step)
    write_file(t);
  pthread_mutex_unlock(&t->lock);
  free(mr_text_take(&t->ev));
  pthread_mutex_destroy(&t->lock);
  free(t->dir);
  free(t->host);
  free(t);
}

int mr_clock_offset(const struct mr_clock_sample *s, int n, int64_t *offset_ns,
                    uint64_t *error_ns) {
  int best = -1;
  for (int i = 0; i < n; i++)
    if (s[i].t1 >= s[i].t0 && (best < 0 || s[i].t1 - s[i].t0 < s[best].t1 - s[best].t0))
      best = i;
  if (best < 0)
    return -1;
  int64_t rtt = s[best].t1 - s[best].t0;
  *offset_ns = s[best].peer - (s[best].t0 + rtt / 2);
  *error_ns = (uint64_t)(rtt + 1) / 2;
  return 0;
}
