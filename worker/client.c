/* client.c - the worker's RPC connection and heartbeat thread. */
#include "worker/client.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/discovery.h"
#include "common/error.h"
#include "common/log.h"
#include "common/rpc.h"
#include "common/tunable.h"
#include "worker/trace.h"

struct mr_rdv_result {
  Meshrun__Envelope *env;      // a RendezvousDone, owned
  struct mr_rdv_result *next;
};

static uint64_t rss_bytes(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  if (f == NULL)
    return 0;
  unsigned long size = 0, resident = 0;
  int n = fscanf(f, "%lu %lu", &size, &resident);
  fclose(f);
  return n == 2 ? (uint64_t)resident * (uint64_t)sysconf(_SC_PAGESIZE) : 0;
}

int mr_client_send(struct mr_client *c, const Meshrun__Envelope *env) {
  pthread_mutex_lock(&c->send_lock);
  int rc = mr_rpc_send_fd(c->fd, env);
  pthread_mutex_unlock(&c->send_lock);
  return rc;
}

static const char *case_name(Meshrun__Envelope__MsgCase m) {
  Meshrun__Envelope e = MESHRUN__ENVELOPE__INIT;
  e.msg_case = m;
  return mr_rpc_name(&e);
}

static int expect(struct mr_client *c, Meshrun__Envelope__MsgCase want,
                  Meshrun__Envelope **out) {
  int timeout = (int)mr_tunable_int(MR_TUNABLE_CONNECT_TIMEOUT_MS);
  for (;;) {
    Meshrun__Envelope *env;
    MR_TRY(mr_rpc_recv_fd(c->fd, &c->reader, timeout, &env));
    if (env->msg_case == want) {
      *out = env;
      return 0;
    }
    if (env->msg_case == MESHRUN__ENVELOPE__MSG_CONTROL) { /* stop before start */
      atomic_store(&c->stop_requested, 1);
      mr_rpc_free(env);
      continue;
    }
    int rc = mr_error_set(MR_EPROTO, "expected %s from the coordinator, got %s",
                          case_name(want), mr_rpc_name(env));
    mr_rpc_free(env);
    return rc;
  }
}

int mr_client_connect(struct mr_client *c, const char *address,
                      const uint8_t token[MR_TOKEN_BYTES], int requested_rank,
                      int restart) {
  memset(c, 0, sizeof *c);
  c->fd = -1;
  pthread_mutex_init(&c->send_lock, NULL);
  pthread_mutex_init(&c->pos_lock, NULL);
  pthread_mutex_init(&c->probe_lock, NULL);
  pthread_mutex_init(&c->rdv_lock, NULL);
  pthread_cond_init(&c->rdv_cond, NULL);
  c->waiting_on = -1;
  mr_frame_reader_init(&c->reader, (size_t)mr_tunable_int(MR_TUNABLE_MAX_FRAME_BYTES));
  int fd = mr_rpc_connect(address);
  if (fd < 0)
    return fd;
  c->fd = fd;
  MR_TRY(mr_auth_client_handshake(fd, &c->reader, token,
                                  (int)mr_tunable_int(MR_TUNABLE_AUTH_TIMEOUT_MS)));
  char host[256] = "";
  gethostname(host, sizeof host - 1);
  struct mr_devices found;
  MR_TRY(mr_discover_devices(&found));
  Meshrun__Device *devs = calloc((size_t)found.n, sizeof *devs);
  Meshrun__Device **dev_ptrs = calloc((size_t)found.n, sizeof *dev_ptrs);
  for (int i = 0; devs != NULL && dev_ptrs != NULL && i < found.n; i++) {
    meshrun__device__init(&devs[i]);
    devs[i].kind = found.dev[i].kind;
    devs[i].index = found.dev[i].index;
    devs[i].name = found.dev[i].name;
    devs[i].memory_bytes = found.dev[i].memory_bytes;
    dev_ptrs[i] = &devs[i];
  }
  Meshrun__Hello hello = MESHRUN__HELLO__INIT;
  hello.protocol_version = MR_PROTOCOL_VERSION;
  hello.host = host;
  hello.pid = (uint32_t)getpid();
  hello.n_devices = devs != NULL && dev_ptrs != NULL ? (size_t)found.n : 0;
  hello.devices = dev_ptrs;
  hello.requested_rank = requested_rank;
  hello.restart = (uint32_t)restart;
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_HELLO;
  env.hello = &hello;
  int sent = mr_client_send(c, &env);
  free(dev_ptrs);
  free(devs);
  mr_devices_close(&found);
  MR_TRY(sent);
  Meshrun__Envelope *w;
  int rc = expect(c, MESHRUN__ENVELOPE__MSG_WELCOME, &w);
  if (rc == MR_ECLOSED)
    return mr_error_set(MR_ECLOSED, "the coordinator refused our registration");
  if (rc < 0)
    return rc;
  c->rank = w->welcome->rank;
  c->world_size = w->welcome->world_size;
  c->local_rank = w->welcome->local_rank;
  c->local_world_size = w->welcome->local_world_size;
  c->restart = (int)w->welcome->restart;
  snprintf(c->job_id, sizeof c->job_id, "%s", w->welcome->job_id ? w->welcome->job_id : "");
  mr_rpc_free(w);
  MR_TRY(expect(c, MESHRUN__ENVELOPE__MSG_PLAN, &c->plan_env));
  c->plan = c->plan_env->plan;
  return 0;
}

#define CLOCK_PROBES 8

int mr_client_clock_offset(struct mr_client *c, int64_t *offset_ns, uint64_t *error_ns) {
  struct mr_clock_sample smp[CLOCK_PROBES];
  for (int i = 0; i < CLOCK_PROBES; i++) {
    Meshrun__ClockProbe probe = MESHRUN__CLOCK_PROBE__INIT;
    smp[i].t0 = mr_clock_ns();
    probe.worker_ns = (uint64_t)smp[i].t0;
    Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
    env.msg_case = MESHRUN__ENVELOPE__MSG_CLOCK_PROBE;
    env.clock_probe = &probe;
    MR_TRY(mr_client_send(c, &env));
    Meshrun__Envelope *got;
    MR_TRY(expect(c, MESHRUN__ENVELOPE__MSG_CLOCK_PROBE, &got));
    smp[i].t1 = mr_clock_ns();
    smp[i].peer = (int64_t)got->clock_probe->coordinator_ns;
    if (got->clock_probe->worker_ns != probe.worker_ns) /* not this probe's answer */
      smp[i].t1 = smp[i].t0 - 1;
    mr_rpc_free(got);
  }
  if (mr_clock_offset(smp, CLOCK_PROBES, offset_ns, error_ns) < 0)
    return mr_error_set(MR_EPROTO, "the coordinator's clock answers did not match the probes");
  return 0;
}

static void send_heartbeat(struct mr_client *c) {
  Meshrun__Heartbeat hb = MESHRUN__HEARTBEAT__INIT;
  char detail[160];
  pthread_mutex_lock(&c->pos_lock);
  hb.step = c->step;
  hb.last_done = c->last_done;
  hb.waiting_on = c->waiting_on;
  hb.state = c->state;
  hb.checkpoint_bytes = atomic_load(&c->checkpoint_bytes);
  hb.comm_done = atomic_load(&c->comm_done);
  memcpy(detail, c->waiting_detail, sizeof detail);
  pthread_mutex_unlock(&c->pos_lock);
  char comm[160] = "", buf[160];
  pthread_mutex_lock(&c->probe_lock);
  if (c->blocked_probe != NULL)
    snprintf(comm, sizeof comm, "%s", c->blocked_probe(c->blocked_ctx, buf, sizeof buf));
  pthread_mutex_unlock(&c->probe_lock);
  if (comm[0] != '\0') {
    /* what the comm backend is blocked on (the operation, and who has not
     * arrived) first, then the instruction waiting for it */
    char instr[160];
    memcpy(instr, detail, sizeof instr);
    if (hb.waiting_on < 0) {
      hb.waiting_on = hb.last_done + 1;
      memcpy(detail, comm, sizeof detail);
    } else {
      snprintf(detail, sizeof detail, "%.99s; in %.55s", comm, instr);
    }
  }
  hb.waiting_detail = detail;
  hb.memory_bytes = rss_bytes();
  hb.time_us = (uint64_t)mr_clock_us();
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_HEARTBEAT;
  env.heartbeat = &hb;
  mr_client_send(c, &env);
}

/* The connection is gone: the job stops as on a stop request (every wait
 * breaks off, a rendezvous gives up), and main exits 1. */
static void coordinator_gone(struct mr_client *c, const char *why) {
  if (atomic_load(&c->shutting_down))
    return;
  MR_ERROR("rpc", "lost the coordinator (%s): exiting", why);
  atomic_store(&c->coordinator_lost, 1);
  atomic_store(&c->stop_requested, 1);
}

static void handle(struct mr_client *c, Meshrun__Envelope *env) {
  switch (env->msg_case) {
  case MESHRUN__ENVELOPE__MSG_CONTROL:
    if (env->control->kind == MESHRUN__CONTROL__KIND__STOP)
      atomic_store(&c->stop_requested, 1);
    else if (env->control->kind == MESHRUN__CONTROL__KIND__CHECKPOINT_NOW)
      atomic_store(&c->checkpoint_requested, 1);
    mr_rpc_free(env);
    return;
  case MESHRUN__ENVELOPE__MSG_RENDEZVOUS_DONE: {
    struct mr_rdv_result *r = malloc(sizeof *r);
    if (r == NULL) {
      mr_rpc_free(env);
      return;
    }
    r->env = env;
    pthread_mutex_lock(&c->rdv_lock);
    r->next = c->rdv;
    c->rdv = r;
    pthread_cond_broadcast(&c->rdv_cond);
    pthread_mutex_unlock(&c->rdv_lock);
    return;
  }
  default:
    MR_WARN("rpc", "ignoring unexpected %s from the coordinator", mr_rpc_name(env));
    mr_rpc_free(env);
  }
}

static void *rpc_main(void *arg) {
  struct mr_client *c = arg;
  int interval = (int)mr_tunable_int(MR_TUNABLE_HEARTBEAT_MS);
  uint64_t next = (uint64_t)mr_clock_us();
  while (!atomic_load(&c->shutting_down) && !atomic_load(&c->coordinator_lost)) {
    uint64_t t = (uint64_t)mr_clock_us();
    if (t >= next) {
      send_heartbeat(c);
      next = t + (uint64_t)interval * 1000u;
    }
    /* drain whole frames already buffered before blocking */
    const uint8_t *payload;
    size_t len;
    int got = mr_frame_reader_next(&c->reader, &payload, &len);
    if (got < 0) {
      coordinator_gone(c, mr_error_message());
      break;
    }
    if (got == 1) {
      Meshrun__Envelope *env;
      if (mr_rpc_decode(payload, len, &env) < 0)
        coordinator_gone(c, mr_error_message());
      else
        handle(c, env);
      continue;
    }
    int wait_ms = (int)((next - (uint64_t)mr_clock_us()) / 1000u) + 1;
    struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
    int pr = poll(&pfd, 1, wait_ms);
    if (pr < 0 && errno != EINTR) {
      coordinator_gone(c, strerror(errno));
      break;
    }
    if (pr <= 0)
      continue;
    uint8_t chunk[16384];
    ssize_t n = recv(c->fd, chunk, sizeof chunk, 0);
    if (n == 0) {
      coordinator_gone(c, "connection closed");
      break;
    }
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN)
        continue;
      coordinator_gone(c, strerror(errno));
      break;
    }
    if (mr_frame_reader_feed(&c->reader, chunk, (size_t)n) < 0)
      coordinator_gone(c, "out of memory");
  }
  return NULL;
}

int mr_client_start(struct mr_client *c) {
  if (pthread_create(&c->thread, NULL, rpc_main, c) != 0)
    return mr_error_set(MR_ESYS, "cannot start the RPC thread");
  c->thread_started = 1;
  return 0;
}

void mr_client_set_position(struct mr_client *c, int64_t step, int64_t last_done,
                            int64_t waiting_on, const char *detail) {
  pthread_mutex_lock(&c->pos_lock);
  c->step = step;
  c->last_done = last_done;
  c->waiting_on = waiting_on;
  snprintf(c->waiting_detail, sizeof c->waiting_detail, "%s", detail ? detail : "");
  pthread_mutex_unlock(&c->pos_lock);
}

void mr_client_set_blocked_probe(struct mr_client *c,
                                 const char *(*probe)(void *ctx, char *buf, size_t len),
                                 void *ctx) {
  pthread_mutex_lock(&c->probe_lock);
  c->blocked_probe = probe;
  c->blocked_ctx = ctx;
  pthread_mutex_unlock(&c->probe_lock);
}

void mr_client_set_state(struct mr_client *c, Meshrun__Heartbeat__State state) {
  pthread_mutex_lock(&c->pos_lock);
  c->state = state;
  pthread_mutex_unlock(&c->pos_lock);
}

int mr_client_rendezvous(struct mr_client *c, const char *key, const void *blob,
                         size_t len, ProtobufCBinaryData **blobs, int timeout_ms) {
  Meshrun__Rendezvous rv = MESHRUN__RENDEZVOUS__INIT;
  rv.key = (char *)key;
  rv.blob.data = (uint8_t *)blob;
  rv.blob.len = len;
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_RENDEZVOUS;
  env.rendezvous = &rv;
  MR_TRY(mr_client_send(c, &env));
  struct timespec deadline;
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += timeout_ms / 1000;
  deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec++;
    deadline.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&c->rdv_lock);
  for (;;) {
    for (struct mr_rdv_result **pp = &c->rdv; *pp != NULL; pp = &(*pp)->next) {
      struct mr_rdv_result *r = *pp;
      if (strcmp(r->env->rendezvous_done->key, key) != 0)
        continue;
      *pp = r->next;
      pthread_mutex_unlock(&c->rdv_lock);
      Meshrun__RendezvousDone *d = r->env->rendezvous_done;
      int rc = 0;
      if ((int)d->n_blobs != c->world_size) {
        rc = mr_error_set(MR_EPROTO, "rendezvous \"%s\" returned %zu blobs for %d ranks", key,
                          d->n_blobs, c->world_size);
      } else {
        ProtobufCBinaryData *out = calloc(d->n_blobs, sizeof *out);
        for (size_t i = 0; out != NULL && i < d->n_blobs; i++) {
          out[i].len = d->blobs[i].len;
          out[i].data = malloc(d->blobs[i].len + 1);
          if (out[i].data != NULL && d->blobs[i].len > 0)
            memcpy(out[i].data, d->blobs[i].data, d->blobs[i].len);
        }
        *blobs = out;
        rc = out != NULL ? 0 : MR_ENOMEM;
      }
      mr_rpc_free(r->env);
      free(r);
      return rc;
    }
    if (atomic_load(&c->stop_requested)) {
      pthread_mutex_unlock(&c->rdv_lock);
      return mr_error_set(MR_ECANCELED, "stopped while in rendezvous \"%s\"", key);
    }
    /* wake up now and then to notice a stop request */
    struct timespec slice;
    clock_gettime(CLOCK_REALTIME, &slice);
    slice.tv_nsec += 20 * 1000000L;
    if (slice.tv_nsec >= 1000000000L) {
      slice.tv_sec++;
      slice.tv_nsec -= 1000000000L;
    }
    int past = slice.tv_sec > deadline.tv_sec ||
               (slice.tv_sec == deadline.tv_sec && slice.tv_nsec >= deadline.tv_nsec);
    if (pthread_cond_timedwait(&c->rdv_cond, &c->rdv_lock, past ? &deadline : &slice) ==
            ETIMEDOUT && past) {
      pthread_mutex_unlock(&c->rdv_lock);
      return mr_error_set(MR_ETIMEDOUT, "rendezvous \"%s\" timed out after %.1f s", key,
                          timeout_ms / 1000.0);
    }
  }
}

void mr_client_free_blobs(ProtobufCBinaryData *blobs, int n) {
  for (int i = 0; blobs != NULL && i < n; i++)
    free(blobs[i].data);
  free(blobs);
}

void mr_client_report_error(struct mr_client *c, int code, const char *message) {
  Meshrun__Report__Error err = MESHRUN__REPORT__ERROR__INIT;
  err.code = code;
  err.message = (char *)message;
  Meshrun__Report rep = MESHRUN__REPORT__INIT;
  rep.what_case = MESHRUN__REPORT__WHAT_ERROR;
  rep.error = &err;
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_REPORT;
  env.report = &rep;
  mr_client_send(c, &env);
}

int mr_client_report_done(struct mr_client *c, int64_t steps, const void *result,
                          size_t len) {
  Meshrun__Report__Done done = MESHRUN__REPORT__DONE__INIT;
  done.steps = steps;
  done.result.data = (uint8_t *)result;
  done.result.len = len;
  Meshrun__Report rep = MESHRUN__REPORT__INIT;
  rep.what_case = MESHRUN__REPORT__WHAT_DONE;
  rep.done = &done;
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_REPORT;
  env.report = &rep;
  return mr_client_send(c, &env);
}

static void reporter_step(void *ctx, const struct mr_step_report *r) {
  struct mr_client *c = ctx;
  Meshrun__Metrics m = MESHRUN__METRICS__INIT;
  m.step = r->step;
  m.loss = r->loss;
  m.lr = r->lr;
  m.grad_norm = r->grad_norm;
  m.tokens_per_s = r->tokens_per_s;
  m.loss_scale = r->loss_scale;
  m.peak_memory_bytes = r->peak_memory_bytes;
  m.step_time_s = r->step_time_s;
  m.comm_wait_s = r->comm_wait_s;
  m.skipped = r->skipped != 0;
  m.val_loss = r->val_loss;
  m.stage = r->stage;
  m.micro_work_s = r->micro_work_s;
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_METRICS;
  env.metrics = &m;
  mr_client_send(c, &env);
  pthread_mutex_lock(&c->pos_lock);
  c->step = r->step;
  pthread_mutex_unlock(&c->pos_lock);
}

static void reporter_progress(void *ctx, int64_t step, int64_t last_done,
                              int64_t waiting_on, const char *detail) {
  mr_client_set_position(ctx, step, last_done, waiting_on, detail);
}

static void reporter_checkpoint_wait(void *ctx, int waiting) {
  mr_client_set_state(ctx, waiting ? MESHRUN__HEARTBEAT__STATE__CHECKPOINTING
                                   : MESHRUN__HEARTBEAT__STATE__RUNNING);
}

static void reporter_running(void *ctx) {
  mr_client_set_state(ctx, MESHRUN__HEARTBEAT__STATE__RUNNING);
}

static int reporter_stop(void *ctx) {
  struct mr_client *c = ctx;
  return atomic_load(&c->stop_requested);
}

static int reporter_checkpoint(void *ctx) {
  struct mr_client *c = ctx;
  return atomic_exchange(&c->checkpoint_requested, 0);
}

static void reporter_checkpoint_written(void *ctx, int64_t step, const char *const *files,
                                        const char *const *checksum, int n) {
  struct mr_client *c = ctx;
  Meshrun__Report__CheckpointWritten cw = MESHRUN__REPORT__CHECKPOINT_WRITTEN__INIT;
  cw.step = step;
  cw.n_files = (size_t)n;
  cw.files = (char **)files;
  cw.n_checksum = (size_t)n;
  cw.checksum = (char **)checksum;
  Meshrun__Report rep = MESHRUN__REPORT__INIT;
  rep.what_case = MESHRUN__REPORT__WHAT_CHECKPOINT;
  rep.checkpoint = &cw;
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_REPORT;
  env.report = &rep;
  mr_client_send(c, &env);
}

void mr_client_reporter(struct mr_client *c, struct mr_reporter *out) {
  out->ctx = c;
  out->step = reporter_step;
  out->progress = reporter_progress;
  out->stop_requested = reporter_stop;
  out->checkpoint_requested = reporter_checkpoint;
  out->checkpoint_written = reporter_checkpoint_written;
  out->checkpoint_bytes = &c->checkpoint_bytes;
  out->comm_done = &c->comm_done;
  out->checkpoint_wait = reporter_checkpoint_wait;
  out->running = reporter_running;
}

void mr_client_close(struct mr_client *c) {
  atomic_store(&c->shutting_down, 1);
  if (c->fd >= 0)
    shutdown(c->fd, SHUT_RDWR);
  if (c->thread_started)
    pthread_join(c->thread, NULL);
  if (c->fd >= 0)
    close(c->fd);
  c->fd = -1;
  while (c->rdv != NULL) {
    struct mr_rdv_result *r = c->rdv;
    c->rdv = r->next;
    mr_rpc_free(r->env);
    free(r);
  }
  mr_rpc_free(c->plan_env);
  c->plan_env = NULL;
  c->plan = NULL;
  mr_frame_reader_close(&c->reader);
}
