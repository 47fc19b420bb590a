/* cluster.c - reading cluster specs. */
#include "compiler/planner/cluster.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/jsonv.h"

/* A required positive number at PATH.KEY. */
static void need_num(struct mr_jv *jv, const cJSON *o, const char *path, const char *key,
                     double min, double max, double *out) {
  if (mr_jv_num(jv, o, path, key, min, max, out) == 0)
    mr_jv_error(jv, path, key, "missing (a number in [%g, %g])", min, max);
}

static const cJSON *need_obj(struct mr_jv *jv, const cJSON *o, const char *key) {
  const cJSON *sub = NULL;
  if (mr_jv_obj(jv, o, "", key, &sub) == 0)
    mr_jv_error(jv, "", key, "missing (an object)");
  return sub;
}

int mr_cluster_parse(const cJSON *obj, const char *file, struct mr_cluster *out) {
  memset(out, 0, sizeof *out);
  struct mr_jv jv;
  mr_jv_init(&jv, file);
  if (!cJSON_IsObject(obj)) {
    mr_jv_error(&jv, "", NULL, "expected a JSON object (a cluster spec)");
    goto done;
  }
  static const char *const keys[] = {"name", "nodes", "devices_per_node", "device",
                                     "intra_node", "inter_node", "host", "source",
                                     "notes", NULL};
  mr_jv_only_keys(&jv, obj, "", keys);
  const char *name = NULL;
  if (mr_jv_str(&jv, obj, "", "name", &name) == 1)
    snprintf(out->name, sizeof out->name, "%s", name);
  else if (cJSON_GetObjectItemCaseSensitive(obj, "name") == NULL)
    mr_jv_error(&jv, "", "name", "missing (a string)");
  int64_t v = 1;
  mr_jv_int(&jv, obj, "", "nodes", 1, 1 << 20, &v);
  out->nodes = (int)v;
  if (mr_jv_int(&jv, obj, "", "devices_per_node", 1, 4096, &v) == 1)
    out->devices_per_node = (int)v;
  else if (cJSON_GetObjectItemCaseSensitive(obj, "devices_per_node") == NULL)
    mr_jv_error(&jv, "", "devices_per_node", "missing (a positive integer)");

  const cJSON *d = need_obj(&jv, obj, "device");
  if (d != NULL) {
    static const char *const dk[] = {"name", "peak_flops", "matmul_efficiency",
                                     "gemm_half_dim", "memory_bytes", "memory_bandwidth",
                                     "reserved_bytes", "source", NULL};
    mr_jv_only_keys(&jv, d, "device", dk);
    const cJSON *pf = NULL;
    if (mr_jv_obj(&jv, d, "device", "peak_flops", &pf) == 1) {
      static const char *const pk[] = {"fp32", "bf16", "fp16", "source", NULL};
      mr_jv_only_keys(&jv, pf, "device.peak_flops", pk);
      need_num(&jv, pf, "device.peak_flops", "fp32", 1, 1e18, &out->peak_flops[MR_AMP_FP32]);
      need_num(&jv, pf, "device.peak_flops", "bf16", 1, 1e18, &out->peak_flops[MR_AMP_BF16]);
      need_num(&jv, pf, "device.peak_flops", "fp16", 1, 1e18, &out->peak_flops[MR_AMP_FP16]);
    } else if (cJSON_GetObjectItemCaseSensitive(d, "peak_flops") == NULL) {
      mr_jv_error(&jv, "device", "peak_flops", "missing (an object with fp32, bf16, fp16)");
    }
    need_num(&jv, d, "device", "matmul_efficiency", 0.01, 1, &out->matmul_efficiency);
    need_num(&jv, d, "device", "gemm_half_dim", 0, 1e6, &out->gemm_half_dim);
    need_num(&jv, d, "device", "memory_bytes", 1e6, 1e15, &out->memory_bytes);
    need_num(&jv, d, "device", "memory_bandwidth", 1e6, 1e15, &out->memory_bandwidth);
    need_num(&jv, d, "device", "reserved_bytes", 0, 1e15, &out->reserved_bytes);
    if (out->reserved_bytes >= out->memory_bytes && out->memory_bytes > 0)
      mr_jv_error(&jv, "device", "reserved_bytes",
                  "expected less than device.memory_bytes (%g), got %g", out->memory_bytes,
                  out->reserved_bytes);
  }
  const cJSON *in = need_obj(&jv, obj, "intra_node");
  if (in != NULL) {
    static const char *const ik[] = {"bus_bandwidth", "latency", "source", NULL};
    mr_jv_only_keys(&jv, in, "intra_node", ik);
    need_num(&jv, in, "intra_node", "bus_bandwidth", 1e3, 1e15, &out->intra_bus_bandwidth);
    need_num(&jv, in, "intra_node", "latency", 0, 1, &out->intra_latency);
  }
  const cJSON *ex = need_obj(&jv, obj, "inter_node");
  if (ex != NULL) {
    static const char *const ek[] = {"bandwidth", "latency", "source", NULL};
    mr_jv_only_keys(&jv, ex, "inter_node", ek);
    need_num(&jv, ex, "inter_node", "bandwidth", 1e3, 1e15, &out->inter_bandwidth);
    need_num(&jv, ex, "inter_node", "latency", 0, 1, &out->inter_latency);
  }
  const cJSON *h = need_obj(&jv, obj, "host");
  if (h != NULL) {
    static const char *const hk[] = {"link_bandwidth", "memory_bandwidth", "is_device", "source",
                                     NULL};
    mr_jv_only_keys(&jv, h, "host", hk);
    need_num(&jv, h, "host", "link_bandwidth", 1e3, 1e15, &out->host_link_bandwidth);
    need_num(&jv, h, "host", "memory_bandwidth", 1e3, 1e15, &out->host_memory_bandwidth);
    mr_jv_bool(&jv, h, "host", "is_device", &out->host_is_device); /* optional, false */
  }
done:;
  int rc = 0;
  if (jv.n_errors > 0)
    rc = mr_error_set(MR_EFORMAT, "%s", jv.errors);
  mr_jv_close(&jv);
  return rc;
}

int mr_cluster_share_host(struct mr_cluster *c, int world) {
  if (c->nodes != 1 || !c->host_is_device)
    return 0;
  if (world > c->devices_per_node) {
    double share = (double)c->devices_per_node / (double)world;
    for (int i = 0; i < 3; i++)
      c->peak_flops[i] *= share;
    c->memory_bandwidth *= share;
    c->host_memory_bandwidth *= share;
    c->host_link_bandwidth *= share;
    c->memory_bytes *= share;
    c->devices_per_node = world;
  }
  return 1;
}

int64_t mr_cluster_devices(const struct mr_cluster *c) {
  return (int64_t)c->nodes * c->devices_per_node;
}
