/* comm_cases.h - the collective test cases shared by the shm and tcp suites:
 * each runs in forked ranks and checks results bit for bit against a serial
 * reference computed here, in rank order, from the same inputs. */
#ifndef MR_TEST_COMM_CASES_H
#define MR_TEST_COMM_CASES_H

#include <check.h>

/* A suite named name whose cases all use transport ("shm" or "tcp"). */
Suite *comm_cases_suite(const char *name, const char *transport);

#endif
