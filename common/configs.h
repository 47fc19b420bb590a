/* configs.h - the configs/ folder shipped with meshrun (model configs,
 * cluster specs): where it is, and the spec file a cluster name names. */
#ifndef MR_CONFIGS_H
#define MR_CONFIGS_H

/* The file a cluster NAME names: NAME itself when it has a '/' or ends in
 * .json, else configs/clusters/NAME.json ($MESHRUN_CONFIGS_DIR, or configs/
 * beside the binary or above its build folder).  Writes into path; returns
 * 0, or MR_ENOENT after printing why (for a NAME that is not there, with
 * the names that are). */
int mr_configs_cluster_path(const char *name, char *path, unsigned long n);

#endif
