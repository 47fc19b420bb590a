/* plugin.c - the host registration table, and loading a plugin with it. */
#include "compiler/plugin.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dl.h"
#include "common/error.h"
#include "common/job.h"
#include "compiler/model.h"
#include "compiler/spmd/rules.h"

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
  api->spmd_rule_register = mr_spmd_rule_register;
  api->graph_fuse = mr_graph_fuse;
  api->pass_register = mr_model_pass_register;
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

/* the paths loaded so far, so a re-plan does not register twice */
enum { MAX_LOADED = 64 };
static char *loaded[MAX_LOADED];
static int n_loaded;

static int was_loaded(const char *path) {
  for (int i = 0; i < n_loaded; i++)
    if (strcmp(loaded[i], path) == 0)
      return 1;
  return 0;
}

int mr_plugin_load_job(const struct mr_job *job) {
  struct mr_plugin_api api;
  mr_plugin_api_init(&api);
  for (int i = 0; i < job->n_plugins; i++) {
    const char *path = job->plugins[i];
    if (was_loaded(path))
      continue;
    if (n_loaded == MAX_LOADED)
      return mr_error_set(MR_ENOMEM, "%s: plugins[%d]: more than %d plugins in one process",
                          job->path, i, MAX_LOADED);
    int rc = mr_plugin_load(path, &api);
    if (rc < 0)
      return mr_error_set(rc, "%s: plugins[%d]: %s", job->path, i, mr_error_of(rc));
    loaded[n_loaded] = strdup(path);
    if (loaded[n_loaded] == NULL)
      return mr_error_set(MR_ENOMEM, "%s: plugins[%d]: out of memory", job->path, i);
    n_loaded++;
  }
  return 0;
}
