/* plan_work.c - plans made on libuv's thread pool (launcher/plan_work.h). */
#include "launcher/plan_work.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/test_hooks.h"
#include "launcher/rebalance.h"

/* On a pool thread: the plan, or the error and its message. */
static void plan_on_pool(uv_work_t *req) {
  struct mr_plan_work *w = req->data;
  mr_hook_plan_delay();
  w->digests = calloc((size_t)w->world, sizeof *w->digests);
  if (w->digests == NULL) {
    w->rc = MR_ENOMEM;
  } else if (w->kind == MR_PLAN_WORLD) {
    w->rc = mr_strategy_choose(w->job, w->world, &w->choice);
    if (w->rc == 0) {
      w->text = mr_strategy_apply(w->job, &w->choice.chosen.strategy);
      w->step_s = w->choice.chosen.cost.step_time_s;
      memcpy(w->digests, w->choice.program_digests, (size_t)w->world * sizeof *w->digests);
      if (w->text == NULL)
        w->rc = mr_error_set(MR_ENOMEM, "re-plan: out of memory");
    }
  } else {
    w->text = w->kind == MR_PLAN_LAYERS
                  ? mr_plan_with_split(w->job, w->plan, w->world, w->counts, w->n, w->digests,
                                       &w->step_s)
                  : mr_plan_with_dp_split(w->job, w->plan, w->world, w->n_micro, w->counts,
                                          w->n, w->digests, &w->step_s);
    w->rc = w->text != NULL ? 0 : MR_EPLAN;
    if (w->rc < 0) /* the message set where it failed, whatever its code */
      w->rc = mr_error_set(MR_EPLAN, "%s", mr_error_message());
  }
  if (w->rc < 0) /* the message is the pool thread's: carried to the loop's */
    snprintf(w->message, sizeof w->message, "%s", mr_error_of(w->rc));
}

/* On the loop's thread. */
static void plan_done(uv_work_t *req, int status) {
  struct mr_plan_work *w = req->data;
  if (status < 0 && w->rc == 0) /* cancelled: never ran */
    w->rc = mr_error_set(MR_ESYS, "re-plan: %s", uv_strerror(status));
  else if (w->rc < 0)
    mr_error_set(w->rc, "%s", w->message);
  w->done(w);
}

int mr_plan_work_start(uv_loop_t *loop, struct mr_plan_work *w, enum mr_plan_work_kind kind,
                       const struct mr_job *job, const char *plan, int world, const int *counts,
                       int n, int n_micro) {
  w->kind = kind;
  w->job = job;
  w->world = world;
  w->n = n;
  w->n_micro = n_micro;
  if (plan != NULL && (w->plan = strdup(plan)) == NULL)
    return mr_error_set(MR_ENOMEM, "re-plan: out of memory");
  if (counts != NULL && n > 0) {
    if ((w->counts = malloc((size_t)n * sizeof *counts)) == NULL)
      return mr_error_set(MR_ENOMEM, "re-plan: out of memory");
    memcpy(w->counts, counts, (size_t)n * sizeof *counts);
  }
  w->req.data = w;
  int rc = uv_queue_work(loop, &w->req, plan_on_pool, plan_done);
  if (rc < 0)
    return mr_error_set(MR_ESYS, "re-plan: %s", uv_strerror(rc));
  return 0;
}

void mr_plan_work_free(struct mr_plan_work *w) {
  if (w == NULL)
    return;
  if (w->kind == MR_PLAN_WORLD)
    mr_strategy_choice_close(&w->choice);
  free(w->plan);
  free(w->counts);
  free(w->text);
  free(w->digests);
  free(w);
}
