/* fuzz_ckpt_pieces.c - libFuzzer target for a checkpoint rank file as the
 * resharding reader takes it: the safetensors header, the "pieces"
 * metadata (boxes and ranges of global tensors), then the launcher's
 * coverage check and reads of every piece's tensor through boxes that
 * overlap it, so an accepted file can never make a read go outside its
 * bytes or its destination. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "common/ckpt_read.h"
#include "common/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct mr_ckpt_reader *r;
  if (mr_ckpt_reader_new(&r) != 0)
    return 0;
  if (mr_ckpt_reader_add_memory(r, data, size, "rank-0.safetensors") == 0) {
    struct mr_st_file *f;
    if (mr_st_open_memory(data, size, "rank-0.safetensors", &f) == 0) {
      for (int i = 0; i < mr_st_count(f); i++) {
        const struct mr_st_tensor *t = mr_st_tensor_at(f, i);
        /* a global tensor the piece could belong to: 1-D of its length,
         * and 2-D [2, ceil(n/2)]; reads of the whole and of a middle box */
        int64_t n = t->rank == 1 ? t->shape[0] : 0;
        if (n <= 0 || n > (1 << 20))
          continue;
        float *buf = malloc((size_t)n * sizeof *buf + 8);
        if (buf == NULL)
          continue;
        int64_t shape1[1] = {n}, off1[1] = {0};
        (void)mr_ckpt_reader_covers(r, t->name, 1, shape1);
        (void)mr_ckpt_reader_read(r, t->name, 1, shape1, off1, shape1, 0, n, buf);
        int64_t cols = (n + 1) / 2, shape2[2] = {2, cols}, off2[2] = {0, 0};
        int64_t len2[2] = {2, cols / 2 > 0 ? cols / 2 : 1};
        (void)mr_ckpt_reader_covers(r, t->name, 2, shape2);
        (void)mr_ckpt_reader_read(r, t->name, 2, shape2, off2, len2, 0, len2[0] * len2[1] < n
                                  ? len2[0] * len2[1] : n, buf);
        free(buf);
      }
      mr_st_free(f);
    }
  }
  mr_ckpt_reader_free(r);
  return 0;
}
