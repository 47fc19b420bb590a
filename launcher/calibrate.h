/* calibrate.h - this machine measured as a cluster spec: `meshrun
 * calibrate`, and the spec `meshrun launch` plans CPU ranks for when a job
 * names none, measured once per machine and cached.
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

/* The spec for CPU ranks on this machine: the cached one when this CPU
 * (model, instruction sets, cores, memory) was measured before, else
 * measured now for one rank a core and cached as
 * ~/.cache/meshrun/cluster-cpu-CORES-ID.json (a cached file that does not
 * load is measured again).  Writes its path into path (len bytes).
 * Returns 0 or an MR_E code with a message (path is then ""). */
int mr_cpu_cluster_spec(char *path, size_t len);

#endif
