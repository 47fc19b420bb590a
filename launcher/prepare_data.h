/* prepare_data.h - `meshrun prepare-data`: text files to token files, one
 * token a byte or through the model's tokenizer.
 *
 *   meshrun prepare-data TEXT... --out FILE [--val-fraction F]
 *                                [--val-out FILE] [--tokenizer TOK]
 *                                [--jsonl-field NAME]
 *
 * Every byte of the inputs (concatenated in the order given, nothing added
 * between them) is one token, vocabulary 256, written in the llm.c uint16
 * format (magic 20240520).  The split is deterministic: with n bytes in all
 * and F in [0, 1) (default 0.05), training gets the bytes before the cut and
 * validation the rest, where the cut is the start of the first line that
 * begins at or after byte floor((1 - F) * n) (or that byte itself when no
 * line starts there), so no line is split between the two.  --val-out
 * defaults to FILE with "-val" inserted before its extension (data/x.bin ->
 * data/x-val.bin); F = 0 writes no validation file.
 *
 * With --tokenizer TOK [--jsonl-field NAME] the documents (each text file;
 * each line of a .jsonl file, its NAME field) go through the model's own
 * tokenizer (common/tokenizer.h), each followed by its end-of-text token,
 * into llm.c uint16 files (vocabulary <= 65536) or uint32 ones (magic
 * 20240801); a document that starts at or past byte floor((1 - F) * n) of
 * the input goes to validation. */
#ifndef MR_PREPARE_DATA_H
#define MR_PREPARE_DATA_H

#include <stdint.h>

/* The split point (bytes for training) of text of n bytes for fraction
 * val_fraction, given the bytes: the formula above.  Exposed for tests. */
int64_t mr_prepare_data_cut(const uint8_t *text, int64_t n,
                            double val_fraction);

/* Runs the command; argv[0] is "prepare-data".  Returns the process exit
 * status: 0 on success, 2 for bad flags (a usage message on stderr), 1 when
 * reading or writing fails (a message naming the file). */
int mr_cmd_prepare_data(int argc, char **argv);

#endif
