/* completion_bench.c - time of mr_spmd_complete on LLaMA graphs (forward +
 * backward) of growing depth under the Megatron hints, to show it is
 * linear in graph size and cheap enough to run per candidate mesh.
 *
 *   build/scripts/bench/completion_bench [MESH]   (default data=2,model=4)
 *
 * Prints layers, ops, tensors, milliseconds per completion (best of 5) and
 * microseconds per op. */
#include <stdio.h>
#include <string.h>

#include "compiler/autodiff.h"
#include "common/clock.h"
#include "common/error.h"
#include "compiler/model.h"
#include "compiler/spmd/completion.h"

int main(int argc, char **argv) {
  const char *spec = argc > 1 ? argv[1] : "data=2,model=4";
  struct mr_mesh m;
  if (mr_mesh_parse(spec, &m) < 0) {
    fprintf(stderr, "%s\n", mr_error_message());
    return 2;
  }
  static struct mr_shard_rule_placement col = {"model", "Shard(0)"};
  static struct mr_shard_rule_placement row = {"model", "Shard(1)"};
  struct mr_shard_rule rules[] = {
      {"q_proj|k_proj|v_proj|gate_proj|up_proj", &col, 1},
      {"o_proj|down_proj", &row, 1}};
  printf("%-7s %-6s %-8s %-12s %s\n", "layers", "ops", "tensors", "ms", "us/op");
  int depth[] = {2, 8, 32, 128};
  for (size_t i = 0; i < sizeof depth / sizeof depth[0]; i++) {
    struct mr_model_config c;
    memset(&c, 0, sizeof c);
    c.family = MR_MODEL_LLAMA;
    c.vocab_size = 32000, c.hidden_size = 256, c.intermediate_size = 688;
    c.num_hidden_layers = depth[i], c.num_attention_heads = 8;
    c.num_key_value_heads = 8, c.max_position_embeddings = 512;
    c.rms_norm_eps = 1e-5, c.rope_theta = 10000, c.initializer_range = 0.02;
    struct mr_model mo;
    int seed;
    if (mr_model_build(&c, 8, 256, &mo) < 0 ||
        mr_autodiff(&mo.graph, mo.loss, &seed) < 0) {
      fprintf(stderr, "%s\n", mr_error_message());
      return 1;
    }
    struct mr_completion_opts o;
    memset(&o, 0, sizeof o);
    o.rules = rules;
    o.n_rules = 2;
    o.data_dim = mr_mesh_dim(&m, "data");
    o.seq_dim = -1;
    double best = 1e30;
    for (int r = 0; r < 5; r++) {
      struct mr_dist_graph dg;
      double t0 = mr_clock_s();
      if (mr_spmd_complete(&mo.graph, &m, &o, &dg) < 0) {
        fprintf(stderr, "%s\n", mr_error_message());
        return 1;
      }
      double dt = mr_clock_s() - t0;
      best = dt < best ? dt : best;
      mr_dist_graph_close(&dg);
    }
    printf("%-7d %-6d %-8d %-12.3f %.2f\n", depth[i], mo.graph.n_ops,
           mo.graph.n_tensors, best * 1e3, best * 1e6 / mo.graph.n_ops);
    mr_model_close(&mo);
  }
  return 0;
}
