/* fuzz_mesh.c - libFuzzer target for the notations users (and schedulers)
 * write: the input (NUL-terminated copy) is parsed as a --mesh spec, a
 * placement and a DistAttr of 1..4 mesh dims — whatever parses is printed
 * and parsed back, which must give the same value — and as a Slurm host
 * list, whose first host must be a non-empty host name that is itself a
 * host list naming it, and as a per-node count list (SLURM_JOB_CPUS_PER_NODE). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "compiler/mesh.h"
#include "launcher/slurm.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *s = malloc(size + 1);
  if (!s)
    return 0;
  memcpy(s, data, size);
  s[size] = 0;
  char buf[512];
  struct mr_mesh m, m2;
  if (mr_mesh_parse(s, &m) == 0) {
    mr_mesh_format(&m, buf, sizeof buf);
    if (mr_mesh_parse(buf, &m2) != 0 || m2.ndim != m.ndim ||
        memcmp(m.shape, m2.shape, sizeof m.shape) != 0)
      abort();
  }
  struct mr_placement p, p2;
  if (mr_placement_parse(s, &p) == 0) {
    mr_placement_format(p, buf, sizeof buf);
    if (mr_placement_parse(buf, &p2) != 0 || !mr_placement_eq(p, p2))
      abort();
  }
  for (int nd = 1; nd <= MR_MESH_MAX_DIMS; nd++) {
    struct mr_dist_attr d, d2;
    if (mr_dist_parse(s, nd, &d) != 0)
      continue;
    mr_dist_format(&d, buf, sizeof buf);
    if (mr_dist_parse(buf, nd, &d2) != 0 || !mr_dist_eq(&d, &d2))
      abort();
  }
  char host[64], again[64];
  if (mr_slurm_first_host(s, host, sizeof host) == 0) {
    size_t n = strlen(host);
    if (n == 0 || n >= sizeof host || strpbrk(host, "[],") != NULL ||
        mr_slurm_first_host(host, again, sizeof again) != 0 || strcmp(host, again) != 0)
      abort();
  }
  /* a per-node count list: counts are never negative, and the list has
   * them for nodes 0..N-1 and none past */
  int ended = 0;
  for (long k = 0; k < 64; k++) {
    long c = -1;
    int rc = mr_slurm_per_node(s, k, &c);
    if ((rc == 0 && (ended || c < 0)) || (rc != 0 && rc != MR_EINVAL))
      abort();
    ended |= rc != 0;
  }
  free(s);
  return 0;
}
