/* model_config.c - Hugging Face config.json for LLaMA and GPT-2. */
#include "common/model_config.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/error.h"
#include "common/jsonv.h"

#define BIG ((int64_t)1 << 40)

/* The families built, by model_type and architectures[0]; and families
 * people train that are not built, refused by name. */
static const struct family {
  const char *type, *arch;
  enum mr_model_family family;
  enum mr_model_arch id;
} families[] = {
    {"llama", "LlamaForCausalLM", MR_MODEL_LLAMA, MR_ARCH_LLAMA},
    {"gpt2", "GPT2LMHeadModel", MR_MODEL_GPT2, MR_ARCH_GPT2},
    {"qwen2", "Qwen2ForCausalLM", MR_MODEL_LLAMA, MR_ARCH_QWEN2},
    {"mistral", "MistralForCausalLM", MR_MODEL_LLAMA, MR_ARCH_MISTRAL},
};
static const char *const not_built[][2] = {
    {"qwen3", "Qwen3ForCausalLM"},     {"mixtral", "MixtralForCausalLM"},
    {"gemma", "GemmaForCausalLM"},     {"gemma2", "Gemma2ForCausalLM"},
    {"gemma3_text", "Gemma3ForCausalLM"}, {"phi3", "Phi3ForCausalLM"},
    {"olmo2", "Olmo2ForCausalLM"},     {"gpt_neox", "GPTNeoXForCausalLM"},
};
#define SUPPORTED                                                                          \
  "supported: model_type \"llama\" (LlamaForCausalLM), \"qwen2\" (Qwen2ForCausalLM), "      \
  "\"mistral\" (MistralForCausalLM), \"gpt2\" (GPT2LMHeadModel)"

/* The family config obj describes: model_type and architectures[0], where
 * given, must name the same built one. */
static int detect_family(struct mr_jv *jv, const cJSON *obj,
                         enum mr_model_family *family, enum mr_model_arch *id) {
  const cJSON *arch = cJSON_GetObjectItemCaseSensitive(obj, "architectures");
  const cJSON *type = cJSON_GetObjectItemCaseSensitive(obj, "model_type");
  const char *a = NULL, *t = NULL;
  if (cJSON_IsArray(arch) && cJSON_IsString(cJSON_GetArrayItem(arch, 0)))
    a = cJSON_GetArrayItem(arch, 0)->valuestring;
  else if (arch != NULL && !cJSON_IsNull(arch))
    return mr_jv_error(jv, "", "architectures", "expected a list of class names; " SUPPORTED),
           -1;
  if (cJSON_IsString(type))
    t = type->valuestring;
  else if (type != NULL && !cJSON_IsNull(type))
    return mr_jv_error(jv, "", "model_type", "expected a string; " SUPPORTED), -1;
  if (a == NULL && t == NULL)
    return mr_jv_error(jv, "", "model_type", "missing (and no architectures); " SUPPORTED), -1;
  for (size_t i = 0; i < sizeof families / sizeof *families; i++) {
    const struct family *f = &families[i];
    int ta = t != NULL && strcmp(t, f->type) == 0, aa = a != NULL && strcmp(a, f->arch) == 0;
    if (!ta && !aa)
      continue;
    if (t != NULL && a != NULL && !(ta && aa))
      return mr_jv_error(jv, "", ta ? "architectures" : "model_type",
                         "\"%s\" does not go with %s \"%s\" (expected \"%s\")",
                         ta ? a : t, ta ? "model_type" : "architectures", ta ? t : a,
                         ta ? f->arch : f->type),
             -1;
    *family = f->family;
    *id = f->id;
    return 0;
  }
  for (size_t i = 0; i < sizeof not_built / sizeof *not_built; i++)
    if ((t != NULL && strcmp(t, not_built[i][0]) == 0) ||
        (a != NULL && strcmp(a, not_built[i][1]) == 0))
      return mr_jv_error(jv, "", t != NULL ? "model_type" : "architectures",
                         "\"%s\" (%s) is not built in meshrun; " SUPPORTED,
                         t != NULL ? t : a, not_built[i][1]),
             -1;
  return mr_jv_error(jv, "", t != NULL ? "model_type" : "architectures",
                     "unknown model \"%s\"; " SUPPORTED, t != NULL ? t : a),
         -1;
}

/* Fields the shape comes from: a config that leaves one out is refused
 * rather than given transformers' default (a 7B model's). */
static void require(struct mr_jv *jv, const cJSON *obj, const char *const *keys) {
  for (; *keys != NULL; keys++)
    if (cJSON_GetObjectItemCaseSensitive(obj, *keys) == NULL)
      mr_jv_error(jv, "", *keys, "missing (the model's shape is not assumed)");
}

/* Dropout is not built: a non-zero rate would be ignored, so it is refused. */
static void no_dropout(struct mr_jv *jv, const cJSON *obj, const char *const *keys) {
  for (; *keys != NULL; keys++) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, *keys);
    if (v == NULL || cJSON_IsNull(v) || (cJSON_IsNumber(v) && v->valuedouble == 0))
      continue;
    char shown[96];
    if (cJSON_IsNumber(v))
      snprintf(shown, sizeof shown, "%g", v->valuedouble);
    else
      mr_jv_show(v, shown, sizeof shown);
    mr_jv_error(jv, "", *keys, "dropout is not built, got %s (0 or 0.0 trains without it)",
                shown);
  }
}

void mr_rope_inv_freq(const struct mr_rope *r, int D, double *inv) {
  const double two_pi = 6.283185307179586;
  for (int i = 0; i < D / 2; i++) {
    double f = pow(r->theta, -2.0 * i / D);
    if (r->kind == MR_ROPE_LINEAR) {
      f /= r->factor;
    } else if (r->kind == MR_ROPE_LLAMA3) {
      double wavelen = two_pi / f, old = r->original_max_positions;
      double low_wavelen = old / r->low_freq_factor, high_wavelen = old / r->high_freq_factor;
      if (wavelen > low_wavelen) {
        f /= r->factor;
      } else if (wavelen >= high_wavelen) { /* between: blend the two */
        double smooth = (old / wavelen - r->low_freq_factor) /
                        (r->high_freq_factor - r->low_freq_factor);
        f = (1 - smooth) * f / r->factor + smooth * f;
      }
    }
    inv[i] = f;
  }
}

int mr_rope_table(const struct mr_rope *r, int P, int D, float *cos_t, float *sin_t) {
  if (P < 0 || D <= 0 || D % 2)
    return mr_error_set(MR_EINVAL, "rope: expected P >= 0 and even D > 0, got P=%d D=%d",
                        P, D);
  if (!(r->theta > 0) || (r->kind != MR_ROPE_DEFAULT && !(r->factor > 0)))
    return mr_error_set(MR_EINVAL, "rope: rope_theta and factor must be > 0, got %g and %g",
                        r->theta, r->factor);
  int half = D / 2;
  double *inv = malloc(sizeof *inv * (size_t)half);
  if (inv == NULL)
    return mr_error_set(MR_ENOMEM, "rope: no memory for %d frequencies", half);
  mr_rope_inv_freq(r, D, inv);
  for (int i = 0; i < half; i++)
    for (int p = 0; p < P; p++) {
      double a = p * inv[i];
      cos_t[(size_t)p * half + i] = (float)cos(a);
      sin_t[(size_t)p * half + i] = (float)sin(a);
    }
  free(inv);
  return 0;
}

/* A positive number field of a RoPE scaling object, required for its kind. */
static void rope_num(struct mr_jv *jv, const cJSON *o, const char *path, const char *key,
                     const char *kind, double *out) {
  if (cJSON_GetObjectItemCaseSensitive(o, key) == NULL)
    mr_jv_error(jv, path, key, "missing (rope_type \"%s\" needs it)", kind);
  else
    mr_jv_num(jv, o, path, key, 1e-9, 1e12, out);
}

/* The scaling one rope_parameters / rope_scaling object names. */
static void read_rope_kind(struct mr_jv *jv, const cJSON *o, const char *path,
                           struct mr_rope *r) {
  const char *kind = NULL;
  const char *key = cJSON_GetObjectItemCaseSensitive(o, "rope_type") ? "rope_type" : "type";
  if (mr_jv_str(jv, o, path, key, &kind) != 1 || strcmp(kind, "default") == 0)
    return;
  if (strcmp(kind, "linear") == 0) {
    r->kind = MR_ROPE_LINEAR;
    rope_num(jv, o, path, "factor", kind, &r->factor);
  } else if (strcmp(kind, "dynamic") == 0) {
    double factor = 1;
    rope_num(jv, o, path, "factor", kind, &factor); /* within max_position_embeddings: none */
  } else if (strcmp(kind, "llama3") == 0) {
    r->kind = MR_ROPE_LLAMA3;
    rope_num(jv, o, path, "factor", kind, &r->factor);
    rope_num(jv, o, path, "low_freq_factor", kind, &r->low_freq_factor);
    rope_num(jv, o, path, "high_freq_factor", kind, &r->high_freq_factor);
    rope_num(jv, o, path, "original_max_position_embeddings", kind, &r->original_max_positions);
    if (r->high_freq_factor <= r->low_freq_factor)
      mr_jv_error(jv, path, "high_freq_factor", "%g: expected more than low_freq_factor (%g)",
                  r->high_freq_factor, r->low_freq_factor);
  } else {
    mr_jv_error(jv, path, key,
                "\"%s\" is not built (supported: \"default\", \"linear\", \"dynamic\", "
                "\"llama3\")",
                kind);
  }
}

/* RoPE's base and scaling, in transformers 4.x form (rope_theta, rope_scaling)
 * or 5.x (rope_parameters {rope_type, rope_theta, ...}); the kinds not
 * built are refused by name. */
static void read_rope(struct mr_jv *jv, const cJSON *obj, struct mr_rope *r) {
  double *theta = &r->theta;
  const cJSON *params = cJSON_GetObjectItemCaseSensitive(obj, "rope_parameters");
  const cJSON *scaling = cJSON_GetObjectItemCaseSensitive(obj, "rope_scaling");
  int top = mr_jv_num(jv, obj, "", "rope_theta", 1e-9, 1e12, theta) == 1;
  const struct {
    const cJSON *o;
    const char *name;
  } forms[] = {{params, "rope_parameters"}, {scaling, "rope_scaling"}};
  for (int k = 0; k < 2; k++) {
    const cJSON *o = forms[k].o;
    if (o == NULL || cJSON_IsNull(o))
      continue;
    if (!cJSON_IsObject(o)) {
      mr_jv_error(jv, "", forms[k].name, "expected an object");
      continue;
    }
    double t;
    if (mr_jv_num(jv, o, forms[k].name, "rope_theta", 1e-9, 1e12, &t) == 1) {
      if (top && t != *theta)
        mr_jv_error(jv, forms[k].name, "rope_theta", "%g, but the top-level rope_theta is %g",
                    t, *theta);
      *theta = t;
    }
    read_rope_kind(jv, o, forms[k].name, r);
  }
}

static void expect_string(struct mr_jv *jv, const cJSON *obj, const char *key,
                          const char *want) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
  if (v == NULL || cJSON_IsNull(v))
    return;
  if (!cJSON_IsString(v) || strcmp(v->valuestring, want) != 0) {
    char shown[96];
    mr_jv_error(jv, "", key, "only \"%s\" is supported, got %s", want,
                mr_jv_show(v, shown, sizeof shown));
  }
}

static void expect_absent(struct mr_jv *jv, const cJSON *obj, const char *key,
                          const char *why) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
  if (v != NULL && !cJSON_IsNull(v) && !cJSON_IsFalse(v))
    mr_jv_error(jv, "", key, "not supported (%s)", why);
}

/* What Qwen2 and Mistral change in the LLaMA graph: q/k/v biases (Qwen2
 * always; LLaMA's attention_bias adds o_proj's), and the sliding window
 * (Mistral's sliding_window; Qwen2's where use_sliding_window). */
static void read_variant(struct mr_jv *jv, const cJSON *obj, struct mr_model_config *c) {
  if (c->arch == MR_ARCH_LLAMA) {
    int bias = 0;
    mr_jv_bool(jv, obj, "", "attention_bias", &bias);
    c->qkv_bias = c->o_bias = bias;
  }
  if (c->arch == MR_ARCH_QWEN2)
    c->qkv_bias = 1;
  expect_absent(jv, obj, "mlp_bias", "the MLP projections have no bias");
  int slide = c->arch == MR_ARCH_MISTRAL;
  if (c->arch == MR_ARCH_QWEN2)
    mr_jv_bool(jv, obj, "", "use_sliding_window", &slide);
  const cJSON *w = cJSON_GetObjectItemCaseSensitive(obj, "sliding_window");
  if (slide && w != NULL && !cJSON_IsNull(w))
    mr_jv_int(jv, obj, "", "sliding_window", 1, BIG, &c->sliding_window);
}

int mr_model_check_seq(const struct mr_model_config *cfg, int64_t seq_len) {
  /* Mistral's window is every layer's, and built; Qwen2's spares the
   * layers below max_window_layers, which is not */
  if (cfg->arch == MR_ARCH_QWEN2 && cfg->sliding_window > 0 && seq_len > cfg->sliding_window)
    return mr_error_set(MR_ENOTSUP,
                        "sliding_window: %lld, shorter than the sequence (%lld): Qwen2's "
                        "per-layer sliding window is not built (sequences of at most %lld "
                        "tokens are full causal attention, and are)",
                        (long long)cfg->sliding_window, (long long)seq_len,
                        (long long)cfg->sliding_window);
  return 0;
}

int mr_model_config_parse(const cJSON *obj, const char *where,
                          struct mr_model_config *out) {
  struct mr_jv jv;
  mr_jv_init(&jv, where);
  struct mr_model_config c;
  memset(&c, 0, sizeof c);
  if (!cJSON_IsObject(obj)) {
    mr_jv_error(&jv, "", NULL, "expected a JSON object");
    goto done;
  }
  if (detect_family(&jv, obj, &c.family, &c.arch) < 0)
    goto done;
  static const char *const llama_shape[] = {"vocab_size", "hidden_size", "intermediate_size",
                                            "num_hidden_layers", "num_attention_heads", NULL};
  static const char *const gpt2_shape[] = {"vocab_size", "n_embd", "n_layer", "n_head", NULL};
  static const char *const llama_dropout[] = {"attention_dropout", NULL};
  static const char *const gpt2_dropout[] = {"attn_pdrop", "resid_pdrop", "embd_pdrop", NULL};
  require(&jv, obj, c.family == MR_MODEL_LLAMA ? llama_shape : gpt2_shape);
  no_dropout(&jv, obj, c.family == MR_MODEL_LLAMA ? llama_dropout : gpt2_dropout);
  c.initializer_range = 0.02;
  mr_jv_num(&jv, obj, "", "initializer_range", 0, 10, &c.initializer_range);
  if (c.family == MR_MODEL_LLAMA) {
    c.vocab_size = 32000;
    c.hidden_size = 4096;
    c.intermediate_size = 11008;
    c.num_hidden_layers = 32;
    c.num_attention_heads = 32;
    c.max_position_embeddings = 2048;
    c.rms_norm_eps = 1e-6;
    c.rope_theta = 10000.0;
    mr_jv_int(&jv, obj, "", "vocab_size", 1, BIG, &c.vocab_size);
    mr_jv_int(&jv, obj, "", "hidden_size", 1, BIG, &c.hidden_size);
    mr_jv_int(&jv, obj, "", "intermediate_size", 1, BIG, &c.intermediate_size);
    mr_jv_int(&jv, obj, "", "num_hidden_layers", 1, 100000, &c.num_hidden_layers);
    mr_jv_int(&jv, obj, "", "num_attention_heads", 1, 100000, &c.num_attention_heads);
    c.num_key_value_heads = c.num_attention_heads;
    const cJSON *kv = cJSON_GetObjectItemCaseSensitive(obj, "num_key_value_heads");
    if (kv != NULL && !cJSON_IsNull(kv))
      mr_jv_int(&jv, obj, "", "num_key_value_heads", 1, 100000, &c.num_key_value_heads);
    mr_jv_int(&jv, obj, "", "max_position_embeddings", 1, BIG, &c.max_position_embeddings);
    mr_jv_num(&jv, obj, "", "rms_norm_eps", 0, 1, &c.rms_norm_eps);
    c.rope.theta = c.rope_theta;
    read_rope(&jv, obj, &c.rope);
    c.rope_theta = c.rope.theta;
    mr_jv_bool(&jv, obj, "", "tie_word_embeddings", &c.tie_word_embeddings);
    expect_string(&jv, obj, "hidden_act", "silu");
    read_variant(&jv, obj, &c);
    if (c.num_attention_heads > 0 && c.num_key_value_heads > 0 &&
        c.num_attention_heads % c.num_key_value_heads != 0)
      mr_jv_error(&jv, "", "num_key_value_heads",
                  "expected a divisor of num_attention_heads (%lld), got %lld",
                  (long long)c.num_attention_heads, (long long)c.num_key_value_heads);
    int64_t head_dim;
    const cJSON *hd = cJSON_GetObjectItemCaseSensitive(obj, "head_dim");
    if (hd != NULL && !cJSON_IsNull(hd) &&
        mr_jv_int(&jv, obj, "", "head_dim", 1, 100000, &head_dim) == 1 &&
        (c.num_attention_heads <= 0 || c.hidden_size % c.num_attention_heads != 0 ||
         head_dim != c.hidden_size / c.num_attention_heads))
      c.head_dim = head_dim; /* q and o are heads x head_dim, not hidden wide */
  } else {
    c.vocab_size = 50257;
    c.hidden_size = 768;
    c.num_hidden_layers = 12;
    c.num_attention_heads = 12;
    c.max_position_embeddings = 1024;
    c.layer_norm_epsilon = 1e-5;
    mr_jv_int(&jv, obj, "", "vocab_size", 1, BIG, &c.vocab_size);
    mr_jv_int(&jv, obj, "", "n_embd", 1, BIG, &c.hidden_size);
    mr_jv_int(&jv, obj, "", "n_layer", 1, 100000, &c.num_hidden_layers);
    mr_jv_int(&jv, obj, "", "n_head", 1, 100000, &c.num_attention_heads);
    mr_jv_int(&jv, obj, "", "n_positions", 1, BIG, &c.max_position_embeddings);
    mr_jv_num(&jv, obj, "", "layer_norm_epsilon", 0, 1, &c.layer_norm_epsilon);
    c.intermediate_size = 4 * c.hidden_size;
    const cJSON *inner = cJSON_GetObjectItemCaseSensitive(obj, "n_inner");
    if (inner != NULL && !cJSON_IsNull(inner))
      mr_jv_int(&jv, obj, "", "n_inner", 1, BIG, &c.intermediate_size);
    c.num_key_value_heads = c.num_attention_heads;
    c.tie_word_embeddings = 1;
    int tie = 1;
    if (mr_jv_bool(&jv, obj, "", "tie_word_embeddings", &tie) == 1 && !tie)
      mr_jv_error(&jv, "", "tie_word_embeddings", "GPT-2's head is always tied");
    expect_string(&jv, obj, "activation_function", "gelu_new");
    expect_absent(&jv, obj, "scale_attn_by_inverse_layer_idx", "standard scaling only");
    expect_absent(&jv, obj, "reorder_and_upcast_attn", "standard attention only");
  }
  if (jv.n_errors == 0 && c.head_dim == 0 && c.hidden_size % c.num_attention_heads != 0)
    mr_jv_error(&jv, "", c.family == MR_MODEL_GPT2 ? "n_head" : "num_attention_heads",
                "expected a divisor of the hidden size (%lld), got %lld",
                (long long)c.hidden_size, (long long)c.num_attention_heads);
  if (jv.n_errors == 0 && c.family == MR_MODEL_LLAMA &&
      mr_model_head_dim(&c) % 2 != 0)
    mr_jv_error(&jv, "", "hidden_size", "RoPE needs an even head dimension, got %lld",
                (long long)mr_model_head_dim(&c));
done:;
  int rc = 0;
  if (jv.n_errors > 0)
    rc = mr_error_set(MR_EJOB, "%s", jv.errors);
  else
    *out = c;
  mr_jv_close(&jv);
  return rc;
}

int mr_model_config_load(const char *path, struct mr_model_config *out) {
  cJSON *obj;
  int rc = mr_model_config_load_json(path, out, &obj);
  cJSON_Delete(obj);
  return rc;
}

int mr_model_config_load_json(const char *path, struct mr_model_config *out, cJSON **obj_out) {
  *obj_out = NULL;
  struct stat st;
  char file[4096];
  if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) { /* a Hugging Face model folder */
    if (snprintf(file, sizeof file, "%s/config.json", path) >= (int)sizeof file)
      return mr_error_set(MR_EINVAL, "%s: path too long", path);
    path = file;
  }
  cJSON *obj;
  MR_TRY(mr_json_load(path, &obj));
  int rc = mr_model_config_parse(obj, path, out);
  if (rc < 0)
    cJSON_Delete(obj);
  else
    *obj_out = obj;
  return rc;
}

char *mr_model_config_to_json(const struct mr_model_config *c) {
  cJSON *o = cJSON_CreateObject();
  if (o == NULL)
    return NULL;
  if (c->family == MR_MODEL_LLAMA) {
    const struct family *f = &families[0];
    for (size_t i = 0; i < sizeof families / sizeof *families; i++)
      if (families[i].id == c->arch)
        f = &families[i];
    cJSON *arch = cJSON_AddArrayToObject(o, "architectures");
    cJSON_AddItemToArray(arch, cJSON_CreateString(f->arch));
    cJSON_AddStringToObject(o, "model_type", f->type);
    if (c->arch == MR_ARCH_LLAMA)
      cJSON_AddBoolToObject(o, "attention_bias", c->qkv_bias);
    if (c->arch == MR_ARCH_QWEN2)
      cJSON_AddBoolToObject(o, "use_sliding_window", c->sliding_window > 0);
    if (c->sliding_window > 0)
      cJSON_AddNumberToObject(o, "sliding_window", (double)c->sliding_window);
    else if (c->arch == MR_ARCH_MISTRAL)
      cJSON_AddNullToObject(o, "sliding_window");
    cJSON_AddNumberToObject(o, "vocab_size", (double)c->vocab_size);
    cJSON_AddNumberToObject(o, "hidden_size", (double)c->hidden_size);
    cJSON_AddNumberToObject(o, "intermediate_size", (double)c->intermediate_size);
    cJSON_AddNumberToObject(o, "num_hidden_layers", (double)c->num_hidden_layers);
    cJSON_AddNumberToObject(o, "num_attention_heads", (double)c->num_attention_heads);
    cJSON_AddNumberToObject(o, "num_key_value_heads", (double)c->num_key_value_heads);
    cJSON_AddNumberToObject(o, "head_dim", (double)mr_model_head_dim(c));
    cJSON_AddNumberToObject(o, "max_position_embeddings",
                            (double)c->max_position_embeddings);
    cJSON_AddNumberToObject(o, "rms_norm_eps", c->rms_norm_eps);
    cJSON_AddNumberToObject(o, "rope_theta", c->rope_theta);
    if (c->rope.kind != MR_ROPE_DEFAULT) {
      cJSON *rs = cJSON_AddObjectToObject(o, "rope_scaling");
      cJSON_AddStringToObject(rs, "rope_type", c->rope.kind == MR_ROPE_LINEAR ? "linear" : "llama3");
      cJSON_AddNumberToObject(rs, "factor", c->rope.factor);
      if (c->rope.kind == MR_ROPE_LLAMA3) {
        cJSON_AddNumberToObject(rs, "low_freq_factor", c->rope.low_freq_factor);
        cJSON_AddNumberToObject(rs, "high_freq_factor", c->rope.high_freq_factor);
        cJSON_AddNumberToObject(rs, "original_max_position_embeddings",
                                c->rope.original_max_positions);
      }
    }
    cJSON_AddBoolToObject(o, "tie_word_embeddings", c->tie_word_embeddings);
    cJSON_AddStringToObject(o, "hidden_act", "silu");
  } else {
    cJSON *arch = cJSON_AddArrayToObject(o, "architectures");
    cJSON_AddItemToArray(arch, cJSON_CreateString("GPT2LMHeadModel"));
    cJSON_AddStringToObject(o, "model_type", "gpt2");
    cJSON_AddNumberToObject(o, "vocab_size", (double)c->vocab_size);
    cJSON_AddNumberToObject(o, "n_embd", (double)c->hidden_size);
    cJSON_AddNumberToObject(o, "n_inner", (double)c->intermediate_size);
    cJSON_AddNumberToObject(o, "n_layer", (double)c->num_hidden_layers);
    cJSON_AddNumberToObject(o, "n_head", (double)c->num_attention_heads);
    cJSON_AddNumberToObject(o, "n_positions", (double)c->max_position_embeddings);
    cJSON_AddNumberToObject(o, "layer_norm_epsilon", c->layer_norm_epsilon);
    cJSON_AddStringToObject(o, "activation_function", "gelu_new");
    cJSON_AddBoolToObject(o, "tie_word_embeddings", 1);
  }
  cJSON_AddNumberToObject(o, "initializer_range", c->initializer_range);
  cJSON_AddStringToObject(o, "torch_dtype", "float32");
  char *s = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  return s;
}

int64_t mr_model_head_dim(const struct mr_model_config *c) {
  if (c->head_dim > 0)
    return c->head_dim;
  return c->num_attention_heads > 0 ? c->hidden_size / c->num_attention_heads : 0;
}

int64_t mr_model_param_count(const struct mr_model_config *c) {
  int64_t h = c->hidden_size, f = c->intermediate_size, v = c->vocab_size;
  int64_t l = c->num_hidden_layers, d = mr_model_head_dim(c);
  int64_t kv = c->num_key_value_heads * d;
  if (c->family == MR_MODEL_LLAMA) {
    int64_t q = c->num_attention_heads * d; /* = h unless head_dim says otherwise */
    int64_t layer = h * q /* q */ + 2 * h * kv /* k, v */ + q * h /* o */ +
                    3 * h * f /* gate, up, down */ + 2 * h /* norms */ +
                    (c->qkv_bias ? q + 2 * kv : 0) + (c->o_bias ? h : 0);
    return v * h * (c->tie_word_embeddings ? 1 : 2) + l * layer + h;
  }
  int64_t layer = 4 * h /* ln_1, ln_2 */ + 3 * h * h + 3 * h /* c_attn */ +
                  h * h + h /* attn c_proj */ + h * f + f /* c_fc */ + f * h + h;
  return v * h + c->max_position_embeddings * h + l * layer + 2 * h;
}
