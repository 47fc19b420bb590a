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
#include "common/ckpt_read.h"

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

void mr_ckpt_manifest_free(struct mr_ckpt_manifest *m) {
  for (int i = 0; i < m->n; i++) {
    free(m->names[i]);
    free(m->sums[i]);
  }
  free(m->names);
  free(m->sums);
  memset(m, 0, sizeof *m);
}

int mr_ckpt_manifest_load(const char *dir, struct mr_ckpt_manifest *m) {
  memset(m, 0, sizeof *m);
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
  if (!mr_json_count(st, INT64_C(1) << 53, &m->step) || !cJSON_IsArray(files) ||
      !cJSON_IsString(algo) || strcmp(algo->valuestring, MR_CHECKSUM_NAME) != 0) {
    rc = mr_error_set(MR_EFORMAT, "%s: expected {step, checksum: \"%s\", files}", path,
                      MR_CHECKSUM_NAME);
    goto out;
  }
  int n = cJSON_GetArraySize(files);
  m->names = calloc((size_t)n + 1, sizeof *m->names);
  m->sums = calloc((size_t)n + 1, sizeof *m->sums);
  if (m->names == NULL || m->sums == NULL) {
    rc = MR_ENOMEM;
    goto out;
  }
  const cJSON *f;
  cJSON_ArrayForEach(f, files) {
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(f, "name");
    const cJSON *sum = cJSON_GetObjectItemCaseSensitive(f, "checksum");
    if (!cJSON_IsString(name) || !cJSON_IsString(sum) || name->valuestring[0] == '\0' ||
        name->valuestring[0] == '.' || strchr(name->valuestring, '/') != NULL) {
      rc = mr_error_set(MR_EFORMAT, "%s: a file entry lacks a plain name or checksum", path);
      goto out;
    }
    if ((m->names[m->n] = strdup(name->valuestring)) == NULL ||
        (m->sums[m->n] = strdup(sum->valuestring)) == NULL) {
      free(m->names[m->n]);
      rc = MR_ENOMEM;
      goto out;
    }
    m->n++;
  }
out:
  cJSON_Delete(o);
  if (rc < 0)
    mr_ckpt_manifest_free(m);
  return rc;
}

int mr_ckpt_verify(const char *dir, int64_t *step) {
  struct mr_ckpt_manifest m;
  MR_TRY(mr_ckpt_manifest_load(dir, &m));
  int rc = 0;
  for (int i = 0; i < m.n && rc == 0; i++) {
    char fp[4300], hex[MR_CHECKSUM_HEX];
    snprintf(fp, sizeof fp, "%s/%s", dir, m.names[i]);
    if (mr_checksum_file(fp, hex) < 0)
      rc = mr_error_set(MR_EFORMAT, "%s: missing or unreadable", fp);
    else if (strcmp(hex, m.sums[i]) != 0)
      rc = mr_error_set(MR_EFORMAT, "%s: checksum mismatch (the file is corrupt)", fp);
  }
  if (rc == 0 && step != NULL)
    *step = m.step;
  mr_ckpt_manifest_free(&m);
  return rc;
}

/* Every tensor of dir's index, and its two moments, covered exactly once
 * by the pieces of the files reader rd opened. */
static int check_cover(const char *dir, struct mr_ckpt_reader *rd) {
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", dir, MR_CKPT_INDEX);
  cJSON *ix;
  if (mr_json_load(path, &ix) < 0)
    return mr_error_set(MR_EFORMAT, "%s", mr_error_message());
  const cJSON *tensors = cJSON_GetObjectItemCaseSensitive(ix, "tensors");
  int rc = cJSON_IsObject(tensors) ? 0
                                   : mr_error_set(MR_EFORMAT, "%s: no \"tensors\" object", path);
  const cJSON *e;
  cJSON_ArrayForEach(e, tensors) {
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
    int nd = cJSON_GetArraySize(sh);
    int64_t shape[MR_CKPT_MAX_DIMS];
    int ok = cJSON_IsArray(sh) && nd >= 1 && nd <= MR_CKPT_MAX_DIMS;
    for (int d = 0; ok && d < nd; d++)
      ok = mr_json_count(cJSON_GetArrayItem(sh, d), INT64_C(1) << 40, &shape[d]) && shape[d] > 0;
    if (!ok) {
      rc = mr_error_set(MR_EFORMAT, "%s: tensors.%s.shape: expected 1 to %d positive dims",
                        path, e->string, MR_CKPT_MAX_DIMS);
      break;
    }
    const char *prefixes[3] = {"", "optim.exp_avg.", "optim.exp_avg_sq."};
    for (int k = 0; k < 3 && rc == 0; k++) {
      char name[600];
      snprintf(name, sizeof name, "%s%s", prefixes[k], e->string);
      rc = mr_ckpt_reader_covers(rd, name, nd, shape);
    }
    if (rc < 0) {
      rc = mr_error_set(MR_EFORMAT, "%s: %s", dir, mr_error_message());
      break;
    }
  }
  cJSON_Delete(ix);
  return rc;
}

int mr_ckpt_check(const char *dir, int64_t *step) {
  int64_t at;
  MR_TRY(mr_ckpt_verify(dir, &at));
  struct mr_ckpt_reader *rd;
  int rc = mr_ckpt_reader_open(dir, &rd);
  if (rc < 0)
    return mr_error_set(MR_EFORMAT, "%s", mr_error_message());
  rc = check_cover(dir, rd);
  mr_ckpt_reader_free(rd);
  if (rc == 0 && step != NULL)
    *step = at;
  return rc;
}

/* A step-N entry under a checkpoint root. */
struct step_entry {
  int64_t step;
  int is_dir;
};

/* The entries named as mr_ckpt_step_dir names them under root, newest
 * first; *out is malloc'd (NULL when there is none).  Returns the count. */
static int list_steps(const char *root, struct step_entry **out) {
  *out = NULL;
  DIR *d = opendir(root);
  if (d == NULL)
    return 0;
  int n = 0, cap = 16;
  struct step_entry *steps = malloc((size_t)cap * sizeof *steps);
  struct dirent *e;
  while (steps != NULL && (e = readdir(d)) != NULL) {
    char *end, canon[32];
    if (strncmp(e->d_name, "step-", 5) != 0)
      continue;
    long long s = strtoll(e->d_name + 5, &end, 10);
    snprintf(canon, sizeof canon, "step-%08lld", s);
    if (*end != '\0' || s < 0 || strcmp(canon, e->d_name) != 0)
      continue; /* step-N.bad, or another name of no save's */
    if (n == cap) {
      struct step_entry *ns = realloc(steps, (size_t)(cap *= 2) * sizeof *steps);
      if (ns == NULL)
        break;
      steps = ns;
    }
    char path[4400];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", root, e->d_name);
    steps[n++] = (struct step_entry){s, stat(path, &st) == 0 && S_ISDIR(st.st_mode)};
  }
  closedir(d);
  for (int i = 1; i < n; i++) /* insertion sort, descending */
    for (int j = i; j > 0 && steps[j].step > steps[j - 1].step; j--) {
      struct step_entry t = steps[j];
      steps[j] = steps[j - 1];
      steps[j - 1] = t;
    }
  *out = steps;
  return steps != NULL ? n : 0;
}

static void warn_not_a_folder(const char *root, int64_t step) {
  char dir[4096];
  mr_ckpt_step_dir(root, step, dir, sizeof dir);
  MR_WARN("ckpt", "%s: not a folder, so not a checkpoint: left alone", dir);
}

int mr_ckpt_find_latest(const char *root, char *dir_out, size_t n, int64_t *step) {
  struct step_entry *steps;
  int count = list_steps(root, &steps);
  int found = 0, corrupt = 0;
  char newest_corrupt[4096 + 600] = "";
  for (int i = 0; i < count && !found; i++) {
    if (!steps[i].is_dir) {
      warn_not_a_folder(root, steps[i].step);
      continue;
    }
    char dir[4096];
    mr_ckpt_step_dir(root, steps[i].step, dir, sizeof dir);
    int64_t s;
    int rc = mr_ckpt_check(dir, &s);
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

/* A file a save writes (or leaves half written): rank-N.safetensors (and
 * its rank-N.safetensors.partial-PID), index.json, COMPLETE, and the
 * .NAME.PID.tmp of their atomic writes. */
static int written_by_a_save(const char *name) {
  int rank, pid, end = 0;
  if (strcmp(name, MR_CKPT_MARKER) == 0 || strcmp(name, MR_CKPT_INDEX) == 0)
    return 1;
  if (sscanf(name, "rank-%d.safetensors%n", &rank, &end) == 1 && name[end] == '\0')
    return 1;
  end = 0;
  if (sscanf(name, "rank-%d.safetensors.partial-%d%n", &rank, &pid, &end) == 2 &&
      name[end] == '\0')
    return 1;
  size_t len = strlen(name);
  return name[0] == '.' && len > 4 && strcmp(name + len - 4, ".tmp") == 0 &&
         (strncmp(name + 1, MR_CKPT_MARKER ".", sizeof MR_CKPT_MARKER) == 0 ||
          strncmp(name + 1, MR_CKPT_INDEX ".", sizeof MR_CKPT_INDEX) == 0);
}

/* Removes what saves wrote in dir, and dir once empty; others' files are
 * named and left.  Returns 1 when dir is gone. */
static int remove_checkpoint(const char *dir) {
  DIR *d = opendir(dir);
  struct dirent *e;
  int kept = 0;
  while (d != NULL && (e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
      continue;
    char p[4400];
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    if (written_by_a_save(e->d_name) && unlink(p) == 0)
      continue;
    if (kept++ == 0)
      MR_WARN("ckpt", "%s: not written by a save: left alone (and its folder with it)", p);
  }
  if (d != NULL)
    closedir(d);
  return kept == 0 && rmdir(dir) == 0;
}

/* dir (complete, failed mr_ckpt_check) renamed DIR.bad (or DIR.bad-K). */
static int mark_bad(const char *dir, const char *why) {
  char bad[4200];
  for (int k = 0; k < 1000; k++) {
    if (k == 0)
      snprintf(bad, sizeof bad, "%s.bad", dir);
    else
      snprintf(bad, sizeof bad, "%s.bad-%d", dir, k);
    if (access(bad, F_OK) == 0)
      continue;
    if (rename(dir, bad) != 0)
      return mr_error_set(MR_EIO, "cannot rename %s to %s: %s", dir, bad, strerror(errno));
    MR_WARN("ckpt", "%s: marked bad (%s): renamed %s, never loaded; its step is saved anew",
            dir, why, bad);
    return 0;
  }
  return mr_error_set(MR_EIO, "%s: too many folders marked bad beside it", dir);
}

int mr_ckpt_clear_after(const char *root, int64_t from) {
  struct step_entry *steps;
  int count = list_steps(root, &steps), rc = 0;
  for (int i = 0; i < count && rc == 0 && steps[i].step > from; i++) {
    char dir[4096];
    mr_ckpt_step_dir(root, steps[i].step, dir, sizeof dir);
    if (!steps[i].is_dir) {
      rc = mr_error_set(MR_EINVAL, "%s: not a folder, where the checkpoint of step %lld is "
                        "to be saved: move it aside", dir, (long long)steps[i].step);
      break;
    }
    int why = mr_ckpt_check(dir, NULL);
    if (why == MR_ENOENT) /* an interrupted save */
      remove_checkpoint(dir);
    else if (why < 0)
      rc = mark_bad(dir, mr_error_of(why));
    /* an intact one newer than `from` is not the job's to touch: a save of
     * its step would find the folder taken and start it again below */
    else
      rc = mark_bad(dir, "newer than the checkpoint resumed from");
  }
  free(steps);
  return rc;
}

int mr_ckpt_prune(const char *root, int keep_last) {
  struct step_entry *steps;
  int count = list_steps(root, &steps);
  int complete = 0, removed = 0;
  for (int i = 0; i < count; i++) {
    if (!steps[i].is_dir)
      continue;
    char dir[4096], marker[4200];
    mr_ckpt_step_dir(root, steps[i].step, dir, sizeof dir);
    snprintf(marker, sizeof marker, "%s/%s", dir, MR_CKPT_MARKER);
    int has_marker = access(marker, F_OK) == 0;
    if (has_marker)
      complete++;
    if ((has_marker && complete > keep_last) || (!has_marker && complete > 0))
      removed += remove_checkpoint(dir);
  }
  free(steps);
  return removed;
}
