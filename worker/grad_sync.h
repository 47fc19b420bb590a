/* grad_sync.h - data-parallel gradient synchronisation that overlaps the
 * backward pass.
 *
 * The backward ops run one by one; as soon as the last op that writes a
 * parameter's gradient has run, an asynchronous AllReduce (average over the
 * data-parallel group) of that gradient starts on the comm backend, whose
 * progress thread moves the data while the remaining backward ops compute.
 * Gradients finished by the same op start together (a bucket).  wait()
 * then collects them all; the time it blocks is the communication the
 * backward could not hide. */
#ifndef MR_GRAD_SYNC_H
#define MR_GRAD_SYNC_H

#include "worker/comm/comm.h"
#include "worker/exec.h"

struct mr_grad_sync;

/* Plans the synchronisation of the gradients of params (n tensor ids) of
 * x's graph over group g (borrowed; both must outlive the sync). */
int mr_grad_sync_new(struct mr_comm_group *g, struct mr_exec *x, const int *params,
                     int n, struct mr_grad_sync **out);

/* Runs ops [from, to) of the graph, starting each gradient's AllReduce as
 * soon as it is final.  Returns 0 or a kernel's or comm's error. */
int mr_grad_sync_run(struct mr_grad_sync *s, int from, int to);

/* Waits for every AllReduce started; *wait_s gets the seconds blocked. */
int mr_grad_sync_wait(struct mr_grad_sync *s, double *wait_s);

/* Averages n floats over the group, blocking (e.g. the loss). */
int mr_grad_sync_average(struct mr_grad_sync *s, float *v, size_t n);

void mr_grad_sync_free(struct mr_grad_sync *s);

#endif
