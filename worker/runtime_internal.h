/* runtime_internal.h - what the runtime's files share (worker/runtime.c:
 * regions, progress, the step loop; runtime_ops.c: the instructions and
 * the optimizer; runtime_state.c: parameters in and out). */
#ifndef MR_RUNTIME_INTERNAL_H
#define MR_RUNTIME_INTERNAL_H

#include "worker/runtime.h"
#include "worker/reshard_run.h"
#include "worker/optim.h"
#include "common/test_hooks.h"
#include "common/tokens.h"
#include "worker/backend/cpu/kernels.h"

#define MAX_PENDING 4096

struct pending {
  struct mr_comm_req *req;
  int param;                    // reduce-scatter: the parameter's index
};

struct mr_runtime {
  const struct mr_job *job;
  const struct mr_lowered *L;
  struct mr_rank_program p;
  struct mr_backend *be;
  struct mr_comm *comm;
  struct mr_comm_group *pipe_g, *data_g, *model_g; // NULL: a group of one
  struct mr_reshard_ctx rs;
  char *param, *acc, *optim, *arena, *send, *zero_tmp, *gstage;
  char **stash;                 // [n_chunks]
  unsigned char *phantom_grad;  // [n_params] a phantom slot reduce-scattered
                                // it this step (mr__rt_phantom_sum)
  float *scalar;                // one float on the device: the small
                                // all-reduces and the loss broadcast
  int64_t allocated;            // device memory held: every region lives
                                // until mr_runtime_free, so also the peak
  int offload_host;             // optim is host memory (offload)
  /* offload on a device: the optimizer runs on the host, on staged copies
   * of the rank's blocks (pinned where the backend has such memory) */
  float *off_param, *off_grad;  // [off_floats] each
  int64_t off_floats;
  struct mr_pool *off_pool;
  int32_t *host_ids, *host_labels, *host_pos; // staging for loads
  struct mr_tokens train, val;
  int have_val;
  struct pending step_req[MAX_PENDING];
  int n_step_req;
  struct pending pass_req[MAX_PENDING];
  int n_pass_req;
  double loss_sum;
  int loss_n;
  struct mr_loss_scaler scaler;
  struct mr_adamw adamw;
  int64_t inject_step;
  struct mr_hook_slow slow;      // test hook: how slow this rank is made (test_hooks.h)
  int overlap;                  // MESHRUN_GRAD_SYNC_OVERLAP
  double comm_wait_s;           // this step
  const struct mr_reporter *rep;
  struct mr_trace *trace;       // NULL: no timeline
  int64_t cur_step;
  struct mr_rt_param *views;
  double *prof_op;              // MESHRUN_PROFILE: s per op kind, else NULL
  double prof_kind[MR_INS_KIND_COUNT]; // s per instruction kind
  int64_t prof_steps;
};


/* Device memory counted in the peak (bytes may be 0). */
int mr__rt_alloc(struct mr_runtime *rt, int64_t bytes, char **out);
/* Where local tensor t lives in pass ps for stash slot `slot`. */
void *mr__rt_buf(const struct mr_runtime *rt, int t, const struct mr_pass *ps, int slot);
/* Progress for hang diagnosis: waiting on instruction idx (in, or a
 * description), and done with it. */
void mr__rt_waiting(struct mr_runtime *rt, int idx, const struct mr_ins *in, const char *what);
void mr__rt_done(struct mr_runtime *rt, int idx);
/* Waits for a request (the time counted as communication wait), for a list
 * of them, and adds one to a list (waiting the list first when full). */
int mr__rt_wait_req(struct mr_runtime *rt, struct mr_comm_req *req);
int mr__rt_wait_all(struct mr_runtime *rt, struct pending *list, int *n);
int mr__rt_push_req(struct mr_runtime *rt, struct pending *list, int *n, struct mr_comm_req *req,
                    int param);
/* The parameters' first values: the seeded initializer or train.init. */
int mr__rt_init_params(struct mr_runtime *rt);
/* One copy of each shard along the model dim is kept (checkpoints,
 * weights): model coordinate 0 unless the parameter is split over model. */
int mr__rt_writes_model(const struct mr_runtime *rt, const struct mr_param_plan *pp);

/* The instructions (runtime_ops.c); eval_batch >= 0 loads evaluation rows. */
int mr__rt_load(struct mr_runtime *rt, const struct mr_pass *ps, int slot, int64_t step, int micro,
                int64_t eval_batch);
int mr__rt_kernel(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps);
int mr__rt_reshard(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps);
int mr__rt_grad(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps);
int mr__rt_grad_wait(struct mr_runtime *rt, const struct mr_ins *in);
int mr__rt_phantom_sum(struct mr_runtime *rt);
int mr__rt_send(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps);
int mr__rt_recv(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps);
int mr__rt_seed(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps);
int mr__rt_gather(struct mr_runtime *rt, const struct mr_ins *in, const struct mr_pass *ps);
/* One float reduced over the model, data and pipe groups. */
int mr__rt_allreduce_all(struct mr_runtime *rt, float *v, enum mr_red_op op);
int mr__rt_optimizer(struct mr_runtime *rt, int64_t step, struct mr_step_report *r);
int mr__rt_param_sync(struct mr_runtime *rt);
int mr__rt_share_loss(struct mr_runtime *rt, float *loss);
int mr__rt_step_loss(struct mr_runtime *rt, double partial_sum, float *loss);

#endif
