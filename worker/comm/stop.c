/* stop.c - what every communicator of the process shares: the stop flag
 * it watches and the tracer it tells (comm.h). */
#include "worker/comm/comm.h"

#include <stddef.h>

static const atomic_int *watched;

void mr_comm_watch_stop(const atomic_int *flag) { watched = flag; }

int mr_comm_stopping(void) {
  const atomic_int *f = watched;
  return f != NULL && atomic_load_explicit(f, memory_order_relaxed) != 0;
}

const struct mr_comm_tracer *mr__comm_tracer;

void mr_comm_set_tracer(const struct mr_comm_tracer *t) { mr__comm_tracer = t; }
