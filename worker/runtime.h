/* runtime.h - runs a rank program (compiler/spmd/lower.h): the training
 * steps of one rank of a distributed job, on a device backend and a comm
 * backend.
 *
 * The runtime allocates every region the program planned (parameters,
 * gradient accumulators, optimizer state, the activations kept per
 * micro-batch slot, the arena, send buffers, reshard staging) once, then
 * walks the step's instructions: kernels through the op registry on local
 * shards, reshards as collectives on the data or model group, pipeline
 * boundaries as sends (started and left in flight) and receives (waited),
 * gradient synchronisation started as each gradient is final.  Before
 * every wait it tells its reporter which instruction it waits on, so a hang
 * names the rank, the instruction and the operation.
 *
 * Parameters start from the counter-based initializer (the same global
 * values on any strategy: each rank draws exactly its shard's elements) or
 * a safetensors file / Hugging Face folder, read slice by slice. */
#ifndef MR_RUNTIME_H
#define MR_RUNTIME_H

#include <stdint.h>

#include "common/job.h"
#include "compiler/spmd/lower.h"
#include "worker/backend/backend.h"
#include "worker/comm/comm.h"
#include "worker/reporter.h"

struct mr_runtime;

/* Builds rank `rank`'s program from L (borrowed, must outlive the runtime),
 * creates its groups on comm (collective: every rank of the job calls it;
 * comm may be NULL for one rank), allocates its regions on be (borrowed),
 * initializes or loads the parameters and opens the token files.  Returns
 * 0 or an error with a message. */
int mr_runtime_new(const struct mr_job *job, const struct mr_lowered *L, int rank,
                   struct mr_backend *be, struct mr_comm *comm, struct mr_runtime **out);

void mr_runtime_free(struct mr_runtime *rt);

/* Under MESHRUN_PROFILE: writes "ms per step over N steps: T in all;
 * kernel …; reshard … (kernels: matmul …, attention …)" into buf and
 * returns 1; else returns 0. */
int mr_runtime_profile(const struct mr_runtime *rt, char *buf, size_t n);

/* Optional: where to report the instruction being waited on. */
void mr_runtime_set_reporter(struct mr_runtime *rt, const struct mr_reporter *rep);

/* Records every instruction of the steps trace chooses (borrowed; NULL:
 * none, the default). */
struct mr_trace;
void mr_runtime_set_trace(struct mr_runtime *rt, struct mr_trace *trace);

/* Runs optimizer step `step` (1-based); fills r (loss: the step's mean
 * over every micro-batch, on every rank).  Returns 0 or an error. */
int mr_runtime_step(struct mr_runtime *rt, int64_t step, struct mr_step_report *r);

/* Mean loss over train.eval_batches batches of the validation data (the
 * training data when there is none), on every rank. */
int mr_runtime_eval(struct mr_runtime *rt, double *loss);

/* Reduces flag (0/1) to its maximum over every rank (checkpoint agreement). */
int mr_runtime_agree(struct mr_runtime *rt, int flag, int *any);

/* The program (borrowed). */
const struct mr_rank_program *mr_runtime_program(const struct mr_runtime *rt);

/* A parameter's state for checkpoints: the local tensor (under ZeRO-3 only
 * the rank's block is kept: `param` is then its block and param_block 1),
 * the AdamW moments of elements [begin, begin + len) of the flattened local
 * tensor, and where the local tensor sits in the global one. */
struct mr_rt_param {
  const char *name;
  int ndim;
  const int64_t *shape;          // global
  const int64_t *goff, *glen;    // the local tensor within it
  int64_t numel;                 // local
  float *param;                  // device memory: the values this rank keeps,
  int64_t pbegin, plen;          //   elements [pbegin, +plen) of the local tensor
  float *m, *v;                  // moments of elements [begin, +len) of the
  int64_t begin, len;            //   local tensor: device memory, or host
  int state_on_host;             //   memory when offloaded
  int keeps_param, keeps_state;  // this rank writes them to checkpoints (one
                                 // copy of each distinct shard in the job)
  int merged;                    // files merge its last two dims (graph.h)
};

/* Fills *out (owned by the runtime) and returns the count. */
int mr_runtime_params(struct mr_runtime *rt, const struct mr_rt_param **out);

/* 1 when the backend's device memory is this process's host memory (the
 * CPU backend): plain memcpy reaches it. */
int mr_runtime_host_memory(const struct mr_runtime *rt);

/* Copies bytes between device and host memory of the runtime's backend. */
int mr_runtime_to_host(struct mr_runtime *rt, void *host, const void *dev, size_t bytes);
int mr_runtime_to_device(struct mr_runtime *rt, void *dev, const void *host, size_t bytes);

/* The lowered graph the runtime runs (borrowed). */
const struct mr_lowered *mr_runtime_lowered(const struct mr_runtime *rt);

/* The loss scaler (fp16), for checkpoints.  Borrowed. */
struct mr_loss_scaler *mr_runtime_scaler(struct mr_runtime *rt);

/* Writes the full weights (safetensors, HF names) to path; collective over
 * every rank (each parameter is gathered to rank 0, which writes).
 * Returns 0 or an error. */
int mr_runtime_save_weights(struct mr_runtime *rt, const char *path);

#endif
