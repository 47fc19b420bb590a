/* selfcheck.c - the built-in end-to-end check job. */
#include "worker/selfcheck.h"

#include <sodium.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "common/log.h"
#include "common/test_hooks.h"
#include "common/tunable.h"

static void sleep_ms(int64_t ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0)
    ;
}


int mr_selfcheck_run(struct mr_client *c) {
  struct mr_reporter rep;
  mr_client_reporter(c, &rep);
  int64_t steps = c->plan->steps > 0 ? c->plan->steps : 1;
  int64_t step_ms = mr_tunable_int(MR_TUNABLE_SELFCHECK_STEP_MS);
  MR_INFO("selfcheck", "rank %d of %d: %lld steps of %lld ms", c->rank, c->world_size,
          (long long)steps, (long long)step_ms);
  for (int64_t s = 1; s <= steps; s++) {
    for (int64_t left = step_ms; left > 0; left -= 10) {
      if (rep.stop_requested(rep.ctx))
        return mr_error_set(MR_ECANCELED, "stopped by the coordinator at step %lld",
                            (long long)s);
      sleep_ms(left < 10 ? left : 10);
    }
    while (mr_hook_stalls(c->rank, s) && !rep.stop_requested(rep.ctx))
      sleep_ms(10);
    /* every step ends in a barrier through the coordinator */
    char key[48], detail[96];
    snprintf(key, sizeof key, "selfcheck/step-%lld", (long long)s);
    snprintf(detail, sizeof detail, "rendezvous \"%s\" through the coordinator", key);
    rep.progress(rep.ctx, s, 2 * s - 1, 2 * s, detail);
    ProtobufCBinaryData *b = NULL;
    MR_TRY(mr_client_rendezvous(c, key, "", 0, &b,
                                (int)mr_tunable_int(MR_TUNABLE_CONNECT_TIMEOUT_MS) * 100));
    mr_client_free_blobs(b, c->world_size);
    rep.progress(rep.ctx, s, 2 * s, -1, "");
    struct mr_step_report r = {.step = s, .loss = 0, .loss_scale = 1,
                               .step_time_s = (double)step_ms / 1000.0};
    rep.step(rep.ctx, &r);
  }
  char mine[32];
  int n = snprintf(mine, sizeof mine, "rank:%d", c->rank);
  ProtobufCBinaryData *blobs = NULL;
  MR_TRY(mr_client_rendezvous(c, "selfcheck", mine, (size_t)n, &blobs,
                              (int)mr_tunable_int(MR_TUNABLE_CONNECT_TIMEOUT_MS)));
  int rc = 0;
  for (int i = 0; i < c->world_size && rc == 0; i++) {
    char want[32];
    int wn = snprintf(want, sizeof want, "rank:%d", i);
    if (blobs[i].len != (size_t)wn || memcmp(blobs[i].data, want, (size_t)wn) != 0)
      rc = mr_error_set(MR_EPROTO, "rendezvous entry %d is wrong", i);
  }
  mr_client_free_blobs(blobs, c->world_size);
  MR_TRY(rc);
  char msg[96];
  int mn = snprintf(msg, sizeof msg, "meshrun-selfcheck:%s:%d:%d", c->job_id, c->rank,
                    c->world_size);
  uint8_t digest[crypto_hash_sha256_BYTES];
  crypto_hash_sha256(digest, (const uint8_t *)msg, (unsigned long long)mn);
  MR_TRY(mr_client_report_done(c, steps, digest, sizeof digest));
  printf("self-check ok: rank %d of %d\n", c->rank, c->world_size);
  fflush(stdout);
  return 0;
}
