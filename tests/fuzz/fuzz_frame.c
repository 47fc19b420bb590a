/* fuzz_frame.c - libFuzzer target for the frame reader and the envelope
 * decoder/validator: the bytes a hostile peer controls.  The first byte picks
 * the chunk size the stream is fed in, so reassembly is exercised too. */
#include <stddef.h>
#include <stdint.h>

#include "common/frame.h"
#include "common/rpc.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0)
    return 0;
  size_t chunk = (size_t)(data[0] % 17) + 1;
  data++;
  size--;
  struct mr_frame_reader r;
  mr_frame_reader_init(&r, 1 << 16);
  for (size_t off = 0; off < size; off += chunk) {
    size_t n = size - off < chunk ? size - off : chunk;
    if (mr_frame_reader_feed(&r, data + off, n) < 0)
      break;
    for (;;) {
      const uint8_t *p;
      size_t len;
      int got = mr_frame_reader_next(&r, &p, &len);
      if (got <= 0)
        break;
      Meshrun__Envelope *env = NULL;
      if (mr_rpc_decode(p, len, &env) == 0) {
        (void)mr_rpc_name(env);
        mr_rpc_free(env);
      }
    }
  }
  /* the decoder alone, on the raw bytes */
  Meshrun__Envelope *env = NULL;
  if (mr_rpc_decode(data, size, &env) == 0)
    mr_rpc_free(env);
  mr_frame_reader_close(&r);
  return 0;
}
