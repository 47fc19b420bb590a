/* fuzz_cluster.c - libFuzzer target for cluster specs: the JSON a user
 * hands `meshrun plan --cluster`.  A spec that parses is then planned
 * against (a small model, at most 64 devices), so whatever numbers pass
 * validation must not crash the cost model or the search. */
#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/jsonv.h"
#include "compiler/planner/search.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *text = malloc(size + 1);
  if (text == NULL)
    return 0;
  memcpy(text, data, size);
  text[size] = '\0';
  cJSON *root = NULL;
  if (mr_json_parse(text, "fuzz.json", &root) == 0) {
    struct mr_cluster c;
    if (mr_cluster_parse(root, "fuzz.json", &c) == 0 && mr_cluster_devices(&c) <= 64) {
      struct mr_model_config m;
      memset(&m, 0, sizeof m);
      m.family = MR_MODEL_GPT2;
      m.hidden_size = 256, m.intermediate_size = 1024, m.num_attention_heads = 8;
      m.num_key_value_heads = 8, m.num_hidden_layers = 4, m.vocab_size = 1000;
      m.max_position_embeddings = 128, m.tie_word_embeddings = 1;
      struct mr_train_config tr;
      memset(&tr, 0, sizeof tr);
      tr.global_batch = 16, tr.seq_len = 128;
      struct mr_plan_request req = {&m, &tr, NULL, &c, 0, 3};
      struct mr_plan_result *r = calloc(1, sizeof *r);
      if (r != NULL)
        mr_plan_search(&req, r);
      free(r);
    }
    cJSON_Delete(root);
  }
  free(text);
  return 0;
}
