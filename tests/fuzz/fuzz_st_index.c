/* fuzz_st_index.c - libFuzzer target for the reader of a sharded
 * checkpoint's index (model.safetensors.index.json, as the hub ships
 * models above a few GB): whatever it accepts maps every tensor it lists
 * to the file it names, once. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct mr_st_index *ix;
  if (mr_st_index_parse((const char *)data, size, "fuzz.index.json", &ix) != 0)
    return 0;
  for (int i = 0; i < mr_st_index_count(ix); i++) {
    const char *name, *file;
    mr_st_index_at(ix, i, &name, &file);
    const char *found = mr_st_index_file(ix, name);
    if (found == NULL || strcmp(found, file) != 0)
      abort();
  }
  (void)mr_st_index_total_size(ix);
  mr_st_index_free(ix);
  return 0;
}
