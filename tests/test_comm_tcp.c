/* test_comm_tcp.c - the collective matrix over TCP, forced with
 * MESHRUN_COMM_TRANSPORT=tcp (cases in comm_cases.c). */
#include "check_main.h"
#include "comm_cases.h"

static Suite *comm_tcp_suite(void) {
  return comm_cases_suite("comm_tcp", "tcp");
}

MR_TEST_MAIN(comm_tcp_suite)
