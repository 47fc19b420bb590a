/* prepare_data.c - `meshrun prepare-data`: byte-level token files from text
 * (see prepare_data.h). */
#include "launcher/prepare_data.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/error.h"
#include "common/tokens.h"

#define TOKEN_CHUNK 65536

int64_t mr_prepare_data_cut(const uint8_t *text, int64_t n,
                            double val_fraction) {
  if (n <= 0 || val_fraction <= 0.0)
    return n > 0 ? n : 0;
  int64_t nominal = (int64_t)((1.0 - val_fraction) * (double)n);
  if (nominal < 0)
    nominal = 0;
  if (nominal > n)
    nominal = n;
  for (int64_t i = nominal; i < n; i++)
    if (i == 0 || text[i - 1] == '\n')
      return i;
  return nominal;
}

static void usage(FILE *out) {
  fprintf(out,
          "usage: meshrun prepare-data TEXT... --out FILE "
          "[--val-fraction F] [--val-out FILE]\n"
          "  Writes every byte of the TEXT files (concatenated in order) as "
          "one token\n"
          "  (vocabulary 256) in the llm.c uint16 format.  The last fraction F "
          "(default\n"
          "  0.05, cut at a line start) goes to --val-out (default: FILE with "
          "-val\n"
          "  before its extension); F = 0 writes no validation file.\n");
}

static int flag_error(const char *fmt, const char *arg) {
  fprintf(stderr, "meshrun prepare-data: ");
  fprintf(stderr, fmt, arg);
  fprintf(stderr, "\n");
  usage(stderr);
  return 2;
}

/* "data/x.bin" -> "data/x-val.bin"; "x" -> "x-val".  Caller frees. */
static char *default_val_path(const char *out) {
  const char *slash = strrchr(out, '/');
  const char *dot = strrchr(out, '.');
  if (dot == NULL || (slash != NULL && dot < slash) || dot == out ||
      dot[-1] == '/')
    dot = out + strlen(out);
  size_t stem = (size_t)(dot - out);
  char *p = malloc(strlen(out) + 5);
  if (p == NULL)
    return NULL;
  memcpy(p, out, stem);
  strcpy(p + stem, "-val");
  strcat(p, dot);
  return p;
}

/* Appends the whole file at path to *buf (growing it).  Returns 0 or 1 with
 * a message on stderr. */
static int slurp(const char *path, uint8_t **buf, size_t *len, size_t *cap) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) {
    fprintf(stderr, "meshrun prepare-data: %s: cannot open: %s\n", path,
            strerror(errno));
    return 1;
  }
  for (;;) {
    if (*cap - *len < 1 << 20) {
      size_t ncap = *cap ? *cap * 2 : 4u << 20;
      uint8_t *p = realloc(*buf, ncap);
      if (p == NULL) {
        fclose(f);
        fprintf(stderr, "meshrun prepare-data: %s: out of memory\n", path);
        return 1;
      }
      *buf = p;
      *cap = ncap;
    }
    size_t k = fread(*buf + *len, 1, *cap - *len, f);
    *len += k;
    if (k == 0)
      break;
  }
  int bad = ferror(f);
  fclose(f);
  if (bad) {
    fprintf(stderr, "meshrun prepare-data: %s: read error\n", path);
    return 1;
  }
  return 0;
}

static int write_tokens(const char *path, const uint8_t *bytes, int64_t n) {
  struct mr_tokens_writer w;
  int rc = mr_tokens_writer_open(&w, path, MR_TOKENS_LLMC_U16);
  uint32_t tok[TOKEN_CHUNK];
  for (int64_t i = 0; rc == 0 && i < n; i += TOKEN_CHUNK) {
    size_t k = (size_t)(n - i < TOKEN_CHUNK ? n - i : TOKEN_CHUNK);
    for (size_t j = 0; j < k; j++)
      tok[j] = bytes[i + (int64_t)j];
    rc = mr_tokens_writer_append(&w, tok, k);
  }
  if (rc < 0) {
    mr_tokens_writer_abort(&w);
    return rc;
  }
  return mr_tokens_writer_close(&w);
}

int mr_cmd_prepare_data(int argc, char **argv) {
  const char *out = NULL, *val_out = NULL;
  double frac = 0.05;
  const char **inputs = calloc((size_t)argc + 1, sizeof *inputs);
  int n_in = 0, status = 2;
  char *val_default = NULL;
  uint8_t *text = NULL;
  if (inputs == NULL)
    return 1;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      usage(stdout);
      status = 0;
      goto done;
    }
    if (strcmp(a, "--out") == 0 || strcmp(a, "--val-out") == 0 ||
        strcmp(a, "--val-fraction") == 0) {
      if (i + 1 >= argc) {
        status = flag_error("%s: expected a value", a);
        goto done;
      }
      const char *v = argv[++i];
      if (strcmp(a, "--out") == 0) {
        out = v;
      } else if (strcmp(a, "--val-out") == 0) {
        val_out = v;
      } else {
        char *end;
        errno = 0;
        frac = strtod(v, &end);
        if (errno != 0 || end == v || *end != '\0' || !(frac >= 0.0) ||
            !(frac < 1.0)) {
          status = flag_error("--val-fraction %s: expected a number in [0, 1)",
                              v);
          goto done;
        }
      }
    } else if (strncmp(a, "--", 2) == 0 && a[2] != '\0') {
      status = flag_error("unknown flag %s", a);
      goto done;
    } else {
      inputs[n_in++] = a;
    }
  }
  if (out == NULL) {
    status = flag_error("%s", "--out FILE is required");
    goto done;
  }
  if (n_in == 0) {
    status = flag_error("%s", "expected at least one TEXT file");
    goto done;
  }
  if (frac > 0.0 && val_out == NULL) {
    val_default = default_val_path(out);
    val_out = val_default;
  }
  if (val_out != NULL && strcmp(val_out, out) == 0) {
    status = flag_error("--val-out %s: must differ from --out", val_out);
    goto done;
  }
  status = 1;
  size_t len = 0, cap = 0;
  for (int i = 0; i < n_in; i++)
    if (slurp(inputs[i], &text, &len, &cap) != 0)
      goto done;
  int64_t n = (int64_t)len;
  int64_t cut = mr_prepare_data_cut(text, n, frac);
  if (cut == 0 || (frac > 0.0 && cut == n)) {
    fprintf(stderr,
            "meshrun prepare-data: %lld bytes of text leave the %s split "
            "empty; give more text or change --val-fraction\n",
            (long long)n, cut == 0 ? "training" : "validation");
    goto done;
  }
  if (write_tokens(out, text, cut) < 0) {
    fprintf(stderr, "meshrun prepare-data: %s\n", mr_error_message());
    goto done;
  }
  if (frac > 0.0 && write_tokens(val_out, text + cut, n - cut) < 0) {
    fprintf(stderr, "meshrun prepare-data: %s\n", mr_error_message());
    goto done;
  }
  printf("%s: %lld tokens\n", out, (long long)cut);
  if (frac > 0.0)
    printf("%s: %lld tokens\n", val_out, (long long)(n - cut));
  status = 0;
done:
  free(text);
  free(val_default);
  free(inputs);
  return status;
}
