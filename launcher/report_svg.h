/* report_svg.h - charts as inline SVG for the run report: series of
 * points over a shared x (lines, or grouped bars for categories), with
 * axes, ticks at round values, a legend and dashed marks at chosen x.
 *
 * The chart says how to read it back: the <svg> carries data-x="X0 X1",
 * data-y="Y0 Y1" (the data ranges of its axes) and data-box="L T R B" (the
 * pixels they span; y grows down), each series is a <polyline
 * data-series="NAME"> (or one <rect data-series="NAME"> per bar), so a
 * test can invert what a browser draws to the numbers plotted. */
#ifndef MR_REPORT_SVG_H
#define MR_REPORT_SVG_H

#include "common/text.h"

struct mr_svg_series {
  const char *name;
  const double *y; // [the chart's n]; NaN: no point there
  int dashed;      // drawn dashed (a prediction beside a measurement)
};

struct mr_svg_chart {
  const char *id;           // the svg's id, "plot-ID"
  const char *title, *x_label, *y_label;
  const double *x;          // [n], increasing
  int n;
  const struct mr_svg_series *series;
  int n_series;
  int bars;                 // grouped bars, one group per x (categories)
  const char *const *x_names; // bars: [n] a label per group
  int from_zero;            // the y axis starts at 0
  const double *marks;      // [n_marks] x where a dashed vertical line goes
  int n_marks;
  const char *mark_name;    // the marks' legend entry
};

/* Appends the chart as an <svg> element to out (the strings escaped). */
void mr_svg_chart(struct mr_text *out, const struct mr_svg_chart *c);

/* Appends s with &, <, > and " escaped for HTML text and attributes. */
void mr_html_escaped(struct mr_text *out, const char *s);

#endif
