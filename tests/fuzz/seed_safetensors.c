/* seed_safetensors.c - writes a few valid safetensors files into DIR with the
 * real writer, the starting corpus for fuzz_safetensors. */
#include <stdio.h>
#include <stdlib.h>

#include "common/safetensors.h"

static void put(const char *dir, const char *name, int variant) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  float f32[24];
  uint16_t h[12];
  int64_t i64[2] = {-1, 1LL << 40};
  uint8_t u8[3] = {1, 2, 3};
  for (int i = 0; i < 24; i++)
    f32[i] = (float)i * 0.25f;
  for (int i = 0; i < 12; i++)
    h[i] = (uint16_t)(0x3c00 + i);
  struct mr_st_writer *w;
  if (mr_st_writer_new(path, 0, &w) != 0)
    exit(1);
  int rc = 0;
  rc |= mr_st_writer_add(w, "model.embed_tokens.weight", MR_F32, 2,
                         (int64_t[]){6, 4}, f32);
  if (variant >= 1) {
    rc |= mr_st_writer_add(w, "h", MR_BF16, 3, (int64_t[]){2, 3, 2}, h);
    rc |= mr_st_writer_add(w, "half", MR_F16, 1, (int64_t[]){12}, h);
    rc |= mr_st_writer_add_metadata(w, "format", "pt");
  }
  if (variant >= 2) {
    rc |= mr_st_writer_add(w, "step", MR_I64, 1, (int64_t[]){2}, i64);
    rc |= mr_st_writer_add(w, "bytes", MR_U8, 1, (int64_t[]){3}, u8);
    rc |= mr_st_writer_add(w, "scalar", MR_F32, 0, NULL, f32);
    rc |= mr_st_writer_add(w, "empty", MR_F32, 2, (int64_t[]){0, 3}, NULL);
  }
  if (rc != 0 || mr_st_writer_finish(w) != 0)
    exit(1);
  mr_st_writer_free(w);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: seed_safetensors DIR\n");
    return 2;
  }
  put(argv[1], "one.safetensors", 0);
  put(argv[1], "three.safetensors", 1);
  put(argv[1], "many.safetensors", 2);
  return 0;
}
