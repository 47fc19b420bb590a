/* test_cost.c - each cost-model formula against a value worked by hand
 * here, and the identities that tie the step time together. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "common/error.h"
#include "compiler/planner/cost.h"
#include "compiler/planner/partition.h"
#include "launcher/cli.h"

#define NEAR(a, b) ck_assert_msg(fabs((a) - (b)) <= 1e-9 * fmax(1.0, fabs(b)), \
                                 "%.12g != %.12g", (double)(a), (double)(b))

static struct mr_cluster test_cluster(void) {
  struct mr_cluster c;
  memset(&c, 0, sizeof c);
  c.nodes = 4;
  c.devices_per_node = 8;
  c.peak_flops[MR_AMP_FP32] = 10e12;
  c.peak_flops[MR_AMP_BF16] = 100e12;
  c.peak_flops[MR_AMP_FP16] = 100e12;
  c.matmul_efficiency = 0.8;
  c.gemm_half_dim = 100;
  c.memory_bytes = 80e9;
  c.memory_bandwidth = 2e12;
  c.reserved_bytes = 1e9;
  c.intra_bus_bandwidth = 200e9;
  c.intra_latency = 1e-6;
  c.inter_bandwidth = 100e9;
  c.inter_latency = 5e-6;
  c.host_link_bandwidth = 25e9;
  c.host_memory_bandwidth = 50e9;
  return c;
}

static struct mr_model_config gpt(int64_t h, int64_t a, int64_t l) {
  struct mr_model_config m;
  memset(&m, 0, sizeof m);
  m.family = MR_MODEL_GPT2;
  m.hidden_size = h;
  m.intermediate_size = 4 * h;
  m.num_attention_heads = a;
  m.num_key_value_heads = a;
  m.num_hidden_layers = l;
  m.vocab_size = 51200;
  m.max_position_embeddings = 2048;
  m.tie_word_embeddings = 1;
  return m;
}

START_TEST(test_cost_gemm_efficiency_saturates) {
  struct mr_cluster c = test_cluster();
  /* 0.8 / (1 + 100·3/400) = 0.8 / 1.75 */
  NEAR(mr_cost_gemm_efficiency(&c, 400, 400, 400), 0.8 / 1.75);
  /* a dimension equal to g alone, the others huge: about half */
  ck_assert(fabs(mr_cost_gemm_efficiency(&c, 100, 1e12, 1e12) - 0.4) < 1e-6);
  /* 2 GEMMs of 400³: 2·2·400³ FLOPs at 100 TF/s × 0.8/1.75 */
  NEAR(mr_cost_gemm_time(&c, MR_AMP_BF16, 2, 400, 400, 400),
       2.56e8 / (100e12 * 0.8 / 1.75));
  NEAR(mr_cost_gemm_time(&c, MR_AMP_FP32, 1, 400, 400, 400),
       1.28e8 / (10e12 * 0.8 / 1.75));
}
END_TEST

START_TEST(test_cost_collectives_alpha_beta) {
  struct mr_link l = {100e9, 1e-6, 0};
  /* ring all-reduce: 2·7·1 µs + 2·(7/8)·1 GB / 100 GB/s */
  NEAR(mr_cost_collective_time(MR_COLL_ALLREDUCE, 8, 1e9, &l), 14e-6 + 0.0175);
  NEAR(mr_cost_collective_time(MR_COLL_REDUCE_SCATTER, 8, 1e9, &l), 7e-6 + 0.00875);
  NEAR(mr_cost_collective_time(MR_COLL_ALLGATHER, 8, 1e9, &l), 7e-6 + 0.00875);
  NEAR(mr_cost_collective_time(MR_COLL_P2P, 2, 1e9, &l), 1e-6 + 0.01);
  NEAR(mr_cost_collective_time(MR_COLL_ALLREDUCE, 1, 1e9, &l), 0.0);
}
END_TEST

START_TEST(test_cost_group_link_by_mesh_position) {
  struct mr_cluster c = test_cluster(); // 8 per node, 200 GB/s bus, 100 GB/s network per node
  struct mr_link l = mr_cost_group_link(&c, 1, 8);
  ck_assert(!l.inter_node && l.bandwidth == 200e9 && l.latency == 1e-6);
  l = mr_cost_group_link(&c, 2, 4);             // 2·4 = 8: inside
  ck_assert(!l.inter_node && l.bandwidth == 200e9);
  l = mr_cost_group_link(&c, 8, 4);             // one member per node, 8 flows per node
  ck_assert(l.inter_node && l.bandwidth == 100e9 / 8 && l.latency == 5e-6);
  l = mr_cost_group_link(&c, 2, 8);             // spans 2 nodes, 2 flows leave each
  ck_assert(l.inter_node && l.bandwidth == 50e9);
  l = mr_cost_group_link(&c, 1, 16);            // whole nodes: min(bus, 100/1)
  ck_assert(l.inter_node && l.bandwidth == 100e9);
  l = mr_cost_group_link(&c, 1, 6);             // 6 on 8-device nodes straddles
  ck_assert(l.inter_node && l.bandwidth == 100e9 / 8);
}
END_TEST

START_TEST(test_cost_pipeline_send_scatter_gather) {
  struct mr_link ib = {25e9, 5e-6, 1}, nv = {200e9, 1e-6, 0};
  /* 4096 tokens × h 6144 × 2 bytes = 50,331,648 bytes.  t 4: each rank
   * sends its quarter, 12,582,912 bytes: 5 µs + 12,582,912 / 25e9 =
   * 508.31648 µs; the receiver all-gathers the quarters on NVLink:
   * 3·1 µs + (3/4)·50,331,648 / 200e9 = 191.74368 µs. */
  NEAR(mr_cost_pipeline_send_time(4096, 6144, 2, 4, 0, &ib, &nv), 508.31648e-6 + 191.74368e-6);
  /* sequence parallel: the slices stay sharded, nothing to gather */
  NEAR(mr_cost_pipeline_send_time(4096, 6144, 2, 4, 1, &ib, &nv), 508.31648e-6);
  /* t 1: the whole tensor, 5 µs + 50,331,648 / 25e9 */
  NEAR(mr_cost_pipeline_send_time(4096, 6144, 2, 1, 0, &ib, &nv), 2018.26592e-6);
}
END_TEST

START_TEST(test_cost_bubble_fraction_per_schedule) {
  NEAR(mr_cost_bubble_fraction(MR_PP_1F1B, 8, 32, 1), 7.0 / 32);
  NEAR(mr_cost_bubble_fraction(MR_PP_GPIPE, 8, 32, 1), 7.0 / 32);
  NEAR(mr_cost_bubble_fraction(MR_PP_INTERLEAVED, 8, 32, 2), 7.0 / 64);
  NEAR(mr_cost_bubble_fraction(MR_PP_1F1B, 1, 32, 1), 0.0);
}
END_TEST

START_TEST(test_cost_activation_memory_korthikanti) {
  /* s 2048, b 1, h 6144, a 48, t 8: sbh = 12,582,912; 5as/h = 80 */
  double sbh = 2048.0 * 6144;
  NEAR(mr_cost_layer_activation_bytes(2048, 1, 6144, 48, 1, 0, MR_RECOMPUTE_NONE),
       sbh * 114);
  NEAR(mr_cost_layer_activation_bytes(2048, 1, 6144, 48, 8, 0, MR_RECOMPUTE_NONE),
       sbh * (10 + 3 + 10));                                   // 289,406,976
  NEAR(mr_cost_layer_activation_bytes(2048, 1, 6144, 48, 8, 1, MR_RECOMPUTE_NONE),
       sbh / 8 * 114);
  NEAR(mr_cost_layer_activation_bytes(2048, 1, 6144, 48, 8, 1, MR_RECOMPUTE_MODE_SELECTIVE),
       34 * sbh / 8);
  NEAR(mr_cost_layer_activation_bytes(2048, 1, 6144, 48, 8, 0, MR_RECOMPUTE_MODE_SELECTIVE),
       sbh * 13);
  NEAR(mr_cost_layer_activation_bytes(2048, 2, 6144, 48, 8, 0, MR_RECOMPUTE_MODE_FULL),
       2 * 2 * sbh);
  NEAR(mr_cost_layer_activation_bytes(2048, 1, 6144, 48, 8, 1, MR_RECOMPUTE_MODE_FULL),
       2 * sbh / 8);
}
END_TEST

START_TEST(test_cost_model_states_by_zero_stage) {
  double p, g, o;
  const double psi = 1e9;
  mr_cost_model_states(psi, 8, 0, MR_AMP_BF16, &p, &g, &o);
  ck_assert(p == 2e9 && g == 2e9 && o == 16e9);           // 20 bytes per parameter
  mr_cost_model_states(psi, 8, 1, MR_AMP_BF16, &p, &g, &o);
  ck_assert(p == 2e9 && g == 2e9 && o == 2e9);            // 4 + 16/d
  mr_cost_model_states(psi, 8, 2, MR_AMP_BF16, &p, &g, &o);
  ck_assert(p == 2e9 && g == 0.25e9 && o == 2e9);
  mr_cost_model_states(psi, 8, 3, MR_AMP_BF16, &p, &g, &o);
  ck_assert(p == 0.25e9 && g == 0.25e9 && o == 2e9);      // 20Ψ/d
  mr_cost_model_states(psi, 8, 0, MR_AMP_FP32, &p, &g, &o);
  ck_assert(p == 4e9 && g == 4e9 && o == 8e9);            // 16 bytes, no copies
}
END_TEST

START_TEST(test_cost_flops_match_narayanan) {
  struct mr_model_config m = gpt(6144, 48, 40);
  struct mr_workload w = {.model = &m, .global_batch = 1024, .seq_len = 2048};
  double B = 1024, s = 2048, l = 40, h = 6144, V = 51200;
  double f96 = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
  double f72 = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h));
  ck_assert(fabs(mr_cost_step_flops(&w, 1) / f96 - 1) < 1e-12);
  ck_assert(fabs(mr_cost_step_flops(&w, 0) / f72 - 1) < 1e-12);
}
END_TEST

START_TEST(test_cost_params_match_narayanan) {
  /* P = 12lh²(1 + 13/(12h) + (V+s)/(12lh)) = 12lh² + 13lh + (V+s)h, and
   * the Table 1 sizes: 18.4B, 145.6B, 529.6B, 1008B. */
  const int64_t rows[4][3] = {{6144, 48, 40}, {12288, 96, 80}, {20480, 128, 105},
                              {25600, 160, 128}};
  const double billions[4] = {18.4, 145.6, 529.6, 1008.0};
  for (int i = 0; i < 4; i++) {
    struct mr_model_config m = gpt(rows[i][0], rows[i][1], rows[i][2]);
    double per, emb, norm, l = (double)rows[i][2], h = (double)rows[i][0];
    mr_cost_param_split(&m, &per, &emb, &norm);
    double P = 12 * l * h * h + 13 * l * h + (51200 + 2048) * h;
    NEAR(l * per + emb, P);
    NEAR(l * per + emb + norm, (double)mr_model_param_count(&m));
    ck_assert_msg(fabs(P / 1e9 - billions[i]) < 0.05, "row %d: %.2f B", i, P / 1e9);
  }
}
END_TEST

START_TEST(test_cost_partition_by_hand) {
  /* 10 layers of cost 1 over 4 chunks, embedding 0.5 on the first, head 1.5
   * on the last: 3.5 is the least maximum (3+0.5, 2+1.5, 3, 3 holds 11
   * layers; 3 holds only 2+3+3+1 = 9). */
  int counts[4];
  NEAR(mr_partition_uniform(10, 1.0, 0.5, 1.5, 4, counts), 3.5);
  ck_assert_int_eq(counts[0] + counts[1] + counts[2] + counts[3], 10);
  ck_assert(counts[0] + 0.5 <= 3.5 && counts[3] + 1.5 <= 3.5 && counts[1] <= 3 && counts[2] <= 3);
  double cost[10] = {1.5, 1, 1, 1, 1, 1, 1, 1, 1, 2.5};
  int start[4];
  NEAR(mr_partition_dp(cost, 10, 4, NULL, start), 3.5);
  ck_assert_int_eq(start[0], 0);
  NEAR(mr_partition_uniform(7, 2.0, 1.0, 1.0, 1, counts), 16.0);
  ck_assert(mr_partition_uniform(3, 1.0, 0, 0, 4, NULL) < 0);
}
END_TEST

/* Brute force over every way to cut n items into k contiguous chunks. */
static double brute(const double *c, int n, int k, int first) {
  if (k == 1) {
    double s = 0;
    for (int i = first; i < n; i++)
      s += c[i];
    return s;
  }
  double best = INFINITY, s = 0;
  for (int end = first + 1; end <= n - (k - 1); end++) {
    s += c[end - 1];
    double rest = brute(c, n, k - 1, end);
    best = fmin(best, fmax(s, rest));
  }
  return best;
}

START_TEST(test_cost_partition_closed_form_equals_dp_and_brute_force) {
  const double extras[][2] = {{0, 0}, {0.3, 0.7}, {2.5, 0.1}, {0.1, 3.2}, {1, 1}};
  for (int l = 1; l <= 11; l++)
    for (int k = 1; k <= l && k <= 6; k++)
      for (int e = 0; e < 5; e++) {
        double cost[16];
        for (int i = 0; i < l; i++)
          cost[i] = 1.0;
        cost[0] += extras[e][0];
        cost[l - 1] += extras[e][1];
        int counts[16], start[16];
        double u = mr_partition_uniform(l, 1.0, extras[e][0], extras[e][1], k, counts);
        double d = mr_partition_dp(cost, l, k, NULL, start);
        double b = brute(cost, l, k, 0);
        ck_assert_msg(fabs(u - b) < 1e-9 && fabs(d - b) < 1e-9,
                      "l %d k %d e %d: uniform %g dp %g brute %g", l, k, e, u, d, b);
        int sum = 0;
        for (int i = 0; i < k; i++) {
          double load = counts[i] + (i == 0 ? extras[e][0] : 0) +
                        (i == k - 1 ? extras[e][1] : 0);
          ck_assert(counts[i] >= 1 && load <= u + 1e-9);
          sum += counts[i];
        }
        ck_assert_int_eq(sum, l);
      }
}
END_TEST

/* Brute force with chunk j costing speed[j] x its items. */
static double brute_weighted(const double *c, int n, int k, const double *speed, int j,
                             int first) {
  double s = 0;
  if (j == k - 1) {
    for (int i = first; i < n; i++)
      s += c[i];
    return speed[j] * s;
  }
  double best = INFINITY;
  for (int end = first + 1; end <= n - (k - 1 - j); end++) {
    s += c[end - 1];
    best = fmin(best, fmax(speed[j] * s, brute_weighted(c, n, k, speed, j + 1, end)));
  }
  return best;
}

/* A chunk on a device that runs w times slower costs w times its layers:
 * the weighted split equals the brute force over every cut, and by hand,
 * 8 equal layers on two stages with the second 3x slow go 6 + 2 (6 against
 * 3 x 2 = 6; 5 + 3 costs 9). */
START_TEST(test_cost_partition_weighted_by_device_speed) {
  double eight[8] = {1, 1, 1, 1, 1, 1, 1, 1}, slow2[2] = {1, 3};
  int start[8];
  NEAR(mr_partition_dp(eight, 8, 2, slow2, start), 6.0);
  ck_assert_int_eq(start[1], 6);
  const double speeds[][4] = {{1, 1, 1, 1}, {1, 2.5, 1, 1}, {4, 1, 1, 1}, {1, 1, 1.3, 7}};
  for (int n = 2; n <= 10; n++)
    for (int k = 2; k <= 4 && k <= n; k++)
      for (int w = 0; w < 4; w++) {
        double cost[10];
        for (int i = 0; i < n; i++)
          cost[i] = 1.0 + 0.37 * ((i * 7) % 5);
        double d = mr_partition_dp(cost, n, k, speeds[w], start);
        double b = brute_weighted(cost, n, k, speeds[w], 0, 0);
        ck_assert_msg(fabs(d - b) < 1e-9, "n %d k %d w %d: dp %g brute %g", n, k, w, d, b);
        double worst = 0; /* the cuts it writes cost what it says */
        for (int j = 0; j < k; j++) {
          int end = j + 1 < k ? start[j + 1] : n;
          ck_assert(end > start[j]);
          double sum = 0;
          for (int i = start[j]; i < end; i++)
            sum += cost[i];
          worst = fmax(worst, speeds[w][j] * sum);
        }
        NEAR(worst, d);
      }
}
END_TEST

START_TEST(test_cost_layer_time_matches_korthikanti_table4) {
  /* Korthikanti et al. 2022, Table 4: one transformer layer of their 22B
   * model (h 6144, a 64, s 2048, micro-batch 4, t 8 on one DGX A100)
   * takes 7.7 ms forward, no recompute.  The A100 spec (matmul rate, g,
   * NVLink) predicts it within 5%: the tensor-parallel width 768 per rank
   * of the 18.4B row costs what it costs there.  (Their backward, 11.9
   * ms, overlaps the input-gradient all-reduce with the weight-gradient
   * GEMM, an optimization this model does not assume: the prediction
   * less that all-reduce must be within 10% of it.) */
  struct mr_cluster c;
  const char *src = getenv("MESHRUN_SOURCE_DIR");
  char path[1024];
  snprintf(path, sizeof path, "%s/configs/clusters/a100-80g-node.json", src ? src : ".");
  ck_assert_msg(mr_cluster_load(path, &c) == 0, "%s", mr_error_message());
  struct mr_model_config m = gpt(6144, 64, 48);
  struct mr_workload w = {.model = &m, .global_batch = 4, .seq_len = 2048};
  struct mr_strategy s;
  memset(&s, 0, sizeof s);
  s.dp = 1, s.tp = 8, s.pp = 1, s.micro_batch_size = 4, s.micro_batches = 1;
  s.grad_accum_steps = 1, s.virtual_stages = 1, s.schedule = MR_PP_1F1B;
  s.amp_dtype = MR_AMP_FP16, s.recompute = MR_RECOMPUTE_NONE, s.recompute_every_n = 1;
  ck_assert_int_eq(mr_cost_check(&w, &c, &s), 0);
  struct mr_cost_prep prep;
  mr_cost_prepare(&w, &c, &s, &prep);
  ck_assert_msg(fabs(prep.lt.fwd / 7.7e-3 - 1) < 0.05, "forward %.2f ms", prep.lt.fwd * 1e3);
  double bwd = prep.lt.bwd - prep.lt.tp_fwd;
  ck_assert_msg(fabs(bwd / 11.9e-3 - 1) < 0.10, "backward %.2f ms", bwd * 1e3);
}
END_TEST

START_TEST(test_cost_memory_bound_traffic_of_the_engine) {
  /* LLaMA runs on meshrun's engine: a layer's memory-bound ops move what
   * it writes per token, written once and read once forward, twice that
   * backward.  C 512, K 256 (4 kv heads of 64), F 1376, H 8, t 2:
   * 4C + 2 + (2C + 2K + 3F + H)/t = 2050 + (1024 + 512 + 4128 + 8)/2 =
   * 4886 elements a token; micro-batch 2 × 128 tokens, fp32: 4886 × 256 ×
   * 4 bytes.  Two memory bandwidths isolate that term of the forward. */
  struct mr_cluster c1 = test_cluster(), c2 = test_cluster();
  c2.memory_bandwidth = 4e12;
  struct mr_model_config m;
  memset(&m, 0, sizeof m);
  m.family = MR_MODEL_LLAMA;
  m.hidden_size = 512, m.intermediate_size = 1376, m.num_attention_heads = 8;
  m.num_key_value_heads = 4, m.num_hidden_layers = 4, m.vocab_size = 1000;
  m.max_position_embeddings = 128;
  struct mr_workload w = {.model = &m, .global_batch = 2, .seq_len = 128};
  struct mr_strategy s;
  memset(&s, 0, sizeof s);
  s.dp = 1, s.tp = 2, s.pp = 1, s.micro_batch_size = 2, s.micro_batches = 1;
  s.grad_accum_steps = 1, s.virtual_stages = 1, s.schedule = MR_PP_1F1B;
  s.amp_dtype = MR_AMP_FP32, s.recompute = MR_RECOMPUTE_MODE_SELECTIVE;
  s.recompute_every_n = 1;
  ck_assert_int_eq(mr_cost_check(&w, &c1, &s), 0);
  struct mr_cost_prep p1, p2;
  mr_cost_prepare(&w, &c1, &s, &p1);
  mr_cost_prepare(&w, &c2, &s, &p2);
  double bytes = 4886.0 * 256 * 4, diff = 1 / 2e12 - 1 / 4e12;
  NEAR(p1.lt.fwd - p2.lt.fwd, 2 * bytes * diff);
  NEAR(p1.lt.bwd - p2.lt.bwd, 4 * bytes * diff);
  /* selective recompute repeats the attention output and its lse:
   * (C + H)/t = 260 elements a token */
  NEAR(p1.lt.rc - p2.lt.rc, 2 * 260.0 * 256 * 4 * diff);
}
END_TEST

static struct mr_strategy base_strategy(void) {
  struct mr_strategy s;
  memset(&s, 0, sizeof s);
  s.dp = 4, s.tp = 8, s.pp = 4;
  s.micro_batch_size = 1, s.micro_batches = 16, s.grad_accum_steps = 1;
  s.virtual_stages = 1, s.schedule = MR_PP_1F1B, s.amp_dtype = MR_AMP_BF16;
  s.recompute = MR_RECOMPUTE_MODE_FULL, s.recompute_every_n = 1;
  return s;
}

START_TEST(test_cost_step_time_identities) {
  struct mr_cluster c = test_cluster();
  c.nodes = 16;
  struct mr_model_config m = gpt(4096, 32, 32);
  struct mr_workload w = {.model = &m, .global_batch = 64, .seq_len = 2048};
  struct mr_strategy s = base_strategy();
  ck_assert_int_eq(mr_cost_check(&w, &c, &s), 0);
  struct mr_cost k;
  ck_assert_int_eq(mr_cost_evaluate(&w, &c, &s, &k), 0);
  NEAR(k.step_time_s, k.compute_s + k.bubble_s + k.p2p_s + k.dp_comm_s + k.optimizer_s);
  /* uniform chunks: bubble over compute is the schedule's (p−1)/m */
  NEAR(k.bubble_s / k.compute_s, 3.0 / 16);
  NEAR(k.tokens_per_s, 64.0 * 2048 / k.step_time_s);
  NEAR(k.mfu, k.model_flops / (k.step_time_s * 128 * 100e12));
  NEAR(k.model_tflops_per_device, k.model_flops / k.step_time_s / 128 / 1e12);
  NEAR(k.mem.total, k.mem.params + k.mem.grads + k.mem.optimizer + k.mem.activations +
                        k.mem.buffers + k.mem.workspace);
  /* pipeline sends: (m + p − 1)·2 of them, each an eighth of 2048 × 4096 ×
   * 2 bytes over the network (stride 32: 8 flows share 100 GB/s, 5 µs),
   * 5 µs + 2,097,152 / 12.5e9 = 172.77216 µs, then the all-gather of the
   * eighths on the node's bus, 7·1 µs + (7/8)·16,777,216 / 200e9 =
   * 80.40032 µs */
  NEAR(k.p2p_s, 19 * 2 * (172.77216e-6 + 80.40032e-6));
  /* interleaving: the same work in v·m slots of half-size chunks */
  s.schedule = MR_PP_INTERLEAVED, s.virtual_stages = 2;
  struct mr_cost ki;
  ck_assert_int_eq(mr_cost_evaluate(&w, &c, &s, &ki), 0);
  NEAR(ki.bubble_s / ki.compute_s, 3.0 / 32);
  ck_assert(ki.bubble_s < k.bubble_s);
}
END_TEST

START_TEST(test_cost_memory_by_hand) {
  /* No pipeline, no tensor parallel, ZeRO 0: states are 20 bytes per
   * parameter, activations the full Korthikanti count for one micro-batch
   * plus the fp32 logits and their gradient. */
  struct mr_cluster c = test_cluster();
  struct mr_model_config m = gpt(1024, 16, 4);
  struct mr_workload w = {.model = &m, .global_batch = 8, .seq_len = 512};
  struct mr_strategy s = base_strategy();
  s.dp = 8, s.tp = 1, s.pp = 1, s.micro_batch_size = 1, s.micro_batches = 1;
  s.recompute = MR_RECOMPUTE_NONE;
  ck_assert_int_eq(mr_cost_check(&w, &c, &s), 0);
  struct mr_cost k;
  mr_cost_memory(&w, &c, &s, &k);
  double P = (double)mr_model_param_count(&m);
  NEAR(k.mem.params, 2 * P);
  NEAR(k.mem.grads, 2 * P);
  NEAR(k.mem.optimizer, 16 * P);
  double sbh = 512.0 * 1024;
  double act = 4 * sbh * (34 + 5.0 * 16 * 512 / 1024) + 2 * 512.0 * 51200 * 4;
  NEAR(k.mem.activations, act);
  NEAR(k.mem.buffers, 2 * 25e6 * 2);                     // gradient bucket pair
  NEAR(k.mem.workspace, 1e9);
  /* offload moves the optimizer to the host */
  s.zero_stage = 1, s.offload = 1;
  mr_cost_memory(&w, &c, &s, &k);
  NEAR(k.mem.optimizer, 0.0);
  NEAR(k.mem.host, 16 * P / 8);
  /* unless the host is the device (CPU ranks): its ZeRO-1 share stays */
  c.host_is_device = 1;
  mr_cost_memory(&w, &c, &s, &k);
  NEAR(k.mem.optimizer, 16 * P / 8);
  NEAR(k.mem.host, 0.0);
}
END_TEST

/* Micro-batches set per data rank, 3 + 1 of 2 a rank: the busiest runs
 * 3, so the per-micro-batch terms are 3/2 of the even split's; gradient
 * sync and the optimizer, once a step, are the same. */
START_TEST(test_cost_uneven_micro_batches_pace_at_the_busiest) {
  struct mr_cluster c = test_cluster();
  struct mr_model_config m = gpt(1024, 16, 4);
  struct mr_workload w = {.model = &m, .global_batch = 8, .seq_len = 512};
  struct mr_strategy s = base_strategy();
  s.dp = 2, s.tp = 1, s.pp = 1, s.micro_batch_size = 2, s.micro_batches = 1;
  s.grad_accum_steps = 2, s.recompute = MR_RECOMPUTE_MODE_FULL;
  struct mr_cost even, uneven;
  ck_assert_int_eq(mr_cost_evaluate(&w, &c, &s, &even), 0);
  w.dp_micro = (int[]){3, 1};
  w.n_dp_micro = 2;
  ck_assert_int_eq(mr_cost_evaluate(&w, &c, &s, &uneven), 0);
  ck_assert(even.compute_s > 0 && even.recompute_s > 0);
  NEAR(uneven.compute_s, 1.5 * even.compute_s);
  NEAR(uneven.recompute_s, 1.5 * even.recompute_s);
  NEAR(uneven.dp_comm_s, even.dp_comm_s);
  NEAR(uneven.optimizer_s, even.optimizer_s);
  NEAR(uneven.step_time_s - even.step_time_s, 0.5 * even.compute_s);
  /* ZeRO-2 reduce-scatters every micro-batch's gradients, and the rank
   * with one joins the busiest rank's three: three rounds of the step's
   * per-micro-batch sync, against two for the even split and one for a
   * step of one micro-batch a rank (half the batch), the rest once a step */
  s.zero_stage = 2;
  c.intra_bus_bandwidth = 10e9; /* a slow link: the backward hides little of each sync */
  struct mr_cost one, two, three;
  ck_assert_int_eq(mr_cost_evaluate(&w, &c, &s, &three), 0);
  w.dp_micro = NULL, w.n_dp_micro = 0;
  ck_assert_int_eq(mr_cost_evaluate(&w, &c, &s, &two), 0);
  w.global_batch = 4, s.grad_accum_steps = 1;
  ck_assert_int_eq(mr_cost_evaluate(&w, &c, &s, &one), 0);
  ck_assert(two.dp_comm_s > one.dp_comm_s);
  NEAR(three.dp_comm_s - two.dp_comm_s, two.dp_comm_s - one.dp_comm_s);
  /* and the rank with one keeps a landing set of its fp32 gradient blocks
   * (P / 2 each) for each of its 2 phantom slots, and the zeros they send:
   * the largest parameter's gradient, V x h */
  w.global_batch = 8, s.grad_accum_steps = 2;
  w.dp_micro = (int[]){3, 1}, w.n_dp_micro = 2;
  struct mr_cost mem3, mem2;
  mr_cost_memory(&w, &c, &s, &mem3);
  w.dp_micro = NULL, w.n_dp_micro = 0;
  mr_cost_memory(&w, &c, &s, &mem2);
  double P = (double)mr_model_param_count(&m);
  NEAR(mem3.mem.buffers - mem2.mem.buffers, 2 * 4.0 * P / 2 + 4.0 * 51200 * 1024);
}
END_TEST

START_TEST(test_cost_check_names_the_problem) {
  struct mr_cluster c = test_cluster();
  c.nodes = 16;
  struct mr_model_config m = gpt(4096, 32, 32);
  struct mr_workload w = {.model = &m, .global_batch = 64, .seq_len = 2048};
  struct mr_strategy s = base_strategy();
  s.tp = 3, s.dp = 4, s.pp = 2;
  ck_assert_int_eq(mr_cost_check(&w, &c, &s), MR_EINVAL);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "attention heads"));
  s = base_strategy();
  s.micro_batches = 8;
  ck_assert_int_eq(mr_cost_check(&w, &c, &s), MR_EINVAL);
  ck_assert_msg(strstr(mr_error_message(), "global_batch") != NULL, "%s", mr_error_message());
  s = base_strategy();
  s.virtual_stages = 2;  // 1f1b
  ck_assert_int_eq(mr_cost_check(&w, &c, &s), MR_EINVAL);
  ck_assert_ptr_nonnull(strstr(mr_error_message(), "interleaved"));
}
END_TEST

START_TEST(test_cost_partition_of_a_strategy) {
  /* 529.6B-like: 105 layers over 35 stages; the head costs about a sixth
   * of a layer, so the optimum is 3 layers everywhere (3 + head on the
   * last beats moving a layer anywhere else, which makes a 4). */
  struct mr_cluster c = test_cluster();
  c.nodes = 400;
  struct mr_model_config m = gpt(20480, 128, 105);
  struct mr_workload w = {.model = &m, .global_batch = 2520, .seq_len = 2048};
  struct mr_strategy s = base_strategy();
  s.dp = 9, s.tp = 8, s.pp = 35, s.micro_batches = 280;
  int counts[64];
  ck_assert_int_eq(mr_cost_partition(&w, &c, &s, counts, 64), 35);
  for (int i = 0; i < 35; i++)
    ck_assert_int_eq(counts[i], 3);
  /* interleaved over 2 × 4 chunks of 10 layers: sums to 10, every chunk
   * has one, and the head's chunk holds no more than the middle ones */
  struct mr_model_config m2 = gpt(4096, 32, 10);
  struct mr_workload w2 = {.model = &m2, .global_batch = 64, .seq_len = 2048};
  s = base_strategy();
  s.pp = 2, s.dp = 4, s.tp = 8, s.virtual_stages = 4, s.schedule = MR_PP_INTERLEAVED;
  ck_assert_int_eq(mr_cost_partition(&w2, &c, &s, counts, 64), 8);
  int sum = 0;
  for (int i = 0; i < 8; i++)
    sum += counts[i], ck_assert(counts[i] >= 1);
  ck_assert_int_eq(sum, 10);
  ck_assert(counts[7] <= counts[3]);
  ck_assert_int_eq(mr_cost_partition(&w2, &c, &s, counts, 4), MR_EINVAL);
}
END_TEST

static Suite *cost_suite(void) {
  Suite *s = suite_create("cost");
  TCase *tc = tcase_create("formulas");
  tcase_add_test(tc, test_cost_gemm_efficiency_saturates);
  tcase_add_test(tc, test_cost_collectives_alpha_beta);
  tcase_add_test(tc, test_cost_group_link_by_mesh_position);
  tcase_add_test(tc, test_cost_pipeline_send_scatter_gather);
  tcase_add_test(tc, test_cost_bubble_fraction_per_schedule);
  tcase_add_test(tc, test_cost_activation_memory_korthikanti);
  tcase_add_test(tc, test_cost_model_states_by_zero_stage);
  tcase_add_test(tc, test_cost_flops_match_narayanan);
  tcase_add_test(tc, test_cost_params_match_narayanan);
  tcase_add_test(tc, test_cost_partition_by_hand);
  tcase_add_test(tc, test_cost_partition_closed_form_equals_dp_and_brute_force);
  tcase_add_test(tc, test_cost_partition_weighted_by_device_speed);
  tcase_add_test(tc, test_cost_layer_time_matches_korthikanti_table4);
  tcase_add_test(tc, test_cost_memory_bound_traffic_of_the_engine);
  tcase_add_test(tc, test_cost_step_time_identities);
  tcase_add_test(tc, test_cost_memory_by_hand);
  tcase_add_test(tc, test_cost_check_names_the_problem);
  tcase_add_test(tc, test_cost_uneven_micro_batches_pace_at_the_busiest);
  tcase_add_test(tc, test_cost_partition_of_a_strategy);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(cost_suite)
