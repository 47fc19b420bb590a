/* plugin.c - the host registration table, and loading a plugin with it. */
#include "compiler/plugin.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dl.h"
#include "common/error.h"

void mr_plugin_api_init(struct mr_plugin_api *api) {
  memset(api, 0, sizeof *api);
  api->version = MR_PLUGIN_API_VERSION;
  api->op_register = mr_op_register;
  api->op_set_kernel = mr_op_set_kernel;
  api->op_def = mr_op_def;
  api->op_kind_by_name = mr_op_kind_by_name;
  api->graph_op = mr_graph_op;
  api->graph_op_into = mr_graph_op_into;
  api->error_set = mr_error_set;
}

int mr_plugin_load(const char *path, const struct mr_plugin_api *api) {
  mr_plugin_init_fn init;
  void (*fn)(void);
  MR_TRY(mr_dl_function(path, MR_PLUGIN_INIT_SYMBOL, &fn));
  init = (mr_plugin_init_fn)fn;
  /* the plugin keeps the table (its gradient builders call through it
   * later): give it a copy that lives as long as the plugin */
  struct mr_plugin_api *kept = malloc(sizeof *kept);
  if (!kept)
    return mr_error_set(MR_ENOMEM, "plugin %s: out of memory", path);
  *kept = *api;
  int rc = init(kept);
  if (rc < 0) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", mr_error_message());
    return mr_error_set(rc, "plugin %s: init failed: %s", path, msg);
  }
  return 0;
}
