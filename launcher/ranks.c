/* ranks.c - worker processes: spawn, output, exits, progress. */
#include "launcher/ranks.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/tunable.h"
#include "launcher/conn.h"

extern char **environ;

int mr_ranks_init(struct mr_ranks *s, uv_loop_t *loop, int n, int local, int base,
                  const char *log_dir, void *ctx, void (*on_exit)(void *, int, int64_t, int)) {
  memset(s, 0, sizeof *s);
  s->r = calloc((size_t)n, sizeof *s->r);
  if (s->r == NULL)
    return mr_error_set(MR_ENOMEM, "out of memory for %d ranks", n);
  s->loop = loop;
  s->n = s->cap = n;
  s->local = local;
  s->log_dir = log_dir;
  s->ctx = ctx;
  s->on_exit = on_exit;
  s->tty = isatty(STDOUT_FILENO);
  s->start_ms = mr_clock_ms();
  for (int i = 0; i < n; i++) {
    s->r[i].set = s;
    s->r[i].waiting_on = -1;
  }
  mr_ranks_renumber(s, n, base);
  return 0;
}

void mr_ranks_renumber(struct mr_ranks *s, int n, int base) {
  s->n = n < s->cap ? n : s->cap;
  for (int i = 0; i < s->cap; i++) {
    if (s->r[i].rank != base + i && s->r[i].log != NULL) { /* another rank's log now */
      fclose(s->r[i].log);
      s->r[i].log = NULL;
    }
    s->r[i].rank = base + i;
    s->r[i].remote = i >= s->local;
    s->r[i].exited = 1;
  }
}

void mr_ranks_close(struct mr_ranks *s) {
  for (int i = 0; i < s->cap; i++)
    if (s->r[i].log != NULL)
      fclose(s->r[i].log);
  free(s->r);
  s->r = NULL;
  s->n = 0;
}

static void clear_progress(struct mr_ranks *s) {
  if (s->progress_shown) {
    fputs("\r\033[K", stdout);
    s->progress_shown = 0;
  }
}

static void keep_tail(struct mr_rank *r, const char *line, size_t len) {
  if (len >= sizeof r->tail[0])
    len = sizeof r->tail[0] - 1;
  memcpy(r->tail[r->tail_pos], line, len);
  r->tail[r->tail_pos][len] = '\0';
  r->tail_pos = (r->tail_pos + 1) % MR_TAIL_LINES_MAX;
  if (r->tail_n < MR_TAIL_LINES_MAX)
    r->tail_n++;
}

static void emit_line(struct mr_rank *r, const char *line, size_t len) {
  clear_progress(r->set);
  printf("[rank %d] %.*s\n", r->rank, (int)len, line);
  fflush(stdout);
  if (r->log != NULL) {
    fprintf(r->log, "%.*s\n", (int)len, line);
    fflush(r->log);
  }
  keep_tail(r, line, len);
}

static void feed_lines(struct mr_rank *r, struct mr_line_buf *b, const char *data,
                       size_t n) {
  for (size_t i = 0; i < n; i++) {
    char ch = data[i];
    if (ch == '\n' || b->len == sizeof b->buf) {
      emit_line(r, b->buf, b->len);
      b->len = 0;
      if (ch == '\n')
        continue;
    }
    b->buf[b->len++] = ch;
  }
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  (void)h;
  (void)suggested;
  static char slab[65536];
  *buf = uv_buf_init(slab, sizeof slab);
}

static void on_handle_closed(uv_handle_t *h) {
  struct mr_rank *r = h->data;
  r->handles_open--;
}

static void on_output(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf) {
  struct mr_rank *r = stream->data;
  struct mr_line_buf *b = stream == (uv_stream_t *)&r->out ? &r->obuf : &r->ebuf;
  if (nread > 0) {
    feed_lines(r, b, buf->base, (size_t)nread);
    return;
  }
  if (nread < 0) {
    if (b->len > 0) {
      emit_line(r, b->buf, b->len);
      b->len = 0;
    }
    uv_close((uv_handle_t *)stream, on_handle_closed);
  }
}

static void on_process_exit(uv_process_t *p, int64_t status, int signal) {
  struct mr_rank *r = p->data;
  r->running = 0;
  r->exited = 1;
  r->exit_status = status;
  r->term_signal = signal;
  uv_close((uv_handle_t *)p, on_handle_closed);
  MR_DEBUG("launch", "rank %d (pid %d) exited: status %lld signal %d", r->rank, r->pid,
           (long long)status, signal);
  r->set->on_exit(r->set->ctx, (int)(r - r->set->r), status, signal);
}

/* The parent's environment with our variables replacing any of the same
 * name.  Returned array and strings are malloc'd; free with free_env. */
static char **build_env(const struct mr_spawn_env *e, int rank, int local_rank,
                        int local_world) {
  char vars[18][1200];
  int nv = 0;
  snprintf(vars[nv++], sizeof vars[0], "RANK=%d", rank);
  snprintf(vars[nv++], sizeof vars[0], "LOCAL_RANK=%d", local_rank);
  snprintf(vars[nv++], sizeof vars[0], "WORLD_SIZE=%d", e->world);
  snprintf(vars[nv++], sizeof vars[0], "LOCAL_WORLD_SIZE=%d", local_world);
  snprintf(vars[nv++], sizeof vars[0], "GROUP_RANK=%d", rank / local_world); /* the node */
  snprintf(vars[nv++], sizeof vars[0], "GROUP_WORLD_SIZE=%d", e->world / local_world);
  snprintf(vars[nv++], sizeof vars[0], "MASTER_ADDR=%s", e->master_addr);
  snprintf(vars[nv++], sizeof vars[0], "MASTER_PORT=%d", e->master_port);
  snprintf(vars[nv++], sizeof vars[0], "MESHRUN_COORD=%s", e->coord_address);
  snprintf(vars[nv++], sizeof vars[0], "MESHRUN_TOKEN_FD=3");
  snprintf(vars[nv++], sizeof vars[0], "MESHRUN_JOB_ID=%s", e->job_id);
  snprintf(vars[nv++], sizeof vars[0], "MESHRUN_RESTART=%d", e->restart);
  snprintf(vars[nv++], sizeof vars[0], "MESHRUN_LAUNCHER_PID=%d", (int)getpid());
  snprintf(vars[nv++], sizeof vars[0], "MESHRUN_THREADS=%d", e->threads);
  snprintf(vars[nv++], sizeof vars[0], "MESHRUN_LOG_DIR=%s", e->log_dir);
  /* our kernels own the threads; keep BLAS and OpenMP from adding more */
  snprintf(vars[nv++], sizeof vars[0], "OPENBLAS_NUM_THREADS=1");
  snprintf(vars[nv++], sizeof vars[0], "OMP_NUM_THREADS=1");
  size_t n_parent = 0;
  while (environ[n_parent] != NULL)
    n_parent++;
  char **env = calloc(n_parent + (size_t)nv + 1, sizeof *env);
  if (env == NULL)
    return NULL;
  size_t k = 0;
  for (size_t i = 0; i < n_parent; i++) {
    const char *eq = strchr(environ[i], '=');
    size_t name_len = eq ? (size_t)(eq - environ[i]) : strlen(environ[i]);
    int overridden = 0;
    for (int j = 0; j < nv && !overridden; j++)
      overridden = strncmp(vars[j], environ[i], name_len) == 0 && vars[j][name_len] == '=';
    if (!overridden)
      env[k++] = strdup(environ[i]);
  }
  for (int j = 0; j < nv; j++)
    env[k++] = strdup(vars[j]);
  env[k] = NULL;
  return env;
}

static void free_env(char **env) {
  for (size_t i = 0; env != NULL && env[i] != NULL; i++)
    free(env[i]);
  free(env);
}

/* A rank of a new group (pid 0: a remote one): nothing known of it yet,
 * its registration clock started. */
static void begin_group(struct mr_rank *r, int pid) {
  r->exited = 0;
  r->done = 0;
  r->error[0] = '\0';
  r->exit_status = 0;
  r->term_signal = 0;
  r->pid = pid;
  r->conn = NULL;
  r->registered = 0;
  r->spawn_ms = r->last_seen_ms = r->progress_ms = mr_clock_ms();
  r->oom_kills = mr_oom_kill_count();
  r->last_done = 0;
  r->step = 0;
  r->waiting_on = -1;
  r->busy_n = r->slow_streak = r->slow_named = 0;
  r->busy_s = r->step_s = 0;
}

static int spawn_one(struct mr_ranks *s, int i, const struct mr_spawn_env *e) {
  struct mr_rank *r = &s->r[i];
  if (r->log == NULL) {
    char path[1024];
    snprintf(path, sizeof path, "%s/rank-%d.log", s->log_dir, r->rank);
    r->log = fopen(path, "a");
    if (r->log == NULL)
      return mr_error_set(MR_EIO, "%s: %s", path, strerror(errno));
  }
  if (e->restart > 0 && r->log != NULL)
    fprintf(r->log, "---- restart %d ----\n", e->restart);
  uv_pipe_init(s->loop, &r->out, 0);
  uv_pipe_init(s->loop, &r->err, 0);
  r->out.data = r->err.data = r->proc.data = r;
  r->obuf.len = r->ebuf.len = 0;
  uv_stdio_container_t stdio[4];
  stdio[0].flags = UV_IGNORE;
  stdio[1].flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE;
  stdio[1].data.stream = (uv_stream_t *)&r->out;
  stdio[2].flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE;
  stdio[2].data.stream = (uv_stream_t *)&r->err;
  stdio[3].flags = UV_INHERIT_FD;
  stdio[3].data.fd = e->token_fd;
  char **env = build_env(e, r->rank, i, s->local);
  char *args[] = {(char *)e->worker_bin, NULL};
  uv_process_options_t po;
  memset(&po, 0, sizeof po);
  po.file = e->worker_bin;
  po.args = args;
  po.env = env;
  po.stdio_count = 4;
  po.stdio = stdio;
  po.exit_cb = on_process_exit;
  int rc = env != NULL ? uv_spawn(s->loop, &r->proc, &po) : UV_ENOMEM;
  free_env(env);
  if (rc < 0) {
    r->handles_open = 3;
    uv_close((uv_handle_t *)&r->out, on_handle_closed);
    uv_close((uv_handle_t *)&r->err, on_handle_closed);
    uv_close((uv_handle_t *)&r->proc, on_handle_closed);
    return mr_error_set(MR_ESYS, "spawning %s for rank %d: %s", e->worker_bin, r->rank,
                        uv_strerror(rc));
  }
  r->handles_open = 3;
  r->running = 1;
  begin_group(r, r->proc.pid);
  uv_read_start((uv_stream_t *)&r->out, on_alloc, on_output);
  uv_read_start((uv_stream_t *)&r->err, on_alloc, on_output);
  return 0;
}

int mr_ranks_spawn_all(struct mr_ranks *s, const struct mr_spawn_env *env) {
  s->have_last = 0;
  for (int i = s->local; i < s->n; i++)
    begin_group(&s->r[i], 0);
  for (int i = 0; i < s->local; i++) {
    int rc = spawn_one(s, i, env);
    if (rc < 0)
      return rc;
  }
  return 0;
}

void mr_ranks_signal(struct mr_ranks *s, int i, int sig) {
  if (s->r[i].running)
    uv_process_kill(&s->r[i].proc, sig);
}

void mr_ranks_signal_all(struct mr_ranks *s, int sig) {
  for (int i = 0; i < s->n; i++)
    mr_ranks_signal(s, i, sig);
}

void mr_ranks_send_control(struct mr_ranks *s, Meshrun__Control__Kind kind) {
  Meshrun__Control ctl = MESHRUN__CONTROL__INIT;
  ctl.kind = kind;
  Meshrun__Envelope env = MESHRUN__ENVELOPE__INIT;
  env.msg_case = MESHRUN__ENVELOPE__MSG_CONTROL;
  env.control = &ctl;
  for (int i = 0; i < s->n; i++)
    if (s->r[i].conn != NULL)
      mr_conn_send(s->r[i].conn, &env);
}

void mr_ranks_close_conns(struct mr_ranks *s) {
  for (int i = 0; i < s->n; i++)
    if (s->r[i].conn != NULL)
      mr_conn_close(s->r[i].conn, NULL);
}

int mr_ranks_all_exited(const struct mr_ranks *s) {
  for (int i = 0; i < s->n; i++)
    if (s->r[i].remote ? !s->r[i].exited : s->r[i].running)
      return 0;
  return 1;
}

int mr_ranks_all_closed(const struct mr_ranks *s) {
  for (int i = 0; i < s->n; i++)
    if (s->r[i].handles_open > 0)
      return 0;
  return 1;
}

void mr_ranks_heartbeat(struct mr_ranks *s, int rank, const Meshrun__Heartbeat *hb) {
  struct mr_rank *r = &s->r[rank];
  /* a checkpoint being written is progress: a save slower than the steps
   * between two makes the next wait for it, and a large one on a slow disk
   * can take longer than the hang timeout.  So are collectives completing:
   * a step's gradient sync is one instruction that waits on all of them */
  int starting = hb->state == MESHRUN__HEARTBEAT__STATE__STARTING;
  if (hb->step != r->step || hb->last_done != r->last_done ||
      hb->checkpoint_bytes != r->checkpoint_bytes || hb->comm_done != r->comm_done ||
      starting != r->starting)
    r->progress_ms = mr_clock_ms(); /* leaving STARTING too: the hang clock starts */
  r->starting = starting;
  r->checkpoint_bytes = hb->checkpoint_bytes;
  r->comm_done = hb->comm_done;
  r->checkpoint_waiting = hb->state == MESHRUN__HEARTBEAT__STATE__CHECKPOINTING;
  r->step = hb->step;
  r->last_done = hb->last_done;
  r->waiting_on = hb->waiting_on;
  snprintf(r->waiting_detail, sizeof r->waiting_detail, "%s",
           hb->waiting_detail != NULL ? hb->waiting_detail : "");
  if (hb->memory_bytes > r->rss_peak)
    r->rss_peak = hb->memory_bytes;
}

/* Where rank r is, without its number, into buf. */
static void describe_position(const struct mr_rank *r, char *buf, size_t n) {
  if (r->exited)
    snprintf(buf, n, "%s", r->remote ? "gone" : "exited");
  else if (r->checkpoint_waiting)
    snprintf(buf, n, "step %lld, completed #%lld, waits on its own checkpoint write (%.1f MiB "
             "written by this rank's writer so far)", (long long)r->step,
             (long long)r->last_done, (double)r->checkpoint_bytes / 1048576.0);
  else if (r->waiting_on >= 0)
    snprintf(buf, n, "step %lld, completed #%lld, waits on #%lld: %s", (long long)r->step,
             (long long)r->last_done, (long long)r->waiting_on,
             r->waiting_detail[0] ? r->waiting_detail : "?");
  else
    snprintf(buf, n, "step %lld, completed #%lld, waits on nothing: busy or stuck in its own "
             "work (instruction #%lld)", (long long)r->step, (long long)r->last_done,
             (long long)r->last_done + 1);
}

#define POSITION_MAX 320

void mr_ranks_describe_positions(const struct mr_ranks *s, char *buf, size_t n) {
  buf[0] = '\0';
  char (*pos)[POSITION_MAX] = malloc((size_t)s->n * sizeof *pos);
  unsigned char *told = calloc((size_t)s->n, 1);
  size_t used = 0;
  for (int i = 0; pos != NULL && told != NULL && i < s->n; i++)
    describe_position(&s->r[i], pos[i], sizeof pos[i]);
  /* ranks at the same place on one line, "ranks 0-2,5: ...", in rank order */
  for (int i = 0; pos != NULL && told != NULL && i < s->n && used + 1 < n; i++) {
    if (told[i])
      continue;
    int same = 0;
    for (int j = i; j < s->n; j++)
      same += !told[j] && strcmp(pos[j], pos[i]) == 0;
    used += (size_t)snprintf(buf + used, n - used, "\n  rank%s ", same > 1 ? "s" : "");
    for (int j = i, first = 1; j < s->n && used + 1 < n; j++) {
      if (told[j] || strcmp(pos[j], pos[i]) != 0)
        continue;
      int k = j; /* a run of ranks at this place: j..k */
      while (k + 1 < s->n && !told[k + 1] && strcmp(pos[k + 1], pos[i]) == 0)
        told[++k] = 1;
      told[j] = 1;
      if (k == j)
        used += (size_t)snprintf(buf + used, n - used, "%s%d", first ? "" : ",", s->r[j].rank);
      else
        used += (size_t)snprintf(buf + used, n - used, "%s%d-%d", first ? "" : ",",
                                 s->r[j].rank, s->r[k].rank);
      first = 0;
      j = k;
    }
    if (used + 1 < n)
      used += (size_t)snprintf(buf + used, n - used, ": %s", pos[i]);
  }
  if (used >= n && n > 4) /* cut short: say so */
    memcpy(buf + n - 4, "...", 4);
  free(pos);
  free(told);
}

static void format_duration(double s, char *buf, size_t n) {
  if (!isfinite(s) || s < 0)
    snprintf(buf, n, "?");
  else if (s < 60)
    snprintf(buf, n, "%.0fs", s);
  else if (s < 3600)
    snprintf(buf, n, "%dm%02ds", (int)(s / 60), (int)s % 60);
  else
    snprintf(buf, n, "%dh%02dm", (int)(s / 3600), ((int)s % 3600) / 60);
}

void mr_ranks_progress(struct mr_ranks *s, const Meshrun__Metrics *m, uint64_t peak,
                       int64_t steps_total, int64_t log_interval) {
  s->last = *m;
  s->have_last = 1;
  s->steps_total = steps_total;
  if (log_interval < 1)
    log_interval = 1;
  int last = steps_total > 0 && m->step >= steps_total;
  if (!s->tty && m->step % log_interval != 0 && !last)
    return;
  double eta = m->step_time_s * (double)(steps_total - m->step);
  char eta_s[32];
  format_duration(eta, eta_s, sizeof eta_s);
  char val[48] = "";
  if (!isnan(m->val_loss))
    snprintf(val, sizeof val, " val %.4f", m->val_loss);
  char scale[48] = "";
  if (m->loss_scale != 1.0 && m->loss_scale != 0.0)
    snprintf(scale, sizeof scale, " scale %g%s", m->loss_scale, m->skipped ? " (skipped)" : "");
  if (s->tty) {
    printf("\r\033[Kstep %lld/%lld  loss %.4f%s  %.0f tok/s  lr %.2e%s  mem %.0f MiB  ETA %s",
           (long long)m->step, (long long)steps_total, m->loss, val, m->tokens_per_s, m->lr,
           scale, (double)peak / 1048576.0, eta_s);
    s->progress_shown = 1;
    if (last) {
      putchar('\n');
      s->progress_shown = 0;
    }
  } else {
    printf("step %lld/%lld loss %.4f%s tokens/s %.0f lr %.3e grad_norm %.3f%s mem_mib %.0f eta %s\n",
           (long long)m->step, (long long)steps_total, m->loss, val, m->tokens_per_s, m->lr,
           m->grad_norm, scale, (double)peak / 1048576.0, eta_s);
  }
  fflush(stdout);
}

void mr_ranks_report_failure(struct mr_ranks *s, int rank, const char *failure,
                             int max_restarts) {
  clear_progress(s);
  fflush(stdout);
  fprintf(stderr, "meshrun: job failed after %d restart%s: %s\n", max_restarts,
          max_restarts == 1 ? "" : "s", failure[0] ? failure : "workers stopped");
  if (rank < 0 || rank >= s->n)
    return;
  struct mr_rank *r = &s->r[rank];
  if (r->remote) {
    fprintf(stderr, "meshrun: rank %d ran on another node: its log is that node's "
            "%s/rank-%d.log\n", r->rank, s->log_dir, r->rank);
    return;
  }
  int want = (int)mr_tunable_int(MR_TUNABLE_LOG_TAIL_LINES);
  if (want > r->tail_n)
    want = r->tail_n;
  if (want <= 0) {
    fprintf(stderr, "meshrun: rank %d printed nothing (log: %s/rank-%d.log)\n", rank,
            s->log_dir, rank);
    return;
  }
  fprintf(stderr, "meshrun: last %d line%s of rank %d's log (%s/rank-%d.log):\n", want,
          want == 1 ? "" : "s", rank, s->log_dir, rank);
  for (int k = r->tail_n - want; k < r->tail_n; k++) {
    int idx = (r->tail_pos - r->tail_n + k + MR_TAIL_LINES_MAX) % MR_TAIL_LINES_MAX;
    fprintf(stderr, "  | %s\n", r->tail[idx]);
  }
}

void mr_ranks_print_summary(struct mr_ranks *s, double median_s, int n, double predicted_s) {
  clear_progress(s);
  if (!s->have_last)
    return;
  double secs = (double)(mr_clock_ms() - s->start_ms) / 1000.0;
  printf("meshrun: done: %lld steps in %.1f s, final loss %.4f, %.0f tokens/s\n",
         (long long)s->last.step, secs, s->last.loss, s->last.tokens_per_s);
  if (n > 0 && predicted_s > 0) {
    double ratio = median_s / predicted_s;
    printf("meshrun: step time: median %.4g ms over %d steps, predicted %.4g ms "
           "(measured / predicted %.2f)\n", 1e3 * median_s, n, 1e3 * predicted_s, ratio);
    /* a step of a few ms is mostly the fixed costs of a step (waking the
     * ranks, the optimizer's pass, logging) the model does not count */
    if ((ratio > 2.0 || ratio < 0.5) && predicted_s >= 0.01)
      printf("meshrun: the cluster spec the plan was made for does not describe these "
             "devices well; `meshrun calibrate` measures this machine and writes one\n");
  } else if (n > 0) {
    printf("meshrun: step time: median %.4g ms over %d steps\n", 1e3 * median_s, n);
  }
  fflush(stdout);
}

void mr_ranks_credit(struct mr_ranks *s, int64_t ms) {
  for (int i = 0; i < s->n; i++) {
    struct mr_rank *r = &s->r[i];
    r->spawn_ms += ms;
    r->last_seen_ms += ms;
    r->progress_ms += ms;
  }
}

int64_t mr_oom_kill_count(void) {
  FILE *f = fopen("/proc/vmstat", "r");
  char line[128];
  long long n = -1;
  while (f != NULL && fgets(line, sizeof line, f) != NULL)
    if (sscanf(line, "oom_kill %lld", &n) == 1)
      break;
  if (f != NULL)
    fclose(f);
  return n;
}
