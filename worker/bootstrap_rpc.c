/* bootstrap_rpc.c - the comm bootstrap over the coordinator: an all-gather
 * of small blobs through its Rendezvous message. */
#include "worker/bootstrap_rpc.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"
#include "common/tunable.h"

static int rpc_allgather(void *ctx, const char *key, const void *blob, size_t len,
                         void *out) {
  struct mr_bootstrap_rpc *b = ctx;
  ProtobufCBinaryData *blobs = NULL;
  char full[160];
  /* keys are per restart: a restarted group never sees an old exchange */
  snprintf(full, sizeof full, "comm/%d/%s", b->client->restart, key);
  MR_TRY(mr_client_rendezvous(b->client, full, blob, len, &blobs,
                              (int)mr_tunable_int(MR_TUNABLE_CONNECT_TIMEOUT_MS)));
  int rc = 0;
  for (int i = 0; i < b->client->world_size; i++) {
    if (blobs[i].len != len) {
      rc = mr_error_set(MR_EPROTO, "rendezvous \"%s\": rank %d sent %zu bytes, expected %zu",
                        full, i, blobs[i].len, len);
      break;
    }
    memcpy((char *)out + (size_t)i * len, blobs[i].data, len);
  }
  mr_client_free_blobs(blobs, b->client->world_size);
  return rc;
}

void mr_bootstrap_rpc_init(struct mr_bootstrap_rpc *b, struct mr_client *c) {
  memset(b, 0, sizeof *b);
  b->client = c;
  gethostname(b->host_id, sizeof b->host_id - 1);
  snprintf(b->job_id, sizeof b->job_id, "%s", c->job_id);
  b->bs.rank = c->rank;
  b->bs.world_size = c->world_size;
  b->bs.host_id = b->host_id;
  b->bs.job_id = b->job_id;
  b->bs.ctx = b;
  b->bs.allgather = rpc_allgather;
}
