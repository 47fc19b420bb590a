/* dist_train.c - one rank's training loop on the runtime. */
#include "worker/dist_train.h"

#include <stdio.h>
#include <stdlib.h>

#include "common/error.h"
#include "common/log.h"
#include "common/test_hooks.h"
#include "compiler/spmd/lower.h"
#include "worker/checkpoint.h"
#include "worker/runtime.h"
#include "worker/trace.h"
#include "worker/train.h"

int mr_dist_train_run(const struct mr_job *job, const struct mr_run_env *env,
                      struct mr_backend *be, struct mr_comm *comm) {
  struct mr_lowered L;
  MR_TRY(mr_lower_graph(job, env->world_size, &L));
  struct mr_runtime *rt = NULL;
  struct mr_ckpt_saver *saver = NULL;
  FILE *mf = NULL;
  int rc = 0;
  MR_TRY_GOTO(rc, mr_runtime_new(job, &L, env->rank, be, comm, &rt), out);
  uint64_t digest = env->program_digest != 0 ? mr_rank_program_digest(mr_runtime_program(rt)) : 0;
  if (digest != env->program_digest) {
    rc = mr_error_set(MR_EPLAN, "rank %d: the program this worker lowered from the plan "
                      "(digest %016llx) is not the one the launcher checked (%016llx, `meshrun "
                      "plan --dump --rank %d` prints it); are meshrun and meshrun-worker the same "
                      "build on every node?", env->rank, (unsigned long long)digest,
                      (unsigned long long)env->program_digest, env->rank);
    goto out;
  }
  mr_runtime_set_reporter(rt, env->reporter);
  mr_runtime_set_trace(rt, env->trace);
  MR_TRY_GOTO(rc, mr_train_open_metrics(env, &mf), out);
  if (job->checkpoint.dir != NULL)
    MR_TRY_GOTO(rc, mr_ckpt_saver_new(env->rank, env->world_size, job, &saver), out);
  if (saver != NULL)
    mr_ckpt_saver_set_trace(saver, env->trace);
  int64_t first = 1;
  if (env->resume_dir != NULL) {
    int64_t done_step;
    MR_TRY_GOTO(rc, mr_ckpt_load(rt, env->resume_dir, &done_step), out);
    first = done_step + 1;
    if (env->rank == 0)
      MR_INFO("ckpt", "resumed from %s: continuing at step %lld", env->resume_dir,
              (long long)first);
  }
  if (env->rank == 0) {
    char lay[256];
    mr_lowered_format(&L, lay, sizeof lay);
    MR_INFO("train", "%lld parameters; %s; planned peak %.1f MiB on rank 0",
            (long long)mr_model_param_count(&job->model), lay,
            (double)mr_rank_program_peak_bytes(mr_runtime_program(rt)) / 1048576.0);
  }
  mr_hook_start();
  if (env->reporter->running != NULL)
    env->reporter->running(env->reporter->ctx);
  for (int64_t s = first; s <= job->train.steps; s++) {
    mr_hook_step(env->rank, s, env->reporter->stop_requested, env->reporter->ctx);
    if (env->reporter->stop_requested && env->reporter->stop_requested(env->reporter->ctx))
      break;
    struct mr_step_report r;
    mr_trace_step_begin(env->trace, s);
    MR_TRY_GOTO(rc, mr_runtime_step(rt, s, &r), out);
    int64_t ev = job->train.eval_interval_steps;
    if (ev > 0 && (s % ev == 0 || s == job->train.steps))
      MR_TRY_GOTO(rc, mr_runtime_eval(rt, &r.val_loss), out);
    mr_train_report_step(job, env, mf, &r,
                         env->world_size <= 1 && getenv("MESHRUN_LAUNCHER_PID") == NULL);
    /* every rank saves the same step: a request (preemption) is agreed on */
    int asked = env->reporter->checkpoint_requested != NULL &&
                env->reporter->checkpoint_requested(env->reporter->ctx);
    int64_t every = job->checkpoint.save_interval_steps;
    if (job->checkpoint.dir != NULL)
      MR_TRY_GOTO(rc, mr_runtime_agree(rt, asked, &asked), out);
    /* the last step too: the job relaunched is complete, not trained again
     * from the interval's last save */
    if (saver != NULL && ((every > 0 && s % every == 0) || asked || s == job->train.steps)) {
      int64_t t0 = mr_trace_now();
      MR_TRY_GOTO(rc, mr_ckpt_save(saver, rt, s, env->reporter), out);
      mr_trace_slice(env->trace, MR_TRACE_COMPUTE, "checkpoint", "checkpoint snapshot", t0,
                     mr_trace_now(), "");
    } else {
      MR_TRY_GOTO(rc, mr_ckpt_saver_poll(saver), out);
    }
    mr_trace_step_end(env->trace, s);
  }
  if (saver != NULL)
    MR_TRY_GOTO(rc, mr_ckpt_saver_wait(saver), out);
  char prof[1024];
  if (mr_runtime_profile(rt, prof, sizeof prof))
    MR_INFO("profile", "rank %d: %s", env->rank, prof);
  int stopped = env->reporter->stop_requested != NULL &&
                env->reporter->stop_requested(env->reporter->ctx);
  if (env->weights_out && !stopped) /* collective: a stopped group has left */
    MR_TRY_GOTO(rc, mr_runtime_save_weights(rt, env->weights_out), out);
out:
  mr_ckpt_saver_free(saver);
  if (mf)
    fclose(mf);
  mr_runtime_free(rt);
  mr_lowered_close(&L);
  return rc;
}
