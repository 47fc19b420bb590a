/* sockdir.h - the launcher's private socket folder (/tmp/meshrun-XXXXXX).
 *
 * The folder holds the coordinator's Unix socket and a lock file the
 * launcher holds locked (flock) for its whole life.  A launcher that dies
 * without removing its folder (SIGKILL, the out-of-memory killer) leaves
 * the lock free, so the next launcher on the host can tell its folder from
 * a live one's and remove it. */
#ifndef MR_LAUNCHER_SOCKDIR_H
#define MR_LAUNCHER_SOCKDIR_H

#include <stddef.h>

#define MR_SOCKDIR_SOCKET "coord.sock" /* the coordinator's socket in it */

/* Makes root/meshrun-XXXXXX (mode 0700) holding its lock, locked on
 * *lock_fd (close-on-exec) until mr_sockdir_remove; its path into dir[n].
 * MR_ESYS naming what failed. */
int mr_sockdir_make(const char *root, char *dir, size_t n, int *lock_fd);

/* Removes what mr_sockdir_make made, and the socket; closes lock_fd. */
void mr_sockdir_remove(const char *dir, int lock_fd);

/* Removes the folders root/meshrun-XXXXXX of this user whose lock nobody
 * holds, with the socket and the lock; a folder without a lock, or holding
 * anything else, is left.  Returns how many were removed. */
int mr_sockdir_sweep(const char *root);

#endif
