/* train_bench.c - drives the single-rank trainer on a token file, for the
 * learning check and the throughput benchmark.
 *
 *   train_bench --train FILE [--val FILE] [--family llama|gpt2]
 *     [--hidden 256] [--layers 4] [--heads 8] [--kv-heads H] [--inter 688]
 *     [--vocab 256] [--seq 256] [--batch 8] [--steps 200] [--lr 1e-3]
 *     [--amp fp32|bf16|fp16] [--threads 2] [--seed 0] [--warmup-steps 0]
 *     [--metrics FILE] [--weights-out FILE] [--quiet]
 *
 * Prints one line per step and ends with
 *   summary loss_first=.. loss_last=.. loss_last10=.. tokens_per_s=..
 *   gflops=.. skipped=.. final_scale=.. peak_mib=..
 * where tokens/s and GFLOP/s are the median over steps after the first. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/job.h"
#include "compiler/ops.h"
#include "worker/exec.h"
#include "worker/train.h"

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
  struct mr_job job;
  memset(&job, 0, sizeof job);
  struct mr_model_config *c = &job.model;
  c->family = MR_MODEL_LLAMA;
  c->vocab_size = 256, c->hidden_size = 256, c->intermediate_size = 688;
  c->num_hidden_layers = 4, c->num_attention_heads = 8, c->num_key_value_heads = 0;
  c->max_position_embeddings = 1024, c->rms_norm_eps = 1e-6;
  c->rope_theta = 10000, c->initializer_range = 0.02;
  c->layer_norm_epsilon = 1e-5;
  struct mr_train_config *t = &job.train;
  t->steps = 200, t->global_batch = 8, t->seq_len = 256, t->lr = 1e-3;
  t->weight_decay = 0.01, t->beta1 = 0.9, t->beta2 = 0.999, t->eps = 1e-8;
  t->grad_clip = 1.0, t->eval_batches = 4;
  job.strategy.init_loss_scaling = 1024;
  int threads = 2, quiet = 0, profile = 0;
  const char *metrics = NULL, *weights = NULL;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define ARG(name) (strcmp(a, name) == 0 && v && ++i)
    if (ARG("--train")) job.data_train = (char *)v;
    else if (ARG("--val")) job.data_val = (char *)v;
    else if (ARG("--family")) c->family = strcmp(v, "gpt2") == 0 ? MR_MODEL_GPT2 : MR_MODEL_LLAMA;
    else if (ARG("--hidden")) c->hidden_size = atoll(v);
    else if (ARG("--layers")) c->num_hidden_layers = atoll(v);
    else if (ARG("--heads")) c->num_attention_heads = atoll(v);
    else if (ARG("--kv-heads")) c->num_key_value_heads = atoll(v);
    else if (ARG("--inter")) c->intermediate_size = atoll(v);
    else if (ARG("--vocab")) c->vocab_size = atoll(v);
    else if (ARG("--seq")) t->seq_len = atoll(v);
    else if (ARG("--batch")) t->global_batch = atoll(v);
    else if (ARG("--steps")) t->steps = atoll(v);
    else if (ARG("--lr")) t->lr = atof(v);
    else if (ARG("--seed")) t->seed = strtoull(v, NULL, 10);
    else if (ARG("--warmup-steps")) t->warmup_steps = atoll(v);
    else if (ARG("--threads")) threads = atoi(v);
    else if (ARG("--metrics")) metrics = v;
    else if (ARG("--weights-out")) weights = v;
    else if (ARG("--amp"))
      job.strategy.amp_dtype = strcmp(v, "bf16") == 0 ? MR_AMP_BF16
                               : strcmp(v, "fp16") == 0 ? MR_AMP_FP16 : MR_AMP_FP32;
    else if (strcmp(a, "--quiet") == 0) quiet = 1;
    else if (strcmp(a, "--profile") == 0) profile = 1;
    else {
      fprintf(stderr, "train_bench: unknown or incomplete flag %s\n", a);
      return 2;
    }
  }
  if (!job.data_train) {
    fprintf(stderr, "train_bench: --train FILE is required\n");
    return 2;
  }
  if (c->num_key_value_heads == 0)
    c->num_key_value_heads = c->num_attention_heads;
  if (c->family == MR_MODEL_GPT2) {
    c->tie_word_embeddings = 1;
    c->max_position_embeddings = t->seq_len;
  }
  struct mr_trainer *tr;
  if (mr_trainer_new(&job, threads, &tr) < 0) {
    fprintf(stderr, "train_bench: %s\n", mr_error_message());
    return 1;
  }
  if (profile)
    mr_exec_profile(mr_trainer_exec(tr), 1);
  FILE *mf = metrics ? fopen(metrics, "w") : NULL;
  double *tps = calloc((size_t)t->steps, sizeof *tps);
  double first = NAN, last = NAN, tail = 0, scale = 1;
  int64_t skipped = 0, tail_n = 0;
  uint64_t peak = 0;
  for (int64_t s = 1; s <= t->steps; s++) {
    struct mr_step_report r;
    if (mr_trainer_step(tr, s, &r) < 0) {
      fprintf(stderr, "train_bench: step %lld: %s\n", (long long)s,
              mr_error_message());
      return 1;
    }
    if (s == 1)
      first = r.loss;
    last = r.loss;
    if (s > t->steps - 10) {
      tail += r.loss;
      tail_n++;
    }
    skipped += r.skipped;
    scale = r.loss_scale;
    peak = r.peak_memory_bytes;
    tps[s - 1] = r.tokens_per_s;
    if (!quiet)
      printf("step %lld loss %.4f lr %.3g norm %.3f scale %g%s %.0f tok/s\n",
             (long long)s, r.loss, r.lr, r.grad_norm, r.loss_scale,
             r.skipped ? " skipped" : "", r.tokens_per_s);
    if (mf) { /* JSON has no infinity: an overflowed norm is null */
      fprintf(mf, "{\"step\":%lld,\"loss\":%.6f,", (long long)s, r.loss);
      if (isfinite(r.grad_norm))
        fprintf(mf, "\"grad_norm\":%.6g,", r.grad_norm);
      else
        fprintf(mf, "\"grad_norm\":null,");
      fprintf(mf, "\"loss_scale\":%g,\"skipped\":%d,\"tokens_per_s\":%.1f}\n", r.loss_scale,
              r.skipped, r.tokens_per_s);
    }
  }
  double val = NAN;
  if (job.data_val)
    mr_trainer_eval(tr, &val);
  if (weights && mr_trainer_save(tr, weights) < 0) {
    fprintf(stderr, "train_bench: %s\n", mr_error_message());
    return 1;
  }
  int64_t n = t->steps > 1 ? t->steps - 1 : 1;
  qsort(tps + (t->steps > 1), (size_t)n, sizeof *tps, cmp);
  double med = tps[(t->steps > 1) + n / 2];
  /* model FLOPs per token, the formula the peer uses too: 6 x matmul
   * parameters (+ attention scores and values, 12 L T C, full T x T) */
  double C = (double)c->hidden_size, kvd = (double)(c->num_key_value_heads *
                                                    (c->hidden_size / c->num_attention_heads));
  double mm = c->family == MR_MODEL_GPT2
                  ? (double)c->num_hidden_layers * (4 * C * C + 2 * C * (double)c->intermediate_size)
                  : (double)c->num_hidden_layers * (2 * C * C + 2 * C * kvd +
                                                     3 * C * (double)c->intermediate_size);
  mm += C * (double)c->vocab_size;
  double per_token = 6 * mm + 12.0 * (double)c->num_hidden_layers * (double)t->seq_len * C;
  printf("summary loss_first=%.4f loss_last=%.4f loss_last10=%.4f val_loss=%.4f "
         "tokens_per_s=%.1f gflops=%.2f skipped=%lld final_scale=%g "
         "peak_mib=%.1f\n",
         first, last, tail / (double)tail_n, val, med,
         per_token * med / 1e9, (long long)skipped,
         scale, (double)peak / 1048576.0);
  if (profile) {
    struct mr_exec *x = mr_trainer_exec(tr);
    double by_kind[MR_OP_COUNT] = {0}, total = 0;
    for (int i = 0; i < x->g->n_ops; i++) {
      by_kind[x->g->ops[i].kind] += x->op_seconds[i];
      total += x->op_seconds[i];
    }
    for (int k = 0; k < MR_OP_COUNT; k++)
      if (by_kind[k] > 0)
        printf("profile %-18s %7.3f s  %5.1f%%\n", mr_op_def(k)->name,
               by_kind[k] / (double)t->steps, 100 * by_kind[k] / total);
    if (getenv("MESHRUN_BENCH_PROFILE_OPS"))
      for (int i = 0; i < x->g->n_ops; i++) {
        const struct mr_op *op = &x->g->ops[i];
        const struct mr_tensor *a = &x->g->tensors[op->in[0]];
        const struct mr_tensor *o = &x->g->tensors[op->out[0]];
        printf("op %4d %-18s %8.3f ms  in0 %lldx%lld  out0 %lldx%lld %s a=%g,%g\n", i,
               mr_op_def(op->kind)->name, 1e3 * x->op_seconds[i] / (double)t->steps,
               (long long)a->shape[0], (long long)(a->ndim > 1 ? a->shape[1] : 1),
               (long long)o->shape[0], (long long)(o->ndim > 1 ? o->shape[1] : 1),
               o->name, op->attr[0], op->attr[1]);
      }
  }
  if (mf)
    fclose(mf);
  free(tps);
  mr_trainer_free(tr);
  return 0;
}
