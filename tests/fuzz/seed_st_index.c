/* seed_st_index.c - writes valid indexes of sharded checkpoints into DIR
 * with the real writer (mr_st_index_write). */
#include <stdio.h>
#include <stdlib.h>

#include "common/safetensors.h"

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: seed_st_index DIR\n");
    return 2;
  }
  for (int n = 1; n <= 3; n++) {
    struct mr_st_index *ix;
    if (mr_st_index_new(&ix) != 0)
      return 1;
    for (int t = 0; t < 4 * n; t++) {
      char name[64], file[64];
      snprintf(name, sizeof name, "model.layers.%d.self_attn.q_proj.weight", t);
      snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", t % n + 1, n);
      if (mr_st_index_add(ix, name, file) != 0)
        return 1;
    }
    mr_st_index_set_total_size(ix, 4096u * (unsigned)n);
    char path[4096];
    snprintf(path, sizeof path, "%s/index-%d.json", argv[1], n);
    if (mr_st_index_write(ix, path) != 0)
      return 1;
    mr_st_index_free(ix);
  }
  return 0;
}
