/* gpu_spec.c - a GPU machine's measurements written as a cluster spec. */
#include "worker/gpu_spec.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/configs.h"
#include "common/error.h"
#include "common/file.h"

static char *slurp(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f == NULL)
    return NULL;
  char *buf = NULL;
  size_t n = 0, cap = 0;
  for (;;) {
    if (n + 4096 + 1 > cap) {
      cap = (n + 4096 + 1) * 2;
      char *b = realloc(buf, cap);
      if (b == NULL) {
        free(buf);
        fclose(f);
        return NULL;
      }
      buf = b;
    }
    size_t r = fread(buf + n, 1, 4096, f);
    n += r;
    if (r < 4096)
      break;
  }
  fclose(f);
  buf[n] = '\0';
  return buf;
}

static void set_num(cJSON *obj, const char *key, double v) {
  cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
  if (item != NULL && cJSON_IsNumber(item))
    cJSON_SetNumberValue(item, v);
  else
    cJSON_AddNumberToObject(obj, key, v);
}

static void set_str(cJSON *obj, const char *key, const char *v) {
  if (cJSON_GetObjectItemCaseSensitive(obj, key) != NULL)
    cJSON_ReplaceItemInObjectCaseSensitive(obj, key, cJSON_CreateString(v));
  else
    cJSON_AddStringToObject(obj, key, v);
}

int mr_gpu_spec_write(const struct mr_gpu_probe *p, const char *out) {
  const char *base = "h100-sxm-node";
  if (strstr(p->name, "H200") != NULL)
    base = "h200-sxm-node";
  else if (strstr(p->name, "A100") != NULL)
    base = "a100-80g-node";
  char base_path[4096];
  MR_TRY(mr_configs_cluster_path(base, base_path, sizeof base_path));
  char *text = slurp(base_path);
  if (text == NULL)
    return mr_error_set(MR_ENOENT, "gpu probe: cannot read the base spec %s", base_path);
  cJSON *root = cJSON_Parse(text);
  free(text);
  cJSON *dev = root ? cJSON_GetObjectItemCaseSensitive(root, "device") : NULL;
  cJSON *intra = root ? cJSON_GetObjectItemCaseSensitive(root, "intra_node") : NULL;
  cJSON *hostl = root ? cJSON_GetObjectItemCaseSensitive(root, "host") : NULL;
  cJSON *peak = dev ? cJSON_GetObjectItemCaseSensitive(dev, "peak_flops") : NULL;
  cJSON *bf16 = peak ? cJSON_GetObjectItemCaseSensitive(peak, "bf16") : NULL;
  if (!cJSON_IsObject(dev) || !cJSON_IsObject(intra) || !cJSON_IsObject(hostl) ||
      !cJSON_IsNumber(bf16)) {
    cJSON_Delete(root);
    return mr_error_set(MR_EFORMAT, "%s: expected device.peak_flops.bf16, intra_node "
                        "and host objects", base_path);
  }
  char host[256] = "host", date[32] = "", buf[1024];
  gethostname(host, sizeof host - 1);
  host[sizeof host - 1] = '\0';
  time_t now = time(NULL);
  struct tm tm;
  strftime(date, sizeof date, "%Y-%m-%d", gmtime_r(&now, &tm));
  snprintf(buf, sizeof buf, "measured-%.200s", host);
  set_str(root, "name", buf);
  snprintf(buf, sizeof buf, "Measured by meshrun-gpu-probe on %.200s, %s: %d x %s; "
           "what was not measured comes from %s.json", host, date, p->devices, p->name,
           base);
  set_str(root, "source", buf);
  set_num(root, "nodes", 1);
  set_num(root, "devices_per_node", p->devices);
  set_str(dev, "name", p->name);
  if (p->memory_bytes > 0)
    set_num(dev, "memory_bytes", p->memory_bytes);
  if (p->d2d_bandwidth > 0)
    set_num(dev, "memory_bandwidth", p->d2d_bandwidth);
  double eff = p->matmul_flops_bf16 / bf16->valuedouble;
  if (p->matmul_flops_bf16 > 0 && eff > 0)
    set_num(dev, "matmul_efficiency", eff < 1 ? eff : 1.0);
  snprintf(buf, sizeof buf, "measured: memory %.1f GB, device copy %.0f GB/s (read + "
           "write), best bf16 GEMM %.0f TFLOP/s (efficiency against the datasheet "
           "peak), fp32 GEMM %.1f TFLOP/s; peak_flops and the rest from %s.json",
           p->memory_bytes / 1e9, p->d2d_bandwidth / 1e9, p->matmul_flops_bf16 / 1e12,
           p->matmul_flops_fp32 / 1e12, base);
  set_str(dev, "source", buf);
  if (p->devices > 1 && p->allreduce_bus_bw > 0) {
    set_num(intra, "bus_bandwidth", p->allreduce_bus_bw);
    if (p->allreduce_latency > 0)
      set_num(intra, "latency", p->allreduce_latency);
    snprintf(buf, sizeof buf, "measured: NCCL AllReduce over %d GPUs, busbw %.0f GB/s "
             "at 64 MiB (nccl-tests' definition), %.1f us per ring step at 4 KiB",
             p->devices, p->allreduce_bus_bw / 1e9, p->allreduce_latency * 1e6);
    set_str(intra, "source", buf);
  }
  double link = p->h2d_bandwidth < p->d2h_bandwidth ? p->h2d_bandwidth : p->d2h_bandwidth;
  if (link > 0) {
    set_num(hostl, "link_bandwidth", link);
    snprintf(buf, sizeof buf, "measured: page-locked copies %.1f GB/s to and %.1f GB/s "
             "from device 0; host memory bandwidth from %s.json",
             p->h2d_bandwidth / 1e9, p->d2h_bandwidth / 1e9, base);
    set_str(hostl, "source", buf);
  }
  char *json = cJSON_Print(root);
  cJSON_Delete(root);
  if (json == NULL)
    return mr_error_set(MR_ENOMEM, "gpu probe: out of memory");
  int rc = mr_file_write_text(out, json, MR_FILE_NEWLINE);
  free(json);
  return rc;
}
