/* tokenizer.c - the meshrun-tokenize helper run as a child process (see
 * tokenizer.h): its stdin a socket (so that a helper that fails early makes
 * our write fail, not a SIGPIPE), its stdout and stderr pipes. */
#include "common/tokenizer.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <spawn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/error.h"
#include "common/file.h"

extern char **environ;

#define MAX_ARGS 64

/* Starts `python meshrun-tokenize ARGS...`; *in (when in is not NULL) is
 * its stdin, *out its stdout, *err its stderr. */
static int spawn(const char *const *args, int *in, int *out, int *err, pid_t *pid) {
  char helper[4096];
  if (mr_find_program("meshrun-tokenize", "common", helper, sizeof helper) < 0)
    return mr_error_set(MR_ENOENT, "meshrun-tokenize: not found beside this program, in the "
                        "build tree or on PATH (it is installed with meshrun)");
  const char *py = getenv("MESHRUN_PYTHON");
  if (py == NULL || py[0] == '\0')
    py = "python3";
  char *argv[MAX_ARGS + 3];
  int n = 0;
  argv[n++] = (char *)py;
  argv[n++] = helper;
  for (; args[n - 2] != NULL && n < MAX_ARGS + 2; n++)
    argv[n] = (char *)args[n - 2];
  argv[n] = NULL;
  int pi[2] = {-1, -1}, po[2] = {-1, -1}, pe[2] = {-1, -1};
  int rc = 0;
  if ((in != NULL && socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pi) < 0) ||
      pipe2(po, O_CLOEXEC) < 0 || pipe2(pe, O_CLOEXEC) < 0)
    rc = mr_error_set(MR_EIO, "meshrun-tokenize: pipes: %s", strerror(errno));
  int null_fd = in == NULL ? open("/dev/null", O_RDONLY | O_CLOEXEC) : -1;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (rc == 0 && in == NULL && null_fd < 0)
    rc = mr_error_set(MR_EIO, "/dev/null: %s", strerror(errno));
  if (rc == 0) {
    posix_spawn_file_actions_adddup2(&fa, in != NULL ? pi[1] : null_fd, 0);
    posix_spawn_file_actions_adddup2(&fa, po[1], 1);
    posix_spawn_file_actions_adddup2(&fa, pe[1], 2);
    int e = posix_spawnp(pid, py, &fa, NULL, argv, environ);
    if (e != 0)
      rc = mr_error_set(MR_ENOENT, "meshrun-tokenize: cannot run %s (MESHRUN_PYTHON): %s", py,
                        strerror(e));
  }
  posix_spawn_file_actions_destroy(&fa);
  /* the child's ends, and on a failure ours too */
  int *fds[] = {&null_fd, &pi[1], &po[1], &pe[1], &pi[0], &po[0], &pe[0]};
  for (size_t i = 0; i < sizeof fds / sizeof *fds && (i < 4 || rc < 0); i++)
    if (*fds[i] >= 0)
      close(*fds[i]);
  if (rc < 0)
    return rc;
  if (in != NULL)
    *in = pi[0];
  *out = po[0];
  *err = pe[0];
  return 0;
}

/* Reads fd to its end into a malloc'd buffer (NUL-terminated). */
static int read_all(int fd, char **buf, size_t *len) {
  size_t cap = 4096, n = 0;
  char *b = malloc(cap);
  while (b != NULL) {
    if (cap - n < 2) {
      char *nb = realloc(b, cap * 2);
      if (nb == NULL)
        break;
      b = nb, cap *= 2;
    }
    ssize_t k = read(fd, b + n, cap - n - 1);
    if (k < 0 && errno == EINTR)
      continue;
    if (k <= 0) {
      b[n] = '\0';
      *buf = b;
      *len = n;
      return k < 0 ? mr_error_set(MR_EIO, "meshrun-tokenize: read: %s", strerror(errno)) : 0;
    }
    n += (size_t)k;
  }
  free(b);
  return mr_error_set(MR_ENOMEM, "meshrun-tokenize: no memory for its output");
}

/* Waits for pid; a failure is the error, with the helper's stderr text. */
static int reap(pid_t pid, int err_fd) {
  char *msg = NULL;
  size_t len = 0;
  read_all(err_fd, &msg, &len);
  close(err_fd);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  int rc = 0;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    while (len > 0 && (msg[len - 1] == '\n' || msg[len - 1] == '\r'))
      msg[--len] = '\0';
    const char *last = msg != NULL && strrchr(msg, '\n') ? strrchr(msg, '\n') + 1 : msg;
    rc = mr_error_set(MR_EINVAL, "%s", last != NULL && last[0] ? last
                                       : "meshrun-tokenize failed without a message");
  }
  free(msg);
  return rc;
}

/* One run: input to stdin (or none), stdout into *out. */
static int run(const char *const *args, const void *input, size_t in_len, char **out,
               size_t *out_len) {
  int in = -1, o, e;
  pid_t pid;
  MR_TRY(spawn(args, input != NULL ? &in : NULL, &o, &e, &pid));
  int rc = 0;
  for (size_t done = 0; in >= 0 && done < in_len;) {
    ssize_t k = send(in, (const char *)input + done, in_len - done, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR)
      continue;
    if (k < 0)
      break; /* the helper stopped reading: its stderr says why */
    done += (size_t)k;
  }
  if (in >= 0)
    close(in);
  rc = read_all(o, out, out_len);
  close(o);
  int r2 = reap(pid, e);
  if (r2 < 0) {
    free(*out);
    *out = NULL;
    return r2;
  }
  return rc;
}

int mr_tokenizer_info(const char *tok, struct mr_tokenizer_info *info) {
  const char *args[] = {"info", tok, NULL};
  char *out;
  size_t n;
  MR_TRY(run(args, NULL, 0, &out, &n));
  long long v, e;
  int ok = sscanf(out, "vocab_size %lld eos_id %lld", &v, &e) == 2 && v > 0;
  free(out);
  if (!ok)
    return mr_error_set(MR_EINVAL, "%s: meshrun-tokenize info: unexpected output", tok);
  info->vocab_size = v;
  info->eos_id = e;
  return 0;
}

int mr_tokenizer_encode(const char *tok, const char *text, int32_t **ids, int64_t *n) {
  const char *args[] = {"encode-text", tok, NULL};
  char *out;
  size_t len;
  MR_TRY(run(args, text, strlen(text), &out, &len));
  *ids = (int32_t *)out; /* uint32 ids, little endian as this machine */
  *n = (int64_t)(len / 4);
  for (int64_t i = 0; i < *n; i++)
    if ((*ids)[i] < 0) {
      free(out);
      return mr_error_set(MR_ERANGE, "%s: token id %" PRIu32 " does not fit", tok,
                          (uint32_t)(*ids)[i]);
    }
  return 0;
}

int mr_tokenizer_decode(const char *tok, const int32_t *ids, int64_t n, char **text) {
  const char *args[] = {"decode", tok, NULL};
  size_t len;
  return run(args, ids, (size_t)n * 4, text, &len);
}

int mr_tokenizer_stream_open(const char *tok, const char *field, const char *const *files,
                             int n_files, struct mr_tokenizer_stream *s) {
  memset(s, 0, sizeof *s);
  s->err_fd = -1;
  if (n_files + 4 > MAX_ARGS)
    return mr_error_set(MR_EINVAL, "--tokenizer: at most %d files at once", MAX_ARGS - 4);
  const char *args[MAX_ARGS + 1];
  int k = 0;
  args[k++] = "encode", args[k++] = tok, args[k++] = field;
  for (int i = 0; i < n_files; i++)
    args[k++] = files[i];
  args[k] = NULL;
  int o;
  MR_TRY(spawn(args, NULL, &o, &s->err_fd, &s->pid));
  s->out = fdopen(o, "rb");
  if (s->out == NULL) {
    close(o);
    return mr_error_set(MR_EIO, "meshrun-tokenize: fdopen: %s", strerror(errno));
  }
  return 0;
}

int mr_tokenizer_stream_next(struct mr_tokenizer_stream *s, const uint32_t **ids, int64_t *n,
                             uint64_t *consumed) {
  unsigned char head[12];
  size_t got = fread(head, 1, sizeof head, s->out);
  if (got == 0 && feof(s->out))
    return 0;
  uint32_t count;
  memcpy(consumed, head, 8);
  memcpy(&count, head + 8, 4);
  if (got != sizeof head)
    return mr_error_set(MR_EFORMAT, "meshrun-tokenize: output cut short");
  if (count > s->cap) {
    uint32_t *p = realloc(s->ids, (size_t)count * sizeof *p);
    if (p == NULL)
      return mr_error_set(MR_ENOMEM, "no memory for a document of %" PRIu32 " tokens", count);
    s->ids = p, s->cap = count;
  }
  if (fread(s->ids, 4, count, s->out) != count)
    return mr_error_set(MR_EFORMAT, "meshrun-tokenize: output cut short");
  *ids = s->ids;
  *n = count;
  return 1;
}

int mr_tokenizer_stream_close(struct mr_tokenizer_stream *s) {
  int rc = 0;
  if (s->out != NULL)
    fclose(s->out);
  if (s->pid > 0)
    rc = reap(s->pid, s->err_fd);
  else if (s->err_fd >= 0)
    close(s->err_fd);
  free(s->ids);
  memset(s, 0, sizeof *s);
  s->err_fd = -1;
  return rc;
}
