/* schedule.c - pipeline schedules. */
#include "compiler/planner/schedule.h"

#include <stdlib.h>
#include <string.h>

int mr_pipeline_schedule(enum mr_pp_schedule sched, int pp, int stage, int vp, int m,
                         struct mr_sched_pass *out) {
  int n = 0;
  if (vp <= 1) {
    if (sched == MR_PP_GPIPE) {
      for (int i = 0; i < m; i++)
        out[n++] = (struct mr_sched_pass){0, i, 0};
      for (int i = 0; i < m; i++)
        out[n++] = (struct mr_sched_pass){0, i, 1};
      return n;
    }
    int warm = pp - stage - 1 < m ? pp - stage - 1 : m;
    for (int i = 0; i < warm; i++)
      out[n++] = (struct mr_sched_pass){0, i, 0};
    for (int i = 0; i < m - warm; i++) {
      out[n++] = (struct mr_sched_pass){0, warm + i, 0};
      out[n++] = (struct mr_sched_pass){0, i, 1};
    }
    for (int i = m - warm; i < m; i++)
      out[n++] = (struct mr_sched_pass){0, i, 1};
    return n;
  }
  /* interleaved: virtual micro-batch k runs chunk (k / pp) % vp forward
   * (vp - 1 - that backward) on micro-batch (k / (pp vp)) pp + k % pp */
  int total = m * vp, warm = (pp - stage - 1) * 2 + (vp - 1) * pp;
  if (warm > total)
    warm = total;
#define FWD(k) (struct mr_sched_pass){((k) / pp) % vp, ((k) / (pp * vp)) * pp + (k) % pp, 0}
#define BWD(k) (struct mr_sched_pass){vp - 1 - ((k) / pp) % vp, ((k) / (pp * vp)) * pp + (k) % pp, 1}
  for (int k = 0; k < warm; k++)
    out[n++] = FWD(k);
  for (int i = 0; i < total - warm; i++) {
    out[n++] = FWD(warm + i);
    out[n++] = BWD(i);
  }
  for (int k = total - warm; k < total; k++)
    out[n++] = BWD(k);
#undef FWD
#undef BWD
  return n;
}

int mr_pipeline_in_flight(enum mr_pp_schedule sched, int pp, int stage, int vp, int m,
                          int *in_flight) {
  if (vp < 1)
    vp = 1;
  struct mr_sched_pass *s = malloc((size_t)(2 * m * vp + 1) * sizeof *s);
  int *fly = calloc((size_t)vp, sizeof *fly);
  if (s == NULL || fly == NULL) {
    free(s);
    free(fly);
    return -1;
  }
  memset(in_flight, 0, (size_t)vp * sizeof *in_flight);
  int n = mr_pipeline_schedule(sched, pp, stage, vp, m, s), total = 0, most = 0;
  for (int i = 0; i < n; i++) {
    int d = s[i].backward ? -1 : 1;
    fly[s[i].chunk] += d;
    total += d;
    if (fly[s[i].chunk] > in_flight[s[i].chunk])
      in_flight[s[i].chunk] = fly[s[i].chunk];
    if (total > most)
      most = total;
  }
  free(s);
  free(fly);
  return most;
}
