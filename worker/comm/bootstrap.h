/* bootstrap.h - how a communicator learns about its peers, without knowing
 * who launched the job.
 *
 * A bootstrap is one all-gather of small fixed-size blobs over the whole
 * world, keyed by a string so that different exchanges never mix.  In a real
 * job the worker runtime implements it through the coordinator's Rendezvous
 * message; for processes forked on one host mr_bootstrap_local_* implements it
 * in a shared anonymous mapping. */
#ifndef MR_COMM_BOOTSTRAP_H
#define MR_COMM_BOOTSTRAP_H

#include <stddef.h>

struct mr_bootstrap {
  int rank;            /* this process's global rank */
  int world_size;      /* ranks in the job */
  const char *host_id; /* equal strings mean "same host": shared memory works */
  const char *job_id;  /* names this job's shared-memory segments; [A-Za-z0-9_-] */
  void *ctx;           /* the implementation's state */
  /* Every rank calls allgather with the same key and len; on return out holds
   * world_size * len bytes, rank i's blob at out + i * len.  Returns 0 or a
   * negative MR_E* code (with mr_error_set) on failure or timeout. */
  int (*allgather)(void *ctx, const char *key, const void *blob, size_t len,
                   void *out);
};

/* A local bootstrap for processes forked from one parent. */
struct mr_bootstrap_local;

/* Creates the shared area for world_size ranks (call before fork).  Blobs are
 * at most max_len bytes.  Returns NULL when out of memory. */
struct mr_bootstrap_local *mr_bootstrap_local_new(int world_size,
                                                  size_t max_len);

/* Fills *bs for rank in a forked child.  host_id and job_id are borrowed and
 * must outlive *bs.  allgather waits at most timeout_ms for the others and
 * then fails with MR_ETIMEDOUT naming the ranks that did not arrive. */
void mr_bootstrap_local_rank(struct mr_bootstrap_local *bl, int rank,
                             const char *host_id, const char *job_id,
                             int timeout_ms, struct mr_bootstrap *bs);

/* Unmaps the area (in each process that is done with it).  NULL is a no-op. */
void mr_bootstrap_local_free(struct mr_bootstrap_local *bl);

#endif
