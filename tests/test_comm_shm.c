/* test_comm_shm.c - the collective matrix over the shared-memory
 * transport (cases in comm_cases.c). */
#include "check_main.h"
#include "comm_cases.h"

static Suite *comm_shm_suite(void) {
  return comm_cases_suite("comm_shm", "shm");
}

MR_TEST_MAIN(comm_shm_suite)
