/* fuzz_job.c - libFuzzer target for job files: the JSON a user or a
 * scheduler hands `meshrun launch`, whose canonical text is also the plan
 * body every worker parses.  A job that parses must give a canonical text
 * that parses again to the same strategy hint.  Model configs named by
 * path resolve under a folder that does not exist (absolute paths are
 * skipped: the fuzzer must not read devices). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/job.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int same_hint(const struct mr_strategy_hint *a, const struct mr_strategy_hint *b) {
  if (a->dp != b->dp || a->tp != b->tp || a->pp != b->pp || a->auto_mode != b->auto_mode ||
      a->micro_batches != b->micro_batches || a->virtual_stages != b->virtual_stages ||
      a->zero_stage != b->zero_stage || a->n_chunk_layers != b->n_chunk_layers)
    return 0;
  for (int i = 0; i < a->n_chunk_layers; i++)
    if (a->chunk_layers[i] != b->chunk_layers[i])
      return 0;
  return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *text = malloc(size + 1);
  if (text == NULL)
    return 0;
  memcpy(text, data, size);
  text[size] = '\0';
  if (strstr(text, "\"/") != NULL || strchr(text, '\\') != NULL) {
    free(text);
    return 0;
  }
  struct mr_job job, again;
  if (mr_job_parse(text, "fuzz.json", "/nonexistent", &job) == 0) {
    if (mr_job_parse(job.text, "fuzz.json", "/nonexistent", &again) != 0 ||
        !same_hint(&job.strategy, &again.strategy))
      abort();
    mr_job_close(&again);
    mr_job_close(&job);
  }
  free(text);
  return 0;
}
