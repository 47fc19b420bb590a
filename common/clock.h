/* clock.h - the monotonic clock (CLOCK_MONOTONIC), in the unit the caller
 * wants: for timeouts, heartbeats and measured durations. */
#ifndef MR_CLOCK_H
#define MR_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline int64_t mr_clock_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline int64_t mr_clock_us(void) { return mr_clock_ns() / 1000; }

static inline int64_t mr_clock_ms(void) { return mr_clock_ns() / 1000000; }

static inline double mr_clock_s(void) { return (double)mr_clock_ns() * 1e-9; }

#endif
