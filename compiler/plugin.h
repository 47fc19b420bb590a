/* plugin.h - loading shared objects that add ops: `--plugin lib.so`.
 *
 * A plugin exports one function, meshrun_plugin_init, which receives a
 * table of the host's registration functions and calls them: a new op
 * kind (its row: shape inference, gradient builder, costs and SPMD rule,
 * the counterpart of Paddle's register_spmd_rule), its kernels per
 * backend and, to put its op into the models meshrun builds, a pass over the
 * forward graph (a fusion through graph_fuse).  The table is all a plugin
 * needs of the host, so it links against nothing of meshrun's and the host
 * exports no symbols.
 *
 * A job names its plugins ("plugins": [...]); launch and plan load them
 * before planning and every worker before it lowers its program, so all
 * of them build the same graph.  Version 2 added graph_fuse and
 * pass_register at the end of the table: a version-1 plugin loads
 * unchanged. */
#ifndef MR_PLUGIN_H
#define MR_PLUGIN_H

#include "compiler/graph.h"
#include "compiler/ops.h"

#define MR_PLUGIN_API_VERSION 2
#define MR_PLUGIN_INIT_SYMBOL "meshrun_plugin_init"

struct mr_job;
struct mr_model_pass;
struct mr_spmd_rule;

struct mr_plugin_api {
  int version;                   // MR_PLUGIN_API_VERSION
  int (*op_register)(const struct mr_op_def *def);
  void (*op_set_kernel)(int kind, enum mr_backend_kind backend, mr_kernel_fn fn);
  const struct mr_op_def *(*op_def)(int kind);
  int (*op_kind_by_name)(const char *name);
  /* for gradient builders: append ops, find tensors */
  int (*graph_op)(struct mr_graph *g, int kind, const char *name, const int *in,
                  int n_in, const double *attr, int *out_ids);
  int (*graph_op_into)(struct mr_graph *g, int kind, const int *in, int n_in,
                       const double *attr, const int *out, int n_out);
  int (*error_set)(int code, const char *fmt, ...);
  int (*spmd_rule_register)(const struct mr_spmd_rule *rule);
  /* version 2: mr_graph_fuse and mr_model_pass_register */
  int (*graph_fuse)(struct mr_graph *g, const int *ops, int n_ops, int kind, const int *in,
                    int n_in, const double *attr, const int *out, int n_out);
  int (*pass_register)(const struct mr_model_pass *pass);
};

/* The plugin's entry point: registers its ops; returns 0 or a negative
 * MR_E* code (with error_set's message). */
typedef int (*mr_plugin_init_fn)(const struct mr_plugin_api *api);

/* Fills api with the compiler's registration functions. */
void mr_plugin_api_init(struct mr_plugin_api *api);

/* Loads the shared object at path and runs its init with a copy of api
 * (the plugin may keep the pointer).  The object and the copy stay for the
 * life of the process.  Returns 0, MR_ENOENT (cannot
 * be loaded, with dlerror's text), MR_EINVAL (no meshrun_plugin_init) or
 * the init's error, each message naming the path. */
int mr_plugin_load(const char *path, const struct mr_plugin_api *api);

/* Loads the job's plugins with the compiler's table, each path once per
 * process (a second call, a re-plan's, loads nothing again).  Returns 0
 * or mr_plugin_load's error, its message naming the job file and the
 * field (`job.json: plugins[0]: plugin ...: ...`). */
int mr_plugin_load_job(const struct mr_job *job);

#endif
