/* mesh.c - meshes, placements, DistAttrs: parsing, printing, shards. */
#include "compiler/mesh.h"

#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

int mr_mesh_init(struct mr_mesh *m, int ndim, const int *shape,
                 const char *const *names) {
  memset(m, 0, sizeof *m);
  if (ndim < 1 || ndim > MR_MESH_MAX_DIMS)
    return mr_error_set(MR_EINVAL, "mesh: %d dims, expected 1..%d", ndim,
                        MR_MESH_MAX_DIMS);
  m->ndim = ndim;
  int stride = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    if (shape[i] < 1)
      return mr_error_set(MR_EINVAL, "mesh: dim %d has size %d, expected >= 1",
                          i, shape[i]);
    if ((int64_t)stride * shape[i] > (1 << 24))
      return mr_error_set(MR_EINVAL, "mesh: more than %d ranks", 1 << 24);
    m->shape[i] = shape[i];
    m->stride[i] = stride;
    stride *= shape[i];
    if (names && names[i]) {
      if (strlen(names[i]) >= MR_MESH_NAME_MAX || !names[i][0])
        return mr_error_set(MR_EINVAL, "mesh: dim name \"%s\": expected 1..%d "
                            "characters", names[i], MR_MESH_NAME_MAX - 1);
      strcpy(m->names[i], names[i]);
    } else {
      snprintf(m->names[i], MR_MESH_NAME_MAX, "d%d", i);
    }
  }
  for (int i = 0; i < ndim; i++)
    for (int j = 0; j < i; j++)
      if (!strcmp(m->names[i], m->names[j]))
        return mr_error_set(MR_EINVAL, "mesh: dim name \"%s\" used twice",
                            m->names[i]);
  return 0;
}

int mr_mesh_parse(const char *spec, struct mr_mesh *m) {
  char names[MR_MESH_MAX_DIMS][MR_MESH_NAME_MAX];
  const char *np[MR_MESH_MAX_DIMS];
  int shape[MR_MESH_MAX_DIMS], n = 0;
  const char *s = spec ? spec : "";
  while (*s) {
    if (n == MR_MESH_MAX_DIMS)
      return mr_error_set(MR_EINVAL, "--mesh \"%s\": more than %d dims", spec,
                          MR_MESH_MAX_DIMS);
    const char *eq = strchr(s, '=');
    const char *comma = strchr(s, ',');
    if (!eq || (comma && comma < eq) || eq == s ||
        eq - s >= MR_MESH_NAME_MAX)
      return mr_error_set(MR_EINVAL, "--mesh \"%s\": expected NAME=SIZE "
                          "entries separated by commas, e.g. data=2,model=4",
                          spec);
    memcpy(names[n], s, (size_t)(eq - s));
    names[n][eq - s] = 0;
    char *end;
    long v = strtol(eq + 1, &end, 10);
    if (end == eq + 1 || v < 1 || v > 65536 || (*end && *end != ',') ||
        (*end == ',' && !end[1]))
      return mr_error_set(MR_EINVAL, "--mesh \"%s\": size of \"%s\": expected "
                          "a positive integer", spec, names[n]);
    shape[n] = (int)v;
    np[n] = names[n];
    n++;
    s = *end ? end + 1 : end;
  }
  if (n == 0)
    return mr_error_set(MR_EINVAL, "--mesh \"%s\": empty, expected e.g. "
                        "data=2,model=4", spec ? spec : "");
  return mr_mesh_init(m, n, shape, np);
}

int mr_mesh_size(const struct mr_mesh *m) {
  int s = 1;
  for (int i = 0; i < m->ndim; i++)
    s *= m->shape[i];
  return s;
}

int mr_mesh_dim(const struct mr_mesh *m, const char *name) {
  for (int i = 0; i < m->ndim; i++)
    if (!strcmp(m->names[i], name))
      return i;
  return -1;
}

int mr_mesh_rank(const struct mr_mesh *m, const int *coord) {
  int r = m->base;
  for (int i = 0; i < m->ndim; i++)
    r += coord[i] * m->stride[i];
  return r;
}

void mr_mesh_coord(const struct mr_mesh *m, int index, int *coord) {
  for (int i = m->ndim - 1; i >= 0; i--) {
    coord[i] = index % m->shape[i];
    index /= m->shape[i];
  }
}

int mr_mesh_slice(const struct mr_mesh *m, int dim, int at, struct mr_mesh *out) {
  if (dim < 0 || dim >= m->ndim || at < 0 || at >= m->shape[dim] ||
      m->ndim < 2)
    return mr_error_set(MR_EINVAL, "mesh slice: dim %d index %d out of range",
                        dim, at);
  struct mr_mesh r;
  memset(&r, 0, sizeof r);
  r.base = m->base + at * m->stride[dim];
  for (int i = 0; i < m->ndim; i++) {
    if (i == dim)
      continue;
    r.shape[r.ndim] = m->shape[i];
    r.stride[r.ndim] = m->stride[i];
    memcpy(r.names[r.ndim], m->names[i], MR_MESH_NAME_MAX);
    r.ndim++;
  }
  *out = r;
  return 0;
}

int mr_mesh_format(const struct mr_mesh *m, char *buf, size_t n) {
  int len = 0;
  if (n)
    buf[0] = 0;
  for (int i = 0; i < m->ndim; i++) {
    size_t room = (size_t)len < n ? n - (size_t)len : 0;
    len += snprintf(room ? buf + len : NULL, room, "%s%s=%d", i ? "," : "",
                    m->names[i], m->shape[i]);
  }
  return len;
}

struct mr_placement mr_shard(int dim) {
  struct mr_placement p = {MR_SHARD, dim, MR_REDUCE_SUM};
  return p;
}

struct mr_placement mr_replicate(void) {
  struct mr_placement p = {MR_REPLICATE, 0, MR_REDUCE_SUM};
  return p;
}

struct mr_placement mr_partial(enum mr_reduce_op op) {
  struct mr_placement p = {MR_PARTIAL, 0, op};
  return p;
}

int mr_placement_eq(struct mr_placement a, struct mr_placement b) {
  if (a.kind != b.kind)
    return 0;
  if (a.kind == MR_SHARD)
    return a.dim == b.dim;
  if (a.kind == MR_PARTIAL)
    return a.reduce == b.reduce;
  return 1;
}

static const char *skip(const char *s) {
  while (isspace((unsigned char)*s))
    s++;
  return s;
}

/* Parses one placement at *s, advancing *s past it. */
static int parse_one(const char **sp, struct mr_placement *p) {
  const char *s = skip(*sp);
  static const char *const kw[] = {"Replicate", "Shard", "Partial"};
  int kind = -1;
  size_t kl = 0;
  for (int i = 0; i < 3; i++) {
    kl = strlen(kw[i]);
    if (!strncmp(s, kw[i], kl)) {
      kind = i;
      break;
    }
  }
  if (kind < 0)
    return -1;
  s = skip(s + kl);
  if (*s != '(')
    return -1;
  s = skip(s + 1);
  struct mr_placement r = mr_replicate();
  if (kind == 1) {
    char *end;
    long d = strtol(s, &end, 10);
    if (end == s || d < 0 || d >= MR_TENSOR_MAX_DIMS)
      return -1;
    r = mr_shard((int)d);
    s = end;
  } else if (kind == 2) {
    r = mr_partial(MR_REDUCE_SUM);
    static const char *const ops[] = {"sum", "avg", "max"};
    for (int i = 0; i < 3; i++)
      if (!strncmp(s, ops[i], 3)) {
        r = mr_partial((enum mr_reduce_op)i);
        s += 3;
        break;
      }
  }
  s = skip(s);
  if (*s != ')')
    return -1;
  *sp = s + 1;
  *p = r;
  return 0;
}

int mr_placement_parse(const char *text, struct mr_placement *p) {
  const char *s = text;
  if (parse_one(&s, p) < 0 || *skip(s))
    return mr_error_set(MR_EINVAL, "placement \"%s\": expected Shard(d), "
                        "Replicate() or Partial(sum|avg|max)", text);
  return 0;
}

int mr_placement_format(struct mr_placement p, char *buf, size_t n) {
  static const char *const ops[] = {"sum", "avg", "max"};
  if (p.kind == MR_SHARD)
    return snprintf(buf, n, "Shard(%d)", p.dim);
  if (p.kind == MR_PARTIAL)
    return snprintf(buf, n, "Partial(%s)", ops[p.reduce]);
  return snprintf(buf, n, "Replicate()");
}

struct mr_dist_attr mr_dist_replicated(int ndim) {
  struct mr_dist_attr d;
  memset(&d, 0, sizeof d);
  d.known = 1;
  d.ndim = ndim;
  return d;
}

int mr_dist_eq(const struct mr_dist_attr *a, const struct mr_dist_attr *b) {
  if (!a->known || !b->known || a->ndim != b->ndim)
    return 0;
  for (int i = 0; i < a->ndim; i++)
    if (!mr_placement_eq(a->p[i], b->p[i]))
      return 0;
  return 1;
}

int mr_dist_parse(const char *text, int ndim, struct mr_dist_attr *d) {
  struct mr_dist_attr r = mr_dist_replicated(ndim);
  const char *s = skip(text);
  int br = *s == '[';
  if (br)
    s++;
  for (int i = 0; i < ndim; i++) {
    if (i) {
      s = skip(s);
      if (*s != ',')
        goto bad;
      s++;
    }
    if (parse_one(&s, &r.p[i]) < 0)
      goto bad;
  }
  s = skip(s);
  if (br) {
    if (*s != ']')
      goto bad;
    s = skip(s + 1);
  }
  if (*s)
    goto bad;
  *d = r;
  return 0;
bad:
  return mr_error_set(MR_EINVAL, "dist attr \"%s\": expected %d placements "
                      "like [Shard(0), Replicate()]", text, ndim);
}

int mr_dist_format(const struct mr_dist_attr *d, char *buf, size_t n) {
  if (!d->known)
    return snprintf(buf, n, "?");
  int len = 0;
  char one[32];
  for (int i = 0; i < d->ndim; i++) {
    mr_placement_format(d->p[i], one, sizeof one);
    size_t room = (size_t)len < n ? n - (size_t)len : 0;
    len += snprintf(room ? buf + len : NULL, room, "%s%s%s", i ? ", " : "[",
                    one, i + 1 == d->ndim ? "]" : "");
  }
  return len;
}

int mr_dist_check(const struct mr_dist_attr *d, int tndim) {
  for (int i = 0; i < d->ndim; i++)
    if (d->p[i].kind == MR_SHARD && (d->p[i].dim < 0 || d->p[i].dim >= tndim))
      return mr_error_set(MR_EINVAL, "Shard(%d) on mesh dim %d of a %d-d "
                          "tensor", d->p[i].dim, i, tndim);
  /* max does not mix with sum/avg: the order of the reductions would
   * matter */
  int mx = 0, sa = 0;
  for (int i = 0; i < d->ndim; i++)
    if (d->p[i].kind == MR_PARTIAL)
    {
      if (d->p[i].reduce == MR_REDUCE_MAX)
        mx = 1;
      else
        sa = 1;
    }
  if (mx && sa)
    return mr_error_set(MR_EINVAL, "Partial(max) mixed with Partial(sum|avg) "
                        "on another mesh dim");
  return 0;
}

int64_t mr_split_len(int64_t n, int k, int i) {
  return n / k + (i < n % k ? 1 : 0);
}

int64_t mr_split_off(int64_t n, int k, int i) {
  int64_t r = n % k;
  return (int64_t)i * (n / k) + (i < r ? i : r);
}

void mr_dist_local(const struct mr_mesh *m, const struct mr_dist_attr *d,
                   int tndim, const int64_t *shape, const int *coord,
                   int64_t *off, int64_t *len) {
  for (int t = 0; t < tndim; t++) {
    off[t] = 0;
    len[t] = shape[t];
  }
  for (int i = 0; i < d->ndim && i < m->ndim; i++) {
    if (d->p[i].kind != MR_SHARD)
      continue;
    int t = d->p[i].dim, k = m->shape[i];
    int64_t n = len[t];
    off[t] += mr_split_off(n, k, coord[i]);
    len[t] = mr_split_len(n, k, coord[i]);
  }
}

int64_t mr_dist_local_numel_max(const struct mr_mesh *m,
                                const struct mr_dist_attr *d, int tndim,
                                const int64_t *shape) {
  int64_t best = 0;
  int coord[MR_MESH_MAX_DIMS];
  for (int r = 0; r < mr_mesh_size(m); r++) {
    int64_t off[MR_TENSOR_MAX_DIMS], len[MR_TENSOR_MAX_DIMS], e = 1;
    mr_mesh_coord(m, r, coord);
    mr_dist_local(m, d, tndim, shape, coord, off, len);
    for (int t = 0; t < tndim; t++)
      e *= len[t];
    if (e > best)
      best = e;
  }
  return best;
}

int mr_dist_split_degree(const struct mr_mesh *m, const struct mr_dist_attr *d,
                         int tdim) {
  int k = 1;
  for (int i = 0; i < d->ndim && i < m->ndim; i++)
    if (d->p[i].kind == MR_SHARD && d->p[i].dim == tdim)
      k *= m->shape[i];
  return k;
}
