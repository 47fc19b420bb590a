/* file.h - small whole files written safely: all of them or, with
 * MR_FILE_ATOMIC, the old one.
 *
 * Cluster specs, checkpoint markers and indexes, the coordinator's address
 * file: each is written in one piece, and a reader (a resumed job, another
 * node's launcher, a second launch reading the cache) must never find a
 * part of one. */
#ifndef MR_FILE_H
#define MR_FILE_H

enum {
  /* through a temporary beside it (.NAME.PID.tmp) renamed over it */
  MR_FILE_ATOMIC = 1,
  /* fsync'ed before returning (and with MR_FILE_ATOMIC the folder too,
   * after the rename), so it survives a crash of the machine */
  MR_FILE_DURABLE = 2,
  /* a final newline added when the text has none (JSON for people and
   * tools; not for files whose checksum was taken of the text) */
  MR_FILE_NEWLINE = 4,
};

/* Writes text to path, byte for byte unless MR_FILE_NEWLINE.  flags: any
 * of the above, or 0.  Returns 0, or MR_EIO naming the file and the
 * system's reason (a temporary is removed). */
int mr_file_write_text(const char *path, const char *text, int flags);

/* Copies the file src to dst (any bytes), through a temporary beside dst
 * renamed over it.  Returns 0, or MR_EIO naming the file and the reason. */
int mr_file_copy(const char *src, const char *dst);

/* mkdir -p.  Returns 0 or an MR_E code with a message. */
int mr_mkdir_p(const char *path);

/* The path of a program installed beside the running one (meshrun-worker,
 * meshrun-tokenize): next to our own executable, in the build tree
 * (../build_subdir/name), or on PATH.  Writes into buf; returns 0 or -1. */
int mr_find_program(const char *name, const char *build_subdir, char *buf, unsigned long n);

#endif
