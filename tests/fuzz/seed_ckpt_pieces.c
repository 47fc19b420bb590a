/* seed_ckpt_pieces.c - writes rank files as a checkpoint holds them (1-D
 * pieces and their "pieces" metadata: a whole 2-D shard, a ZeRO block of
 * one, a 1-D tensor) into DIR with the real writer: the starting corpus of
 * fuzz_ckpt_pieces. */
#include <stdio.h>
#include <stdlib.h>

#include "common/ckpt_read.h"
#include "common/safetensors.h"

static void put(const char *dir, const char *name, int variant) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  float f[24];
  for (int i = 0; i < 24; i++)
    f[i] = (float)i;
  struct mr_st_writer *w;
  if (mr_st_writer_new(path, 0, &w) != 0)
    exit(1);
  int rc = 0;
  const char *pieces = variant == 0
      ? "{\"w\":[0,2,6,4,0,24],\"b\":[0,8,0,8]}"
      : "{\"w\":[4,0,4,6,6,12],\"b\":[8,8,4,4]}";
  rc |= mr_st_writer_add(w, "w", MR_F32, 1, (int64_t[]){variant == 0 ? 24 : 12}, f);
  rc |= mr_st_writer_add(w, "b", MR_F32, 1, (int64_t[]){variant == 0 ? 8 : 4}, f);
  rc |= mr_st_writer_add_metadata(w, "format", "meshrun-checkpoint-2");
  rc |= mr_st_writer_add_metadata(w, "pieces", pieces);
  if (rc != 0 || mr_st_writer_finish(w) != 0)
    exit(1);
  mr_st_writer_free(w);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: seed_ckpt_pieces DIR\n");
    return 2;
  }
  put(argv[1], "whole.safetensors", 0);
  put(argv[1], "block.safetensors", 1);
  return 0;
}
