/* tunable.c - environment-backed tunables. */
#include "common/tunable.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct tunable {
  const char *env;
  const char *def;
  const char *desc;
};

static const struct tunable table[MR_TUNABLE_COUNT] = {
#define XX(id, env, def, desc) [MR_TUNABLE_##id] = {env, def, desc},
    MR_TUNABLE_MAP(XX)
#undef XX
};

static char *values[MR_TUNABLE_COUNT];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

const char *mr_tunable_str(enum mr_tunable_id id) {
  pthread_mutex_lock(&lock);
  if (values[id] == NULL) {
    const char *v = getenv(table[id].env);
    values[id] = strdup(v != NULL && v[0] != '\0' ? v : table[id].def);
  }
  const char *out = values[id];
  pthread_mutex_unlock(&lock);
  return out != NULL ? out : table[id].def;
}

int64_t mr_tunable_int(enum mr_tunable_id id) {
  const char *s = mr_tunable_str(id);
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0') {
    fprintf(stderr, "[meshrun] warn env: %s=\"%s\" is not an integer; using %s\n",
            table[id].env, s, table[id].def);
    v = strtoll(table[id].def, NULL, 10);
  }
  return v;
}

void mr_tunable_override(enum mr_tunable_id id, const char *value) {
  pthread_mutex_lock(&lock);
  free(values[id]);
  values[id] = strdup(value);
  pthread_mutex_unlock(&lock);
}

const char *mr_tunable_env(enum mr_tunable_id id) { return table[id].env; }
const char *mr_tunable_default(enum mr_tunable_id id) { return table[id].def; }
const char *mr_tunable_desc(enum mr_tunable_id id) { return table[id].desc; }
