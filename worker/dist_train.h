/* dist_train.h - the training loop of one rank of a job: lowers the job's
 * strategy to this rank's program, runs its steps on the runtime
 * (worker/runtime.h), evaluates, checkpoints, reports, and writes the final
 * weights. */
#ifndef MR_DIST_TRAIN_H
#define MR_DIST_TRAIN_H

#include "common/job.h"
#include "worker/comm/comm.h"
#include "worker/reporter.h"

/* Trains job (its strategy as chosen by the launcher) on this rank of
 * env->world_size, computing on device be (worker/device.h) with comm,
 * the job's communicator of the matching backend (NULL for one rank); both
 * borrowed.  Returns 0 or a negative code with a message. */
struct mr_backend;
int mr_dist_train_run(const struct mr_job *job, const struct mr_run_env *env,
                      struct mr_backend *be, struct mr_comm *comm);

#endif
