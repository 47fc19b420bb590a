/* prepare_data.c - `meshrun prepare-data`: token files from text, bytes or
 * the model's own tokenizer (see prepare_data.h). */
#include "launcher/prepare_data.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/tokenizer.h"
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
          "usage: meshrun prepare-data TEXT... --out FILE [--val-fraction F] [--val-out FILE]\n"
          "                            [--tokenizer TOK [--jsonl-field NAME]]\n"
          "  Without --tokenizer, writes every byte of the TEXT files (concatenated in\n"
          "  order) as one token (vocabulary 256) in the llm.c uint16 format.  The last\n"
          "  fraction F (default 0.05, cut at a line start) goes to --val-out (default:\n"
          "  FILE with -val before its extension); F = 0 writes no validation file.\n"
          "  --tokenizer TOK (a tokenizer.json, or a model folder holding one) tokenizes\n"
          "  with the model's own tokenizer instead (Hugging Face's tokenizers library,\n"
          "  through meshrun-tokenize and $MESHRUN_PYTHON): each TEXT file is one\n"
          "  document, each line of a .jsonl file one (its NAME field, default \"text\"),\n"
          "  each followed by the end-of-text token; llm.c uint16 files for a vocabulary\n"
          "  of at most 65536, uint32 above; the documents after the first 1 - F of the\n"
          "  input go to the validation file.\n");
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

/* Progress on a terminal (tty: stderr is one, asked once): bytes of input
 * read, tokens written, at most every 0.2 s. */
static void progress(int tty, uint64_t done, uint64_t total, int64_t tokens, double *last,
                     int final) {
  if (!tty)
    return;
  double now = mr_clock_s();
  if (!final && now - *last < 0.2)
    return;
  *last = now;
  int width = 30, fill = total ? (int)((double)done / (double)total * width) : width;
  fprintf(stderr, "\r[%.*s%*s] %3.0f%%  %.1f of %.1f MB, %lld tokens", fill,
          "##############################", width - fill, "",
          total ? 100.0 * (double)done / (double)total : 100.0, (double)done / 1e6,
          (double)total / 1e6, (long long)tokens);
  if (final)
    fputc('\n', stderr);
}

/* --tokenizer: the documents through the model's tokenizer, the first
 * 1 - frac of the input's bytes to out, the rest to val_out. */
static int prepare_tokenized(const char *tok, const char *field, const char **inputs, int n_in,
                             double frac, const char *out, const char *val_out) {
  struct mr_tokenizer_info info;
  if (mr_tokenizer_info(tok, &info) < 0) {
    fprintf(stderr, "meshrun prepare-data: --tokenizer %s: %s\n", tok, mr_error_message());
    return 2;
  }
  enum mr_tokens_format fmt = info.vocab_size <= 65536 ? MR_TOKENS_LLMC_U16 : MR_TOKENS_LLMC_U32;
  uint64_t total = 0;
  for (int i = 0; i < n_in; i++) {
    struct stat st;
    if (stat(inputs[i], &st) != 0) {
      fprintf(stderr, "meshrun prepare-data: %s: cannot open: %s\n", inputs[i], strerror(errno));
      return 1;
    }
    total += (uint64_t)st.st_size;
  }
  uint64_t cut = frac > 0 ? (uint64_t)((1.0 - frac) * (double)total) : UINT64_MAX;
  struct mr_tokenizer_stream ts;
  struct mr_tokens_writer w[2];
  int open_w[2] = {0, 0}, rc = mr_tokenizer_stream_open(tok, field, inputs, n_in, &ts);
  int64_t count[2] = {0, 0};
  uint64_t before = 0, consumed = 0;
  double last = 0;
  int tty = isatty(2);
  const uint32_t *ids;
  int64_t n;
  while (rc == 0 && (rc = mr_tokenizer_stream_next(&ts, &ids, &n, &consumed)) == 1) {
    int split = before >= cut; /* the document starts past the cut: validation */
    before = consumed;
    if (!open_w[split]) {
      if ((rc = mr_tokens_writer_open(&w[split], split ? val_out : out, fmt)) < 0)
        break;
      open_w[split] = 1;
    }
    rc = mr_tokens_writer_append(&w[split], ids, (size_t)n);
    count[split] += n;
    progress(tty, consumed, total, count[0] + count[1], &last, 0);
  }
  int rc2 = mr_tokenizer_stream_close(&ts);
  if (rc >= 0 && rc2 < 0)
    rc = rc2;
  if (rc >= 0 && (count[0] == 0 || (frac > 0 && count[1] == 0))) {
    rc = mr_error_set(MR_EINVAL, "%lld document tokens leave the %s split empty; give more "
                      "documents (a text file is one, a .jsonl line one) or change "
                      "--val-fraction", (long long)(count[0] + count[1]),
                      count[0] == 0 ? "training" : "validation");
  }
  for (int k = 0; k < 2; k++)
    if (open_w[k]) {
      if (rc < 0)
        mr_tokens_writer_abort(&w[k]);
      else if ((rc2 = mr_tokens_writer_close(&w[k])) < 0)
        rc = rc2;
    }
  if (rc < 0) {
    if (tty)
      fputc('\n', stderr);
    fprintf(stderr, "meshrun prepare-data: %s\n", mr_error_message());
    return rc == MR_EINVAL ? 2 : 1;
  }
  progress(tty, total, total, count[0] + count[1], &last, 1);
  printf("%s: %lld tokens (vocabulary %lld, %s)\n", out, (long long)count[0],
         (long long)info.vocab_size, fmt == MR_TOKENS_LLMC_U16 ? "uint16" : "uint32");
  if (frac > 0)
    printf("%s: %lld tokens\n", val_out, (long long)count[1]);
  return 0;
}

int mr_cmd_prepare_data(int argc, char **argv) {
  const char *out = NULL, *val_out = NULL, *tok = NULL, *field = "text";
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
        strcmp(a, "--val-fraction") == 0 || strcmp(a, "--tokenizer") == 0 ||
        strcmp(a, "--jsonl-field") == 0) {
      if (i + 1 >= argc) {
        status = flag_error("%s: expected a value", a);
        goto done;
      }
      const char *v = argv[++i];
      if (strcmp(a, "--out") == 0) {
        out = v;
      } else if (strcmp(a, "--tokenizer") == 0) {
        tok = v;
      } else if (strcmp(a, "--jsonl-field") == 0) {
        field = v;
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
  if (tok != NULL) {
    status = prepare_tokenized(tok, field, inputs, n_in, frac, out, val_out);
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
