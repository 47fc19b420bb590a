/* fuzz_tokens.c - libFuzzer target for the token-file reader: the input,
 * after two control bytes (vocabulary check on/off, sequence length), is
 * the file, presented through a memfd; every accepted file is read by the
 * training- and evaluation-row formulas. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/tokens.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 2)
    return 0;
  int64_t vocab = (data[0] & 1) ? 50257 : 0;
  int64_t seq = 1 + data[1] % 32;
  data += 2;
  size -= 2;
  int fd = memfd_create("fuzz-tokens", MFD_CLOEXEC);
  if (fd < 0)
    return 0;
  if (write(fd, data, size) != (ssize_t)size) {
    close(fd);
    return 0;
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  struct mr_tokens t;
  if (mr_tokens_open(&t, path, vocab) == 0) {
    int32_t in[32], tg[32];
    for (int64_t r = 0; r < 4; r++) {
      (void)mr_tokens_batch_row(&t, 7, r, r, seq, in, tg);
      (void)mr_tokens_eval_row(&t, r, r, 4, seq, in, tg);
    }
    mr_tokens_close(&t);
  }
  close(fd);
  return 0;
}
