/* test_comm_check.c - the static communication check.  Programs that are
 * correct by construction (events dealt to ranks from one serial global
 * order, which is itself an execution) must pass; the same programs with
 * one event altered must fail naming it; hand-built deadlocks must be
 * found and described. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "compiler/comm_check.h"
#include "common/error.h"

#define WORLD 8
#define MAXEV 4096

struct prog {
  struct mr_comm_event ev[WORLD][MAXEV];
  struct mr_comm_trace tr[WORLD];
};

static void add(struct prog *p, int r, struct mr_comm_event e) {
  ck_assert_int_lt(p->tr[r].n, MAXEV);
  e.id = p->tr[r].n;
  p->ev[r][p->tr[r].n++] = e;
}

static void init(struct prog *p) {
  memset(p, 0, sizeof *p);
  for (int r = 0; r < WORLD; r++)
    p->tr[r].ev = p->ev[r];
}

/* The groups of a dp2 x tp4 mesh plus the world. */
static const int g_world[] = {0, 1, 2, 3, 4, 5, 6, 7};
static const int g_model0[] = {0, 1, 2, 3}, g_model1[] = {4, 5, 6, 7};
static const int g_data[4][2] = {{0, 4}, {1, 5}, {2, 6}, {3, 7}};
static const char *const data_names[4] = {"data{0,4}", "data{1,5}", "data{2,6}", "data{3,7}"};

static uint32_t next(uint32_t *s) {
  *s = *s * 1664525u + 1013904223u;
  return *s >> 8;
}

/* A random program dealt from one global order: collectives on mesh
 * groups and point-to-point transfers between random pairs. */
static void random_program(struct prog *p, uint32_t seed, int n_ops) {
  init(p);
  for (int k = 0; k < n_ops; k++) {
    uint32_t c = next(&seed) % 6;
    struct mr_comm_event e = {.dtype = MR_F32, .batch = -1, .count = 1 + next(&seed) % 999};
    if (c == 0) {
      e.kind = MR_CEV_ALL_REDUCE, e.group = "world", e.ranks = g_world, e.n_ranks = 8;
    } else if (c == 1 || c == 2) {
      int half = next(&seed) % 2;
      e.kind = c == 1 ? MR_CEV_ALL_GATHER : MR_CEV_REDUCE_SCATTER;
      e.group = half ? "model{4,5,6,7}" : "model{0,1,2,3}";
      e.ranks = half ? g_model1 : g_model0;
      e.n_ranks = 4;
    } else if (c == 3) {
      int d = next(&seed) % 4;
      e.kind = MR_CEV_BROADCAST, e.group = data_names[d], e.ranks = g_data[d], e.n_ranks = 2;
      e.root = next(&seed) % 2;
    } else {
      int a = next(&seed) % WORLD, b = (a + 1 + next(&seed) % (WORLD - 1)) % WORLD;
      e.group = "p2p";
      e.kind = MR_CEV_SEND, e.peer = b;
      add(p, a, e);
      e.kind = MR_CEV_RECV, e.peer = a;
      add(p, b, e);
      continue;
    }
    for (int i = 0; i < e.n_ranks; i++)
      add(p, e.ranks[i], e);
  }
}

START_TEST(test_comm_check_accepts_programs_from_a_serial_order) {
  static struct prog p;
  for (uint32_t seed = 1; seed <= 40; seed++) {
    random_program(&p, seed, 300);
    int rc = mr_comm_check(p.tr, WORLD);
    ck_assert_msg(rc == 0, "seed %u: %s", seed, mr_error_message());
  }
}
END_TEST

/* One rank's collective moves a different count: the check names it. */
START_TEST(test_comm_check_names_a_changed_count) {
  static struct prog p;
  for (uint32_t seed = 1; seed <= 40; seed++) {
    random_program(&p, seed, 300);
    uint32_t s = seed * 7919u;
    int r, e;
    do {
      r = next(&s) % WORLD;
      e = p.tr[r].n > 0 ? (int)(next(&s) % (uint32_t)p.tr[r].n) : 0;
    } while (p.tr[r].n == 0);
    p.ev[r][e].count += 1;
    ck_assert_int_eq(mr_comm_check(p.tr, WORLD), MR_EPLAN);
    char want[64];
    snprintf(want, sizeof want, "instruction %d", e);
    const char *msg = mr_error_message();
    ck_assert_msg(strstr(msg, "different counts") != NULL, "seed %u: %s", seed, msg);
    ck_assert_msg(strstr(msg, want) != NULL, "seed %u: %s lacks %s", seed, msg, want);
  }
}
END_TEST

/* Two ranks issue the collectives of two groups in opposite orders. */
START_TEST(test_comm_check_finds_a_collective_order_deadlock) {
  static struct prog p;
  init(&p);
  static const int pair[] = {0, 1};
  struct mr_comm_event a = {.kind = MR_CEV_ALL_REDUCE, .group = "grad", .ranks = pair,
                            .n_ranks = 2, .count = 64, .dtype = MR_F32, .batch = -1};
  struct mr_comm_event b = a;
  b.group = "loss";
  b.count = 1;
  add(&p, 0, a);
  add(&p, 0, b);
  add(&p, 1, b);
  add(&p, 1, a);
  ck_assert_int_eq(mr_comm_check(p.tr, 2), MR_EPLAN);
  const char *msg = mr_error_message();
  ck_assert_msg(strstr(msg, "deadlock") != NULL, "%s", msg);
  ck_assert_msg(strstr(msg, "rank 0 waits in AllReduce #1 on group grad") != NULL, "%s", msg);
  ck_assert_msg(strstr(msg, "rank 1 waits in AllReduce #1 on group loss") != NULL, "%s", msg);
  ck_assert_msg(strstr(msg, "not arrived: rank 1") != NULL, "%s", msg);
}
END_TEST

/* Both ranks receive first: a cycle.  Both send first: with sends that
 * complete only with their receive, also a cycle.  Posted together as one
 * batch (isend + irecv), the same exchange completes. */
START_TEST(test_comm_check_point_to_point_cycles_and_batches) {
  static struct prog p;
  struct mr_comm_event s = {.kind = MR_CEV_SEND, .group = "pipe", .count = 32,
                            .dtype = MR_F32, .batch = -1};
  struct mr_comm_event r = s;
  r.kind = MR_CEV_RECV;
  for (int order = 0; order < 3; order++) {
    init(&p);
    for (int me = 0; me < 2; me++) {
      s.peer = r.peer = 1 - me;
      s.batch = r.batch = order == 2 ? 7 : -1;
      add(&p, me, order == 0 ? r : s);
      add(&p, me, order == 0 ? s : r);
    }
    int rc = mr_comm_check(p.tr, 2);
    if (order == 2) {
      ck_assert_msg(rc == 0, "%s", mr_error_message());
      continue;
    }
    ck_assert_int_eq(rc, MR_EPLAN);
    const char *msg = mr_error_message();
    const char *want = order == 0 ? "rank 0 waits in Recv from rank 1" : "rank 0 waits in Send to rank 1";
    ck_assert_msg(strstr(msg, want) != NULL, "%s", msg);
  }
}
END_TEST

/* GPipe over 4 stages and 6 micro-batches with blocking sends: all
 * forwards (receive the input, send the output), then all backwards. */
START_TEST(test_comm_check_gpipe_blocking_is_deadlock_free) {
  static struct prog p;
  init(&p);
  const int P = 4, M = 6;
  for (int st = 0; st < P; st++) {
    struct mr_comm_event e = {.group = "pipe", .count = 256, .dtype = MR_F32, .batch = -1};
    for (int j = 0; j < M; j++) {
      if (st > 0)
        e.kind = MR_CEV_RECV, e.peer = st - 1, add(&p, st, e);
      if (st < P - 1)
        e.kind = MR_CEV_SEND, e.peer = st + 1, add(&p, st, e);
    }
    for (int j = 0; j < M; j++) {
      if (st < P - 1)
        e.kind = MR_CEV_RECV, e.peer = st + 1, add(&p, st, e);
      if (st > 0)
        e.kind = MR_CEV_SEND, e.peer = st - 1, add(&p, st, e);
    }
  }
  ck_assert_msg(mr_comm_check(p.tr, P) == 0, "%s", mr_error_message());
  /* stage 2 forgets one backward receive: stage 3's last send is never met */
  p.tr[2].n -= 2;
  p.ev[2][p.tr[2].n] = p.ev[2][p.tr[2].n + 1];
  p.ev[2][p.tr[2].n].id = p.tr[2].n;
  p.tr[2].n++;
  ck_assert_int_eq(mr_comm_check(p.tr, P), MR_EPLAN);
  const char *msg = mr_error_message();
  ck_assert_msg(strstr(msg, "rank 3 waits in Send to rank 2") != NULL, "%s", msg);
  ck_assert_msg(strstr(msg, "rank 2 has finished its program") != NULL, "%s", msg);
}
END_TEST

/* A collective one member never issues, and one issued outside its group. */
START_TEST(test_comm_check_missing_member_and_outsider) {
  static struct prog p;
  init(&p);
  struct mr_comm_event e = {.kind = MR_CEV_ALL_REDUCE, .group = "model{0,1,2,3}",
                            .ranks = g_model0, .n_ranks = 4, .count = 16, .dtype = MR_F32,
                            .batch = -1, .what = "layer 0 mlp out"};
  for (int r = 0; r < 4; r++)
    if (r != 2)
      add(&p, r, e);
  ck_assert_int_eq(mr_comm_check(p.tr, 4), MR_EPLAN);
  const char *msg = mr_error_message();
  ck_assert_msg(strstr(msg, "not arrived: rank 2 (finished)") != NULL, "%s", msg);
  ck_assert_msg(strstr(msg, "layer 0 mlp out") != NULL, "%s", msg);
  init(&p);
  for (int r = 0; r < 5; r++)
    add(&p, r, e);
  ck_assert_int_eq(mr_comm_check(p.tr, 5), MR_EPLAN);
  ck_assert_msg(strstr(mr_error_message(), "rank 4 issues AllReduce #1 on group model{0,1,2,3}") != NULL,
                "%s", mr_error_message());
  ck_assert_msg(strstr(mr_error_message(), "not in") != NULL, "%s", mr_error_message());
}
END_TEST

static Suite *comm_check_suite(void) {
  Suite *s = suite_create("comm_check");
  TCase *tc = tcase_create("unit");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_comm_check_accepts_programs_from_a_serial_order);
  tcase_add_test(tc, test_comm_check_names_a_changed_count);
  tcase_add_test(tc, test_comm_check_finds_a_collective_order_deadlock);
  tcase_add_test(tc, test_comm_check_point_to_point_cycles_and_batches);
  tcase_add_test(tc, test_comm_check_gpipe_blocking_is_deadlock_free);
  tcase_add_test(tc, test_comm_check_missing_member_and_outsider);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(comm_check_suite)
