/* frame.h - length-prefixed framing of RPC messages.
 *
 * A frame is a 4-byte little-endian payload length, then the payload.  The
 * reader accumulates bytes from a stream in any chunking and hands out whole
 * payloads; a declared length above the reader's maximum is an error the
 * moment its 4 header bytes arrive, before any payload is buffered, so a
 * hostile peer cannot make us allocate. */
#ifndef MR_FRAME_H
#define MR_FRAME_H

#include <stddef.h>
#include <stdint.h>

#define MR_FRAME_HEADER_BYTES 4

struct mr_frame_reader {
  uint8_t *buf;     // owned; bytes [head, len) are unconsumed
  size_t head;
  size_t len;
  size_t cap;
  size_t max_frame; // largest payload accepted, bytes
};

/* Initialises r for payloads of at most max_frame bytes. */
void mr_frame_reader_init(struct mr_frame_reader *r, size_t max_frame);

/* Releases r's buffer.  Safe on a zeroed reader. */
void mr_frame_reader_close(struct mr_frame_reader *r);

/* Appends n bytes read from the stream.  Returns 0 or MR_ENOMEM. */
int mr_frame_reader_feed(struct mr_frame_reader *r, const void *data,
                         size_t n);

/* Takes the next whole frame.  Returns 1 and sets *payload (borrowed, valid
 * until the next feed or next call) and *len; 0 when more bytes are needed;
 * MR_ETOOBIG when the declared length exceeds the maximum (the stream is
 * then unusable and should be closed). */
int mr_frame_reader_next(struct mr_frame_reader *r, const uint8_t **payload,
                         size_t *len);

/* Bytes buffered but not yet returned as frames. */
size_t mr_frame_reader_pending(const struct mr_frame_reader *r);

/* Writes the 4-byte header for a payload of len bytes. */
void mr_frame_put_header(uint8_t header[MR_FRAME_HEADER_BYTES], uint32_t len);

/* Reads a 4-byte little-endian header. */
uint32_t mr_frame_get_header(const uint8_t header[MR_FRAME_HEADER_BYTES]);

#endif
