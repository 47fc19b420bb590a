/* seed_job.c - writes valid job files into DIR, the starting corpus for
 * fuzz_job. */
#include <stdio.h>

#define LLAMA                                                                                  \
  "{\"model_type\": \"llama\", \"vocab_size\": 256, \"hidden_size\": 64, "                      \
  "\"intermediate_size\": 172, \"num_hidden_layers\": 4, \"num_attention_heads\": 4, "          \
  "\"num_key_value_heads\": 2, \"max_position_embeddings\": 128}"

static const char *const jobs[] = {
    "{\"model\": " LLAMA ", \"data\": {\"train\": \"t.bin\"}}",
    "{\"model\": " LLAMA ", \"data\": {\"train\": \"t.bin\", \"val\": \"v.bin\"}, \"train\": "
    "{\"steps\": 20, \"global_batch\": 16, \"seq_len\": 64, \"lr\": 3e-4, \"schedule\": "
    "\"cosine\", \"warmup_steps\": 2, \"min_lr\": 1e-5, \"betas\": [0.9, 0.95], \"seed\": 7}, "
    "\"strategy\": {\"auto_mode\": \"semi\", \"data_parallel\": {\"degree\": 2}, "
    "\"tensor_parallel\": {\"degree\": 2}, \"pipeline_parallel\": {\"degree\": 2, \"schedule\": "
    "\"interleaved\", \"micro_batches\": 4, \"virtual_stages\": 2, \"layers\": [1, 1, 1, 1]}, "
    "\"sequence_parallel\": {\"enable\": true}, \"sharding\": {\"stage\": 2, \"offload\": true}, "
    "\"recompute\": {\"enable\": true, \"granularity\": \"selective\"}, \"amp\": {\"dtype\": "
    "\"bf16\"}, \"gradient_accumulation_steps\": 2, \"mesh_mapping\": \"tp,pp,dp\"}, "
    "\"shard_rules\": [{\"match\": \"q_proj|k_proj\", \"placements\": {\"model\": "
    "\"Shard(0)\"}}], \"checkpoint\": {\"dir\": \"ck\", \"save_interval_steps\": 10}}",
    "{\"model\": {\"model_type\": \"gpt2\", \"vocab_size\": 256, \"n_embd\": 64, \"n_layer\": 2, "
    "\"n_head\": 4, \"n_positions\": 64}, \"data\": {\"train\": \"t.bin\"}, \"strategy\": "
    "{\"auto_mode\": \"manual\", \"pipeline_parallel\": {\"degree\": 2, \"layers\": [1, 1]}}}",
};

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: seed_job DIR\n");
    return 2;
  }
  for (unsigned i = 0; i < sizeof jobs / sizeof jobs[0]; i++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/job%u.json", argv[1], i);
    FILE *f = fopen(path, "w");
    if (f == NULL)
      return 1;
    fputs(jobs[i], f);
    fclose(f);
  }
  return 0;
}
