/* report_svg.c - line and bar charts as SVG text (report_svg.h). */
#include "launcher/report_svg.h"

#include <math.h>
#include <string.h>

/* The chart's size and the plot box inside it, in pixels. */
enum { W = 680, H = 260, LEFT = 72, RIGHT = 20, TOP = 34, BOTTOM = 44 };
#define MARKERS_MAX 60 // series of at most this many points get a dot at each

static const char *const colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd"};

void mr_html_escaped(struct mr_text *out, const char *s) {
  for (const char *p = s; *p != '\0'; p++) {
    size_t run = strcspn(p, "&<>\"");
    if (run > 0)
      mr_text_add(out, "%.*s", (int)run, p);
    p += run;
    if (*p == '\0')
      break;
    mr_text_add(out, "%s", *p == '&'   ? "&amp;"
                           : *p == '<' ? "&lt;"
                           : *p == '>' ? "&gt;"
                                       : "&quot;");
  }
}

/* A round step (1, 2 or 5 times a power of ten) near span / want. */
static double nice_step(double span, int want) {
  double raw = span / want, p = pow(10, floor(log10(raw))), f = raw / p;
  return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * p;
}

struct axes {
  double x0, x1, y0, y1, ystep;
};

static double px(const struct axes *a, double x) {
  return LEFT + (x - a->x0) / (a->x1 - a->x0) * (W - LEFT - RIGHT);
}

static double py(const struct axes *a, double y) {
  return (H - BOTTOM) - (y - a->y0) / (a->y1 - a->y0) * (H - TOP - BOTTOM);
}

/* The axes' ranges: x as given (categories: a unit around each), y from
 * the finite points rounded out to ticks.  Returns the points found. */
static int axes_of(const struct mr_svg_chart *c, struct axes *a) {
  double lo = INFINITY, hi = -INFINITY;
  int found = 0;
  for (int s = 0; s < c->n_series; s++)
    for (int i = 0; i < c->n; i++)
      if (isfinite(c->series[s].y[i]) && isfinite(c->x[i])) {
        lo = fmin(lo, c->series[s].y[i]), hi = fmax(hi, c->series[s].y[i]);
        found++;
      }
  if (found == 0)
    lo = 0, hi = 1;
  if (c->from_zero)
    lo = fmin(lo, 0);
  if (hi - lo <= fabs(hi) * 1e-9) /* a flat line: a band around it */
    lo -= fabs(lo) > 0 ? fabs(lo) * 0.1 : 0.5, hi += fabs(hi) > 0 ? fabs(hi) * 0.1 : 0.5;
  if (c->from_zero && lo < 0 && lo > -INFINITY && found > 0 && hi > 0)
    lo = 0;
  a->ystep = nice_step(hi - lo, 5);
  a->y0 = floor(lo / a->ystep) * a->ystep, a->y1 = ceil(hi / a->ystep) * a->ystep;
  if (c->bars || c->n == 0) {
    a->x0 = -0.5, a->x1 = (c->n > 0 ? c->n : 1) - 0.5;
  } else {
    a->x0 = c->x[0], a->x1 = c->x[c->n - 1];
    if (a->x1 <= a->x0)
      a->x0 -= 1, a->x1 += 1;
  }
  return found;
}

/* A tick's label: short, and never "-0" or 0.30000000000000004. */
static void tick_label(struct mr_text *out, double v, double step) {
  if (fabs(v) < step * 1e-6)
    v = 0;
  mr_text_add(out, "%.6g", v);
}

static void draw_axes(struct mr_text *o, const struct mr_svg_chart *c, const struct axes *a) {
  mr_text_add(o, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"#fff\" "
              "stroke=\"#999\"/>\n", LEFT, TOP, W - LEFT - RIGHT, H - TOP - BOTTOM);
  for (double y = a->y0; y <= a->y1 + a->ystep * 1e-6; y += a->ystep) {
    mr_text_add(o, "<line x1=\"%d\" x2=\"%d\" y1=\"%.2f\" y2=\"%.2f\" stroke=\"#eee\"/>"
                "<text x=\"%d\" y=\"%.2f\" text-anchor=\"end\">", LEFT, W - RIGHT, py(a, y),
                py(a, y), LEFT - 6, py(a, y) + 4);
    tick_label(o, y, a->ystep);
    mr_text_add(o, "</text>\n");
  }
  if (c->bars) {
    int every = c->n > 16 ? (c->n + 15) / 16 : 1;
    for (int i = 0; i < c->n; i += every) {
      mr_text_add(o, "<text x=\"%.2f\" y=\"%d\" text-anchor=\"middle\">", px(a, i),
                  H - BOTTOM + 16);
      mr_html_escaped(o, c->x_names != NULL ? c->x_names[i] : "");
      mr_text_add(o, "</text>\n");
    }
  } else {
    double step = nice_step(a->x1 - a->x0, 8);
    if (step < 1)
      step = 1; /* steps and ranks are whole */
    for (double x = ceil(a->x0 / step) * step; x <= a->x1 + step * 1e-6; x += step) {
      mr_text_add(o, "<line x1=\"%.2f\" x2=\"%.2f\" y1=\"%d\" y2=\"%d\" stroke=\"#999\"/>"
                  "<text x=\"%.2f\" y=\"%d\" text-anchor=\"middle\">", px(a, x), px(a, x),
                  H - BOTTOM, H - BOTTOM + 4, px(a, x), H - BOTTOM + 16);
      tick_label(o, x, step);
      mr_text_add(o, "</text>\n");
    }
  }
  mr_text_add(o, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">", (LEFT + W - RIGHT) / 2, H - 8);
  mr_html_escaped(o, c->x_label);
  mr_text_add(o, "</text>\n<text transform=\"translate(14 %d) rotate(-90)\" "
              "text-anchor=\"middle\">", (TOP + H - BOTTOM) / 2);
  mr_html_escaped(o, c->y_label);
  mr_text_add(o, "</text>\n");
}

/* A legend entry at *x along the top; *x moves past it. */
static void legend(struct mr_text *o, int *x, const char *name, const char *color, int dashed) {
  mr_text_add(o, "<line x1=\"%d\" x2=\"%d\" y1=\"16\" y2=\"16\" stroke=\"%s\" "
              "stroke-width=\"2\"%s/><text x=\"%d\" y=\"20\">", *x, *x + 18, color,
              dashed ? " stroke-dasharray=\"5 3\"" : "", *x + 22);
  mr_html_escaped(o, name);
  mr_text_add(o, "</text>\n");
  *x += 34 + 7 * (int)strlen(name);
}

static void draw_line(struct mr_text *o, const struct mr_svg_chart *c, const struct axes *a,
                      int s) {
  const struct mr_svg_series *se = &c->series[s];
  const char *color = colors[s % 4];
  int n = 0;
  for (int i = 0; i < c->n; i++)
    n += isfinite(se->y[i]) && isfinite(c->x[i]);
  mr_text_add(o, "<polyline class=\"series\" data-series=\"");
  mr_html_escaped(o, se->name);
  mr_text_add(o, "\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\"%s points=\"", color,
              se->dashed ? " stroke-dasharray=\"5 3\"" : "");
  for (int i = 0; i < c->n; i++)
    if (isfinite(se->y[i]) && isfinite(c->x[i]))
      mr_text_add(o, "%.2f,%.2f ", px(a, c->x[i]), py(a, se->y[i]));
  mr_text_add(o, "\"/>\n");
  if (se->dashed) /* a prediction: a line, no points */
    return;
  for (int i = 0; n <= MARKERS_MAX && i < c->n; i++)
    if (isfinite(se->y[i]) && isfinite(c->x[i]))
      mr_text_add(o, "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"2.5\" fill=\"%s\"/>", px(a, c->x[i]),
                  py(a, se->y[i]), color);
  if (n <= MARKERS_MAX && n > 0)
    mr_text_add(o, "\n");
}

static void draw_bars(struct mr_text *o, const struct mr_svg_chart *c, const struct axes *a) {
  double group = (px(a, 1) - px(a, 0)) * 0.8, w = group / c->n_series;
  double base = py(a, fmax(a->y0, 0));
  for (int s = 0; s < c->n_series; s++)
    for (int i = 0; i < c->n; i++) {
      double v = c->series[s].y[i];
      if (!isfinite(v))
        continue;
      double top = fmin(py(a, v), base);
      mr_text_add(o, "<rect class=\"bar\" data-series=\"");
      mr_html_escaped(o, c->series[s].name);
      mr_text_add(o, "\" x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\"/>\n",
                  px(a, i) - group / 2 + s * w, top, w * 0.9, fabs(base - py(a, v)),
                  colors[s % 4]);
    }
}

void mr_svg_chart(struct mr_text *o, const struct mr_svg_chart *c) {
  struct axes a;
  int found = axes_of(c, &a);
  mr_text_add(o, "<svg class=\"plot\" id=\"plot-%s\" xmlns=\"http://www.w3.org/2000/svg\" "
              "width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" "
              "font-size=\"11\" data-x=\"%.17g %.17g\" data-y=\"%.17g %.17g\" "
              "data-box=\"%d %d %d %d\" data-points=\"%d\">\n<title>",
              c->id, W, H, W, H, a.x0, a.x1, a.y0, a.y1, LEFT, TOP, W - RIGHT, H - BOTTOM, found);
  mr_html_escaped(o, c->title);
  mr_text_add(o, "</title>\n");
  draw_axes(o, c, &a);
  for (int i = 0; i < c->n_marks; i++)
    if (c->marks[i] >= a.x0 && c->marks[i] <= a.x1)
      mr_text_add(o, "<line class=\"mark\" data-x=\"%.17g\" x1=\"%.2f\" x2=\"%.2f\" y1=\"%d\" "
                  "y2=\"%d\" stroke=\"#888\" stroke-dasharray=\"2 3\"/>\n", c->marks[i],
                  px(&a, c->marks[i]), px(&a, c->marks[i]), TOP, H - BOTTOM);
  if (c->bars)
    draw_bars(o, c, &a);
  else
    for (int s = 0; s < c->n_series; s++)
      draw_line(o, c, &a, s);
  if (found == 0)
    mr_text_add(o, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"#888\">no data "
                "recorded</text>\n", (LEFT + W - RIGHT) / 2, (TOP + H - BOTTOM) / 2);
  int x = LEFT;
  for (int s = 0; s < c->n_series; s++)
    legend(o, &x, c->series[s].name, colors[s % 4], c->series[s].dashed);
  if (c->n_marks > 0 && c->mark_name != NULL)
    legend(o, &x, c->mark_name, "#888", 1);
  mr_text_add(o, "</svg>\n");
}
