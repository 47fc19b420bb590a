/* grad_sync.c - gradient AllReduce overlapping the backward pass. */
#include "worker/grad_sync.h"

#include <stdlib.h>
#include <time.h>

#include "common/error.h"

struct mr_grad_sync {
  struct mr_comm_group *group;
  struct mr_exec *x;
  int n;
  int *grad;                 // [n] gradient tensor ids
  int *ready_after;          // [n] op after which the gradient is final
  struct mr_comm_req **req;  // [n] in flight, or NULL
};

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int mr_grad_sync_new(struct mr_comm_group *g, struct mr_exec *x, const int *params,
                     int n, struct mr_grad_sync **out) {
  struct mr_grad_sync *s = calloc(1, sizeof *s);
  if (s == NULL)
    return MR_ENOMEM;
  s->group = g;
  s->x = x;
  s->n = n;
  s->grad = calloc((size_t)(n > 0 ? n : 1), sizeof *s->grad);
  s->ready_after = calloc((size_t)(n > 0 ? n : 1), sizeof *s->ready_after);
  s->req = calloc((size_t)(n > 0 ? n : 1), sizeof *s->req);
  if (s->grad == NULL || s->ready_after == NULL || s->req == NULL) {
    mr_grad_sync_free(s);
    return MR_ENOMEM;
  }
  const struct mr_graph *gr = x->g;
  for (int i = 0; i < n; i++) {
    s->grad[i] = gr->tensors[params[i]].grad;
    s->ready_after[i] = gr->n_ops - 1;
    /* the last op writing the gradient (several write one when it is
     * accumulated, e.g. a tied embedding) */
    for (int o = gr->n_ops - 1; o >= 0; o--) {
      const struct mr_op *op = &gr->ops[o];
      int writes = 0;
      for (int k = 0; k < op->n_out; k++)
        writes |= op->out[k] == s->grad[i];
      if (writes) {
        s->ready_after[i] = o;
        break;
      }
    }
  }
  *out = s;
  return 0;
}

static int start(struct mr_grad_sync *s, int i) {
  const struct mr_tensor *t = &s->x->g->tensors[s->grad[i]];
  float *buf = mr_exec_buf(s->x, s->grad[i]);
  return mr_comm_all_reduce(s->group, buf, buf, (size_t)mr_tensor_numel(t), MR_F32,
                            MR_RED_AVG, &s->req[i]);
}

int mr_grad_sync_run(struct mr_grad_sync *s, int from, int to) {
  for (int o = from; o < to; o++) {
    MR_TRY(mr_exec_run(s->x, o, o + 1));
    for (int i = 0; i < s->n; i++)
      if (s->ready_after[i] == o && s->req[i] == NULL)
        MR_TRY(start(s, i));
  }
  return 0;
}

int mr_grad_sync_wait(struct mr_grad_sync *s, double *wait_s) {
  double t0 = now();
  int rc = 0;
  for (int i = 0; i < s->n; i++) {
    if (s->req[i] == NULL && rc == 0)
      rc = start(s, i); /* a gradient no op wrote in the range run */
    if (s->req[i] != NULL) {
      int r = mr_comm_wait(s->req[i]);
      s->req[i] = NULL;
      if (rc == 0)
        rc = r;
    }
  }
  if (wait_s != NULL)
    *wait_s = now() - t0;
  return rc;
}

int mr_grad_sync_average(struct mr_grad_sync *s, float *v, size_t n) {
  struct mr_comm_req *r;
  MR_TRY(mr_comm_all_reduce(s->group, v, v, n, MR_F32, MR_RED_AVG, &r));
  return mr_comm_wait(r);
}

void mr_grad_sync_free(struct mr_grad_sync *s) {
  if (s == NULL)
    return;
  for (int i = 0; s->req != NULL && i < s->n; i++)
    if (s->req[i] != NULL)
      mr_comm_wait(s->req[i]);
  free(s->grad);
  free(s->ready_after);
  free(s->req);
  free(s);
}
