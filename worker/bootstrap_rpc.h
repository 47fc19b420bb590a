/* bootstrap_rpc.h - a comm bootstrap (worker/comm/bootstrap.h) that
 * exchanges blobs through the coordinator, for real jobs. */
#ifndef MR_BOOTSTRAP_RPC_H
#define MR_BOOTSTRAP_RPC_H

#include "worker/client.h"
#include "worker/comm/bootstrap.h"

struct mr_bootstrap_rpc {
  struct mr_bootstrap bs;    // what comm backends take
  struct mr_client *client;  // borrowed
  char host_id[256];
  char job_id[64];
};

/* Fills b for the connected client c (borrowed; must outlive b). */
void mr_bootstrap_rpc_init(struct mr_bootstrap_rpc *b, struct mr_client *c);

#endif
