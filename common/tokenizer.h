/* tokenizer.h - a model's own tokenizer (tokenizer.json, as the hub ships
 * it) through the helper program meshrun-tokenize, which runs Hugging
 * Face's `tokenizers` library in Python ($MESHRUN_PYTHON, else python3):
 * a well-kept implementation of every tokenizer the hub's models use,
 * rather than one written here.  The helper is found beside the running
 * program or in the build tree (mr_find_program).
 *
 * TOK below is a tokenizer.json or a folder holding one.  Every call runs
 * the helper once; its error (a missing library, a bad file, a JSONL line
 * without the field) becomes the message of MR_EINVAL, naming the file. */
#ifndef MR_TOKENIZER_H
#define MR_TOKENIZER_H

#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

struct mr_tokenizer_info {
  int64_t vocab_size;
  int64_t eos_id; // the end-of-text token, or -1
};

int mr_tokenizer_info(const char *tok, struct mr_tokenizer_info *info);

/* text -> *ids (malloc'd, *n of them). */
int mr_tokenizer_encode(const char *tok, const char *text, int32_t **ids, int64_t *n);

/* ids -> *text (malloc'd, NUL-terminated). */
int mr_tokenizer_decode(const char *tok, const int32_t *ids, int64_t n, char **text);

/* Documents of files tokenized as they come: a whole text file, or each
 * line of a .jsonl file (its `field`), each followed by the end-of-text
 * token where the tokenizer has one. */
struct mr_tokenizer_stream {
  pid_t pid;
  FILE *out;   // the helper's stdout
  int err_fd;  // its stderr
  uint32_t *ids;
  size_t cap;
};

int mr_tokenizer_stream_open(const char *tok, const char *field, const char *const *files,
                             int n_files, struct mr_tokenizer_stream *s);

/* The next document: 1 with *ids (borrowed until the next call), *n and
 * *consumed (bytes of input read so far); 0 at the end; or an error. */
int mr_tokenizer_stream_next(struct mr_tokenizer_stream *s, const uint32_t **ids, int64_t *n,
                             uint64_t *consumed);

/* Waits for the helper; its failure is the error.  Safe after any result
 * of open (a zeroed stream too). */
int mr_tokenizer_stream_close(struct mr_tokenizer_stream *s);

#endif
