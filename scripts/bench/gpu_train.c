/* gpu_train.c - a LLaMA training step driven straight through a device
 * backend (worker/device.h): forward, backward and AdamW over every op of
 * the model's graph, with buffers allocated at their producer and freed
 * after their last reader.  Used by scripts/gpu-check for the tokens/s and
 * MFU of a ~1B-parameter model in bf16, and (--compare) to run the same
 * small model on the CPU and on the GPU from the same weights and compare
 * the losses step by step.
 *
 *   gpu_train [--device cuda|cpu] [--compare] [--amp fp32|bf16|fp16]
 *     [--hidden 2048] [--layers 22] [--heads 32] [--kv-heads 4]
 *     [--inter 5632] [--vocab 32000] [--seq 2048] [--batch 2] [--steps 8]
 *     [--warmup 2] [--lr 3e-4] [--peak-tflops 989] [--threads 2]
 *
 * Defaults are TinyLlama-1.1B's shape.  Prints a line per step, then
 *   summary device=.. params=.. tokens_per_s=.. tflops=.. mfu=.. loss_first=.. loss_last=..
 * (FLOPs counted from the graph: every matmul and attention, forward and
 * backward, no recompute; MFU against --peak-tflops).  --compare prints
 *   compare step=N cpu=.. cuda=.. rel=..   and   compare max_rel=.. ok|FAIL
 * and exits 1 when the losses part by more than 1e-3 (fp32) or 3e-2 (amp). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compiler/autodiff.h"
#include "common/clock.h"
#include "common/error.h"
#include "compiler/model.h"
#include "compiler/ops.h"
#include "worker/backend/backend.h"
#include "worker/backend/cpu/kernels.h"
#include "worker/device.h"

struct opts {
  const char *device;
  int compare, amp, steps, warmup, threads;
  double lr, peak_tflops;
  int64_t batch, seq;
  struct mr_model_config cfg;
};

static uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* the same values on any backend: a function of (tensor, element) */
static float init_value(int tensor, int64_t i, double scale) {
  uint64_t z = mix(((uint64_t)tensor << 40) ^ (uint64_t)i ^ 0x9e3779b97f4a7c15ull);
  return (float)(((double)(z >> 11) / 9007199254740992.0 * 2.0 - 1.0) * scale);
}

struct run {
  struct mr_backend *be;
  struct mr_model m;
  int seed;                 // gradient of the loss, an input
  void **buf;               // [n_tensors]
  int *last_use;            // [n_tensors] last op reading it, -1 none
  int *persistent;          // [n_tensors] params, grads of params, inputs
  void **adam_m, **adam_v;  // [n_tensors] for parameters
  double flops;             // per step
};

static int upload_fn(struct mr_backend *be, void *dst, int tensor, int64_t n,
                     double scale, float constant, int ones) {
  const int64_t chunk = 1 << 20;
  float *h = malloc((size_t)chunk * sizeof(float));
  if (h == NULL)
    return MR_ENOMEM;
  for (int64_t off = 0; off < n; off += chunk) {
    int64_t k = n - off < chunk ? n - off : chunk;
    for (int64_t i = 0; i < k; i++)
      h[i] = ones ? constant : init_value(tensor, off + i, scale);
    int rc = be->ops->copy(be, NULL, (float *)dst + off, h, (size_t)k * sizeof(float),
                           MR_COPY_HOST_TO_DEVICE);
    if (rc < 0) {
      free(h);
      return rc;
    }
  }
  free(h);
  return 0;
}

static int run_open(struct run *r, const struct opts *o, const char *device) {
  memset(r, 0, sizeof *r);
  MR_TRY(mr_device_open(device, 0, o->threads, o->amp, &r->be));
  MR_TRY(mr_model_build(&o->cfg, o->batch, o->seq, &r->m));
  struct mr_graph *g = &r->m.graph;
  MR_TRY(mr_autodiff(g, r->m.loss, &r->seed));
  int n = g->n_tensors;
  r->buf = calloc((size_t)n, sizeof *r->buf);
  r->last_use = malloc((size_t)n * sizeof *r->last_use);
  r->persistent = calloc((size_t)n, sizeof *r->persistent);
  r->adam_m = calloc((size_t)n, sizeof *r->adam_m);
  r->adam_v = calloc((size_t)n, sizeof *r->adam_v);
  if (!r->buf || !r->last_use || !r->persistent || !r->adam_m || !r->adam_v)
    return MR_ENOMEM;
  for (int t = 0; t < n; t++)
    r->last_use[t] = -1;
  for (int i = 0; i < g->n_ops; i++) {
    const struct mr_op *op = &g->ops[i];
    for (int k = 0; k < op->n_in; k++)
      if (op->in[k] >= 0)
        r->last_use[op->in[k]] = i;
    if (mr_op_kernel(op->kind, r->be->ops->registry) == NULL)
      return mr_error_set(MR_ENOTSUP, "op %s has no %s kernel", mr_op_def(op->kind)->name,
                          r->be->ops->name);
  }
  r->flops = mr_graph_flops(g);
  for (int t = 0; t < n; t++) {
    const struct mr_tensor *T = &g->tensors[t];
    int param_grad = T->role == MR_ROLE_GRAD && T->grad_of >= 0 &&
                     g->tensors[T->grad_of].role == MR_ROLE_PARAM;
    if (T->role == MR_ROLE_PARAM || T->role == MR_ROLE_INPUT || param_grad)
      r->persistent[t] = 1;
    if (!r->persistent[t])
      continue;
    size_t bytes = (size_t)mr_tensor_bytes(T);
    MR_TRY(r->be->ops->alloc(r->be, bytes, &r->buf[t]));
    int64_t numel = mr_tensor_numel(T);
    if (T->role == MR_ROLE_PARAM) {
      int ones = T->init == MR_INIT_ONES;
      MR_TRY(upload_fn(r->be, r->buf[t], t, numel, o->cfg.initializer_range * 1.7, 1.0f,
                       ones));
      MR_TRY(r->be->ops->alloc(r->be, bytes, &r->adam_m[t]));
      MR_TRY(r->be->ops->alloc(r->be, bytes, &r->adam_v[t]));
      MR_TRY(r->be->ops->memset(r->be, NULL, r->adam_m[t], 0, bytes));
      MR_TRY(r->be->ops->memset(r->be, NULL, r->adam_v[t], 0, bytes));
    }
  }
  float one = 1.0f;
  MR_TRY(r->be->ops->copy(r->be, NULL, r->buf[r->seed], &one, 4, MR_COPY_HOST_TO_DEVICE));
  return 0;
}

static void run_close(struct run *r) {
  if (r->be != NULL) {
    int n = r->m.graph.n_tensors;
    for (int t = 0; t < n && r->buf != NULL; t++) {
      r->be->ops->free(r->be, r->buf[t]);
      if (r->adam_m != NULL) {
        r->be->ops->free(r->be, r->adam_m[t]);
        r->be->ops->free(r->be, r->adam_v[t]);
      }
    }
    mr_backend_free(r->be);
  }
  free(r->buf);
  free(r->last_use);
  free(r->persistent);
  free(r->adam_m);
  free(r->adam_v);
  mr_model_close(&r->m);
  memset(r, 0, sizeof *r);
}

/* a stream with structure (so the loss falls): token i of row b */
static void batch_tokens(int step, int64_t rows, int64_t seq, int64_t vocab,
                         int32_t *ids, int32_t *labels) {
  for (int64_t b = 0; b < rows; b++)
    for (int64_t t = 0; t < seq; t++) {
      int64_t s = (int64_t)step * 7919 + b * 104729 + t;
      int64_t base = (s / 5) % 17;
      ids[b * seq + t] = (int32_t)((base * 31 + s % 5) % vocab);
      int64_t s2 = s + 1, base2 = (s2 / 5) % 17;
      labels[b * seq + t] = (int32_t)((base2 * 31 + s2 % 5) % vocab);
    }
}

static int run_step(struct run *r, const struct opts *o, int step, float *loss) {
  struct mr_backend *be = r->be;
  struct mr_graph *g = &r->m.graph;
  int64_t n = o->batch * o->seq;
  int32_t *ids = malloc((size_t)n * 4), *labels = malloc((size_t)n * 4);
  if (ids == NULL || labels == NULL)
    return MR_ENOMEM;
  batch_tokens(step, o->batch, o->seq, o->cfg.vocab_size, ids, labels);
  int rc = be->ops->copy(be, NULL, r->buf[r->m.input_ids], ids, (size_t)n * 4,
                         MR_COPY_HOST_TO_DEVICE);
  if (rc == 0)
    rc = be->ops->copy(be, NULL, r->buf[r->m.labels], labels, (size_t)n * 4,
                       MR_COPY_HOST_TO_DEVICE);
  free(ids);
  free(labels);
  MR_TRY(rc);
  void *kctx = be->ops->kernel_ctx(be);
  for (int i = 0; i < g->n_ops; i++) {
    const struct mr_op *op = &g->ops[i];
    void *bufs[MR_OP_MAX_IN + MR_OP_MAX_OUT];
    for (int k = 0; k < op->n_in; k++)
      bufs[k] = op->in[k] >= 0 ? r->buf[op->in[k]] : NULL;
    for (int k = 0; k < op->n_out; k++) {
      int t = op->out[k];
      if (r->buf[t] == NULL)
        MR_TRY(be->ops->alloc(be, (size_t)mr_tensor_bytes(&g->tensors[t]), &r->buf[t]));
      bufs[op->n_in + k] = r->buf[t];
    }
    rc = mr_op_kernel(op->kind, be->ops->registry)(kctx, g, op, bufs);
    if (rc < 0)
      return mr_error_set(rc, "op %d (%s): %s", i, mr_op_def(op->kind)->name,
                          mr_error_message());
    for (int k = 0; k < op->n_in; k++) {
      int t = op->in[k];
      if (t >= 0 && r->last_use[t] == i && !r->persistent[t] && t != r->m.loss) {
        be->ops->free(be, r->buf[t]);
        r->buf[t] = NULL;
      }
    }
  }
  MR_TRY(be->ops->copy(be, NULL, loss, r->buf[r->m.loss], 4, MR_COPY_DEVICE_TO_HOST));
  struct mr_adamw h = mr_adamw_defaults();
  h.lr = (float)o->lr;
  for (int t = 0; t < g->n_tensors; t++) {
    const struct mr_tensor *T = &g->tensors[t];
    if (T->role != MR_ROLE_PARAM || T->grad < 0 || r->buf[T->grad] == NULL)
      continue;
    MR_TRY(be->ops->adamw(be, r->buf[t], r->buf[T->grad], r->adam_m[t], r->adam_v[t],
                          (size_t)mr_tensor_numel(T), &h, step + 1));
  }
  /* activations nobody read (the loss, lse of the last ops) */
  for (int t = 0; t < g->n_tensors; t++)
    if (!r->persistent[t] && r->buf[t] != NULL) {
      be->ops->free(be, r->buf[t]);
      r->buf[t] = NULL;
    }
  return be->ops->synchronize(be, NULL);
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static int bench(const struct opts *o) {
  struct run r;
  int rc = run_open(&r, o, o->device);
  if (rc < 0) {
    fprintf(stderr, "gpu_train: %s\n", mr_error_message());
    run_close(&r);
    return 1;
  }
  int64_t params = mr_model_param_count(&o->cfg);
  printf("model: %.3f B parameters, %lld layers, hidden %lld, batch %lld x seq %lld, "
         "%.2f TFLOP per step, amp %d, device %s\n", (double)params / 1e9,
         (long long)o->cfg.num_hidden_layers, (long long)o->cfg.hidden_size,
         (long long)o->batch, (long long)o->seq, r.flops / 1e12, o->amp, o->device);
  double *times = calloc((size_t)o->steps + 1, sizeof(double));
  float first = NAN, last = NAN;
  int timed = 0;
  for (int s = 0; s < o->warmup + o->steps; s++) {
    float loss = NAN;
    double t0 = mr_clock_s();
    rc = run_step(&r, o, s, &loss);
    double dt = mr_clock_s() - t0;
    if (rc < 0) {
      fprintf(stderr, "gpu_train: step %d: %s\n", s, mr_error_message());
      break;
    }
    if (s == 0)
      first = loss;
    last = loss;
    if (s >= o->warmup)
      times[timed++] = dt;
    printf("step %d loss %.5f time_ms %.1f%s\n", s, (double)loss, dt * 1e3,
           s < o->warmup ? " (warm-up)" : "");
    fflush(stdout);
  }
  if (rc == 0 && timed > 0) {
    qsort(times, (size_t)timed, sizeof(double), cmp_d);
    double t = times[timed / 2];
    double tok = (double)(o->batch * o->seq) / t, tf = r.flops / t / 1e12;
    printf("summary device=%s params=%.3fB tokens_per_s=%.0f tflops=%.1f mfu=%.3f "
           "step_ms=%.1f loss_first=%.4f loss_last=%.4f\n", o->device,
           (double)params / 1e9, tok, tf,
           o->peak_tflops > 0 ? tf / o->peak_tflops : 0.0, t * 1e3, (double)first,
           (double)last);
  }
  free(times);
  run_close(&r);
  return rc < 0 ? 1 : 0;
}

static int compare(const struct opts *o) {
  struct run cpu, gpu;
  if (run_open(&cpu, o, "cpu") < 0 || run_open(&gpu, o, "cuda") < 0) {
    fprintf(stderr, "gpu_train: %s\n", mr_error_message());
    run_close(&cpu);
    run_close(&gpu);
    return 1;
  }
  double tol = o->amp ? 3e-2 : 1e-3, worst = 0;
  int rc = 0;
  for (int s = 0; s < o->steps && rc == 0; s++) {
    float lc = NAN, lg = NAN;
    rc = run_step(&cpu, o, s, &lc);
    if (rc == 0)
      rc = run_step(&gpu, o, s, &lg);
    if (rc < 0) {
      fprintf(stderr, "gpu_train: step %d: %s\n", s, mr_error_message());
      break;
    }
    double rel = fabs((double)lc - lg) / fmax(fabs((double)lc), 1e-6);
    if (!(rel <= worst))
      worst = rel;
    printf("compare step=%d cpu=%.6f cuda=%.6f rel=%.2e\n", s, (double)lc, (double)lg, rel);
    fflush(stdout);
  }
  int ok = rc == 0 && worst <= tol;
  printf("compare max_rel=%.2e tolerance=%.0e %s\n", worst, tol, ok ? "ok" : "FAIL");
  run_close(&cpu);
  run_close(&gpu);
  return ok ? 0 : 1;
}

int main(int argc, char **argv) {
  struct opts o;
  memset(&o, 0, sizeof o);
  o.device = "cuda";
  o.steps = 8;
  o.warmup = 2;
  o.threads = 2;
  o.lr = 3e-4;
  o.peak_tflops = 989;
  o.batch = 2;
  o.seq = 2048;
  o.amp = 1;
  struct mr_model_config *c = &o.cfg;
  c->family = MR_MODEL_LLAMA;
  c->vocab_size = 32000, c->hidden_size = 2048, c->intermediate_size = 5632;
  c->num_hidden_layers = 22, c->num_attention_heads = 32, c->num_key_value_heads = 4;
  c->max_position_embeddings = 4096, c->rms_norm_eps = 1e-5, c->rope_theta = 10000;
  c->initializer_range = 0.02, c->layer_norm_epsilon = 1e-5;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define ARG(name) (strcmp(a, name) == 0 && v && ++i)
    if (ARG("--device")) o.device = v;
    else if (strcmp(a, "--compare") == 0) o.compare = 1;
    else if (ARG("--amp")) o.amp = strcmp(v, "bf16") == 0 ? 1 : strcmp(v, "fp16") == 0 ? 2 : 0;
    else if (ARG("--hidden")) c->hidden_size = atoll(v);
    else if (ARG("--layers")) c->num_hidden_layers = atoll(v);
    else if (ARG("--heads")) c->num_attention_heads = atoll(v);
    else if (ARG("--kv-heads")) c->num_key_value_heads = atoll(v);
    else if (ARG("--inter")) c->intermediate_size = atoll(v);
    else if (ARG("--vocab")) c->vocab_size = atoll(v);
    else if (ARG("--seq")) o.seq = atoll(v);
    else if (ARG("--batch")) o.batch = atoll(v);
    else if (ARG("--steps")) o.steps = atoi(v);
    else if (ARG("--warmup")) o.warmup = atoi(v);
    else if (ARG("--lr")) o.lr = atof(v);
    else if (ARG("--peak-tflops")) o.peak_tflops = atof(v);
    else if (ARG("--threads")) o.threads = atoi(v);
    else {
      fprintf(stderr, "gpu_train: unknown or incomplete option %s (see the comment at "
              "the top of scripts/bench/gpu_train.c)\n", a);
      return 2;
    }
#undef ARG
  }
  if (c->num_key_value_heads <= 0)
    c->num_key_value_heads = c->num_attention_heads;
  if (o.seq > c->max_position_embeddings)
    c->max_position_embeddings = o.seq;
  return o.compare ? compare(&o) : bench(&o);
}
