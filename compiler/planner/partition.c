/* partition.c - min-max contiguous partition of pipeline layers. */
#include "compiler/planner/partition.h"

#include <math.h>
#include <stdlib.h>

#include "common/error.h"

double mr_partition_dp(const double *cost, int n, int k, const double *speed, int *start) {
  if (n < 1 || k < 1 || k > n || n > MR_PARTITION_MAX_ITEMS)
    return MR_EINVAL;
  double *prefix = malloc(sizeof(double) * (size_t)(n + 1));
  double *best = malloc(sizeof(double) * (size_t)(n + 1) * (size_t)(k + 1));
  int *cut = malloc(sizeof(int) * (size_t)(n + 1) * (size_t)(k + 1));
  if (prefix == NULL || best == NULL || cut == NULL) {
    free(prefix), free(best), free(cut);
    return MR_ENOMEM;
  }
  prefix[0] = 0;
  for (int i = 0; i < n; i++)
    prefix[i + 1] = prefix[i] + cost[i];
  /* best[j][i]: the smallest largest-chunk cost of items [0, i) in j chunks. */
#define B(j, i) best[(size_t)(j) * (size_t)(n + 1) + (size_t)(i)]
#define C(j, i) cut[(size_t)(j) * (size_t)(n + 1) + (size_t)(i)]
#define W(j) (speed != NULL ? speed[(j) - 1] : 1.0)
  for (int i = 0; i <= n; i++)
    B(1, i) = W(1) * prefix[i], C(1, i) = 0;
  for (int j = 2; j <= k; j++) {
    for (int i = j; i <= n; i++) {
      double bv = INFINITY;
      int bc = j - 1;
      for (int c = j - 1; c < i; c++) { // last chunk is [c, i)
        double v = fmax(B(j - 1, c), W(j) * (prefix[i] - prefix[c]));
        if (v < bv)
          bv = v, bc = c;
      }
      B(j, i) = bv, C(j, i) = bc;
    }
  }
  double result = B(k, n);
  if (start != NULL) {
    int i = n;
    for (int j = k; j >= 1; j--) {
      start[j - 1] = C(j, i);
      i = C(j, i);
    }
  }
#undef B
#undef C
#undef W
  free(prefix), free(best), free(cut);
  return result;
}

/* Layers each chunk can hold when no chunk may cost more than x. */
static int64_t capacity(int l, double c, double first, double last, int k, double x,
                        int *cap0, int *capmid, int *caplast) {
  double eps = 1e-9;
  int c0 = (int)fmin(floor((x - first) / c + eps), l);
  int cl = (int)fmin(floor((x - last) / c + eps), l);
  int cm = (int)fmin(floor(x / c + eps), l);
  *cap0 = c0, *capmid = cm, *caplast = cl;
  if (c0 < 1 || cl < 1 || cm < 1)
    return -1;
  return (int64_t)c0 + cl + (int64_t)(k - 2) * cm;
}

double mr_partition_uniform(int l, double c, double first, double last, int k, int *counts) {
  if (l < 1 || k < 1 || k > l || !(c > 0))
    return MR_EINVAL;
  if (k == 1) {
    if (counts != NULL)
      counts[0] = l;
    return l * c + first + last;
  }
  const double offsets[3] = {0, first, last};
  double best = INFINITY;
  for (int o = 0; o < 3; o++) {
    int lo = 1, hi = l + 1; // smallest j with j·c + offset feasible
    while (lo < hi) {
      int mid = (lo + hi) / 2;
      int a, b, d;
      if (capacity(l, c, first, last, k, mid * c + offsets[o], &a, &b, &d) >= l)
        hi = mid;
      else
        lo = mid + 1;
    }
    if (lo <= l)
      best = fmin(best, lo * c + offsets[o]);
  }
  if (counts != NULL) {
    int c0, cm, cl;
    capacity(l, c, first, last, k, best, &c0, &cm, &cl);
    /* Water-fill: the lowest level L at which min(cap, L) over the chunks
     * still holds l layers, then the excess off chunks at L, middle first. */
    int top = c0 > cm ? c0 : cm;
    top = top > cl ? top : cl;
    int lo = 1, hi = top;
    while (lo < hi) {
      int mid = (lo + hi) / 2;
      int64_t s = (c0 < mid ? c0 : mid) + (cl < mid ? cl : mid) +
                  (int64_t)(k - 2) * (cm < mid ? cm : mid);
      if (s >= l)
        hi = mid;
      else
        lo = mid + 1;
    }
    int level = lo;
    counts[0] = c0 < level ? c0 : level;
    counts[k - 1] = cl < level ? cl : level;
    for (int i = 1; i < k - 1; i++)
      counts[i] = cm < level ? cm : level;
    int64_t sum = 0;
    for (int i = 0; i < k; i++)
      sum += counts[i];
    for (int i = 1; sum > l && i < k - 1; i++)
      if (counts[i] == level)
        counts[i]--, sum--;
    if (sum > l && counts[0] == level)
      counts[0]--, sum--;
    if (sum > l && counts[k - 1] == level)
      counts[k - 1]--, sum--;
  }
  return best;
}
