/* configs.c - finding the configs/ folder shipped with meshrun. */
#include "common/configs.h"

#include <dirent.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/tunable.h"

static int is_dir(const char *p) {
  struct stat st;
  return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* configs/: $MESHRUN_CONFIGS_DIR, else beside the binary, in the source
 * tree above a build folder, or in share/meshrun. */
static int find_configs(char *buf, size_t n) {
  const char *env = mr_tunable_str(MR_TUNABLE_CONFIGS_DIR);
  if (env != NULL && env[0] != '\0') {
    snprintf(buf, n, "%s", env);
    return 0;
  }
  char self[PATH_MAX];
  ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0)
    return -1;
  self[len] = '\0';
  char *slash = strrchr(self, '/');
  if (slash == NULL)
    return -1;
  *slash = '\0';
  static const char *const rel[] = {"configs", "../configs", "../../configs",
                                    "../share/meshrun/configs", NULL};
  for (int i = 0; rel[i] != NULL; i++) {
    char probe[PATH_MAX + 64];
    snprintf(probe, sizeof probe, "%s/%s/clusters", self, rel[i]);
    if (is_dir(probe)) {
      size_t pl = strlen(probe) - strlen("/clusters");
      if (pl + 1 > n)
        return -1;
      memcpy(buf, probe, pl);
      buf[pl] = '\0';
      return 0;
    }
  }
  return -1;
}

/* NAME.json, not hidden */
static int is_spec(const struct dirent *e) {
  size_t n = strlen(e->d_name);
  return e->d_name[0] != '.' && n > 5 && strcmp(e->d_name + n - 5, ".json") == 0;
}

int mr_configs_cluster_path(const char *name, char *path, unsigned long n) {
  if (strchr(name, '/') != NULL || strstr(name, ".json") != NULL) {
    snprintf(path, n, "%s", name);
    return 0;
  }
  char dir[PATH_MAX];
  if (find_configs(dir, sizeof dir) < 0) {
    fprintf(stderr, "meshrun: cluster %s: cannot find the configs folder; set "
            "MESHRUN_CONFIGS_DIR or give a path\n", name);
    return MR_ENOENT;
  }
  snprintf(path, n, "%s/clusters/%s.json", dir, name);
  if (access(path, F_OK) == 0)
    return 0;
  /* a name that is not there: say which are, sorted */
  char list[1024] = "", folder[PATH_MAX + 16];
  snprintf(folder, sizeof folder, "%s/clusters", dir);
  struct dirent **specs = NULL;
  int count = scandir(folder, &specs, is_spec, alphasort);
  for (int i = 0; i < count; i++) {
    snprintf(list + strlen(list), sizeof list - strlen(list), "%s%.*s", i ? ", " : "",
             (int)strlen(specs[i]->d_name) - 5, specs[i]->d_name);
    free(specs[i]);
  }
  free(specs);
  fprintf(stderr, "meshrun: cluster %s: no spec %s; the specs there: %s (or give a spec "
          "file's path)\n", name, path, count > 0 ? list : "none");
  return MR_ENOENT;
}
