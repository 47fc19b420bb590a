/* comm_check.c - simulating every rank's communication at once. */
#include "compiler/comm_check.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

const char *mr_comm_event_kind_name(enum mr_comm_event_kind k) {
  static const char *const names[] = {"AllReduce", "ReduceScatter", "AllGather", "Broadcast",
                                      "AllToAll",  "Barrier",       "Send",      "Recv"};
  return (unsigned)k < sizeof names / sizeof names[0] ? names[k] : "?";
}

static int is_p2p(const struct mr_comm_event *e) {
  return e->kind == MR_CEV_SEND || e->kind == MR_CEV_RECV;
}

struct sim {
  const struct mr_comm_trace *tr;
  int world;
  int *pc;                      // [world] first event not completed
  unsigned char **matched;      // [world][n] p2p events matched to a partner
  int **ordinal;                // [world][n] the event's 1-based ordinal on its group
  char msg[4096];
  size_t len;
};

static void say(struct sim *s, const char *fmt, ...) {
  if (s->len >= sizeof s->msg - 1)
    return;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(s->msg + s->len, sizeof s->msg - s->len, fmt, ap);
  va_end(ap);
  if (n > 0)
    s->len += (size_t)n;
  if (s->len >= sizeof s->msg)
    s->len = sizeof s->msg - 1;
}

static uint64_t hash_str(const char *p) {
  uint64_t h = 1469598103934665603ull;
  for (; *p; p++)
    h = (h ^ (unsigned char)*p) * 1099511628211ull;
  return h;
}

/* ordinal[e] = how many events on e's group up to e, for this rank. */
static int number_events(const struct mr_comm_trace *t, int *ordinal) {
  size_t cap = 16;
  while (cap < 2 * (size_t)t->n + 2)
    cap *= 2;
  const char **key = calloc(cap, sizeof *key);
  int *count = calloc(cap, sizeof *count);
  if (key == NULL || count == NULL) {
    free(key);
    free(count);
    return MR_ENOMEM;
  }
  for (int e = 0; e < t->n; e++) {
    const char *g = t->ev[e].group != NULL ? t->ev[e].group : "";
    size_t i = hash_str(g) & (cap - 1);
    while (key[i] != NULL && strcmp(key[i], g) != 0)
      i = (i + 1) & (cap - 1);
    key[i] = g;
    ordinal[e] = ++count[i];
  }
  free(key);
  free(count);
  return 0;
}

static void describe(struct sim *s, int r, int e) {
  const struct mr_comm_event *ev = &s->tr[r].ev[e];
  say(s, "%s", mr_comm_event_kind_name(ev->kind));
  if (is_p2p(ev))
    say(s, " %s rank %d", ev->kind == MR_CEV_SEND ? "to" : "from", ev->peer);
  say(s, " #%d on group %s (%lld %s", s->ordinal[r][e], ev->group ? ev->group : "?",
      (long long)ev->count, mr_dtype_name(ev->dtype));
  if (ev->kind == MR_CEV_BROADCAST)
    say(s, ", root %d", ev->root);
  say(s, "; instruction %d%s%s)", ev->id, ev->what ? ": " : "", ev->what ? ev->what : "");
}

static int same_group(const struct mr_comm_event *a, const struct mr_comm_event *b) {
  return strcmp(a->group ? a->group : "", b->group ? b->group : "") == 0;
}

static int done(const struct sim *s, int r) { return s->pc[r] >= s->tr[r].n; }

/* End of the batch that starts at e on rank r. */
static int batch_end(const struct sim *s, int r, int e) {
  const struct mr_comm_trace *t = &s->tr[r];
  if (!is_p2p(&t->ev[e]) || t->ev[e].batch < 0)
    return e + 1;
  int f = e + 1;
  while (f < t->n && is_p2p(&t->ev[f]) && t->ev[f].batch == t->ev[e].batch)
    f++;
  return f;
}

static int mismatch(struct sim *s, int r, int e, int m, int f, const char *why) {
  say(s, "rank programs do not match: %s: rank %d issues ", why, r);
  describe(s, r, e);
  say(s, " but rank %d issues ", m);
  describe(s, m, f);
  return mr_error_set(MR_EPLAN, "%s", s->msg);
}

/* Tries to complete the collective at rank r's pc: 1 done, 0 waits, <0. */
static int try_collective(struct sim *s, int r) {
  const struct mr_comm_event *ev = &s->tr[r].ev[s->pc[r]];
  int member = 0;
  for (int i = 0; i < ev->n_ranks; i++) {
    if (ev->ranks[i] < 0 || ev->ranks[i] >= s->world) {
      say(s, "rank %d's ", r);
      describe(s, r, s->pc[r]);
      say(s, " names rank %d, outside the world of %d", ev->ranks[i], s->world);
      return mr_error_set(MR_EPLAN, "%s", s->msg);
    }
    member |= ev->ranks[i] == r;
  }
  if (!member) {
    say(s, "rank %d issues ", r);
    describe(s, r, s->pc[r]);
    say(s, " on a group it is not in");
    return mr_error_set(MR_EPLAN, "%s", s->msg);
  }
  int ready = 1;
  for (int i = 0; i < ev->n_ranks; i++) {
    int m = ev->ranks[i];
    if (m == r)
      continue;
    if (done(s, m)) {
      ready = 0;
      continue;
    }
    const struct mr_comm_event *o = &s->tr[m].ev[s->pc[m]];
    if (is_p2p(o) || !same_group(ev, o)) {
      ready = 0;
      continue;
    }
    int same_members = o->n_ranks == ev->n_ranks;
    for (int j = 0; same_members && j < ev->n_ranks; j++)
      same_members = o->ranks[j] == ev->ranks[j];
    const char *why = !same_members                 ? "the group's members differ"
                      : o->kind != ev->kind         ? "different collectives"
                      : o->count != ev->count       ? "different counts"
                      : o->dtype != ev->dtype       ? "different dtypes"
                      : (ev->kind == MR_CEV_BROADCAST && o->root != ev->root) ? "different roots"
                                                                             : NULL;
    if (why != NULL)
      return mismatch(s, r, s->pc[r], m, s->pc[m], why);
  }
  if (!ready)
    return 0;
  for (int i = 0; i < ev->n_ranks; i++)
    s->pc[ev->ranks[i]]++;
  return 1;
}

static int detached(const struct mr_comm_event *e) {
  return e->kind == MR_CEV_SEND && e->batch == MR_CEV_DETACHED;
}

/* Matches the receive e of rank r with the oldest detached send its peer
 * has issued to r and not yet seen received: 1 matched, 0 none, <0. */
static int match_detached(struct sim *s, int r, int e) {
  const struct mr_comm_event *ev = &s->tr[r].ev[e];
  int p = ev->peer;
  for (int f = 0; f < s->pc[p]; f++) {
    const struct mr_comm_event *o = &s->tr[p].ev[f];
    if (!detached(o) || s->matched[p][f] || o->peer != r || !same_group(ev, o))
      continue;
    if (o->count != ev->count || o->dtype != ev->dtype)
      return mismatch(s, r, e, p, f, o->count != ev->count ? "different counts"
                                                            : "different dtypes");
    s->matched[r][e] = s->matched[p][f] = 1;
    return 1;
  }
  return 0;
}

/* Matches what it can of rank r's current p2p batch: 1 completed, 0 waits. */
static int try_p2p(struct sim *s, int r) {
  int b = s->pc[r], end = batch_end(s, r, b), all = 1;
  if (detached(&s->tr[r].ev[b])) { /* issued; it never blocks */
    s->pc[r]++;
    return 1;
  }
  for (int e = b; e < end; e++) {
    if (s->matched[r][e])
      continue;
    const struct mr_comm_event *ev = &s->tr[r].ev[e];
    int p = ev->peer;
    if (p < 0 || p >= s->world || p == r) {
      say(s, "rank %d's ", r);
      describe(s, r, e);
      say(s, " names peer %d (world %d)", p, s->world);
      return mr_error_set(MR_EPLAN, "%s", s->msg);
    }
    if (ev->kind == MR_CEV_RECV) {
      int m = match_detached(s, r, e);
      if (m < 0)
        return m;
      if (m > 0)
        continue;
    }
    if (done(s, p) || !is_p2p(&s->tr[p].ev[s->pc[p]])) {
      all = 0;
      continue;
    }
    int pb = s->pc[p], pend = batch_end(s, p, pb), found = 0;
    for (int f = pb; f < pend && !found; f++) {
      const struct mr_comm_event *o = &s->tr[p].ev[f];
      if (s->matched[p][f] || o->peer != r || o->kind == ev->kind || !same_group(ev, o))
        continue;
      if (o->count != ev->count || o->dtype != ev->dtype)
        return mismatch(s, r, e, p, f, o->count != ev->count ? "different counts"
                                                              : "different dtypes");
      s->matched[r][e] = s->matched[p][f] = 1;
      found = 1;
    }
    all &= found;
  }
  if (!all)
    return 0;
  s->pc[r] = end;
  return 1;
}

static int report_deadlock(struct sim *s) {
  say(s, "rank programs deadlock: no rank can proceed:");
  for (int r = 0; r < s->world; r++) {
    if (done(s, r))
      continue;
    int e = s->pc[r];
    const struct mr_comm_event *ev = &s->tr[r].ev[e];
    if (is_p2p(ev)) {
      int end = batch_end(s, r, e);
      while (e < end - 1 && s->matched[r][e])
        e++;
      ev = &s->tr[r].ev[e];
      say(s, " rank %d waits in ", r);
      describe(s, r, e);
      if (ev->peer >= 0 && ev->peer < s->world && done(s, ev->peer))
        say(s, ", but rank %d has finished its program", ev->peer);
      say(s, ";");
      continue;
    }
    say(s, " rank %d waits in ", r);
    describe(s, r, e);
    int first = 1;
    for (int i = 0; i < ev->n_ranks; i++) {
      int m = ev->ranks[i];
      if (m == r)
        continue;
      int there = !done(s, m) && !is_p2p(&s->tr[m].ev[s->pc[m]]) &&
                  same_group(ev, &s->tr[m].ev[s->pc[m]]);
      if (!there) {
        say(s, "%s%d%s", first ? ", not arrived: rank " : ", ", m,
            done(s, m) ? " (finished)" : "");
        first = 0;
      }
    }
    say(s, ";");
  }
  if (s->len > 0 && s->msg[s->len - 1] == ';')
    s->msg[--s->len] = '\0';
  return mr_error_set(MR_EPLAN, "%s", s->msg);
}

int mr_comm_check(const struct mr_comm_trace *trace, int world) {
  struct sim *s = calloc(1, sizeof *s);
  if (s == NULL)
    return MR_ENOMEM;
  s->tr = trace;
  s->world = world;
  s->pc = calloc((size_t)world, sizeof *s->pc);
  s->matched = calloc((size_t)world, sizeof *s->matched);
  s->ordinal = calloc((size_t)world, sizeof *s->ordinal);
  int rc = MR_ENOMEM;
  if (s->pc == NULL || s->matched == NULL || s->ordinal == NULL)
    goto out;
  for (int r = 0; r < world; r++) {
    size_t n = (size_t)(trace[r].n > 0 ? trace[r].n : 1);
    s->matched[r] = calloc(n, 1);
    s->ordinal[r] = calloc(n, sizeof **s->ordinal);
    if (s->matched[r] == NULL || s->ordinal[r] == NULL)
      goto out;
    if ((rc = number_events(&trace[r], s->ordinal[r])) < 0)
      goto out;
  }
  for (;;) {
    int moved = 0, left = 0;
    for (int r = 0; r < world; r++) {
      if (done(s, r))
        continue;
      left = 1;
      rc = is_p2p(&trace[r].ev[s->pc[r]]) ? try_p2p(s, r) : try_collective(s, r);
      if (rc < 0)
        goto out;
      moved |= rc;
    }
    if (!left) {
      rc = 0;
      for (int r = 0; r < world && rc == 0; r++)
        for (int e = 0; e < trace[r].n; e++)
          if (detached(&trace[r].ev[e]) && !s->matched[r][e]) {
            say(s, "rank programs do not match: rank %d's ", r);
            describe(s, r, e);
            say(s, " is never received");
            rc = mr_error_set(MR_EPLAN, "%s", s->msg);
            break;
          }
      break;
    }
    if (!moved) {
      rc = report_deadlock(s);
      break;
    }
  }
out:
  for (int r = 0; r < world && s->matched != NULL && s->ordinal != NULL; r++) {
    free(s->matched[r]);
    free(s->ordinal[r]);
  }
  free(s->matched);
  free(s->ordinal);
  free(s->pc);
  free(s);
  return rc;
}
