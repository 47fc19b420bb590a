/* weights.h - a model's parameters in and out of the executor: seeded
 * initialization, loading a safetensors checkpoint (Hugging Face names and
 * layouts), writing one with the model config in its metadata. */
#ifndef MR_WEIGHTS_H
#define MR_WEIGHTS_H

#include <stdint.h>

#include "compiler/model.h"
#include "common/safetensors.h"
#include "worker/exec.h"

/* Fills every parameter of m in x from its init kind: N(0, std) with
 * element i = std * mr_rng_normal(seed, mr_hash_str(name), i) (a pure
 * function of seed, name and global index, so any sharding reproduces the
 * same weights), ones, or zeros. */
void mr_weights_init(const struct mr_model *m, struct mr_exec *x, uint64_t seed);

/* Weights as the hub ships them: a .safetensors file; a folder holding
 * model.safetensors; or a folder holding model.safetensors.index.json and
 * the shards it names (opened on first use).  A tensor is found under its
 * meshrun (Hugging Face) name or the same without, or with, the base
 * model's prefix ("transformer." for GPT-2, "model." for LLaMA), as
 * checkpoints of the bare base model (GPT2Model, LlamaModel) name them. */
struct mr_weights_src {
  char *dir;                 // the folder (sharded), or NULL
  struct mr_st_file *single; // one file, or NULL when sharded
  struct mr_st_index *index; // sharded: tensor -> shard
  struct mr_st_file **shards;
  char **shard_names;
  int n_shards;
};

/* Opens path (any of the three forms).  A missing file, a malformed index
 * or a shard name that is not a file in the folder is an error naming the
 * file. */
int mr_weights_src_open(const char *path, struct mr_weights_src *s);
void mr_weights_src_close(struct mr_weights_src *s);

/* The tensor of parameter `name` (aliases as above) and the file holding
 * it, or MR_EFORMAT "FILE: tensor NAME: missing". */
int mr_weights_src_find(struct mr_weights_src *s, const char *name,
                        const struct mr_st_tensor **t, struct mr_st_file **f);

/* Loads every parameter from path (mr_weights_src_open's forms).  Any float
 * dtype converts to float32.  A tensor
 * missing or of the wrong shape is MR_EFORMAT naming the file and tensor;
 * tensors the model does not have (lm_head.weight of a tied model,
 * attention mask buffers) are ignored. */
int mr_weights_load(const struct mr_model *m, struct mr_exec *x,
                    const char *path);

/* Writes every parameter as float32 safetensors under its Hugging Face
 * name, with __metadata__ {"format": "pt", "config": config.json text}. */
int mr_weights_save(const struct mr_model *m, const struct mr_exec *x,
                    const char *path);

/* The same from data[t], the values of every parameter t of graph g (the
 * rest of data unread), with cfg as the config. */
int mr_weights_write(const struct mr_graph *g, const struct mr_model_config *cfg,
                     float *const *data, const char *path);

/* Whether file tensor s has the shape Hugging Face files give parameter t
 * (mr_tensor_file_shape). */
int mr_weights_file_matches(const struct mr_st_tensor *s, const struct mr_tensor *t);

/* The model config of path: the one mr_weights_save stored in a file's
 * metadata, or a folder's config.json (what meshrun export writes, and
 * Hugging Face models ship). */
int mr_weights_read_config(const char *path, struct mr_model_config *cfg);

#endif
