/* client.h - a worker's connection to its coordinator.
 *
 * mr_client_connect() connects, authenticates with the job token, says
 * Hello and receives Welcome and Plan.  mr_client_start() then runs the
 * RPC thread: it sends a Heartbeat every MESHRUN_HEARTBEAT_MS with the
 * position the job last published, and reads what the coordinator sends
 * (Control, RendezvousDone).  If the coordinator goes away the thread ends
 * the process: a worker never outlives its launcher.  Every function here
 * may be called from any thread. */
#ifndef MR_CLIENT_H
#define MR_CLIENT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common/auth.h"
#include "common/frame.h"
#include "meshrun.pb-c.h"
#include "worker/reporter.h"

struct mr_rdv_result;

struct mr_client {
  int fd;
  pthread_mutex_t send_lock;
  struct mr_frame_reader reader;    // used by the RPC thread only (after start)
  pthread_t thread;
  int thread_started;
  atomic_int stop_requested;
  atomic_int checkpoint_requested;
  atomic_int shutting_down;
  atomic_int coordinator_lost;      // the connection broke: stop, exit 1
  /* published position, for heartbeats */
  pthread_mutex_t pos_lock;
  int64_t step, last_done, waiting_on;
  char waiting_detail[160];
  Meshrun__Heartbeat__State state;
  _Atomic uint64_t checkpoint_bytes; // what the checkpoint writer has written
  _Atomic uint64_t comm_done;        // communication operations seen to end
  /* what the job is blocked on, asked at each heartbeat (e.g. the comm
   * backend's blocked()); NULL: only the published position.  probe_lock
   * is held across each call, so a probe removed is no longer running */
  const char *(*blocked_probe)(void *ctx, char *buf, size_t len);
  void *blocked_ctx;
  pthread_mutex_t probe_lock;
  /* rendezvous answers */
  pthread_mutex_t rdv_lock;
  pthread_cond_t rdv_cond;
  struct mr_rdv_result *rdv;        // answers received, not yet taken
  /* from Welcome and Plan */
  int rank, world_size, local_rank, local_world_size, restart;
  char job_id[64];
  Meshrun__Plan *plan;              // owned (unpacked Plan envelope)
  Meshrun__Envelope *plan_env;
};

/* The coordinator's monotonic clock minus this process's, from a few
 * round trips (the shortest one's midpoint), and its bound: half that
 * round trip.  Call between connect and start. */
int mr_client_clock_offset(struct mr_client *c, int64_t *offset_ns, uint64_t *error_ns);

/* Connects to address ("unix:PATH" / "tcp:HOST:PORT"), authenticates with
 * token and registers as requested_rank (-1: any).  On success c holds the
 * rank and the plan.  Returns 0, MR_EAUTH, MR_ECLOSED, or another error. */
int mr_client_connect(struct mr_client *c, const char *address,
                      const uint8_t token[MR_TOKEN_BYTES], int requested_rank,
                      int restart);

/* Starts the RPC thread. */
int mr_client_start(struct mr_client *c);

/* Sends one envelope (thread-safe). */
int mr_client_send(struct mr_client *c, const Meshrun__Envelope *env);

/* Publishes where the job is, for the next heartbeat. */
void mr_client_set_position(struct mr_client *c, int64_t step, int64_t last_done,
                            int64_t waiting_on, const char *detail);
void mr_client_set_state(struct mr_client *c, Meshrun__Heartbeat__State state);

/* Installs a probe the heartbeat asks what the job is blocked on; its
 * answer (when not empty) is reported as the instruction waited on.  On
 * return no call of the previous probe is in flight: its context may be
 * freed. */
void mr_client_set_blocked_probe(struct mr_client *c,
                                 const char *(*probe)(void *ctx, char *buf, size_t len),
                                 void *ctx);

/* All-gathers a small blob through the coordinator: every rank calls this
 * with the same key; returns the world's blobs in rank order in *blobs
 * (caller frees with mr_client_free_blobs).  Waits at most timeout_ms. */
int mr_client_rendezvous(struct mr_client *c, const char *key, const void *blob,
                         size_t len, ProtobufCBinaryData **blobs, int timeout_ms);
void mr_client_free_blobs(ProtobufCBinaryData *blobs, int n);

/* Reports an error message to the coordinator (best effort). */
void mr_client_report_error(struct mr_client *c, int code, const char *message);

/* Reports the job finished, with a result blob. */
int mr_client_report_done(struct mr_client *c, int64_t steps, const void *result,
                          size_t len);

/* A reporter that forwards steps as Metrics and answers stop/checkpoint
 * requests from the coordinator. */
void mr_client_reporter(struct mr_client *c, struct mr_reporter *out);

/* Stops the RPC thread and closes the connection. */
void mr_client_close(struct mr_client *c);

#endif
