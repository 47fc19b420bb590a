/* testutil.h - helpers for tests that drive the real binaries: spawn a
 * command with its output captured in files, wait for it with a timeout,
 * wait for text to appear in a file, find a process's children. */
#ifndef MR_TESTUTIL_H
#define MR_TESTUTIL_H

#include <stddef.h>
#include <sys/types.h>

struct mr_tproc {
  pid_t pid;
  char out_path[256];   // captured stdout
  char err_path[256];   // captured stderr
  int status;           // raw wait status once reaped
  int reaped;
};

/* Monotonic seconds. */
double mr_t_now(void);

/* A fresh temporary directory (mkdtemp under /tmp).  Writes into buf.  It
 * is removed after the test when the test passes (a failed one's stays to
 * be read; MESHRUN_KEEP_TEST_DIRS=1 keeps every one), if the test case was
 * made by mr_t_tcase. */
void mr_t_tmpdir(char *buf, size_t n);

/* tcase_create(name), with a checked teardown that removes the
 * directories its passing tests made with mr_t_tmpdir (Check runs it only
 * after a test that passed). */
struct TCase;
struct TCase *mr_t_tcase(const char *name);

/* Spawns argv (NULL-terminated) with extra "NAME=VALUE" environment
 * entries (NULL-terminated, may be NULL), stdout/stderr captured under
 * dir.  Aborts the test on failure. */
void mr_t_spawn(struct mr_tproc *p, const char *dir, char *const argv[],
                char *const extra_env[]);

/* Waits up to timeout_s; returns the exit code (or 128+signal), or -1 on
 * timeout (the process is then left running). */
int mr_t_wait(struct mr_tproc *p, double timeout_s);

/* Kills and reaps p if it still runs. */
void mr_t_kill(struct mr_tproc *p);

/* Reads a whole file into a malloc'd NUL-terminated string ("" if none). */
char *mr_t_slurp(const char *path);

/* Waits until needle appears in the file; returns seconds waited, or -1
 * after timeout_s. */
double mr_t_wait_for_text(const char *path, const char *needle, double timeout_s);

/* Lists the direct children of pid into pids (at most max); returns the count. */
int mr_t_children(pid_t pid, pid_t *pids, int max);

/* True if pid no longer runs (gone, or a zombie). */
int mr_t_gone(pid_t pid);

/* Writes an llm.c token file (uint16, magic 20240520) of n tokens drawn
 * from a fixed generator over a small alphabet, so there is something to
 * learn. */
void mr_t_write_tokens(const char *path, int n);

/* The slow-rank jobs: an 8-layer LLaMA (hidden 64, 4 heads, vocabulary
 * 128, sequence 32, global batch 8, seed 11), `steps` steps on dir/train.bin
 * (written when missing), checkpoints every 10 into ckpt_dir (NULL: none),
 * strategy manual plus the members given; written to dir/NAME. */
void mr_t_write_llama8_job(const char *dir, const char *name, int steps, const char *ckpt_dir,
                           const char *strategy);

/* Reads the per-step "loss" values of a metrics.jsonl into loss (at most
 * max); returns how many. */
int mr_t_read_losses(const char *metrics_path, double *loss, int max);

/* The entries of folder dir not starting with '.' (-1: no such folder). */
int mr_t_count_files(const char *dir);

/* Byte-compares two files; returns 1 when identical. */
int mr_t_same_file(const char *a, const char *b);

/* Path of a built binary: $MESHRUN_BIN or $MESHRUN_WORKER_BIN. */
const char *mr_t_meshrun(void);
const char *mr_t_worker(void);

#endif
