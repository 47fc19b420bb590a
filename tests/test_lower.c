/* test_lower.c - lowering the tiny LLaMA to rank programs under every
 * strategy the runtime executes: every rank's communication must fit
 * together (the static check), buffers must be planned for every tensor
 * read, the schedule must run each (chunk, micro-batch) forward before its
 * backward, and the memory plan must follow the strategy (ZeRO-3 keeps a
 * dp-th of the parameter and optimizer bytes, recomputation keeps fewer
 * activations, a 1F1B stage keeps at most pp - stage micro-batches). */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "common/error.h"
#include "common/dtype.h"
#include "common/job.h"
#include "compiler/ops.h"
#include "common/tunable.h"
#include "compiler/spmd/lower.h"

static void job_for(struct mr_job *job, const char *strategy, int layers, int tie) {
  char text[2048];
  snprintf(text, sizeof text,
           "{\"model\": {\"model_type\": \"llama\", \"vocab_size\": 128, \"hidden_size\": 32,"
           " \"intermediate_size\": 56, \"num_hidden_layers\": %d, \"num_attention_heads\": 8,"
           " \"num_key_value_heads\": 4, \"max_position_embeddings\": 64,"
           " \"tie_word_embeddings\": %s},"
           " \"data\": {\"train\": \"train.bin\"},"
           " \"train\": {\"steps\": 4, \"global_batch\": 16, \"seq_len\": 16},"
           " \"strategy\": {\"auto_mode\": \"manual\"%s%s}}",
           layers, tie ? "true" : "false", strategy[0] ? ", " : "", strategy);
  ck_assert_msg(mr_job_parse(text, "job.json", "/tmp", job) == 0, "%s", mr_error_message());
}

static void check_layout(const char *strategy, int world) {
  struct mr_job job;
  job_for(&job, strategy, 4, 0);
  int rc = mr_lower_check_all(&job, world, NULL);
  ck_assert_msg(rc == 0, "%s on %d ranks: %s", strategy, world, mr_error_message());
  /* every (chunk, micro) forward runs before its backward, once each */
  struct mr_lowered L;
  ck_assert_int_eq(mr_lower_graph(&job, world, &L), 0);
  for (int r = 0; r < world; r++) {
    struct mr_rank_program p;
    ck_assert_msg(mr_rank_program_build(&L, r, &p) == 0, "%s", mr_error_message());
    int seen[64][64] = {{0}};
    for (int i = 0; i < p.n_step; i++) {
      const struct mr_ins *in = &p.step[i];
      if (in->kind != MR_INS_KERNEL)
        continue;
      const struct mr_pass *ps = &p.passes[in->pass];
      int *s = &seen[ps->chunk][in->micro];
      if (!ps->backward)
        *s |= 1;
      else
        ck_assert_msg(*s & 1, "%s rank %d: backward of chunk %d micro %d before forward",
                      strategy, r, ps->chunk, in->micro);
    }
    for (int c = p.pipe; c < L.n_chunks; c += L.lay.pp)
      for (int m = 0; m < L.lay.n_micro; m++)
        ck_assert_msg(seen[c][m] == 1, "%s rank %d: chunk %d micro %d not run", strategy, r,
                      c, m);
    /* every buffer holds its tensor (a ZeRO-2 gradient bigger than its
     * parameter's shard was once cut to the shard's padded size) */
    for (int t = 0; t < L.n_local; t++)
      if (p.buf[t].region != MR_REG_NONE)
        ck_assert_msg(p.buf[t].bytes >= p.buf[t].numel * (int64_t)mr_dtype_size(
                                                            p.local.tensors[t].dtype),
                      "%s rank %d: %s holds %lld elements in %lld bytes", strategy, r,
                      p.local.tensors[t].name, (long long)p.buf[t].numel,
                      (long long)p.buf[t].bytes);
    mr_rank_program_close(&p);
  }
  mr_lowered_close(&L);
  mr_job_close(&job);
}

START_TEST(test_lower_layouts_check) {
  static const struct {
    const char *s;
    int world;
  } cases[] = {
      {"", 1},
      {"\"data_parallel\": {\"degree\": 8}", 8},
      {"\"tensor_parallel\": {\"degree\": 4}, \"data_parallel\": {\"degree\": 2}", 8},
      {"\"pipeline_parallel\": {\"degree\": 4, \"micro_batches\": 4}, "
       "\"data_parallel\": {\"degree\": 2}", 8},
      {"\"pipeline_parallel\": {\"degree\": 2, \"schedule\": \"interleaved\", "
       "\"virtual_stages\": 2, \"micro_batches\": 4}", 2},
      {"\"pipeline_parallel\": {\"degree\": 2, \"schedule\": \"gpipe\", \"micro_batches\": 4}",
       2},
      {"\"data_parallel\": {\"degree\": 2}, \"tensor_parallel\": {\"degree\": 2}, "
       "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}, "
       "\"sequence_parallel\": {\"enable\": true}", 8},
      {"\"data_parallel\": {\"degree\": 4}, \"sharding\": {\"stage\": 1}", 4},
      {"\"data_parallel\": {\"degree\": 4}, \"sharding\": {\"stage\": 2}", 4},
      {"\"data_parallel\": {\"degree\": 4}, \"sharding\": {\"stage\": 3}", 4},
      {"\"data_parallel\": {\"degree\": 2}, \"recompute\": {\"enable\": true}", 2},
      {"\"tensor_parallel\": {\"degree\": 2}, \"recompute\": {\"enable\": true, "
       "\"granularity\": \"selective\"}", 2},
      {"\"gradient_accumulation_steps\": 4", 1},
      {"\"tensor_parallel\": {\"degree\": 2}, \"data_parallel\": {\"degree\": 2}, "
       "\"sharding\": {\"stage\": 3}", 4},
      {"\"tensor_parallel\": {\"degree\": 2}, \"data_parallel\": {\"degree\": 2}, "
       "\"sharding\": {\"stage\": 2}, \"gradient_accumulation_steps\": 2", 4},
      {"\"data_parallel\": {\"degree\": 2}, \"tensor_parallel\": {\"degree\": 2}, "
       "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}, "
       "\"mesh_mapping\": \"tp,pp,dp\"", 8},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    check_layout(cases[i].s, cases[i].world);
}
END_TEST

START_TEST(test_lower_mesh_mapping_numbers_ranks) {
  /* dp 2 x tp 2 x pp 2 on 8 ranks.  "tp,dp,pp": rank = (pipe·2 + data)·2 +
   * model; "tp,pp,dp": rank = (data·2 + pipe)·2 + model.  Rank 3 is
   * (pipe 0, data 1, model 1) in the first and (data 0, pipe 1, model 1)
   * in the second; its groups follow. */
  static const struct {
    const char *mapping;
    int pipe, data;
    int data_group[2], pipe_group[2];
  } want[] = {{"tp,dp,pp", 0, 1, {1, 3}, {3, 7}}, {"tp,pp,dp", 1, 0, {3, 7}, {1, 3}}};
  for (int i = 0; i < 2; i++) {
    char st[300];
    snprintf(st, sizeof st,
             "\"data_parallel\": {\"degree\": 2}, \"tensor_parallel\": {\"degree\": 2}, "
             "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}, "
             "\"mesh_mapping\": \"%s\"", want[i].mapping);
    struct mr_job job;
    job_for(&job, st, 4, 0);
    struct mr_lowered L;
    ck_assert_msg(mr_lower_graph(&job, 8, &L) == 0, "%s", mr_error_message());
    struct mr_rank_program p;
    ck_assert_int_eq(mr_rank_program_build(&L, 3, &p), 0);
    ck_assert_int_eq(p.model, 1);
    ck_assert_int_eq(p.pipe, want[i].pipe);
    ck_assert_int_eq(p.data, want[i].data);
    ck_assert_int_eq(p.model_group.n, 2);
    ck_assert_int_eq(p.model_group.ranks[0], 2);
    ck_assert_int_eq(p.model_group.ranks[1], 3);
    ck_assert_int_eq(p.data_group.n, 2);
    ck_assert_int_eq(p.pipe_group.n, 2);
    for (int k = 0; k < 2; k++) {
      ck_assert_int_eq(p.data_group.ranks[k], want[i].data_group[k]);
      ck_assert_int_eq(p.pipe_group.ranks[k], want[i].pipe_group[k]);
    }
    mr_rank_program_close(&p);
    mr_lowered_close(&L);
    mr_job_close(&job);
  }
}
END_TEST

START_TEST(test_lower_program_digests) {
  /* what the launcher sends each rank to compare with the program it
   * lowers itself: the same plan gives the same digest, every rank of
   * dp2 x pp2 its own (stages differ; so do the data groups' ranks), and
   * one more micro-batch another */
  const char *st = "\"data_parallel\": {\"degree\": 2}, "
                   "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}";
  const char *st4 = "\"data_parallel\": {\"degree\": 2}, "
                    "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 4}";
  struct mr_job job, again, more;
  job_for(&job, st, 4, 0);
  job_for(&again, st, 4, 0);
  job_for(&more, st4, 4, 0);
  uint64_t a[4], b[4], c[4];
  ck_assert_int_eq(mr_lower_check_all(&job, 4, a), 0);
  ck_assert_int_eq(mr_lower_check_all(&again, 4, b), 0);
  ck_assert_int_eq(mr_lower_check_all(&more, 4, c), 0);
  for (int r = 0; r < 4; r++) {
    ck_assert(a[r] != 0);
    ck_assert(a[r] == b[r]);
    ck_assert(a[r] != c[r]);
    for (int q = 0; q < r; q++)
      ck_assert_msg(a[r] != a[q], "ranks %d and %d: the same digest", q, r);
  }
  /* the worker's side: the program it builds itself */
  struct mr_lowered L;
  ck_assert_int_eq(mr_lower_graph(&job, 4, &L), 0);
  struct mr_rank_program p;
  ck_assert_int_eq(mr_rank_program_build(&L, 3, &p), 0);
  ck_assert(mr_rank_program_digest(&p) == a[3]);
  mr_rank_program_close(&p);
  mr_lowered_close(&L);
  mr_job_close(&job);
  mr_job_close(&again);
  mr_job_close(&more);
}
END_TEST

/* Parameter + optimizer bytes of rank 0 under a strategy. */
static int64_t model_state(const char *strategy, int world, int64_t *stash) {
  struct mr_job job;
  job_for(&job, strategy, 4, 0);
  struct mr_lowered L;
  ck_assert_msg(mr_lower_graph(&job, world, &L) == 0, "%s", mr_error_message());
  struct mr_rank_program p;
  ck_assert_int_eq(mr_rank_program_build(&L, 0, &p), 0);
  int64_t b = p.param_bytes + p.optim_bytes;
  if (stash) {
    *stash = 0;
    for (int c = 0; c < L.n_chunks; c++)
      *stash += p.stash_bytes[c] * p.stash_slots[c];
  }
  mr_rank_program_close(&p);
  mr_lowered_close(&L);
  mr_job_close(&job);
  return b;
}

START_TEST(test_lower_zero3_quarter_of_dp8_state) {
  int64_t dp8 = model_state("\"data_parallel\": {\"degree\": 8}", 8, NULL);
  int64_t z3 = model_state("\"data_parallel\": {\"degree\": 8}, \"sharding\": {\"stage\": 3}", 8,
                           NULL);
  ck_assert_msg(4 * z3 <= dp8, "ZeRO-3 %lld vs dp8 %lld", (long long)z3, (long long)dp8);
}
END_TEST

START_TEST(test_lower_recompute_keeps_fewer_activations) {
  int64_t none, full, sel;
  model_state("", 1, &none);
  model_state("\"recompute\": {\"enable\": true}", 1, &full);
  model_state("\"recompute\": {\"enable\": true, \"granularity\": \"selective\"}", 1, &sel);
  ck_assert_msg(full < sel && sel < none, "kept: none %lld, selective %lld, full %lld",
                (long long)none, (long long)sel, (long long)full);
}
END_TEST

START_TEST(test_lower_1f1b_in_flight) {
  struct mr_job job;
  job_for(&job, "\"pipeline_parallel\": {\"degree\": 4, \"micro_batches\": 8}", 4, 0);
  struct mr_lowered L;
  ck_assert_int_eq(mr_lower_graph(&job, 4, &L), 0);
  for (int r = 0; r < 4; r++) {
    struct mr_rank_program p;
    ck_assert_int_eq(mr_rank_program_build(&L, r, &p), 0);
    ck_assert_int_eq(p.stash_slots[r], 4 - r);
    mr_rank_program_close(&p);
  }
  mr_lowered_close(&L);
  mr_job_close(&job);
}
END_TEST

/* pipeline_parallel.layers puts each layer's ops (forward and backward)
 * on the chunk the job says, plain and interleaved, and the programs still
 * fit together. */
START_TEST(test_lower_fixed_layer_split) {
  static const struct {
    const char *strategy;
    int world, n_chunks, first[5];
  } cases[] = {
      {"\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2, \"layers\": [5, 1]}", 2, 2,
       {0, 5, 6}},
      {"\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2, \"schedule\": "
       "\"interleaved\", \"virtual_stages\": 2, \"layers\": [1, 3, 1, 1]}", 2, 4,
       {0, 1, 4, 5, 6}},
      {"\"data_parallel\": {\"degree\": 2}, \"pipeline_parallel\": {\"degree\": 2, "
       "\"micro_batches\": 2, \"layers\": [1, 5]}", 4, 2, {0, 1, 6}},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    struct mr_job job;
    job_for(&job, cases[k].strategy, 6, 0);
    ck_assert_msg(mr_lower_check_all(&job, cases[k].world, NULL) == 0, "%s: %s",
                  cases[k].strategy, mr_error_message());
    struct mr_lowered L;
    ck_assert_int_eq(mr_lower_graph(&job, cases[k].world, &L), 0);
    ck_assert_int_eq(L.n_chunks, cases[k].n_chunks);
    for (int c = 0; c <= L.n_chunks; c++)
      ck_assert_int_eq(L.chunk_first_layer[c], cases[k].first[c]);
    const struct mr_graph *g = &L.model.graph;
    for (int o = 0; o < g->n_ops; o++) {
      int l = L.op_layer[o], want = 0;
      if (l >= 6)
        want = L.n_chunks - 1;
      else if (l >= 0)
        while (cases[k].first[want + 1] <= l)
          want++;
      ck_assert_msg(L.op_chunk[o] == want, "%s: op %d of layer %d on chunk %d, want %d",
                    cases[k].strategy, o, l, L.op_chunk[o], want);
    }
    mr_lowered_close(&L);
    mr_job_close(&job);
  }
}
END_TEST

/* Micro-batches set per data rank: every rank's communication still fits
 * (the static check), each rank runs its count of micro-batches, and the
 * ranks of one (stage, model) coordinate read every slice of the step's
 * batch once; counts that do not fit the layout are refused naming why. */
START_TEST(test_lower_uneven_micro_batches) {
  static const struct {
    const char *s;
    int world;
  } cases[] = {
      {"\"data_parallel\": {\"degree\": 2, \"micro_batches\": [3, 1]}, "
       "\"gradient_accumulation_steps\": 2", 2},
      {"\"data_parallel\": {\"degree\": 4, \"micro_batches\": [1, 1, 1, 5]}, "
       "\"sharding\": {\"stage\": 1}, \"gradient_accumulation_steps\": 2", 4},
      {"\"data_parallel\": {\"degree\": 2, \"micro_batches\": [3, 1]}, "
       "\"tensor_parallel\": {\"degree\": 2}, \"sequence_parallel\": {\"enable\": true}, "
       "\"gradient_accumulation_steps\": 2", 4},
      {"\"data_parallel\": {\"degree\": 2, \"micro_batches\": [6, 2]}, "
       "\"pipeline_parallel\": {\"degree\": 2, \"schedule\": \"interleaved\", "
       "\"virtual_stages\": 2, \"micro_batches\": 4}", 4},
      {"\"data_parallel\": {\"degree\": 2, \"micro_batches\": [3, 1]}, "
       "\"sharding\": {\"stage\": 2}, \"gradient_accumulation_steps\": 2", 2},
      {"\"data_parallel\": {\"degree\": 4, \"micro_batches\": [1, 1, 1, 5]}, "
       "\"tensor_parallel\": {\"degree\": 2}, \"sharding\": {\"stage\": 3}, "
       "\"gradient_accumulation_steps\": 2", 8},
      {"\"data_parallel\": {\"degree\": 2, \"micro_batches\": [3, 1]}, "
       "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}, "
       "\"sharding\": {\"stage\": 2}", 4},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    struct mr_job job;
    job_for(&job, cases[k].s, 4, 0);
    ck_assert_msg(mr_lower_check_all(&job, cases[k].world, NULL) == 0, "%s: %s", cases[k].s,
                  mr_error_message());
    struct mr_lowered L;
    ck_assert_int_eq(mr_lower_graph(&job, cases[k].world, &L), 0);
    int slices = L.lay.dp * L.lay.n_micro, busiest = 0;
    for (int d = 0; d < L.lay.dp; d++)
      busiest = job.strategy.dp_micro[d] > busiest ? job.strategy.dp_micro[d] : busiest;
    int seen[8][8][64] = {{{0}}}; /* [pipe][model][slice] */
    for (int r = 0; r < cases[k].world; r++) {
      struct mr_rank_program p;
      ck_assert_msg(mr_rank_program_build(&L, r, &p) == 0, "%s", mr_error_message());
      ck_assert_int_eq(p.n_micro, job.strategy.dp_micro[p.data]);
      /* ZeRO-2/3: the busiest data rank's slots, those past this rank's
       * own micro-batches holding only the data-parallel collectives, and
       * under ZeRO-2 without a pipeline before any of its own work */
      ck_assert_int_eq(p.n_slots, L.lay.zero >= 2 ? busiest : p.n_micro);
      int own_seen = 0;
      for (int i = 0; i < p.n_step; i++) {
        int phantom = p.step[i].micro >= p.n_micro;
        if (phantom)
          ck_assert_msg(p.step[i].kind == MR_INS_GATHER || p.step[i].kind == MR_INS_GRAD,
                        "%s rank %d: instruction %d (kind %d) in phantom slot %d", cases[k].s,
                        r, i, p.step[i].kind, p.step[i].micro);
        if (phantom && L.lay.zero == 2 && L.lay.pp == 1)
          ck_assert_msg(!own_seen, "%s rank %d: phantom instruction %d after its own work",
                        cases[k].s, r, i);
        own_seen |= !phantom && p.step[i].micro >= 0;
      }
      int run[64] = {0};
      for (int i = 0; i < p.n_step; i++)
        if (p.step[i].kind == MR_INS_KERNEL && !p.passes[p.step[i].pass].backward)
          run[p.step[i].micro] = 1;
      for (int m = 0; m < 64; m++)
        ck_assert_int_eq(run[m], m < p.n_micro);
      for (int m = 0; m < p.n_micro; m++)
        seen[p.pipe][p.model][p.first_slice + m]++;
      mr_rank_program_close(&p);
    }
    for (int pp = 0; pp < L.lay.pp; pp++)
      for (int t = 0; t < L.lay.tp; t++)
        for (int q = 0; q < slices; q++)
          ck_assert_msg(seen[pp][t][q] == 1, "%s: stage %d model %d reads slice %d %d times",
                        cases[k].s, pp, t, q, seen[pp][t][q]);
    mr_lowered_close(&L);
    mr_job_close(&job);
  }
  static const struct {
    const char *s, *says;
    int world;
  } bad[] = {
      {"\"data_parallel\": {\"degree\": 2, \"micro_batches\": [3, 2]}, "
       "\"gradient_accumulation_steps\": 2", "expected counts adding up to "
       "data_parallel.degree (2) x micro-batches per step (2) = 4, got 5", 2},
      {"\"data_parallel\": {\"degree\": 2, \"micro_batches\": [5, 3]}, "
       "\"pipeline_parallel\": {\"degree\": 2, \"schedule\": \"interleaved\", "
       "\"virtual_stages\": 2, \"micro_batches\": 4}", "micro_batches[0]: the interleaved "
       "schedule needs a multiple of pipeline_parallel.degree (2), got 5", 4},
  };
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    struct mr_job job;
    job_for(&job, bad[k].s, 4, 0);
    struct mr_lowered L;
    ck_assert_int_eq(mr_lower_graph(&job, bad[k].world, &L), MR_EINVAL);
    ck_assert_msg(strstr(mr_error_message(), bad[k].says) != NULL, "%s", mr_error_message());
    mr_job_close(&job);
  }
}
END_TEST

/* The loss is made whole once a step, not each micro-batch: no rank's
 * step program reshards the loss edge, and the last stage adds each
 * micro-batch's partial loss to the step's sum (the edge's all-reduces and
 * scalings then run once on it, mr__rt_step_loss; the distributed training
 * tests compare the reported losses with a single rank's). */
START_TEST(test_lower_loss_made_whole_once_a_step) {
  static const struct {
    const char *s;
    int world;
  } cases[] = {
      {"\"data_parallel\": {\"degree\": 2}, \"gradient_accumulation_steps\": 4", 2},
      {"\"data_parallel\": {\"degree\": 2}, \"tensor_parallel\": {\"degree\": 2}, "
       "\"sequence_parallel\": {\"enable\": true}, \"gradient_accumulation_steps\": 2", 4},
      {"\"data_parallel\": {\"degree\": 2}, \"pipeline_parallel\": {\"degree\": 2, "
       "\"micro_batches\": 4}", 4},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    struct mr_job job;
    job_for(&job, cases[k].s, 4, 0);
    struct mr_lowered L;
    ck_assert_msg(mr_lower_graph(&job, cases[k].world, &L) == 0, "%s", mr_error_message());
    int le = mr_lowered_loss_edge(&L);
    ck_assert_msg(le >= 0 && mr_lowered_loss_deferred(&L), "%s", cases[k].s);
    for (int r = 0; r < cases[k].world; r++) {
      struct mr_rank_program p;
      ck_assert_msg(mr_rank_program_build(&L, r, &p) == 0, "%s", mr_error_message());
      int loss_reshards = 0, losses = 0;
      for (int i = 0; i < p.n_step; i++) {
        loss_reshards += p.step[i].kind == MR_INS_RESHARD && p.step[i].edge == le;
        losses += p.step[i].kind == MR_INS_LOSS;
      }
      ck_assert_msg(loss_reshards == 0, "%s rank %d: %d reshards of the loss", cases[k].s, r,
                    loss_reshards);
      ck_assert_int_eq(losses, p.pipe == L.lay.pp - 1 ? p.n_micro : 0);
      mr_rank_program_close(&p);
    }
    mr_lowered_close(&L);
    mr_job_close(&job);
  }
}
END_TEST

/* Several micro-batches: a parameter's gradient is written straight into
 * its accumulator by the op producing it (which adds into it after the
 * first micro-batch) wherever ZeRO < 2 and the gradient needs no reshard of
 * its own off the data dimension; under ZeRO-2 it is reduce-scattered per
 * micro-batch from a buffer of its own, as before. */
START_TEST(test_lower_gradients_accumulate_in_place) {
  static const struct {
    const char *s;
    int world, in_place;
  } cases[] = {
      {"\"data_parallel\": {\"degree\": 2}, \"gradient_accumulation_steps\": 4", 2, 1},
      {"\"data_parallel\": {\"degree\": 2}, \"sharding\": {\"stage\": 1}, "
       "\"gradient_accumulation_steps\": 4", 2, 1},
      {"\"data_parallel\": {\"degree\": 2}, \"pipeline_parallel\": {\"degree\": 2, "
       "\"micro_batches\": 4}", 4, 1},
      {"\"data_parallel\": {\"degree\": 2}, \"tensor_parallel\": {\"degree\": 2}, "
       "\"gradient_accumulation_steps\": 2", 4, 1},
      {"\"data_parallel\": {\"degree\": 2}, \"sharding\": {\"stage\": 2}, "
       "\"gradient_accumulation_steps\": 4", 2, 0},
      /* the same as the first, measured against: a buffer per gradient */
      {"\"data_parallel\": {\"degree\": 2}, \"gradient_accumulation_steps\": 4, "
       "\"gradient_accumulation_in_op\": false", 2, 0},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    struct mr_job job;
    job_for(&job, cases[k].s, 4, 0);
    struct mr_lowered L;
    ck_assert_msg(mr_lower_graph(&job, cases[k].world, &L) == 0, "%s", mr_error_message());
    ck_assert_int_gt(L.lay.n_micro, 1);
    for (int r = 0; r < cases[k].world; r++) {
      struct mr_rank_program p;
      ck_assert_msg(mr_rank_program_build(&L, r, &p) == 0, "%s", mr_error_message());
      int in_place = 0;
      for (int i = 0; i < p.n_params; i++) {
        const struct mr_param_plan *pp = &p.params[i];
        const struct mr_lbuf *gb = &p.buf[p.local.tensors[pp->tensor].grad];
        int expect = cases[k].in_place && !pp->off_data && pp->replica_of < 0;
        ck_assert_msg((gb->region == MR_REG_ACC) == expect,
                      "%s rank %d: %s's gradient in region %d", cases[k].s, r,
                      p.local.tensors[pp->tensor].name, gb->region);
        if (expect)
          ck_assert_int_eq(gb->offset, pp->acc_offset);
        in_place += expect;
      }
      /* the weights (not only the odd bias or norm) are among them */
      ck_assert_msg(!cases[k].in_place || in_place >= p.n_params / 2,
                    "%s rank %d: %d of %d in place", cases[k].s, r, in_place, p.n_params);
      mr_rank_program_close(&p);
    }
    mr_lowered_close(&L);
    mr_job_close(&job);
  }
}
END_TEST

/* Tied embeddings across pipeline stages: the last stage holds a copy the
 * first stage's update refreshes (a check that passes); under ZeRO-3 they
 * are refused naming the parameter. */
START_TEST(test_lower_tied_embeddings_across_stages) {
  struct mr_job job;
  job_for(&job, "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}", 4, 1);
  ck_assert_msg(mr_lower_check_all(&job, 2, NULL) == 0, "%s", mr_error_message());
  mr_job_close(&job);
  /* under ZeRO-3 both stages store a data-th of the tied embedding (vocab
   * 128 x hidden 32 = 4096 elements, blocks of 2048): the owner updates
   * its block and sends it to the copy at the same data coordinate, which
   * keeps no gradient and no optimizer state */
  job_for(&job, "\"pipeline_parallel\": {\"degree\": 2}, \"data_parallel\": {\"degree\": 2}, "
                "\"sharding\": {\"stage\": 3}", 4, 1);
  ck_assert_msg(mr_lower_check_all(&job, 4, NULL) == 0, "%s", mr_error_message());
  struct mr_lowered L;
  ck_assert_int_eq(mr_lower_graph(&job, 4, &L), 0);
  int owners = 0, copies = 0;
  for (int r = 0; r < 4; r++) {
    struct mr_rank_program p;
    ck_assert_int_eq(mr_rank_program_build(&L, r, &p), 0);
    for (int i = 0; i < p.n_params; i++) {
      const struct mr_param_plan *pp = &p.params[i];
      if (strcmp(L.model.graph.tensors[pp->tensor].name, "model.embed_tokens.weight") != 0)
        continue;
      ck_assert_int_eq(pp->numel, 4096);
      ck_assert_int_eq(pp->begin, 2048 * p.data);
      ck_assert_int_eq(pp->len, 2048);
      ck_assert_int_eq(mr_param_sync_count(&L.lay, pp), 2048);
      if (pp->replica_of >= 0) {
        copies++;
        ck_assert_int_eq(pp->acc_floats, 0);
        ck_assert_int_eq(pp->norm, 0);
      } else {
        owners++;
        ck_assert_int_eq(pp->n_replicas, 1);
      }
    }
    mr_rank_program_close(&p);
  }
  ck_assert_int_eq(owners, 2);
  ck_assert_int_eq(copies, 2);
  mr_lowered_close(&L);
  mr_job_close(&job);
}
END_TEST

/* The check on real programs: dp2 x tp2 x pp2 fits together; the same
 * programs with one rank's collective dropped, or a count changed, fail
 * naming the rank and the operation. */
START_TEST(test_lower_check_names_the_first_mismatch) {
  struct mr_job job;
  job_for(&job, "\"data_parallel\": {\"degree\": 2}, \"tensor_parallel\": {\"degree\": 2}, "
                "\"pipeline_parallel\": {\"degree\": 2, \"micro_batches\": 2}", 4, 0);
  struct mr_lowered L;
  ck_assert_int_eq(mr_lower_graph(&job, 8, &L), 0);
  struct mr_rank_program p[8];
  struct mr_comm_trace tr[8];
  for (int r = 0; r < 8; r++) {
    ck_assert_int_eq(mr_rank_program_build(&L, r, &p[r]), 0);
    tr[r] = mr_rank_program_trace(&p[r], 0);
  }
  ck_assert_int_eq(mr_comm_check(tr, 8), 0);
  /* rank 5 skips its first collective on the model group */
  int e = 0;
  while (e < tr[5].n && (tr[5].ev[e].kind != MR_CEV_ALL_REDUCE ||
                         strncmp(tr[5].ev[e].group, "model", 5) != 0))
    e++;
  ck_assert_int_lt(e, tr[5].n);
  struct mr_comm_event *copy = malloc((size_t)tr[5].n * sizeof *copy);
  memcpy(copy, tr[5].ev, (size_t)e * sizeof *copy);
  memcpy(copy + e, tr[5].ev + e + 1, (size_t)(tr[5].n - e - 1) * sizeof *copy);
  struct mr_comm_trace saved = tr[5];
  tr[5].ev = copy;
  tr[5].n--;
  ck_assert_int_eq(mr_comm_check(tr, 8), MR_EPLAN);
  ck_assert_msg(strstr(mr_error_message(), "rank 5") != NULL ||
                    strstr(mr_error_message(), "rank 4") != NULL,
                "%s", mr_error_message());
  /* a send whose count differs from its receive */
  tr[5] = saved;
  memcpy(copy, tr[5].ev, (size_t)tr[5].n * sizeof *copy);
  for (e = 0; e < tr[5].n && copy[e].kind != MR_CEV_SEND; e++)
    ;
  if (e == tr[5].n) /* rank 5 is on the last stage: it receives */
    for (e = 0; e < tr[5].n && copy[e].kind != MR_CEV_RECV; e++)
      ;
  ck_assert_int_lt(e, tr[5].n);
  copy[e].count++;
  tr[5].ev = copy;
  ck_assert_int_eq(mr_comm_check(tr, 8), MR_EPLAN);
  ck_assert_msg(strstr(mr_error_message(), "different counts") != NULL, "%s", mr_error_message());
  free(copy);
  for (int r = 0; r < 8; r++)
    mr_rank_program_close(&p[r]);
  mr_lowered_close(&L);
  mr_job_close(&job);
}
END_TEST

/* GPT-2 under tensor parallelism splits its attention as Megatron-LM does:
 * the fused q|k|v weight [C, 3, C] along its last dim (each rank the same
 * slice of the heads of q, k and v), its bias alike, the output projection
 * by rows; each rank's attention runs H / t heads, and the ranks'
 * communication fits together with and without sequence parallelism. */
START_TEST(test_lower_gpt2_attention_split_by_heads) {
  const char *strategies[] = {"\"tensor_parallel\": {\"degree\": 2}",
                              "\"tensor_parallel\": {\"degree\": 2}, "
                              "\"sequence_parallel\": {\"enable\": true}",
                              "\"tensor_parallel\": {\"degree\": 2}, \"data_parallel\": "
                              "{\"degree\": 2}, \"pipeline_parallel\": {\"degree\": 2}"};
  const int worlds[] = {2, 2, 8};
  for (int k = 0; k < 3; k++) {
    char text[2048];
    snprintf(text, sizeof text,
             "{\"model\": {\"model_type\": \"gpt2\", \"vocab_size\": 128, \"n_embd\": 32,"
             " \"n_layer\": 2, \"n_head\": 8, \"n_positions\": 64},"
             " \"data\": {\"train\": \"train.bin\"},"
             " \"train\": {\"steps\": 4, \"global_batch\": 8, \"seq_len\": 16},"
             " \"strategy\": {\"auto_mode\": \"manual\", %s}}", strategies[k]);
    struct mr_job job;
    ck_assert_msg(mr_job_parse(text, "job.json", "/tmp", &job) == 0, "%s", mr_error_message());
    ck_assert_msg(mr_lower_check_all(&job, worlds[k], NULL) == 0, "%s: %s", strategies[k],
                  mr_error_message());
    struct mr_lowered L;
    ck_assert_int_eq(mr_lower_graph(&job, worlds[k], &L), 0);
    struct mr_rank_program p;
    ck_assert_int_eq(mr_rank_program_build(&L, worlds[k] - 1, &p), 0);
    const struct mr_graph *g = &L.model.graph;
    const char *names[3] = {"attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight"};
    const int64_t want[3][3] = {{32, 3, 16}, {3, 16, 0}, {16, 32, 0}};
    int found = 0;
    for (int t = 0; t < g->n_tensors; t++) {
      if (g->tensors[t].role != MR_ROLE_PARAM || strncmp(g->tensors[t].name, "transformer.h.", 14))
        continue;
      for (int n = 0; n < 3; n++) {
        if (strstr(g->tensors[t].name, names[n]) == NULL)
          continue;
        const struct mr_tensor *lt = &p.local.tensors[t];
        for (int d = 0; d < lt->ndim; d++)
          ck_assert_msg(lt->shape[d] == want[n][d], "%s: %s local dim %d is %lld, expected %lld",
                        strategies[k], g->tensors[t].name, d, (long long)lt->shape[d],
                        (long long)want[n][d]);
        found++;
      }
    }
    ck_assert_int_eq(found, 3 * 2); /* three of each of the two layers */
    int attention = 0;
    for (int o = 0; o < g->n_ops; o++)
      if (g->ops[o].kind == MR_OP_ATTENTION) {
        ck_assert_msg(p.local.ops[o].attr[1] == 4, "%s: attention runs %g heads, expected 4",
                      strategies[k], p.local.ops[o].attr[1]);
        attention++;
      }
    ck_assert_int_eq(attention, 2);
    mr_rank_program_close(&p);
    mr_lowered_close(&L);
    mr_job_close(&job);
  }
}
END_TEST

static Suite *lower_suite(void) {
  Suite *s = suite_create("lower");
  TCase *tc = tcase_create("lower");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_lower_layouts_check);
  tcase_add_test(tc, test_lower_mesh_mapping_numbers_ranks);
  tcase_add_test(tc, test_lower_program_digests);
  tcase_add_test(tc, test_lower_zero3_quarter_of_dp8_state);
  tcase_add_test(tc, test_lower_recompute_keeps_fewer_activations);
  tcase_add_test(tc, test_lower_1f1b_in_flight);
  tcase_add_test(tc, test_lower_fixed_layer_split);
  tcase_add_test(tc, test_lower_uneven_micro_batches);
  tcase_add_test(tc, test_lower_loss_made_whole_once_a_step);
  tcase_add_test(tc, test_lower_gradients_accumulate_in_place);
  tcase_add_test(tc, test_lower_tied_embeddings_across_stages);
  tcase_add_test(tc, test_lower_check_names_the_first_mismatch);
  tcase_add_test(tc, test_lower_gpt2_attention_split_by_heads);
  suite_add_tcase(s, tc);
  return s;
}

MR_TEST_MAIN(lower_suite)
