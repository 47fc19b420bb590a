/* file.c - small whole files written safely (see file.h). */
#include "common/file.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"

/* fsync of the folder holding path (a rename is durable once it is) */
static int sync_folder(const char *path) {
  char dir[4096];
  const char *slash = strrchr(path, '/');
  if (slash == NULL)
    snprintf(dir, sizeof dir, ".");
  else if (slash == path)
    snprintf(dir, sizeof dir, "/");
  else
    snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return mr_error_set(MR_EIO, "%s: %s", dir, strerror(errno));
  int rc = fsync(fd);
  close(fd);
  return rc == 0 ? 0 : mr_error_set(MR_EIO, "fsync %s: %s", dir, strerror(errno));
}

int mr_file_copy(const char *src, const char *dst) {
  char tmp[4200];
  if (snprintf(tmp, sizeof tmp, "%s.%d.tmp", dst, (int)getpid()) >= (int)sizeof tmp)
    return mr_error_set(MR_EIO, "%s: the path is too long", dst);
  FILE *in = fopen(src, "rb");
  if (in == NULL)
    return mr_error_set(MR_EIO, "cannot read %s: %s", src, strerror(errno));
  FILE *out = fopen(tmp, "wb");
  if (out == NULL) {
    int e = errno;
    fclose(in);
    return mr_error_set(MR_EIO, "cannot write %s: %s", dst, strerror(e));
  }
  char buf[65536];
  size_t k;
  int bad = 0;
  while (!bad && (k = fread(buf, 1, sizeof buf, in)) > 0)
    bad = fwrite(buf, 1, k, out) != k;
  bad |= ferror(in);
  int err = errno;
  fclose(in);
  if (fclose(out) != 0 && !bad)
    bad = 1, err = errno;
  if (!bad && rename(tmp, dst) != 0)
    bad = 1, err = errno;
  if (bad) {
    unlink(tmp);
    return mr_error_set(MR_EIO, "cannot copy %s to %s: %s", src, dst, strerror(err));
  }
  return 0;
}

int mr_file_write_text(const char *path, const char *text, int flags) {
  char tmp[4200];
  const char *target = path;
  if (flags & MR_FILE_ATOMIC) {
    const char *slash = strrchr(path, '/');
    const char *name = slash != NULL ? slash + 1 : path;
    int n = snprintf(tmp, sizeof tmp, "%.*s.%s.%d.tmp", (int)(name - path), path, name,
                     (int)getpid());
    if (n < 0 || (size_t)n >= sizeof tmp)
      return mr_error_set(MR_EIO, "%s: the path is too long", path);
    target = tmp;
  }
  FILE *f = fopen(target, "w");
  if (f == NULL)
    return mr_error_set(MR_EIO, "cannot write %s: %s", path, strerror(errno));
  size_t len = strlen(text);
  int bad = fwrite(text, 1, len, f) != len ||
            ((flags & MR_FILE_NEWLINE) && (len == 0 || text[len - 1] != '\n') &&
             fputc('\n', f) == EOF) ||
            fflush(f) != 0 ||
            ((flags & MR_FILE_DURABLE) && fsync(fileno(f)) != 0);
  int err = errno;
  if (fclose(f) != 0 && !bad) {
    bad = 1;
    err = errno;
  }
  if (!bad && target != path && rename(target, path) != 0) {
    bad = 1;
    err = errno;
  }
  if (bad) {
    if (target != path)
      unlink(target);
    return mr_error_set(MR_EIO, "cannot write %s: %s", path, strerror(err));
  }
  if ((flags & MR_FILE_ATOMIC) && (flags & MR_FILE_DURABLE))
    return sync_folder(path);
  return 0;
}

int mr_mkdir_p(const char *path) {
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s", path);
  for (char *p = tmp + 1; *p != '\0'; p++) {
    if (*p != '/')
      continue;
    *p = '\0';
    if (mkdir(tmp, 0755) != 0 && errno != EEXIST)
      return mr_error_set(mr_from_errno(errno), "mkdir %s: %s", tmp, strerror(errno));
    *p = '/';
  }
  if (mkdir(tmp, 0755) != 0 && errno != EEXIST)
    return mr_error_set(mr_from_errno(errno), "mkdir %s: %s", tmp, strerror(errno));
  return 0;
}

int mr_find_program(const char *name, const char *build_subdir, char *buf, unsigned long n) {
  char self[PATH_MAX];
  ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len > 0) {
    self[len] = '\0';
    char *slash = strrchr(self, '/');
    if (slash != NULL) {
      *slash = '\0';
      snprintf(buf, n, "%s/%s", self, name);
      if (access(buf, X_OK) == 0)
        return 0;
      snprintf(buf, n, "%s/../%s/%s", self, build_subdir, name);
      if (access(buf, X_OK) == 0)
        return 0;
    }
  }
  const char *path = getenv("PATH");
  while (path != NULL && *path != '\0') {
    const char *colon = strchr(path, ':');
    size_t dl = colon ? (size_t)(colon - path) : strlen(path);
    snprintf(buf, n, "%.*s/%s", (int)dl, path, name);
    if (dl > 0 && access(buf, X_OK) == 0)
      return 0;
    path = colon ? colon + 1 : NULL;
  }
  return -1;
}
