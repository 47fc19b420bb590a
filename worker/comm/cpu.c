/* cpu.c - the CPU comm backend's engine: communicator, groups, the per-group
 * FIFO of operations, the progress thread, requests, timeouts and the
 * diagnosis of a blocked operation.
 *
 * One mutex guards everything; whoever holds it (the progress thread, or a
 * thread in wait/test) advances the head operation of every group.  A
 * waiting thread drives progress itself, so a wait never needs a thread
 * switch; the progress thread steps aside while anyone waits and otherwise
 * moves data so that communication overlaps computation. */
#include "worker/comm/cpu.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/test_hooks.h"
#include "common/tunable.h"

struct occurrence {
  char *desc;
  int count;
  struct occurrence *next;
};

struct mr__cpu {
  struct mr_comm base;
  struct mr__cpu_info info;
  struct mr__peer_info *peers; /* (world) */
  char *job_id;
  pthread_mutex_t lock;
  pthread_cond_t wake;
  pthread_t thread;
  int thread_started;
  int stop;
  int sleeping;                /* the progress thread waits on wake */
  _Atomic int waiters;         /* threads in wait() */
  struct mr__group *groups;
  struct occurrence *occ;
  size_t wake_bytes;           /* ops this large wake the progress thread */
  uint64_t moves;              /* times any op advanced: waiters stop backing
                                  off while data moves */
  FILE *trace;                 /* test hook (mr_hook_comm_trace): every op issued */
};

const char *mr__op_name(enum mr__op_kind k) {
  static const char *names[] = {"AllReduce", "ReduceScatter", "AllGather",
                                "Broadcast", "AllToAll",      "Send",
                                "Recv",      "Barrier"};
  return names[k];
}

const struct mr__cpu_info *mr__cpu_info(const struct mr__group *g) {
  return &g->cpu->info;
}

/* ---- progress ---------------------------------------------------------- */

static void format_waiting(const struct mr__group *g, char *buf, size_t len) {
  size_t off = 0;
  int count = 0;
  buf[0] = '\0';
  for (int i = 0; i < g->n && off + 16 < len; i++)
    if (g->waiting[i]) {
      off += (size_t)snprintf(buf + off, len - off, "%s%d", count ? ", " : "",
                              g->ranks[i]);
      count++;
    }
  if (count == 0)
    snprintf(buf, len, "(none identified)");
}

static int count_waiting(const struct mr__group *g) {
  int c = 0;
  for (int i = 0; i < g->n; i++)
    c += g->waiting[i];
  return c;
}

static void finish(struct mr__group *g, struct mr__op *op, int rc) {
  g->head = op->next;
  if (g->head == NULL)
    g->tail = NULL;
  op->next = NULL;
  op->rc = rc;
  free(op->scratch);
  op->scratch = NULL;
  atomic_store_explicit(&op->done, 1, memory_order_release);
}

static void break_group(struct mr__group *g, const char *why) {
  if (g->broken == NULL)
    g->broken = strdup(why);
  if (!mr_comm_stopping())
    MR_ERROR("comm", "%s", why);
  while (g->head != NULL) {
    struct mr__op *op = g->head;
    snprintf(op->err, sizeof op->err, "%s #%llu on group %s not run: %s",
             mr__op_name(op->kind), (unsigned long long)op->seq, g->desc,
             g->broken ? g->broken : why);
    finish(g, op, MR_EPEER);
  }
}

/* Advances g's operations in order; returns how many are still queued. */
static int progress_group(struct mr__group *g) {
  while (g->head != NULL) {
    struct mr__op *op = g->head;
    if (!op->started) {
      op->started = 1;
      memset(g->waiting, 0, (size_t)g->n);
    }
    int phase = op->phase;
    size_t chunk = op->chunk;
    int r = g->tp->progress(g, op);
    if (r != MR__PENDING || phase != op->phase || chunk != op->chunk ||
        op->moved) {
      op->moved = 0;
      g->cpu->moves++;
    }
    if (r == MR__PENDING) {
      /* the clock is read only once an op has to wait, and then on every
       * 64th poll: the fast path of a small op never reads it */
      if (op->start_ns == 0) {
        op->start_ns = mr_clock_ns();
        return 1;
      }
      if ((++op->polls & 63) != 0)
        return 1;
      int64_t waited = mr_clock_ns() - op->start_ns;
      if (mr_comm_stopping()) { /* the rank is stopping: no peer is owed */
        snprintf(op->err, sizeof op->err, "%s #%llu on group %s given up after %.1f s: the "
                 "rank is stopping", mr__op_name(op->kind), (unsigned long long)op->seq,
                 g->desc, (double)waited / 1e9);
        finish(g, op, MR_ECANCELED);
        break_group(g, "the rank is stopping");
        return 0;
      }
      if (waited <= g->cpu->info.timeout_ms * 1000000)
        return 1;
      char who[256];
      format_waiting(g, who, sizeof who);
      snprintf(op->err, sizeof op->err,
               "%s #%llu on group %s timed out after %.1f s: rank%s %s %s not "
               "arrived",
               mr__op_name(op->kind), (unsigned long long)op->seq, g->desc,
               (double)waited / 1e9, count_waiting(g) == 1 ? "" : "s", who,
               count_waiting(g) == 1 ? "has" : "have");
      r = MR_ETIMEDOUT;
    }
    if (r < 0) {
      char why[sizeof op->err];
      memcpy(why, op->err, sizeof why);
      finish(g, op, r);
      break_group(g, why);
      return 0;
    }
    memset(g->waiting, 0, (size_t)g->n);
    finish(g, op, 0);
  }
  return 0;
}

static int progress_all(struct mr__cpu *c) {
  int pending = 0;
  for (struct mr__group *g = c->groups; g != NULL; g = g->next)
    pending += progress_group(g);
  return pending;
}

/* Spins briefly, then yields, then sleeps: ranks may outnumber cores. */
static void backoff(unsigned *spins) {
  unsigned s = (*spins)++;
  if (s < 2000) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  } else if (s < 2200) {
    sched_yield();
  } else {
    struct timespec ts = {0, s < 4000 ? 20000 : 200000};
    nanosleep(&ts, NULL);
  }
}

static void *progress_thread(void *arg) {
  struct mr__cpu *c = arg;
  unsigned spins = 2000; /* the thread itself never busy-spins long */
  uint64_t moves = 0;
  pthread_mutex_lock(&c->lock);
  while (!c->stop) {
    int pending = atomic_load(&c->waiters) == 0 ? progress_all(c) : 1;
    if (pending == 0 || atomic_load(&c->waiters) > 0) {
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_nsec += 2000000; /* small ops do not wake us: poll them */
      if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
      }
      c->sleeping = 1;
      pthread_cond_timedwait(&c->wake, &c->lock, &ts);
      c->sleeping = 0;
      spins = 2000;
      continue;
    }
    if (c->moves != moves) {
      moves = c->moves;
      spins = 2000;
    }
    pthread_mutex_unlock(&c->lock);
    backoff(&spins);
    pthread_mutex_lock(&c->lock);
  }
  pthread_mutex_unlock(&c->lock);
  return NULL;
}

/* ---- requests ---------------------------------------------------------- */

static int cpu_test(struct mr_comm_req *r, int *done) {
  struct mr__op *op = (struct mr__op *)r;
  struct mr__cpu *c = (struct mr__cpu *)r->comm;
  if (!atomic_load_explicit(&op->done, memory_order_acquire)) {
    pthread_mutex_lock(&c->lock);
    progress_all(c);
    pthread_mutex_unlock(&c->lock);
  }
  *done = atomic_load_explicit(&op->done, memory_order_acquire);
  return 0;
}

static int cpu_wait(struct mr_comm_req *r) {
  struct mr__op *op = (struct mr__op *)r;
  struct mr__cpu *c = (struct mr__cpu *)r->comm;
  unsigned spins = 0;
  atomic_fetch_add(&c->waiters, 1);
  uint64_t moves = 0;
  while (!atomic_load_explicit(&op->done,
                               memory_order_acquire)) {
    pthread_mutex_lock(&c->lock);
    progress_all(c);
    if (c->moves != moves) {
      moves = c->moves;
      spins = 0;
    }
    pthread_mutex_unlock(&c->lock);
    if (atomic_load_explicit(&op->done, memory_order_acquire))
      break;
    backoff(&spins);
  }
  atomic_fetch_sub(&c->waiters, 1);
  int rc = op->rc;
  if (rc < 0)
    mr_error_set(rc, "%s", op->err);
  free(op->counts);
  free(op->displs);
  free(op);
  return rc;
}

static int submit(struct mr__group *g, struct mr__op *op, size_t bytes,
                  struct mr_comm_req **req) {
  struct mr__cpu *c = g->cpu;
  op->base.comm = &c->base;
  op->group = g;
  pthread_mutex_lock(&c->lock);
  op->seq = ++g->issued;
  if (c->trace != NULL) /* kind, count, dtype, group, global peer */
    fprintf(c->trace, "%s %zu %s %s %d\n", mr__op_name(op->kind), op->count,
            mr_dtype_name(op->dt), g->desc, op->peer >= 0 ? g->ranks[op->peer] : -1);
  if (g->broken != NULL) {
    snprintf(op->err, sizeof op->err, "%s #%llu on group %s not run: %s",
             mr__op_name(op->kind), (unsigned long long)op->seq, g->desc,
             g->broken);
    op->rc = MR_EPEER;
    op->done = 1;
  } else {
    if (g->tail != NULL)
      g->tail->next = op;
    else
      g->head = op;
    g->tail = op;
    if (c->sleeping && bytes >= c->wake_bytes)
      pthread_cond_signal(&c->wake);
  }
  pthread_mutex_unlock(&c->lock);
  *req = &op->base;
  return 0;
}

static struct mr__op *op_new(enum mr__op_kind kind, const void *send,
                             void *recv, size_t count, enum mr_dtype dt) {
  struct mr__op *op = calloc(1, sizeof *op);
  if (op == NULL)
    return NULL;
  op->kind = kind;
  op->send = send;
  op->recv = recv;
  op->count = count;
  op->dt = dt;
  op->peer = -1;
  return op;
}

static int check_common(struct mr_comm_group *gg, enum mr_dtype dt,
                        const char *what, struct mr_comm_req **req) {
  if (gg == NULL || req == NULL)
    return mr_error_set(MR_EINVAL, "comm %s: NULL group or request", what);
  if ((unsigned)dt >= MR_DTYPE_COUNT)
    return mr_error_set(MR_EINVAL, "comm %s: dtype %d is not a dtype", what,
                        (int)dt);
  *req = NULL;
  return 0;
}

static int check_reduce(enum mr_dtype dt, enum mr_red_op op,
                        const char *what) {
  if (!(dt == MR_F32 || dt == MR_BF16 || dt == MR_F16 || dt == MR_I32 ||
        dt == MR_I64))
    return mr_error_set(MR_ENOTSUP, "comm %s: dtype %s cannot be reduced "
                        "(expected float32, bfloat16, float16, int32, int64)",
                        what, mr_dtype_name(dt));
  if (op != MR_RED_SUM && op != MR_RED_AVG && op != MR_RED_MAX)
    return mr_error_set(MR_EINVAL, "comm %s: reduction %d is not sum, avg or "
                        "max", what, (int)op);
  return 0;
}

static int start_simple(struct mr_comm_group *gg, enum mr__op_kind kind,
                        const void *send, void *recv, size_t count,
                        enum mr_dtype dt, enum mr_red_op red, int peer,
                        size_t bytes, struct mr_comm_req **req) {
  struct mr__group *g = (struct mr__group *)gg;
  struct mr__op *op = op_new(kind, send, recv, count, dt);
  if (op == NULL)
    return mr_error_set(MR_ENOMEM, "comm: out of memory for a request");
  op->red = red;
  op->peer = peer;
  return submit(g, op, bytes, req);
}

static int cpu_all_reduce(struct mr_comm_group *gg, const void *send,
                          void *recv, size_t count, enum mr_dtype dt,
                          enum mr_red_op red, struct mr_comm_req **req) {
  MR_TRY(check_common(gg, dt, "AllReduce", req));
  MR_TRY(check_reduce(dt, red, "AllReduce"));
  return start_simple(gg, MR__ALL_REDUCE, send, recv, count, dt, red, -1,
                      mr__bytes(count, dt), req);
}

static int cpu_reduce_scatter(struct mr_comm_group *gg, const void *send,
                              void *recv, size_t count, enum mr_dtype dt,
                              enum mr_red_op red, struct mr_comm_req **req) {
  MR_TRY(check_common(gg, dt, "ReduceScatter", req));
  MR_TRY(check_reduce(dt, red, "ReduceScatter"));
  return start_simple(gg, MR__REDUCE_SCATTER, send, recv, count, dt, red, -1,
                      mr__bytes(count, dt), req);
}

static int cpu_all_gather(struct mr_comm_group *gg, const void *send,
                          void *recv, size_t count, const size_t *counts,
                          enum mr_dtype dt, struct mr_comm_req **req) {
  MR_TRY(check_common(gg, dt, "AllGather", req));
  struct mr__group *g = (struct mr__group *)gg;
  struct mr__op *op = op_new(MR__ALL_GATHER, send, recv, count, dt);
  if (op == NULL)
    return mr_error_set(MR_ENOMEM, "comm: out of memory for a request");
  op->counts = malloc((size_t)g->n * sizeof(size_t));
  op->displs = malloc((size_t)g->n * sizeof(size_t));
  if (op->counts == NULL || op->displs == NULL) {
    free(op->counts);
    free(op->displs);
    free(op);
    return mr_error_set(MR_ENOMEM, "comm: out of memory for a request");
  }
  size_t total = 0;
  for (int i = 0; i < g->n; i++) {
    op->counts[i] = counts != NULL ? counts[i] : count;
    op->displs[i] = total;
    total += op->counts[i];
  }
  op->count = op->counts[g->me];
  return submit(g, op, mr__bytes(total, dt), req);
}

static int cpu_broadcast(struct mr_comm_group *gg, void *buf, size_t count,
                         enum mr_dtype dt, int root,
                         struct mr_comm_req **req) {
  MR_TRY(check_common(gg, dt, "Broadcast", req));
  struct mr__group *g = (struct mr__group *)gg;
  if (root < 0 || root >= g->n)
    return mr_error_set(MR_EINVAL, "comm Broadcast on %s: root %d is not a "
                        "group rank (0..%d)", g->desc, root, g->n - 1);
  return start_simple(gg, MR__BROADCAST, buf, buf, count, dt, MR_RED_SUM,
                      root, mr__bytes(count, dt), req);
}

static int cpu_all_to_all(struct mr_comm_group *gg, const void *send,
                          void *recv, size_t count, enum mr_dtype dt,
                          struct mr_comm_req **req) {
  MR_TRY(check_common(gg, dt, "AllToAll", req));
  if (send == recv && count > 0)
    return mr_error_set(MR_EINVAL, "comm AllToAll: send and recv must "
                        "differ");
  return start_simple(gg, MR__ALL_TO_ALL, send, recv, count, dt, MR_RED_SUM,
                      -1, mr__bytes(count, dt), req);
}

static int check_peer(struct mr__group *g, int peer, const char *what) {
  if (peer < 0 || peer >= g->n || peer == g->me)
    return mr_error_set(MR_EINVAL, "comm %s on %s: peer %d is not another "
                        "group rank (0..%d, not %d)", what, g->desc, peer,
                        g->n - 1, g->me);
  return 0;
}

static int cpu_send(struct mr_comm_group *gg, const void *buf, size_t count,
                    enum mr_dtype dt, int peer, struct mr_comm_req **req) {
  MR_TRY(check_common(gg, dt, "Send", req));
  MR_TRY(check_peer((struct mr__group *)gg, peer, "Send"));
  return start_simple(gg, MR__SEND, buf, NULL, count, dt, MR_RED_SUM, peer,
                      mr__bytes(count, dt), req);
}

static int cpu_recv(struct mr_comm_group *gg, void *buf, size_t count,
                    enum mr_dtype dt, int peer, struct mr_comm_req **req) {
  MR_TRY(check_common(gg, dt, "Recv", req));
  MR_TRY(check_peer((struct mr__group *)gg, peer, "Recv"));
  return start_simple(gg, MR__RECV, NULL, buf, count, dt, MR_RED_SUM, peer,
                      mr__bytes(count, dt), req);
}

static int cpu_barrier(struct mr_comm_group *gg, struct mr_comm_req **req) {
  MR_TRY(check_common(gg, MR_F32, "Barrier", req));
  return start_simple(gg, MR__BARRIER, NULL, NULL, 0, MR_F32, MR_RED_SUM, -1,
                      0, req);
}

static const char *cpu_blocked(struct mr_comm *cc, char *buf, size_t len) {
  struct mr__cpu *c = (struct mr__cpu *)cc;
  if (len == 0)
    return buf;
  buf[0] = '\0';
  pthread_mutex_lock(&c->lock);
  struct mr__group *oldest = NULL;
  for (struct mr__group *g = c->groups; g != NULL; g = g->next)
    if (g->head != NULL && g->head->start_ns != 0 &&
        (oldest == NULL || g->head->start_ns < oldest->head->start_ns))
      oldest = g;
  if (oldest != NULL) {
    char who[256];
    format_waiting(oldest, who, sizeof who);
    struct mr__op *op = oldest->head;
    snprintf(buf, len, "%s #%llu on group %s: %.1f s, waiting for rank%s %s",
             mr__op_name(op->kind), (unsigned long long)op->seq, oldest->desc,
             (double)(mr_clock_ns() - op->start_ns) / 1e9,
             count_waiting(oldest) == 1 ? "" : "s", who);
  }
  pthread_mutex_unlock(&c->lock);
  return buf;
}

/* ---- groups ------------------------------------------------------------ */

static int cpu_group_rank(const struct mr_comm_group *gg) {
  return ((const struct mr__group *)gg)->me;
}

static int cpu_group_size(const struct mr_comm_group *gg) {
  return ((const struct mr__group *)gg)->n;
}

static int occurrence(struct mr__cpu *c, const char *desc) {
  for (struct occurrence *o = c->occ; o != NULL; o = o->next)
    if (strcmp(o->desc, desc) == 0)
      return o->count++;
  struct occurrence *o = calloc(1, sizeof *o);
  if (o == NULL || (o->desc = strdup(desc)) == NULL) {
    free(o);
    return -1;
  }
  o->count = 1;
  o->next = c->occ;
  c->occ = o;
  return 0;
}

int mr__group_occurrence(struct mr__group *g) {
  pthread_mutex_lock(&g->cpu->lock);
  int r = occurrence(g->cpu, g->desc);
  pthread_mutex_unlock(&g->cpu->lock);
  return r;
}

static void group_release(struct mr__group *g) {
  free(g->name);
  free(g->ranks);
  free(g->waiting);
  free(g->broken);
  free(g);
}

static int cpu_group_new(struct mr_comm *cc, const char *name,
                         const int *ranks, int n,
                         struct mr_comm_group **out) {
  struct mr__cpu *c = (struct mr__cpu *)cc;
  if (name == NULL || ranks == NULL || n <= 0 || n > MR__MAX_GROUP ||
      out == NULL)
    return mr_error_set(MR_EINVAL, "comm group: expected a name and 1..%d "
                        "ranks", MR__MAX_GROUP);
  struct mr__group *g = calloc(1, sizeof *g);
  if (g == NULL)
    return mr_error_set(MR_ENOMEM, "comm group %s: out of memory", name);
  g->base.comm = cc;
  g->base.label = g->desc;
  g->cpu = c;
  g->n = n;
  g->me = -1;
  g->name = strdup(name);
  g->ranks = malloc((size_t)n * sizeof(int));
  g->waiting = calloc((size_t)n, 1);
  if (g->name == NULL || g->ranks == NULL || g->waiting == NULL) {
    group_release(g);
    return mr_error_set(MR_ENOMEM, "comm group %s: out of memory", name);
  }
  size_t off = (size_t)snprintf(g->desc, sizeof g->desc, "%s{", name);
  for (int i = 0; i < n; i++) {
    if (ranks[i] < 0 || ranks[i] >= c->info.world) {
      group_release(g);
      return mr_error_set(MR_EINVAL, "comm group %s: rank %d is outside the "
                          "world (0..%d)", name, ranks[i], c->info.world - 1);
    }
    for (int j = 0; j < i; j++)
      if (ranks[j] == ranks[i]) {
        group_release(g);
        return mr_error_set(MR_EINVAL, "comm group %s: rank %d listed twice",
                            name, ranks[i]);
      }
    g->ranks[i] = ranks[i];
    if (ranks[i] == c->info.rank)
      g->me = i;
    if (off < sizeof g->desc)
      off += (size_t)snprintf(g->desc + off, sizeof g->desc - off, "%s%d",
                              i ? "," : "", ranks[i]);
  }
  if (off < sizeof g->desc)
    snprintf(g->desc + off, sizeof g->desc - off, "}");
  if (g->me < 0) {
    int rc = mr_error_set(MR_EINVAL, "comm group %s: this rank (%d) is not a "
                          "member", g->desc, c->info.rank);
    group_release(g);
    return rc;
  }
  const char *tp = mr_tunable_str(MR_TUNABLE_COMM_TRANSPORT);
  int same_host = 1;
  for (int i = 1; i < n; i++)
    if (strcmp(c->peers[ranks[i]].host, c->peers[ranks[0]].host) != 0)
      same_host = 0;
  if (strcmp(tp, "tcp") == 0) {
    g->tp = &mr__tcp_transport;
  } else if (strcmp(tp, "shm") == 0 || strcmp(tp, "auto") == 0) {
    if (!same_host && strcmp(tp, "shm") == 0) {
      group_release(g);
      return mr_error_set(MR_EINVAL, "comm group %s: MESHRUN_COMM_TRANSPORT="
                          "shm but its ranks are on different hosts", name);
    }
    g->tp = same_host ? &mr__shm_transport : &mr__tcp_transport;
  } else {
    group_release(g);
    return mr_error_set(MR_EINVAL, "MESHRUN_COMM_TRANSPORT=\"%s\": expected "
                        "auto, shm or tcp", tp);
  }
  int rc = g->tp->open(g);
  if (rc < 0) {
    group_release(g);
    return rc;
  }
  pthread_mutex_lock(&c->lock);
  g->next = c->groups;
  c->groups = g;
  pthread_mutex_unlock(&c->lock);
  MR_DEBUG("comm", "group %s: %s", g->desc, g->tp->name);
  *out = &g->base;
  return 0;
}

static void cpu_group_free(struct mr_comm_group *gg) {
  if (gg == NULL)
    return;
  struct mr__group *g = (struct mr__group *)gg;
  struct mr__cpu *c = g->cpu;
  pthread_mutex_lock(&c->lock);
  for (struct mr__group **p = &c->groups; *p != NULL; p = &(*p)->next)
    if (*p == g) {
      *p = g->next;
      break;
    }
  pthread_mutex_unlock(&c->lock);
  g->tp->close(g);
  group_release(g);
}

static int cpu_mem_alloc(struct mr_comm_group *gg, size_t bytes, void **out) {
  struct mr__group *g = (struct mr__group *)gg;
  *out = NULL;
  if (g->tp->mem_alloc != NULL && g->tp->mem_alloc(g, bytes, out) == 0)
    return 0;
  *out = malloc(bytes ? bytes : 1);
  return *out != NULL ? 0 : mr_error_set(MR_ENOMEM, "comm: out of memory "
                                         "for %zu bytes", bytes);
}

static void cpu_mem_free(struct mr_comm_group *gg, void *p) {
  struct mr__group *g = (struct mr__group *)gg;
  if (p == NULL)
    return;
  if (g->tp->mem_free != NULL && g->tp->mem_free(g, p))
    return;
  free(p);
}

/* ---- communicator ------------------------------------------------------ */

static void advertised_addr(char *out, size_t len) {
  const char *a = mr_tunable_str(MR_TUNABLE_COMM_ADDR);
  if (a[0] != '\0') {
    snprintf(out, len, "%s", a);
    return;
  }
  snprintf(out, len, "127.0.0.1");
  char host[256];
  if (gethostname(host, sizeof host) != 0)
    return;
  struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM};
  struct addrinfo *res = NULL;
  if (getaddrinfo(host, NULL, &hints, &res) != 0)
    return;
  for (struct addrinfo *ai = res; ai != NULL; ai = ai->ai_next) {
    struct sockaddr_in *sin = (struct sockaddr_in *)ai->ai_addr;
    if ((ntohl(sin->sin_addr.s_addr) >> 24) == 127)
      continue;
    inet_ntop(AF_INET, &sin->sin_addr, out, (socklen_t)len);
    break;
  }
  freeaddrinfo(res);
}

static int listen_any(int *fd_out, int *port_out) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return mr_error_set(MR_ESYS, "comm: socket: %s", strerror(errno));
  struct sockaddr_in sin = {.sin_family = AF_INET,
                            .sin_addr.s_addr = htonl(INADDR_ANY)};
  socklen_t sl = sizeof sin;
  if (bind(fd, (struct sockaddr *)&sin, sizeof sin) != 0 ||
      listen(fd, 128) != 0 ||
      getsockname(fd, (struct sockaddr *)&sin, &sl) != 0) {
    int e = errno;
    close(fd);
    return mr_error_set(MR_ESYS, "comm: listen: %s", strerror(e));
  }
  *fd_out = fd;
  *port_out = ntohs(sin.sin_port);
  return 0;
}

static void cpu_close(struct mr_comm *cc);

static int cpu_open(const struct mr_bootstrap *bs, struct mr_comm **out) {
  if (bs == NULL || out == NULL || bs->allgather == NULL ||
      bs->world_size <= 0 || bs->rank < 0 || bs->rank >= bs->world_size)
    return mr_error_set(MR_EINVAL, "comm open: expected a bootstrap with a "
                        "rank in 0..world_size-1 and an allgather");
  struct mr__cpu *c = calloc(1, sizeof *c);
  if (c == NULL)
    return mr_error_set(MR_ENOMEM, "comm open: out of memory");
  c->base.ops = mr_comm_cpu_ops();
  pthread_mutex_init(&c->lock, NULL);
  pthread_cond_init(&c->wake, NULL);
  c->info.rank = bs->rank;
  c->info.world = bs->world_size;
  c->info.listen_fd = -1;
  c->info.timeout_ms = mr_tunable_int(MR_TUNABLE_COMM_TIMEOUT_MS);
  c->wake_bytes = 65536;
  c->job_id = strdup(bs->job_id != NULL && bs->job_id[0] ? bs->job_id : "0");
  c->peers = calloc((size_t)bs->world_size, sizeof *c->peers);
  int rc = 0;
  if (c->job_id == NULL || c->peers == NULL) {
    rc = mr_error_set(MR_ENOMEM, "comm open: out of memory");
    goto err;
  }
  for (const char *p = c->job_id; *p; p++)
    if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
          (*p >= '0' && *p <= '9') || *p == '-' || *p == '_')) {
      rc = mr_error_set(MR_EINVAL, "comm open: job id \"%s\": expected "
                        "letters, digits, '-' and '_'", c->job_id);
      goto err;
    }
  c->info.job_id = c->job_id;
  const char *trace = mr_hook_comm_trace();
  if (trace != NULL) {
    char path[4096];
    snprintf(path, sizeof path, "%s.%d", trace, bs->rank);
    if ((c->trace = fopen(path, "a")) == NULL) {
      rc = mr_error_set(mr_from_errno(errno), "%s: %s", path, strerror(errno));
      goto err;
    }
    setvbuf(c->trace, NULL, _IOLBF, 0);
  }
  int port = 0;
  MR_TRY_GOTO(rc, listen_any(&c->info.listen_fd, &port), err);
  struct {
    struct mr__peer_info p;
    uint64_t nonce;
  } mine, *all = NULL;
  memset(&mine, 0, sizeof mine);
  snprintf(mine.p.host, sizeof mine.p.host, "%s",
           bs->host_id != NULL ? bs->host_id : "");
  advertised_addr(mine.p.addr, sizeof mine.p.addr);
  mine.p.port = port;
  if (getrandom(&mine.nonce, sizeof mine.nonce, 0) != sizeof mine.nonce)
    mine.nonce = (uint64_t)mr_clock_ns() ^ ((uint64_t)getpid() << 32);
  all = calloc((size_t)bs->world_size, sizeof *all);
  if (all == NULL) {
    rc = mr_error_set(MR_ENOMEM, "comm open: out of memory");
    goto err;
  }
  rc = bs->allgather(bs->ctx, "comm.open", &mine, sizeof mine, all);
  if (rc < 0) {
    free(all);
    goto err;
  }
  for (int i = 0; i < bs->world_size; i++)
    c->peers[i] = all[i].p;
  c->info.nonce = all[0].nonce;
  free(all);
  c->info.peers = c->peers;
  if (pthread_create(&c->thread, NULL, progress_thread, c) != 0) {
    rc = mr_error_set(MR_ESYS, "comm open: cannot start the progress thread");
    goto err;
  }
  c->thread_started = 1;
  *out = &c->base;
  return 0;
err:
  cpu_close(&c->base);
  return rc;
}

static void cpu_close(struct mr_comm *cc) {
  if (cc == NULL)
    return;
  struct mr__cpu *c = (struct mr__cpu *)cc;
  if (c->thread_started) {
    pthread_mutex_lock(&c->lock);
    c->stop = 1;
    pthread_cond_signal(&c->wake);
    pthread_mutex_unlock(&c->lock);
    pthread_join(c->thread, NULL);
  }
  while (c->groups != NULL)
    cpu_group_free(&c->groups->base);
  while (c->occ != NULL) {
    struct occurrence *o = c->occ;
    c->occ = o->next;
    free(o->desc);
    free(o);
  }
  if (c->info.listen_fd >= 0)
    close(c->info.listen_fd);
  if (c->trace != NULL)
    fclose(c->trace);
  pthread_mutex_destroy(&c->lock);
  pthread_cond_destroy(&c->wake);
  free(c->peers);
  free(c->job_id);
  free(c);
}

static const struct mr_comm_ops cpu_ops = {
    .name = "cpu",
    .open = cpu_open,
    .close = cpu_close,
    .group_new = cpu_group_new,
    .group_free = cpu_group_free,
    .group_rank = cpu_group_rank,
    .group_size = cpu_group_size,
    .mem_alloc = cpu_mem_alloc,
    .mem_free = cpu_mem_free,
    .all_reduce = cpu_all_reduce,
    .reduce_scatter = cpu_reduce_scatter,
    .all_gather = cpu_all_gather,
    .broadcast = cpu_broadcast,
    .all_to_all = cpu_all_to_all,
    .send = cpu_send,
    .recv = cpu_recv,
    .barrier = cpu_barrier,
    .test = cpu_test,
    .wait = cpu_wait,
    .blocked = cpu_blocked,
};

const struct mr_comm_ops *mr_comm_cpu_ops(void) { return &cpu_ops; }
