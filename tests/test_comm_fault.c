/* test_comm_fault.c - failures end in a diagnosis, never a hang: a killed
 * peer, a peer that never arrives, bad arguments; and nothing is left in
 * /dev/shm afterwards (run_ranks checks every case). */
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check_main.h"
#include "comm_harness.h"
#include "common/error.h"

static struct mr_comm_group *all3(struct rank_ctx *rc) {
  int ranks[3] = {0, 1, 2};
  struct mr_comm_group *g = NULL;
  if (rc->comm->ops->group_new(rc->comm, "model", ranks, 3, &g) != 0)
    rank_fail(rc, "group_new: %s", mr_error_message());
  return g;
}

static void expect_contains(struct rank_ctx *rc, const char *what,
                            const char *text, const char *needle) {
  if (strstr(text, needle) == NULL)
    rank_fail(rc, "%s: \"%s\" does not contain \"%s\"", what, text, needle);
}

/* Rank 2 is killed after the group exists; ranks 0 and 1 must fail within
 * the timeout, naming it. */
static void killed_body(struct rank_ctx *rc) {
  struct mr_comm_group *g = all3(rc);
  if (g == NULL)
    return;
  float buf[1000];
  for (int i = 0; i < 1000; i++)
    buf[i] = (float)i;
  struct mr_comm_req *req;
  mr_comm_all_reduce(g, buf, buf, 1000, MR_F32, MR_RED_SUM, &req);
  if (mr_comm_wait(req) != 0)
    rank_fail(rc, "first AllReduce: %s", mr_error_message());
  if (rc->rank == 2)
    raise(SIGKILL);
  double t0 = now_s();
  mr_comm_all_reduce(g, buf, buf, 1000, MR_F32, MR_RED_SUM, &req);
  usleep(300000);
  char desc[512];
  rc->comm->ops->blocked(rc->comm, desc, sizeof desc);
  int r = mr_comm_wait(req);
  double took = now_s() - t0;
  const char *tp = getenv("COMM_FAULT_TP");
  int tcp = tp != NULL && strcmp(tp, "tcp") == 0;
  if (r == 0) {
    rank_fail(rc, "AllReduce with a dead peer succeeded");
  } else {
    const char *m = mr_error_message();
    expect_contains(rc, "error", m, "AllReduce #2 on group model{0,1,2}");
    if (tcp) {
      /* the dead peer's socket closes: either rank 2 is named directly, or
       * (for the rank that only hears of it late) the timeout names it */
      if (strstr(m, "rank 2 closed") == NULL && strstr(m, "rank 2 has not") ==
          NULL && strstr(m, "ranks 2") == NULL)
        rank_fail(rc, "error \"%s\" does not name rank 2", m);
    } else {
      if (r != MR_ETIMEDOUT)
        rank_fail(rc, "expected MR_ETIMEDOUT, got %s", mr_errname(r));
      expect_contains(rc, "error", m, "timed out after");
      expect_contains(rc, "error", m, "rank 2 has not arrived");
      expect_contains(rc, "blocked()", desc, "AllReduce #2 on group "
                      "model{0,1,2}");
      expect_contains(rc, "blocked()", desc, "waiting for rank 2");
    }
  }
  if (took > 5.0)
    rank_fail(rc, "failure took %.1f s with a 1 s timeout", took);
  /* the group is broken now: the next operation fails at once */
  mr_comm_barrier(g, &req);
  r = mr_comm_wait(req);
  if (r != MR_EPEER)
    rank_fail(rc, "Barrier after the failure: expected MR_EPEER, got %s",
              mr_errname(r));
  else
    expect_contains(rc, "later error", mr_error_message(), "Barrier #3");
  rc->comm->ops->group_free(g);
}

static void run_fault(const char *tp, void (*body)(struct rank_ctx *),
                      int killed) {
  setenv("COMM_FAULT_TP", tp, 1);
  struct run_opts o = {tp, 1000, 30, killed};
  char msg[8192];
  int bad = run_ranks(3, &o, body, NULL, msg, sizeof msg);
  for (char *p = msg; *p; p++) /* one line, for TAP */
    *p = *p == '\n' ? ';' : *p;
  msg[1000] = '\0'; /* Check's messages must stay short */
  ck_assert_msg(bad == 0, "%s", msg);
}

START_TEST(test_comm_killed_peer_shm) { run_fault("shm", killed_body, 2); }
END_TEST

START_TEST(test_comm_killed_peer_tcp) { run_fault("tcp", killed_body, 2); }
END_TEST

/* Rank 2 is alive but never calls the collective. */
static void absent_body(struct rank_ctx *rc) {
  struct mr_comm_group *g = all3(rc);
  if (g == NULL)
    return;
  if (rc->rank == 2) {
    usleep(2500000);
    rc->comm->ops->group_free(g);
    return;
  }
  int x = 1;
  struct mr_comm_req *req;
  mr_comm_broadcast(g, &x, 1, MR_I32, 2, &req);
  int r = mr_comm_wait(req);
  if (r != MR_ETIMEDOUT)
    rank_fail(rc, "expected MR_ETIMEDOUT, got %s (%s)", mr_errname(r),
              mr_error_message());
  else
    expect_contains(rc, "error", mr_error_message(),
                    "Broadcast #1 on group model{0,1,2} timed out after");
  rc->comm->ops->group_free(g);
}

START_TEST(test_comm_absent_peer_shm) { run_fault("shm", absent_body, -1); }
END_TEST

START_TEST(test_comm_absent_peer_tcp) { run_fault("tcp", absent_body, -1); }
END_TEST

/* Rank 2 never creates the group: creation fails naming it, and the
 * half-made segment is removed. */
static void no_group_body(struct rank_ctx *rc) {
  if (rc->rank == 2) {
    usleep(1500000);
    return;
  }
  int ranks[3] = {0, 1, 2};
  struct mr_comm_group *g = NULL;
  int r = rc->comm->ops->group_new(rc->comm, "model", ranks, 3, &g);
  if (r != MR_ETIMEDOUT)
    rank_fail(rc, "group_new without rank 2: expected MR_ETIMEDOUT, got %s",
              mr_errname(r));
  else if (strstr(mr_error_message(), "2") == NULL)
    rank_fail(rc, "\"%s\" does not name rank 2", mr_error_message());
}

START_TEST(test_comm_missing_member_shm) { run_fault("shm", no_group_body, -1); }
END_TEST

START_TEST(test_comm_missing_member_tcp) { run_fault("tcp", no_group_body, -1); }
END_TEST

/* Bad arguments are errors with a message, never a crash. */
static void bad_args_body(struct rank_ctx *rc) {
  struct mr_comm_group *g = all3(rc);
  if (g == NULL)
    return;
  unsigned char b[16] = {0};
  struct mr_comm_req *req = NULL;
  if (mr_comm_send(g, b, 1, MR_U8, 3, &req) != MR_EINVAL)
    rank_fail(rc, "Send to group rank 3 of 3 accepted");
  else
    expect_contains(rc, "Send", mr_error_message(), "peer 3");
  if (mr_comm_broadcast(g, b, 1, MR_U8, -1, &req) != MR_EINVAL)
    rank_fail(rc, "Broadcast from root -1 accepted");
  if (mr_comm_all_reduce(g, b, b, 1, MR_U8, MR_RED_SUM, &req) != MR_ENOTSUP)
    rank_fail(rc, "AllReduce of uint8 accepted");
  else
    expect_contains(rc, "AllReduce", mr_error_message(), "uint8");
  int dup[2] = {0, 0};
  struct mr_comm_group *g2 = NULL;
  if (rc->comm->ops->group_new(rc->comm, "x", dup, 2, &g2) != MR_EINVAL)
    rank_fail(rc, "group with rank 0 twice accepted");
  int other[2] = {(rc->rank + 1) % 3, (rc->rank + 2) % 3};
  if (rc->comm->ops->group_new(rc->comm, "x", other, 2, &g2) != MR_EINVAL)
    rank_fail(rc, "group without this rank accepted");
  /* the group still works */
  mr_comm_barrier(g, &req);
  if (mr_comm_wait(req) != 0)
    rank_fail(rc, "Barrier: %s", mr_error_message());
  rc->comm->ops->group_free(g);
}

START_TEST(test_comm_bad_arguments) { run_fault("shm", bad_args_body, -1); }
END_TEST

static Suite *comm_fault_suite(void) {
  Suite *s = suite_create("comm_fault");
  TCase *tc = tcase_create("fault");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_comm_killed_peer_shm);
  tcase_add_test(tc, test_comm_killed_peer_tcp);
  tcase_add_test(tc, test_comm_absent_peer_shm);
  tcase_add_test(tc, test_comm_absent_peer_tcp);
  tcase_add_test(tc, test_comm_missing_member_shm);
  tcase_add_test(tc, test_comm_missing_member_tcp);
  tcase_add_test(tc, test_comm_bad_arguments);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(comm_fault_suite)
