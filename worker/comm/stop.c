/* stop.c - the stop flag every communicator of the process watches. */
#include "worker/comm/comm.h"

#include <stddef.h>

static const atomic_int *watched;

void mr_comm_watch_stop(const atomic_int *flag) { watched = flag; }

int mr_comm_stopping(void) {
  const atomic_int *f = watched;
  return f != NULL && atomic_load_explicit(f, memory_order_relaxed) != 0;
}
