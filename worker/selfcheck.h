/* selfcheck.h - the built-in end-to-end check job (`meshrun launch
 * --selfcheck`): every rank runs a few timed steps with heartbeats and
 * metrics, joins a rendezvous through the coordinator and checks that it
 * returns every rank's blob in rank order, then reports a digest of (job,
 * rank, world) that the coordinator recomputes.  It exercises spawning,
 * authentication, registration, the plan, heartbeats, rendezvous and
 * reports without any training code. */
#ifndef MR_SELFCHECK_H
#define MR_SELFCHECK_H

#include "worker/client.h"

/* Runs the check.  Returns 0, or an error (reported to the coordinator by
 * the caller). */
int mr_selfcheck_run(struct mr_client *c);

#endif
