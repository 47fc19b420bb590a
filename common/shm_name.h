/* shm_name.h - the names of a job's shared-memory segments in /dev/shm,
 * which the comm backend creates and the launcher sweeps after a rank was
 * killed.  Both sides agree on them through this one place. */
#ifndef MR_SHM_NAME_H
#define MR_SHM_NAME_H

#include <stddef.h>
#include <stdint.h>

/* The segment of group desc (its occurrence-th group of that description)
 * in job job_id, started with nonce: "/meshrun-JOB-NONCE-DESCHASH-OCC"
 * into out (n bytes). */
void mr_shm_segment_name(char *out, size_t n, const char *job_id, uint64_t nonce,
                         const char *desc, int occurrence);

/* Unlinks every shared-memory segment left by job job_id (e.g. after a rank
 * was killed before its groups were complete).  Returns the number removed. */
int mr_shm_sweep(const char *job_id);

#endif
