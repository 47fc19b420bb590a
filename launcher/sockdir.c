/* sockdir.c - the launcher's socket folder and the sweep of dead ones'. */
#include "launcher/sockdir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"

#define PREFIX "meshrun-"
#define LOCK "lock"

int mr_sockdir_make(const char *root, char *dir, size_t n, int *lock_fd) {
  *lock_fd = -1;
  if ((size_t)snprintf(dir, n, "%s/" PREFIX "XXXXXX", root) >= n)
    return mr_error_set(MR_EINVAL, "socket folder under %s: path too long", root);
  if (mkdtemp(dir) == NULL)
    return mr_error_set(MR_ESYS, "mkdtemp %s: %s", dir, strerror(errno));
  /* locked under another name, then renamed: a sweep never finds the lock
   * unlocked while its launcher lives */
  char fresh[1100], lock[1100];
  snprintf(fresh, sizeof fresh, "%s/" LOCK ".new", dir);
  snprintf(lock, sizeof lock, "%s/" LOCK, dir);
  int fd = open(fresh, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0 || flock(fd, LOCK_EX) != 0 || rename(fresh, lock) != 0) {
    int rc = mr_error_set(MR_ESYS, "socket folder lock %s: %s", lock, strerror(errno));
    if (fd >= 0)
      close(fd);
    unlink(fresh);
    rmdir(dir);
    return rc;
  }
  *lock_fd = fd;
  return 0;
}

/* Unlinks the socket and the lock and removes the folder. */
static int remove_folder(const char *dir) {
  char path[1200];
  snprintf(path, sizeof path, "%s/" MR_SOCKDIR_SOCKET, dir);
  unlink(path);
  snprintf(path, sizeof path, "%s/" LOCK, dir);
  unlink(path);
  return rmdir(dir);
}

void mr_sockdir_remove(const char *dir, int lock_fd) {
  remove_folder(dir);
  if (lock_fd >= 0)
    close(lock_fd);
}

int mr_sockdir_sweep(const char *root) {
  DIR *d = opendir(root);
  if (d == NULL)
    return 0;
  int removed = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (strncmp(e->d_name, PREFIX, strlen(PREFIX)) != 0 ||
        strlen(e->d_name) != strlen(PREFIX) + 6)
      continue;
    char dir[1100], lock[1200];
    snprintf(dir, sizeof dir, "%s/%s", root, e->d_name);
    struct stat st;
    if (lstat(dir, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid())
      continue;
    snprintf(lock, sizeof lock, "%s/" LOCK, dir);
    int fd = open(lock, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
      continue; /* being made, or not a launcher's */
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) /* its launcher is gone */
      removed += remove_folder(dir) == 0;
    close(fd);
  }
  closedir(d);
  return removed;
}
