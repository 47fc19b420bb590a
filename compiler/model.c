/* model.c - LLaMA and GPT-2 forward graphs, named as in transformers. */
#include "compiler/model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/error.h"
#include "compiler/ops.h"

static int param1(struct mr_graph *g, enum mr_init_kind init, int64_t a,
                  const char *fmt, int layer) {
  char nm[MR_TENSOR_NAME_MAX];
  snprintf(nm, sizeof nm, fmt, layer);
  int64_t s[1] = {a};
  return mr_graph_param(g, nm, init, 1, s);
}

static int param2(struct mr_graph *g, int64_t a, int64_t b, const char *fmt,
                  int layer) {
  char nm[MR_TENSOR_NAME_MAX];
  snprintf(nm, sizeof nm, fmt, layer);
  int64_t s[2] = {a, b};
  return mr_graph_param(g, nm, MR_INIT_NORMAL, 2, s);
}

/* A parameter of shape[ndim] that Hugging Face files hold with its last
 * two dims merged (GPT-2's fused q|k|v). */
static int param_merged(struct mr_graph *g, enum mr_init_kind init, int ndim,
                        const int64_t *shape, const char *fmt, int layer) {
  char nm[MR_TENSOR_NAME_MAX];
  snprintf(nm, sizeof nm, fmt, layer);
  int id = mr_graph_param(g, nm, init, ndim, shape);
  if (id >= 0)
    g->tensors[id].merged = 1;
  return id;
}

/* Appends op; returns its first output id (or an error). */
static int op(struct mr_graph *g, int kind, const char *name, int layer,
              int a, int b, int c, const double *attr, int *extra) {
  char nm[MR_TENSOR_NAME_MAX];
  snprintf(nm, sizeof nm, name, layer);
  int in[3] = {a, b, c}, out[MR_OP_MAX_OUT];
  int n = c >= 0 ? 3 : (b >= 0 ? 2 : 1);
  int rc = mr_graph_op(g, kind, nm, in, n, attr, out);
  if (rc < 0)
    return rc;
  if (extra)
    memcpy(extra, out, sizeof out);
  return out[0];
}

#define CK(expr)                                                             \
  do {                                                                       \
    if ((expr) < 0)                                                          \
      return MR_ESHAPE;                                                      \
  } while (0)

static int linear(struct mr_graph *g, int x, int w, const char *name,
                  int layer) {
  double a[MR_OP_MAX_ATTR] = {0, 1}; /* x W^T, W [out, in] */
  return op(g, MR_OP_MATMUL, name, layer, x, w, -1, a, NULL);
}

/* x W^T (+ b): a projection, with its bias when the config has one. */
static int proj(struct mr_graph *g, int x, int w, int has_bias, int64_t out, const char *bias_fmt,
                const char *name, int layer) {
  if (!has_bias)
    return linear(g, x, w, name, layer);
  int b = param1(g, MR_INIT_ZEROS, out, bias_fmt, layer);
  if (b < 0)
    return b;
  double a[MR_OP_MAX_ATTR] = {0, 1};
  return op(g, MR_OP_MATMUL, name, layer, x, w, b, a, NULL);
}

static int build_llama(struct mr_model *m) {
  struct mr_graph *g = &m->graph;
  const struct mr_model_config *c = &m->cfg;
  int64_t C = c->hidden_size, V = c->vocab_size, I = c->intermediate_size;
  int64_t H = c->num_attention_heads, KH = c->num_key_value_heads;
  int64_t D = mr_model_head_dim(c);
  int emb = param2(g, V, C, "model.embed_tokens.weight", 0);
  CK(emb);
  int x = op(g, MR_OP_EMBEDDING, "h0", 0, m->input_ids, emb, -1, NULL, NULL);
  CK(x);
  double rms[MR_OP_MAX_ATTR] = {c->rms_norm_eps};
  double rq[MR_OP_MAX_ATTR] = {(double)m->seq, (double)H, 0, 1};
  double rk[MR_OP_MAX_ATTR] = {(double)m->seq, (double)KH, 0, 1};
  struct mr_rope rope = c->rope;
  rope.theta = c->rope_theta;
  mr_rope_to_attr(&rope, rq);
  mr_rope_to_attr(&rope, rk);
  double at[MR_OP_MAX_ATTR] = {(double)m->seq, (double)H, (double)KH};
  if (c->sliding_window > 0 && c->sliding_window < m->seq)
    at[3] = (double)c->sliding_window; /* within it: full causal attention */
  for (int l = 0; l < c->num_hidden_layers; l++) {
    int ln1 = param1(g, MR_INIT_ONES, C, "model.layers.%d.input_layernorm.weight", l);
    int wq = param2(g, H * D, C, "model.layers.%d.self_attn.q_proj.weight", l);
    int wk = param2(g, KH * D, C, "model.layers.%d.self_attn.k_proj.weight", l);
    int wv = param2(g, KH * D, C, "model.layers.%d.self_attn.v_proj.weight", l);
    int wo = param2(g, C, H * D, "model.layers.%d.self_attn.o_proj.weight", l);
    int ln2 = param1(g, MR_INIT_ONES, C,
                     "model.layers.%d.post_attention_layernorm.weight", l);
    int wg = param2(g, I, C, "model.layers.%d.mlp.gate_proj.weight", l);
    int wu = param2(g, I, C, "model.layers.%d.mlp.up_proj.weight", l);
    int wd = param2(g, C, I, "model.layers.%d.mlp.down_proj.weight", l);
    CK(ln1 | wq | wk | wv | wo | ln2 | wg | wu | wd);
    int h = op(g, MR_OP_RMSNORM, "L%d.ln1", l, x, ln1, -1, rms, NULL);
    CK(h);
    int qb = c->qkv_bias;
    int q = proj(g, h, wq, qb, H * D, "model.layers.%d.self_attn.q_proj.bias", "L%d.q", l);
    int k = proj(g, h, wk, qb, KH * D, "model.layers.%d.self_attn.k_proj.bias", "L%d.k", l);
    int v = proj(g, h, wv, qb, KH * D, "model.layers.%d.self_attn.v_proj.bias", "L%d.v", l);
    CK(q | k | v);
    q = op(g, MR_OP_ROPE, "L%d.q_rope", l, q, -1, -1, rq, NULL);
    k = op(g, MR_OP_ROPE, "L%d.k_rope", l, k, -1, -1, rk, NULL);
    CK(q | k);
    int o = op(g, MR_OP_ATTENTION, "L%d.attn", l, q, k, v, at, NULL);
    CK(o);
    int a = proj(g, o, wo, c->o_bias, C, "model.layers.%d.self_attn.o_proj.bias", "L%d.o", l);
    CK(a);
    x = op(g, MR_OP_ADD, "L%d.res1", l, x, a, -1, NULL, NULL);
    CK(x);
    h = op(g, MR_OP_RMSNORM, "L%d.ln2", l, x, ln2, -1, rms, NULL);
    CK(h);
    int gt = linear(g, h, wg, "L%d.gate", l), up = linear(g, h, wu, "L%d.up", l);
    CK(gt | up);
    int s = op(g, MR_OP_SWIGLU, "L%d.swiglu", l, gt, up, -1, NULL, NULL);
    CK(s);
    int d = linear(g, s, wd, "L%d.down", l);
    CK(d);
    x = op(g, MR_OP_ADD, "L%d.res2", l, x, d, -1, NULL, NULL);
    CK(x);
  }
  int lnf = param1(g, MR_INIT_ONES, C, "model.norm.weight", 0);
  CK(lnf);
  int h = op(g, MR_OP_RMSNORM, "norm", 0, x, lnf, -1, rms, NULL);
  CK(h);
  int head = emb;
  if (!c->tie_word_embeddings) {
    head = param2(g, V, C, "lm_head.weight", 0);
    CK(head);
  }
  m->logits = linear(g, h, head, "logits", 0);
  CK(m->logits);
  return 0;
}

static int build_gpt2(struct mr_model *m) {
  struct mr_graph *g = &m->graph;
  const struct mr_model_config *c = &m->cfg;
  int64_t C = c->hidden_size, V = c->vocab_size, I = c->intermediate_size;
  int64_t H = c->num_attention_heads, P = c->max_position_embeddings;
  int wte = param2(g, V, C, "transformer.wte.weight", 0);
  int wpe = param2(g, P, C, "transformer.wpe.weight", 0);
  CK(wte | wpe);
  int te = op(g, MR_OP_EMBEDDING, "tok_emb", 0, m->input_ids, wte, -1, NULL, NULL);
  int pe = op(g, MR_OP_EMBEDDING, "pos_emb", 0, m->position_ids, wpe, -1, NULL,
              NULL);
  CK(te | pe);
  int x = op(g, MR_OP_ADD, "h0", 0, te, pe, -1, NULL, NULL);
  CK(x);
  double ln[MR_OP_MAX_ATTR] = {c->layer_norm_epsilon};
  double at[MR_OP_MAX_ATTR] = {(double)m->seq, (double)H, (double)H};
  double plain[MR_OP_MAX_ATTR] = {0, 0}; /* x W, Conv1D W [in, out] */
  for (int l = 0; l < c->num_hidden_layers; l++) {
    int l1w = param1(g, MR_INIT_ONES, C, "transformer.h.%d.ln_1.weight", l);
    int l1b = param1(g, MR_INIT_ZEROS, C, "transformer.h.%d.ln_1.bias", l);
    /* Conv1D [C, 3C], its columns q | k | v: held as [C, 3, C] so that a
     * split of the last dim splits the heads of all three */
    int64_t wsh[3] = {C, 3, C}, bsh[2] = {3, C};
    int caw = param_merged(g, MR_INIT_NORMAL, 3, wsh, "transformer.h.%d.attn.c_attn.weight", l);
    int cab = param_merged(g, MR_INIT_ZEROS, 2, bsh, "transformer.h.%d.attn.c_attn.bias", l);
    int cpw = param2(g, C, C, "transformer.h.%d.attn.c_proj.weight", l);
    int cpb = param1(g, MR_INIT_ZEROS, C, "transformer.h.%d.attn.c_proj.bias", l);
    int l2w = param1(g, MR_INIT_ONES, C, "transformer.h.%d.ln_2.weight", l);
    int l2b = param1(g, MR_INIT_ZEROS, C, "transformer.h.%d.ln_2.bias", l);
    int fw = param2(g, C, I, "transformer.h.%d.mlp.c_fc.weight", l);
    int fb = param1(g, MR_INIT_ZEROS, I, "transformer.h.%d.mlp.c_fc.bias", l);
    int pw = param2(g, I, C, "transformer.h.%d.mlp.c_proj.weight", l);
    int pb = param1(g, MR_INIT_ZEROS, C, "transformer.h.%d.mlp.c_proj.bias", l);
    CK(l1w | l1b | caw | cab | cpw | cpb | l2w | l2b | fw | fb | pw | pb);
    int h = op(g, MR_OP_LAYERNORM, "L%d.ln1", l, x, l1w, l1b, ln, NULL);
    CK(h);
    int qkv = op(g, MR_OP_MATMUL, "L%d.qkv", l, h, caw, cab, plain, NULL);
    CK(qkv);
    int parts[MR_OP_MAX_OUT];
    CK(op(g, MR_OP_SPLIT3, "L%d.q", l, qkv, -1, -1, NULL, parts));
    int o = op(g, MR_OP_ATTENTION, "L%d.attn", l, parts[0], parts[1], parts[2],
               at, NULL);
    CK(o);
    int a = op(g, MR_OP_MATMUL, "L%d.proj", l, o, cpw, cpb, plain, NULL);
    CK(a);
    x = op(g, MR_OP_ADD, "L%d.res1", l, x, a, -1, NULL, NULL);
    CK(x);
    h = op(g, MR_OP_LAYERNORM, "L%d.ln2", l, x, l2w, l2b, ln, NULL);
    CK(h);
    int f = op(g, MR_OP_MATMUL, "L%d.fc", l, h, fw, fb, plain, NULL);
    CK(f);
    f = op(g, MR_OP_GELU, "L%d.gelu", l, f, -1, -1, NULL, NULL);
    CK(f);
    int d = op(g, MR_OP_MATMUL, "L%d.mlp_proj", l, f, pw, pb, plain, NULL);
    CK(d);
    x = op(g, MR_OP_ADD, "L%d.res2", l, x, d, -1, NULL, NULL);
    CK(x);
  }
  int fw = param1(g, MR_INIT_ONES, C, "transformer.ln_f.weight", 0);
  int fb = param1(g, MR_INIT_ZEROS, C, "transformer.ln_f.bias", 0);
  CK(fw | fb);
  int h = op(g, MR_OP_LAYERNORM, "ln_f", 0, x, fw, fb, ln, NULL);
  CK(h);
  m->logits = linear(g, h, wte, "logits", 0); /* lm_head tied to wte */
  CK(m->logits);
  return 0;
}

/* loss = mean cross-entropy of logits against labels, in three steps:
 * row maxima, sums of exponentials with the targets' logits, the mean. */
static int vocab_parallel_loss(struct mr_graph *g, int logits, int labels,
                               int *out) {
  int m, se[MR_OP_MAX_OUT];
  int in1[1] = {logits};
  CK(mr_graph_op(g, MR_OP_XENT_MAX, "loss.max", in1, 1, NULL, &m));
  int in2[3] = {logits, labels, m};
  CK(mr_graph_op(g, MR_OP_XENT_SUMEXP, "loss.sumexp", in2, 3, NULL, se));
  int in3[4] = {se[0], se[1], m, labels};
  CK(mr_graph_op(g, MR_OP_XENT_FINISH, "loss", in3, 4, NULL, out));
  return 0;
}

enum { MAX_PASSES = 16 };
static const struct mr_model_pass *passes[MAX_PASSES];
static int n_passes;

int mr_model_pass_register(const struct mr_model_pass *p) {
  if (p == NULL || p->name == NULL || p->run == NULL)
    return mr_error_set(MR_EINVAL, "model pass: a pass needs a name and a function");
  for (int i = 0; i < n_passes; i++)
    if (strcmp(passes[i]->name, p->name) == 0)
      return mr_error_set(MR_EINVAL, "model pass %s is registered already", p->name);
  if (n_passes == MAX_PASSES)
    return mr_error_set(MR_ENOMEM, "model pass %s: more than %d passes", p->name, MAX_PASSES);
  passes[n_passes++] = p;
  return 0;
}

static int run_passes(struct mr_graph *g) {
  for (int i = 0; i < n_passes; i++) {
    int rc = passes[i]->run(g);
    if (rc < 0)
      return mr_error_set(rc, "model pass %s: %s", passes[i]->name, mr_error_of(rc));
  }
  return 0;
}

int mr_model_build(const struct mr_model_config *cfg, int64_t batch,
                   int64_t seq, struct mr_model *m) {
  return mr_model_build_loss(cfg, batch, seq, MR_LOSS_FUSED, m);
}

int mr_model_build_loss(const struct mr_model_config *cfg, int64_t batch,
                        int64_t seq, enum mr_loss_form form,
                        struct mr_model *m) {
  memset(m, 0, sizeof *m);
  m->loss_form = form;
  mr_graph_init(&m->graph);
  m->cfg = *cfg;
  m->batch = batch;
  m->seq = seq;
  m->position_ids = -1;
  if (batch < 1 || seq < 1 || seq > cfg->max_position_embeddings)
    return mr_error_set(MR_EINVAL, "model: batch %lld x seq %lld: expected "
                        "positive and seq <= max_position_embeddings (%lld)",
                        (long long)batch, (long long)seq,
                        (long long)cfg->max_position_embeddings);
  MR_TRY(mr_model_check_seq(cfg, seq));
  if (cfg->num_attention_heads < 1 || cfg->num_key_value_heads < 1 ||
      (cfg->head_dim == 0 && cfg->hidden_size % cfg->num_attention_heads) ||
      cfg->num_attention_heads % cfg->num_key_value_heads)
    return mr_error_set(MR_EINVAL, "model: heads %lld / kv heads %lld do not "
                        "divide hidden %lld", (long long)cfg->num_attention_heads,
                        (long long)cfg->num_key_value_heads,
                        (long long)cfg->hidden_size);
  struct mr_graph *g = &m->graph;
  int64_t n[1] = {batch * seq};
  m->input_ids = mr_graph_tensor(g, "input_ids", MR_I32, MR_ROLE_INPUT, 1, n);
  m->labels = mr_graph_tensor(g, "labels", MR_I32, MR_ROLE_INPUT, 1, n);
  if (cfg->family == MR_MODEL_GPT2)
    m->position_ids =
        mr_graph_tensor(g, "position_ids", MR_I32, MR_ROLE_INPUT, 1, n);
  int rc = cfg->family == MR_MODEL_GPT2 ? build_gpt2(m) : build_llama(m);
  if (rc < 0)
    return rc;
  MR_TRY(run_passes(g));
  int out[MR_OP_MAX_OUT];
  int in[2] = {m->logits, m->labels};
  if (form == MR_LOSS_VOCAB_PARALLEL)
    rc = vocab_parallel_loss(g, m->logits, m->labels, out);
  else
    rc = mr_graph_op(g, MR_OP_CROSS_ENTROPY, "loss", in, 2, NULL, out);
  if (rc < 0)
    return rc;
  m->loss = out[0];
  g->loss = out[0];
  return 0;
}

void mr_model_close(struct mr_model *m) { mr_graph_close(&m->graph); }
