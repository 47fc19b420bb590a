/* export.h - `meshrun export CKPT --out DIR`: writes a Hugging Face model
 * directory (config.json, model.safetensors) from a complete checkpoint.
 * Returns the exit code: 0, 1 on I/O failure, 2 on bad usage or a
 * checkpoint that is incomplete or corrupt. */
#ifndef MR_EXPORT_H
#define MR_EXPORT_H

int mr_cmd_export(int argc, char **argv);

#endif
