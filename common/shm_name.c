/* shm_name.c - naming and sweeping a job's /dev/shm segments. */
#include "common/shm_name.h"

#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "common/rng.h"

void mr_shm_segment_name(char *out, size_t n, const char *job_id, uint64_t nonce,
                         const char *desc, int occurrence) {
  snprintf(out, n, "/meshrun-%s-%016llx-%016llx-%d", job_id, (unsigned long long)nonce,
           (unsigned long long)mr_hash_str(desc), occurrence);
}

int mr_shm_sweep(const char *job_id) {
  char prefix[128];
  snprintf(prefix, sizeof prefix, "meshrun-%s-", job_id);
  size_t pl = strlen(prefix);
  int removed = 0;
  DIR *d = opendir("/dev/shm");
  if (d == NULL)
    return 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (strncmp(e->d_name, prefix, pl) == 0) {
      char name[300];
      snprintf(name, sizeof name, "/%s", e->d_name);
      removed += shm_unlink(name) == 0;
    }
  closedir(d);
  return removed;
}
