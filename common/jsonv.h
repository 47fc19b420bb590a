/* jsonv.h - reading JSON objects field by field with validation.
 *
 * A `struct mr_jv` collects every problem found while reading one document,
 * each as "FILE: PATH: expected ..., got ...", so a user sees all mistakes
 * in a job file at once.  Getters take the object, the dotted path of that
 * object (for messages) and a key; they return 1 when the key is present
 * and valid, 0 when absent (the output is left untouched: callers
 * pre-load defaults), and record an error (returning -1) otherwise. */
#ifndef MR_JSONV_H
#define MR_JSONV_H

#include <stddef.h>
#include <stdint.h>

struct cJSON;

struct mr_jv {
  const char *file;  // borrowed; names the document in messages
  char *errors;      // owned; newline-separated messages
  size_t len, cap;
  int n_errors;
};

void mr_jv_init(struct mr_jv *jv, const char *file);
void mr_jv_close(struct mr_jv *jv);

/* Records one problem at PATH.KEY (key may be NULL for the path itself). */
void mr_jv_error(struct mr_jv *jv, const char *path, const char *key,
                 const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* Records an error for every key of obj not in the NULL-terminated list. */
void mr_jv_only_keys(struct mr_jv *jv, const struct cJSON *obj,
                     const char *path, const char *const *keys);

/* Integer in [min, max]; JSON numbers with a fraction are rejected. */
int mr_jv_int(struct mr_jv *jv, const struct cJSON *obj, const char *path,
              const char *key, int64_t min, int64_t max, int64_t *out);

/* 1 when v is a JSON number that is a whole number in [0, max] (max at
 * most 2^53), storing it in *out; 0 otherwise (NaN, infinities, fractions,
 * negatives and anything not a number included). */
int mr_json_count(const struct cJSON *v, int64_t max, int64_t *out);

/* Number in [min, max]. */
int mr_jv_num(struct mr_jv *jv, const struct cJSON *obj, const char *path,
              const char *key, double min, double max, double *out);

/* Boolean. */
int mr_jv_bool(struct mr_jv *jv, const struct cJSON *obj, const char *path,
               const char *key, int *out);

/* Non-empty string; *out borrowed from obj. */
int mr_jv_str(struct mr_jv *jv, const struct cJSON *obj, const char *path,
              const char *key, const char **out);

/* String that must be one of the NULL-terminated choices; *out = index. */
int mr_jv_enum(struct mr_jv *jv, const struct cJSON *obj, const char *path,
               const char *key, const char *const *choices, int *out);

/* Object; *out borrowed. */
int mr_jv_obj(struct mr_jv *jv, const struct cJSON *obj, const char *path,
              const char *key, const struct cJSON **out);

/* A short rendering of a JSON value for messages ("\"two\"", "3.5", "an
 * object").  Writes into buf. */
const char *mr_jv_show(const struct cJSON *v, char *buf, size_t n);

/* Joins path and key into buf ("strategy" + "sharding" -> "strategy.sharding"). */
const char *mr_jv_join(char *buf, size_t n, const char *path, const char *key);

/* Reads a whole file into a NUL-terminated malloc'd buffer.  Returns 0,
 * MR_ENOENT or MR_EIO with a message naming the file, or MR_EINVAL for one
 * larger than MR_TEXT_FILE_MAX (every file read so is a JSON document:
 * a job, a model config, a cluster spec). */
#define MR_TEXT_FILE_MAX (64 << 20)
int mr_read_file(const char *path, char **text, size_t *len);

/* Reads and parses a JSON file.  A syntax error is MR_EJOB with the line
 * and column ("job.json: not valid JSON: line 3, column 7").  The caller
 * owns *out (cJSON_Delete). */
int mr_json_load(const char *path, struct cJSON **out);

/* Parses JSON text; `name` stands for the file in messages. */
int mr_json_parse(const char *text, const char *name, struct cJSON **out);

#endif
