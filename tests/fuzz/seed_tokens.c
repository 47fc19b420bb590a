/* seed_tokens.c - writes valid token files (llm.c uint16, uint32, raw) into
 * DIR with the real writer, each behind the two control bytes fuzz_tokens
 * reads first. */
#include <stdio.h>
#include <stdlib.h>

#include "common/tokens.h"

static void put(const char *dir, const char *name, enum mr_tokens_format fmt) {
  char tmp[4096], path[4096];
  snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, name);
  snprintf(path, sizeof path, "%s/%s", dir, name);
  struct mr_tokens_writer w;
  uint32_t tok[100];
  for (int i = 0; i < 100; i++)
    tok[i] = (uint32_t)(i * 257 % 50000);
  if (mr_tokens_writer_open(&w, tmp, fmt) != 0 ||
      mr_tokens_writer_append(&w, tok, 100) != 0 ||
      mr_tokens_writer_close(&w) != 0)
    exit(1);
  FILE *in = fopen(tmp, "rb"), *out = fopen(path, "wb");
  if (in == NULL || out == NULL)
    exit(1);
  fputc(1, out);
  fputc(15, out);
  int c;
  while ((c = fgetc(in)) != EOF)
    fputc(c, out);
  fclose(in);
  fclose(out);
  remove(tmp);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: seed_tokens DIR\n");
    return 2;
  }
  put(argv[1], "llmc16", MR_TOKENS_LLMC_U16);
  put(argv[1], "llmc32", MR_TOKENS_LLMC_U32);
  put(argv[1], "raw", MR_TOKENS_RAW_U16);
  return 0;
}
