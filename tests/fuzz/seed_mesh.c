/* seed_mesh.c - writes valid mesh specs, placements, DistAttrs and Slurm
 * host lists into DIR, one per file. */
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: seed_mesh DIR\n");
    return 2;
  }
  const char *seeds[] = {"data=2,model=4", "pipe=2,data=2,model=2", "x=8",
                         "Shard(1)", "Partial(avg)", "Replicate()",
                         "[Shard(0), Partial(sum)]",
                         "[Replicate(), Shard(1), Shard(0), Partial(max)]",
                         "gpu[07-09,12],cpu3", "a[1-2]b[03]", "127.0.0.[1-2]"};
  for (size_t i = 0; i < sizeof seeds / sizeof seeds[0]; i++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/seed%zu", argv[1], i);
    FILE *f = fopen(path, "wb");
    if (!f || fputs(seeds[i], f) < 0 || fclose(f) != 0)
      return 1;
  }
  return 0;
}
