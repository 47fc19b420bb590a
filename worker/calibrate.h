/* calibrate.h - this machine's CPU ranks measured as a cluster spec, in a
 * worker process: `meshrun calibrate`, and the spec `meshrun launch` plans
 * CPU ranks for when a job names none (launcher/measure.h caches it).
 *
 * The measurements: the FMA peak of one core, the worker's own matmul at
 * two shapes (its rate and how it falls with small dimensions), memcpy
 * bandwidth, and AllReduce latency and bus bandwidth with the CPU comm
 * backend between forked ranks; what one machine cannot measure (the
 * network to other nodes, the reserved bytes) comes from a base spec. */
#ifndef MR_CALIBRATE_H
#define MR_CALIBRATE_H

#include <stddef.h>

/* Measures this machine for `ranks` ranks (one a core) and returns the spec
 * as JSON in *text (the caller frees it), with base's (a cluster name or
 * file) unmeasured fields.  Progress goes to stderr unless quiet.  Takes
 * about a second.  Returns 0; MR_ENOENT or MR_EFORMAT when base is missing
 * or malformed; another MR_E code when a measurement failed. */
int mr_calibrate_spec(long ranks, const char *base, int quiet, char **text);

/* `meshrun-worker --calibrate [--out FILE] [--ranks N] [--base SPEC]
 * [--quiet]`, which `meshrun calibrate` runs: argv from "--calibrate" on.
 * Returns the exit status: 0, 1 (a measurement failed) or 2 (bad usage, a
 * base spec missing or malformed). */
int mr_calibrate_main(int argc, char **argv);

#endif
