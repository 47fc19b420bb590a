/* model_config.c - reading a Hugging Face config.json (LLaMA, GPT-2). */
#include "common/model_config.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

/* Reads an optional integer key; keeps *out (the default) when absent. */
static int get_int(const cJSON *o, const char *where, const char *key,
                   int64_t *out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!v || cJSON_IsNull(v))
    return 0;
  if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) ||
      fabs(v->valuedouble) > 9e15)
    return mr_error_set(MR_EJOB, "%s: %s: expected an integer", where, key);
  *out = (int64_t)v->valuedouble;
  return 0;
}

static int get_num(const cJSON *o, const char *where, const char *key,
                   double *out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!v || cJSON_IsNull(v))
    return 0;
  if (!cJSON_IsNumber(v))
    return mr_error_set(MR_EJOB, "%s: %s: expected a number", where, key);
  *out = v->valuedouble;
  return 0;
}

static int get_bool(const cJSON *o, const char *where, const char *key,
                    int *out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  if (!v || cJSON_IsNull(v))
    return 0;
  if (!cJSON_IsBool(v))
    return mr_error_set(MR_EJOB, "%s: %s: expected true or false", where, key);
  *out = cJSON_IsTrue(v);
  return 0;
}

static int positive(const char *where, const char *key, int64_t v) {
  if (v <= 0)
    return mr_error_set(MR_EJOB, "%s: %s: expected a positive integer, got "
                        "%lld", where, key, (long long)v);
  return 0;
}

static int family_of(const cJSON *o, const char *where,
                     enum mr_model_family *f) {
  const cJSON *arch = cJSON_GetObjectItemCaseSensitive(o, "architectures");
  const cJSON *mt = cJSON_GetObjectItemCaseSensitive(o, "model_type");
  const char *a = NULL;
  if (cJSON_IsArray(arch) && cJSON_IsString(cJSON_GetArrayItem(arch, 0)))
    a = cJSON_GetArrayItem(arch, 0)->valuestring;
  if ((a && strcmp(a, "LlamaForCausalLM") == 0) ||
      (!a && cJSON_IsString(mt) && strcmp(mt->valuestring, "llama") == 0)) {
    *f = MR_MODEL_LLAMA;
    return 0;
  }
  if ((a && strcmp(a, "GPT2LMHeadModel") == 0) ||
      (!a && cJSON_IsString(mt) && strcmp(mt->valuestring, "gpt2") == 0)) {
    *f = MR_MODEL_GPT2;
    return 0;
  }
  return mr_error_set(MR_EJOB, "%s: architectures: expected "
                      "[\"LlamaForCausalLM\"] or [\"GPT2LMHeadModel\"] (or "
                      "model_type \"llama\" / \"gpt2\"), got %s", where,
                      a ? a : (cJSON_IsString(mt) ? mt->valuestring : "none"));
}

int mr_model_config_parse(const struct cJSON *obj, const char *where,
                          struct mr_model_config *out) {
  memset(out, 0, sizeof *out);
  if (!cJSON_IsObject(obj))
    return mr_error_set(MR_EJOB, "%s: expected a JSON object", where);
  MR_TRY(family_of(obj, where, &out->family));
  struct mr_model_config *c = out;
  if (c->family == MR_MODEL_LLAMA) {
    c->vocab_size = 32000, c->hidden_size = 4096, c->intermediate_size = 11008;
    c->num_hidden_layers = 32, c->num_attention_heads = 32;
    c->max_position_embeddings = 2048, c->rms_norm_eps = 1e-6;
    c->rope_theta = 10000.0, c->initializer_range = 0.02;
    c->tie_word_embeddings = 0;
    MR_TRY(get_int(obj, where, "vocab_size", &c->vocab_size));
    MR_TRY(get_int(obj, where, "hidden_size", &c->hidden_size));
    MR_TRY(get_int(obj, where, "intermediate_size", &c->intermediate_size));
    MR_TRY(get_int(obj, where, "num_hidden_layers", &c->num_hidden_layers));
    MR_TRY(get_int(obj, where, "num_attention_heads", &c->num_attention_heads));
    c->num_key_value_heads = c->num_attention_heads;
    MR_TRY(get_int(obj, where, "num_key_value_heads", &c->num_key_value_heads));
    MR_TRY(get_int(obj, where, "max_position_embeddings",
                   &c->max_position_embeddings));
    MR_TRY(get_num(obj, where, "rms_norm_eps", &c->rms_norm_eps));
    MR_TRY(get_num(obj, where, "rope_theta", &c->rope_theta));
    MR_TRY(get_bool(obj, where, "tie_word_embeddings", &c->tie_word_embeddings));
  } else {
    c->vocab_size = 50257, c->hidden_size = 768, c->num_hidden_layers = 12;
    c->num_attention_heads = 12, c->max_position_embeddings = 1024;
    c->layer_norm_epsilon = 1e-5, c->initializer_range = 0.02;
    c->tie_word_embeddings = 1;
    MR_TRY(get_int(obj, where, "vocab_size", &c->vocab_size));
    MR_TRY(get_int(obj, where, "n_embd", &c->hidden_size));
    MR_TRY(get_int(obj, where, "n_layer", &c->num_hidden_layers));
    MR_TRY(get_int(obj, where, "n_head", &c->num_attention_heads));
    MR_TRY(get_int(obj, where, "n_positions", &c->max_position_embeddings));
    c->intermediate_size = 4 * c->hidden_size;
    MR_TRY(get_int(obj, where, "n_inner", &c->intermediate_size));
    MR_TRY(get_num(obj, where, "layer_norm_epsilon", &c->layer_norm_epsilon));
    c->num_key_value_heads = c->num_attention_heads;
    int tie = 1;
    MR_TRY(get_bool(obj, where, "tie_word_embeddings", &tie));
    if (!tie)
      return mr_error_set(MR_EJOB, "%s: tie_word_embeddings: GPT-2's lm_head "
                          "is always tied to transformer.wte", where);
  }
  MR_TRY(get_num(obj, where, "initializer_range", &c->initializer_range));
  MR_TRY(positive(where, "vocab_size", c->vocab_size));
  MR_TRY(positive(where, c->family ? "n_embd" : "hidden_size", c->hidden_size));
  MR_TRY(positive(where, c->family ? "n_inner" : "intermediate_size",
                  c->intermediate_size));
  MR_TRY(positive(where, c->family ? "n_layer" : "num_hidden_layers",
                  c->num_hidden_layers));
  MR_TRY(positive(where, c->family ? "n_head" : "num_attention_heads",
                  c->num_attention_heads));
  MR_TRY(positive(where, "num_key_value_heads", c->num_key_value_heads));
  MR_TRY(positive(where, c->family ? "n_positions" : "max_position_embeddings",
                  c->max_position_embeddings));
  if (c->hidden_size % c->num_attention_heads)
    return mr_error_set(MR_EJOB, "%s: %s: %lld heads do not divide the hidden "
                        "size %lld", where,
                        c->family ? "n_head" : "num_attention_heads",
                        (long long)c->num_attention_heads,
                        (long long)c->hidden_size);
  if (c->num_attention_heads % c->num_key_value_heads)
    return mr_error_set(MR_EJOB, "%s: num_key_value_heads: %lld does not "
                        "divide num_attention_heads %lld", where,
                        (long long)c->num_key_value_heads,
                        (long long)c->num_attention_heads);
  if ((c->hidden_size / c->num_attention_heads) % 2)
    return mr_error_set(MR_EJOB, "%s: head dimension %lld is odd; rotary "
                        "embeddings need it even", where,
                        (long long)(c->hidden_size / c->num_attention_heads));
  if (!(c->rms_norm_eps >= 0) || !(c->layer_norm_epsilon >= 0) ||
      !(c->initializer_range >= 0) ||
      (c->family == MR_MODEL_LLAMA && !(c->rope_theta > 0)))
    return mr_error_set(MR_EJOB, "%s: eps, initializer_range and rope_theta "
                        "must be non-negative (rope_theta positive)", where);
  return 0;
}

int mr_model_config_load(const char *path, struct mr_model_config *out) {
  FILE *f = fopen(path, "rb");
  if (!f)
    return mr_error_set(mr_from_errno(errno), "%s: cannot open: %s", path,
                        strerror(errno));
  char *text = NULL;
  size_t len = 0, cap = 0;
  for (;;) {
    if (len + 4096 > cap) {
      cap = cap ? 2 * cap : 8192;
      char *t = realloc(text, cap + 1);
      if (!t) {
        free(text);
        fclose(f);
        return MR_ENOMEM;
      }
      text = t;
    }
    size_t n = fread(text + len, 1, cap - len, f);
    len += n;
    if (n == 0)
      break;
  }
  fclose(f);
  text[len] = 0;
  cJSON *obj = cJSON_ParseWithLength(text, len);
  free(text);
  if (!obj)
    return mr_error_set(MR_EJOB, "%s: not valid JSON", path);
  int rc = mr_model_config_parse(obj, path, out);
  cJSON_Delete(obj);
  return rc;
}

char *mr_model_config_to_json(const struct mr_model_config *c) {
  cJSON *o = cJSON_CreateObject();
  if (!o)
    return NULL;
  cJSON *arch = cJSON_AddArrayToObject(o, "architectures");
  int g = c->family == MR_MODEL_GPT2;
  cJSON_AddItemToArray(arch, cJSON_CreateString(g ? "GPT2LMHeadModel"
                                                  : "LlamaForCausalLM"));
  cJSON_AddStringToObject(o, "model_type", g ? "gpt2" : "llama");
  cJSON_AddNumberToObject(o, "vocab_size", (double)c->vocab_size);
  cJSON_AddNumberToObject(o, "initializer_range", c->initializer_range);
  if (g) {
    cJSON_AddNumberToObject(o, "n_embd", (double)c->hidden_size);
    cJSON_AddNumberToObject(o, "n_layer", (double)c->num_hidden_layers);
    cJSON_AddNumberToObject(o, "n_head", (double)c->num_attention_heads);
    cJSON_AddNumberToObject(o, "n_positions", (double)c->max_position_embeddings);
    cJSON_AddNumberToObject(o, "n_inner", (double)c->intermediate_size);
    cJSON_AddNumberToObject(o, "layer_norm_epsilon", c->layer_norm_epsilon);
  } else {
    cJSON_AddNumberToObject(o, "hidden_size", (double)c->hidden_size);
    cJSON_AddNumberToObject(o, "intermediate_size", (double)c->intermediate_size);
    cJSON_AddNumberToObject(o, "num_hidden_layers", (double)c->num_hidden_layers);
    cJSON_AddNumberToObject(o, "num_attention_heads",
                            (double)c->num_attention_heads);
    cJSON_AddNumberToObject(o, "num_key_value_heads",
                            (double)c->num_key_value_heads);
    cJSON_AddNumberToObject(o, "max_position_embeddings",
                            (double)c->max_position_embeddings);
    cJSON_AddNumberToObject(o, "rms_norm_eps", c->rms_norm_eps);
    cJSON_AddNumberToObject(o, "rope_theta", c->rope_theta);
    cJSON_AddBoolToObject(o, "tie_word_embeddings", c->tie_word_embeddings);
  }
  char *s = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  return s;
}

int64_t mr_model_head_dim(const struct mr_model_config *c) {
  return c->num_attention_heads ? c->hidden_size / c->num_attention_heads : 0;
}

int64_t mr_model_param_count(const struct mr_model_config *c) {
  int64_t C = c->hidden_size, V = c->vocab_size, I = c->intermediate_size;
  int64_t L = c->num_hidden_layers, D = mr_model_head_dim(c);
  if (c->family == MR_MODEL_GPT2)
    return V * C + c->max_position_embeddings * C +
           L * (4 * C + C * 3 * C + 3 * C + C * C + C + C * I + I + I * C + C) +
           2 * C;
  int64_t kv = c->num_key_value_heads * D;
  int64_t layer = 2 * C + C * C * 2 + 2 * C * kv + 3 * C * I;
  return V * C * (c->tie_word_embeddings ? 1 : 2) + L * layer + C;
}
