/* ckpt.c - checkpoint folders, completion markers, verification. */
#include "common/ckpt.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/file.h"
#include "common/jsonv.h"
#include "common/log.h"
#include "common/checksum.h"

void mr_ckpt_step_dir(const char *root, int64_t step, char *buf, size_t n) {
  snprintf(buf, n, "%s/step-%08" PRId64, root, step);
}

int mr_ckpt_write_marker(const char *dir, int64_t step, const char *const *files,
                         const char *const *checksum, int n) {
  cJSON *o = cJSON_CreateObject();
  cJSON_AddNumberToObject(o, "step", (double)step);
  cJSON_AddStringToObject(o, "checksum", MR_CHECKSUM_NAME);
  cJSON *arr = cJSON_AddArrayToObject(o, "files");
  for (int i = 0; i < n; i++) {
    cJSON *f = cJSON_CreateObject();
    cJSON_AddStringToObject(f, "name", files[i]);
    cJSON_AddStringToObject(f, "checksum", checksum[i]);
    cJSON_AddItemToArray(arr, f);
  }
  char *text = cJSON_Print(o);
  cJSON_Delete(o);
  if (text == NULL)
    return MR_ENOMEM;
  char final[4200];
  snprintf(final, sizeof final, "%s/%s", dir, MR_CKPT_MARKER);
  int rc = mr_file_write_text(final, text, MR_FILE_ATOMIC | MR_FILE_DURABLE);
  free(text);
  return rc;
}

int mr_ckpt_verify(const char *dir, int64_t *step) {
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", dir, MR_CKPT_MARKER);
  if (access(path, F_OK) != 0)
    return mr_error_set(MR_ENOENT, "%s: no completion marker (an interrupted save)", dir);
  cJSON *o;
  if (mr_json_load(path, &o) < 0)
    return mr_error_set(MR_EFORMAT, "%s", mr_error_message());
  int rc = 0;
  const cJSON *st = cJSON_GetObjectItemCaseSensitive(o, "step");
  const cJSON *files = cJSON_GetObjectItemCaseSensitive(o, "files");
  const cJSON *algo = cJSON_GetObjectItemCaseSensitive(o, "checksum");
  int64_t step_at = 0;
  if (!mr_json_count(st, INT64_C(1) << 53, &step_at) || !cJSON_IsArray(files) ||
      !cJSON_IsString(algo) ||
      strcmp(algo->valuestring, MR_CHECKSUM_NAME) != 0) {
    rc = mr_error_set(MR_EFORMAT, "%s: expected {step, checksum: \"%s\", files}", path,
                      MR_CHECKSUM_NAME);
    goto out;
  }
  const cJSON *f;
  cJSON_ArrayForEach(f, files) {
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(f, "name");
    const cJSON *sum = cJSON_GetObjectItemCaseSensitive(f, "checksum");
    if (!cJSON_IsString(name) || !cJSON_IsString(sum) || strchr(name->valuestring, '/')) {
      rc = mr_error_set(MR_EFORMAT, "%s: a file entry lacks a plain name or checksum", path);
      goto out;
    }
    char fp[4300], hex[MR_CHECKSUM_HEX];
    snprintf(fp, sizeof fp, "%s/%s", dir, name->valuestring);
    if (mr_checksum_file(fp, hex) < 0) {
      rc = mr_error_set(MR_EFORMAT, "%s: missing or unreadable", fp);
      goto out;
    }
    if (strcmp(hex, sum->valuestring) != 0) {
      rc = mr_error_set(MR_EFORMAT, "%s: checksum mismatch (the file is corrupt)", fp);
      goto out;
    }
  }
  if (step != NULL)
    *step = step_at;
out:
  cJSON_Delete(o);
  return rc;
}

/* Steps of the step-* folders under root, newest first. */
static int list_steps(const char *root, int64_t **out) {
  DIR *d = opendir(root);
  if (d == NULL)
    return 0;
  int n = 0, cap = 16;
  int64_t *steps = malloc((size_t)cap * sizeof *steps);
  struct dirent *e;
  while (steps != NULL && (e = readdir(d)) != NULL) {
    char *end;
    if (strncmp(e->d_name, "step-", 5) != 0)
      continue;
    long long s = strtoll(e->d_name + 5, &end, 10);
    if (*end != '\0' || s < 0)
      continue;
    if (n == cap) {
      int64_t *ns = realloc(steps, (size_t)(cap *= 2) * sizeof *steps);
      if (ns == NULL)
        break;
      steps = ns;
    }
    steps[n++] = s;
  }
  closedir(d);
  for (int i = 1; i < n; i++) /* insertion sort, descending */
    for (int j = i; j > 0 && steps[j] > steps[j - 1]; j--) {
      int64_t t = steps[j];
      steps[j] = steps[j - 1];
      steps[j - 1] = t;
    }
  *out = steps;
  return steps != NULL ? n : 0;
}

int mr_ckpt_find_latest(const char *root, char *dir_out, size_t n, int64_t *step) {
  int64_t *steps = NULL;
  int count = list_steps(root, &steps);
  int found = 0, corrupt = 0;
  char newest_corrupt[4096 + 600] = "";
  for (int i = 0; i < count && !found; i++) {
    char dir[4096];
    mr_ckpt_step_dir(root, steps[i], dir, sizeof dir);
    int64_t s;
    int rc = mr_ckpt_verify(dir, &s);
    if (rc == 0) {
      snprintf(dir_out, n, "%s", dir);
      *step = s;
      found = 1;
    } else {
      MR_WARN("ckpt", "skipping checkpoint %s: %s", dir, mr_error_of(rc));
      if (rc != MR_ENOENT && corrupt++ == 0) /* complete once, damaged since */
        snprintf(newest_corrupt, sizeof newest_corrupt, "%s", mr_error_of(rc));
    }
  }
  free(steps);
  if (!found && corrupt > 0) /* starting over would throw their steps away */
    return mr_error_set(MR_EFORMAT, "%s: none of its %d complete checkpoint%s is intact (the "
                        "newest: %s); starting over from step 1 would discard %s: move %s "
                        "aside, or set another checkpoint.dir", root, corrupt,
                        corrupt == 1 ? "" : "s", newest_corrupt, corrupt == 1 ? "it" : "them",
                        corrupt == 1 ? "it" : "them");
  return found;
}

static void remove_tree(const char *dir) {
  DIR *d = opendir(dir);
  struct dirent *e;
  while (d != NULL && (e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
      continue;
    char p[4400];
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    unlink(p);
  }
  if (d != NULL)
    closedir(d);
  rmdir(dir);
}

int mr_ckpt_prune(const char *root, int keep_last) {
  int64_t *steps = NULL;
  int count = list_steps(root, &steps);
  int complete = 0, removed = 0;
  for (int i = 0; i < count; i++) {
    char dir[4096], marker[4200];
    mr_ckpt_step_dir(root, steps[i], dir, sizeof dir);
    snprintf(marker, sizeof marker, "%s/%s", dir, MR_CKPT_MARKER);
    int has_marker = access(marker, F_OK) == 0;
    if (has_marker)
      complete++;
    if ((has_marker && complete > keep_last) || (!has_marker && complete > 0)) {
      remove_tree(dir);
      removed++;
    }
  }
  free(steps);
  return removed;
}
