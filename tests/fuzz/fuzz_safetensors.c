/* fuzz_safetensors.c - libFuzzer target for the safetensors header parser
 * and validator, then reads of every tensor it accepts (whole, converted,
 * and a slice), so an accepted header can never point outside the bytes. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "common/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct mr_st_file *f;
  if (mr_st_open_memory(data, size, "fuzz.safetensors", &f) != 0)
    return 0;
  (void)mr_st_metadata(f, "format");
  for (int i = 0; i < mr_st_metadata_count(f); i++) {
    const char *k, *v;
    mr_st_metadata_at(f, i, &k, &v);
    (void)k;
    (void)v;
  }
  for (int i = 0; i < mr_st_count(f); i++) {
    const struct mr_st_tensor *t = mr_st_tensor_at(f, i);
    if (mr_st_find(f, t->name) != t)
      abort();
    /* the validated size fits in the input, so the buffers stay small */
    size_t bytes = (size_t)(t->end - t->begin);
    void *buf = malloc(bytes * 4 + 8);
    if (buf == NULL)
      continue;
    (void)mr_st_read(f, t, t->dtype, buf);
    (void)mr_st_read(f, t, MR_F64, buf);
    if (t->rank > 0 && t->shape[0] > 0) {
      int64_t start[MR_ST_MAX_RANK] = {0}, count[MR_ST_MAX_RANK];
      for (int k = 0; k < t->rank; k++) {
        start[k] = t->shape[k] / 2;
        count[k] = t->shape[k] - start[k];
      }
      (void)mr_st_read_slice(f, t, start, count, MR_F32, buf);
      (void)mr_st_read_rows(f, t, t->shape[0] - 1, 1, t->dtype, buf);
    }
    free(buf);
  }
  mr_st_free(f);
  return 0;
}
