/* report.c - `meshrun report`: a run read back (report_read.c) as one
 * HTML page of SVG charts (report_svg.c) or as Markdown tables. */
#include "launcher/report.h"

#include <getopt.h>
#include <stddef.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "common/file.h"
#include "launcher/report_svg.h"

/* ---- the figures, shared by both formats ------------------------------ */

enum { FIG_LOSS, FIG_TOKENS, FIG_MFU, FIG_STEP, FIG_MEMORY, N_FIGURES };
#define SERIES_MAX 3

struct figure {
  struct mr_svg_chart chart;
  struct mr_svg_series series[SERIES_MAX];
  double *y[SERIES_MAX]; // owned, [chart.n]
  int sparse[SERIES_MAX]; // a value at a few x only: every one is a row of the table
  double *x, *marks;     // owned
  char **names;          // owned, [chart.n] (bars)
  const char *fmt;       // a value in a table
  const char *empty;     // why there may be no points
};

/* A figure of n points with these series, titles borrowed. */
static int figure_init(struct figure *f, const char *id, const char *title, const char *x_label,
                       const char *y_label, int n, const char *const *names, int n_series) {
  memset(f, 0, sizeof *f);
  f->chart = (struct mr_svg_chart){.id = id, .title = title, .x_label = x_label,
                                   .y_label = y_label, .n = n, .n_series = n_series,
                                   .series = f->series};
  f->fmt = "%.6g";
  f->x = calloc((size_t)(n > 0 ? n : 1), sizeof *f->x);
  if (f->x == NULL)
    return MR_ENOMEM;
  f->chart.x = f->x;
  for (int s = 0; s < n_series; s++) {
    if ((f->y[s] = calloc((size_t)(n > 0 ? n : 1), sizeof *f->y[s])) == NULL)
      return MR_ENOMEM;
    f->series[s] = (struct mr_svg_series){.name = names[s], .y = f->y[s]};
  }
  return 0;
}

static void figure_close(struct figure *f) {
  for (int s = 0; s < SERIES_MAX; s++)
    free(f->y[s]);
  for (int i = 0; f->names != NULL && i < f->chart.n; i++)
    free(f->names[i]);
  free(f->names), free(f->x), free(f->marks);
}

/* A figure over the steps: series[s] is the double at offset[s] of each
 * step, times scale[s]. */
static int step_figure(struct figure *f, const struct mr_run *run, const char *id,
                       const char *title, const char *y_label, const char *const *names,
                       const size_t *offset, const double *scale, int n_series) {
  MR_TRY(figure_init(f, id, title, "step", y_label, run->n_steps, names, n_series));
  for (int i = 0; i < run->n_steps; i++) {
    f->x[i] = (double)run->steps[i].step;
    for (int s = 0; s < n_series; s++)
      f->y[s][i] = *(const double *)((const char *)&run->steps[i] + offset[s]) * scale[s];
  }
  /* a dashed line where each group after the first begins */
  if ((f->marks = calloc((size_t)run->n_groups + 1, sizeof *f->marks)) == NULL)
    return MR_ENOMEM;
  for (int g = 1; g < run->n_groups; g++)
    if (run->groups[g].first_step >= 0)
      f->marks[f->chart.n_marks++] = (double)run->groups[g].first_step;
  f->chart.marks = f->marks;
  f->chart.mark_name = "a group began again";
  return 0;
}

#define AT(field) offsetof(struct mr_run_step, field)

static int figures_of(const struct mr_run *run, struct figure *f) {
  MR_TRY(step_figure(&f[FIG_LOSS], run, "loss", "Loss", "loss",
                     (const char *const[]){"training loss", "validation loss"},
                     (const size_t[]){AT(loss), AT(val_loss)}, (const double[]){1, 1}, 2));
  f[FIG_LOSS].sparse[1] = 1;
  MR_TRY(step_figure(&f[FIG_TOKENS], run, "throughput", "Throughput", "tokens / s",
                     (const char *const[]){"tokens/s"}, (const size_t[]){AT(tokens_per_s)},
                     (const double[]){1}, 1));
  f[FIG_TOKENS].chart.from_zero = 1;
  MR_TRY(step_figure(&f[FIG_MFU], run, "mfu", "Model FLOPs utilisation", "MFU (%)",
                     (const char *const[]){"MFU %"}, (const size_t[]){AT(mfu)},
                     (const double[]){100}, 1));
  f[FIG_MFU].chart.from_zero = 1;
  f[FIG_MFU].fmt = "%.4g";
  f[FIG_MFU].empty = "no MFU: the run's plan gave no peak FLOP/s (" "run.jsonl's plan "
                     "peak_device_s)";
  MR_TRY(step_figure(&f[FIG_STEP], run, "step_time", "Step time: predicted and measured",
                     "seconds",
                     (const char *const[]){"measured", "predicted", "communication wait"},
                     (const size_t[]){AT(step_time_s), AT(predicted_s), AT(comm_wait_s)},
                     (const double[]){1, 1, 1}, 3));
  f[FIG_STEP].series[1].dashed = 1;
  f[FIG_STEP].chart.from_zero = 1;
  struct figure *m = &f[FIG_MEMORY];
  MR_TRY(figure_init(m, "memory", "Memory per rank", "rank", "MiB", run->n_ranks,
                     (const char *const[]){"peak memory", "resident peak"}, 2));
  m->chart.bars = 1, m->chart.from_zero = 1, m->fmt = "%.1f";
  m->empty = "no memory per rank recorded (run.jsonl's memory events)";
  if ((m->names = calloc((size_t)run->n_ranks + 1, sizeof *m->names)) == NULL)
    return MR_ENOMEM;
  for (int i = 0; i < run->n_ranks; i++) {
    m->x[i] = i;
    m->y[0][i] = (double)run->rank_peak[i] / 1048576.0;
    m->y[1][i] = (double)run->rank_rss[i] / 1048576.0;
    char name[32];
    snprintf(name, sizeof name, "rank %d", i);
    if ((m->names[i] = strdup(name)) == NULL)
      return MR_ENOMEM;
  }
  m->chart.x_names = (const char *const *)m->names;
  return 0;
}

static int finite_points(const struct figure *f) {
  int n = 0;
  for (int s = 0; s < f->chart.n_series; s++)
    for (int i = 0; i < f->chart.n; i++)
      n += isfinite(f->y[s][i]);
  return n;
}

/* ---- what both formats say in words ----------------------------------- */

static void utc(double t, char *buf, size_t n) {
  time_t s = (time_t)t;
  struct tm tm;
  gmtime_r(&s, &tm);
  strftime(buf, n, "%Y-%m-%d %H:%M:%S", &tm);
}

static const char *event_name(enum mr_run_event_kind k) {
  static const char *const n[] = {[MR_RUN_EV_START] = "launch", [MR_RUN_EV_FAILURE] = "failure",
                                  [MR_RUN_EV_RESTART] = "restart", [MR_RUN_EV_END] = "end"};
  return n[k];
}

/* The state, steps and restarts in one line. */
static void summary(const struct mr_run *run, char *buf, size_t n) {
  const struct mr_run_group *g = run->n_groups > 0 ? &run->groups[run->n_groups - 1] : NULL;
  int used = snprintf(buf, n, "%s", mr_run_state_name(run->state));
  if (run->state != MR_RUN_RUNNING && run->state != MR_RUN_VANISHED)
    used += snprintf(buf + used, n - (size_t)used, " (exit %d)", run->exit_code);
  if (run->n_steps > 0)
    used += snprintf(buf + used, n - (size_t)used, "; step %lld",
                     (long long)run->steps[run->n_steps - 1].step);
  if (g != NULL && g->steps > 0 && used < (int)n)
    used += snprintf(buf + used, n - (size_t)used, " of %lld", (long long)g->steps);
  if (used < (int)n)
    snprintf(buf + used, n - (size_t)used, "; %d record%s of steps (%d trained again); %d "
             "failure%s, %d restart%s", run->n_records, run->n_records == 1 ? "" : "s",
             run->n_records - run->n_steps, run->n_failures, run->n_failures == 1 ? "" : "s",
             run->n_restarts, run->n_restarts == 1 ? "" : "s");
}

/* ---- HTML ------------------------------------------------------------- */

static const char style[] =
    "body{font-family:sans-serif;margin:24px auto;max-width:720px;color:#222}"
    "h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ccc}"
    "table{border-collapse:collapse;font-size:13px}"
    "td,th{border-bottom:1px solid #e4e4e4;padding:3px 8px;text-align:left;vertical-align:top}"
    "figure{margin:0}figcaption{font-size:16px;font-weight:bold;margin:28px 0 6px;"
    "border-bottom:1px solid #ccc}.events td:first-child{white-space:nowrap}"
    ".note{color:#777;font-size:13px}.failure td{color:#a00}pre{white-space:pre-wrap;margin:0}";

static void html_row(struct mr_text *o, const char *key, const char *value) {
  mr_text_add(o, "<tr><th>%s</th><td>", key);
  mr_html_escaped(o, value);
  mr_text_add(o, "</td></tr>\n");
}

static void html_plan(struct mr_text *o, const struct mr_run *run) {
  mr_text_add(o, "<h2>Plan</h2>\n");
  if (run->n_groups == 0) {
    mr_text_add(o, "<p class=\"note\">no plan recorded (%s)</p>\n",
                run->have_log ? "no group has started" : "no run.jsonl: a run of an earlier "
                "meshrun");
    return;
  }
  const struct mr_run_group *g = &run->groups[run->n_groups - 1];
  char buf[160];
  mr_text_add(o, "<table class=\"plan\">\n");
  snprintf(buf, sizeof buf, "%d ranks on %d node%s (group %d)", g->world, g->nodes,
           g->nodes == 1 ? "" : "s", g->restart);
  html_row(o, "ranks", buf);
  html_row(o, "mesh", g->mesh);
  html_row(o, "schedule", g->schedule);
  snprintf(buf, sizeof buf, g->predicted_s > 0 ? "%.4g s" : "none", g->predicted_s);
  html_row(o, "predicted step", buf);
  snprintf(buf, sizeof buf, g->peak_device_s > 0 ? "%.4g s (a step at peak FLOP/s on one "
           "device; MFU = this / (step time x ranks))" : "none", g->peak_device_s);
  html_row(o, "MFU input", buf);
  mr_text_add(o, "<tr><th>placements</th><td>");
  for (int i = 0; i < g->n_placements; i++) {
    mr_html_escaped(o, g->placements[i]);
    mr_text_add(o, "<br>");
  }
  mr_text_add(o, "</td></tr>\n</table>\n");
  if (run->n_groups > 1) {
    mr_text_add(o, "<p>Each group's plan:</p>\n<table class=\"groups\"><tr><th>launch</th>"
                "<th>group</th><th>first step</th><th>ranks</th><th>mesh</th>"
                "<th>predicted step</th></tr>\n");
    for (int i = 0; i < run->n_groups; i++) {
      const struct mr_run_group *h = &run->groups[i];
      mr_text_add(o, "<tr><td>%d</td><td>%d</td><td>%lld</td><td>%d</td><td>", h->launch + 1,
                  h->restart, (long long)h->first_step, h->world);
      mr_html_escaped(o, h->mesh);
      mr_text_add(o, "</td><td>%.4g s</td></tr>\n", h->predicted_s);
    }
    mr_text_add(o, "</table>\n");
  }
}

static void html_figure(struct mr_text *o, const struct figure *f) {
  mr_text_add(o, "<figure id=\"fig-%s\"><figcaption>", f->chart.id);
  mr_html_escaped(o, f->chart.title);
  mr_text_add(o, "</figcaption>\n");
  mr_svg_chart(o, &f->chart);
  if (f->empty != NULL && finite_points(f) == 0)
    mr_text_add(o, "<p class=\"note\">%s</p>\n", f->empty);
  mr_text_add(o, "</figure>\n");
}

static void html_events(struct mr_text *o, const struct mr_run *run) {
  mr_text_add(o, "<h2>Restarts and failures</h2>\n");
  if (run->n_events == 0) {
    mr_text_add(o, "<p class=\"note\">none recorded</p>\n");
    return;
  }
  mr_text_add(o, "<table class=\"events\"><tr><th>time (UTC)</th><th>launch</th><th>group</th>"
              "<th>event</th><th>rank</th><th>what</th></tr>\n");
  for (int i = 0; i < run->n_events; i++) {
    const struct mr_run_event *e = &run->events[i];
    char when[32], rank[16] = "";
    utc(e->time, when, sizeof when);
    if (e->rank >= 0)
      snprintf(rank, sizeof rank, "%d", e->rank);
    mr_text_add(o, "<tr class=\"%s\"><td>%s</td><td>%d</td><td>%d</td><td>%s</td><td>%s</td>"
                "<td><pre>", event_name(e->kind), when, e->launch + 1, e->restart,
                event_name(e->kind), rank);
    mr_html_escaped(o, e->text);
    mr_text_add(o, "</pre></td></tr>\n");
  }
  mr_text_add(o, "</table>\n");
}

void mr_report_html(const struct mr_run *run, struct mr_text *o) {
  struct figure f[N_FIGURES];
  memset(f, 0, sizeof f);
  int rc = figures_of(run, f);
  char line[512];
  summary(run, line, sizeof line);
  mr_text_add(o, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
              "<title>meshrun report: ");
  mr_html_escaped(o, run->dir);
  mr_text_add(o, "</title>\n<style>%s</style></head>\n<body>\n<h1>Run ", style);
  mr_html_escaped(o, run->dir);
  mr_text_add(o, "</h1>\n<p class=\"state state-%s\">", run->state == MR_RUN_VANISHED ? "vanished"
                                                        : mr_run_state_name(run->state));
  mr_html_escaped(o, line);
  mr_text_add(o, "</p>\n");
  if (run->job_id[0] != '\0')
    mr_text_add(o, "<p class=\"note\">job %s, %d ranks on %d node%s</p>\n", run->job_id,
                run->world, run->nodes, run->nodes == 1 ? "" : "s");
  html_plan(o, run);
  for (int i = 0; rc == 0 && i < N_FIGURES; i++)
    html_figure(o, &f[i]);
  if (rc < 0)
    mr_text_add(o, "<p>out of memory for the figures</p>\n");
  html_events(o, run);
  mr_text_add(o, "</body></html>\n");
  for (int i = 0; i < N_FIGURES; i++)
    figure_close(&f[i]);
}

/* ---- Markdown --------------------------------------------------------- */

#define MD_ROWS 20 // a figure over steps shows about this many, evenly spread

static void md_cell(struct mr_text *o, const char *fmt, double v) {
  mr_text_add(o, " | ");
  if (isfinite(v))
    mr_text_add(o, fmt, v);
  else
    mr_text_add(o, "-");
}

static void md_figure(struct mr_text *o, const struct figure *f) {
  const struct mr_svg_chart *c = &f->chart;
  mr_text_add(o, "\n## %s\n\n%s by %s", c->title, c->y_label, c->x_label);
  if (finite_points(f) == 0) {
    mr_text_add(o, ": %s\n", f->empty != NULL ? f->empty : "no data recorded");
    return;
  }
  int every = c->n > MD_ROWS ? (c->n + MD_ROWS - 1) / MD_ROWS : 1;
  if (every > 1)
    mr_text_add(o, ", every %d%s %s, the last%s%s", every,
                every == 2 ? "nd" : every == 3 ? "rd" : "th", c->x_label,
                f->sparse[1] ? " and each with a " : "", f->sparse[1] ? f->series[1].name : "");
  mr_text_add(o, ":\n\n| %s", c->x_label);
  for (int s = 0; s < c->n_series; s++)
    mr_text_add(o, " | %s", c->series[s].name);
  mr_text_add(o, " |\n|---");
  for (int s = 0; s < c->n_series; s++)
    mr_text_add(o, "|---");
  mr_text_add(o, "|\n");
  for (int i = 0; i < c->n; i++) {
    int show = i % every == 0 || i == c->n - 1;
    for (int s = 0; s < c->n_series; s++)
      show |= f->sparse[s] && isfinite(f->y[s][i]);
    if (!show)
      continue;
    if (c->bars)
      mr_text_add(o, "| %s", c->x_names[i]);
    else
      mr_text_add(o, "| %.17g", c->x[i]);
    for (int s = 0; s < c->n_series; s++)
      md_cell(o, f->fmt, f->y[s][i]);
    mr_text_add(o, " |\n");
  }
}

void mr_report_md(const struct mr_run *run, struct mr_text *o) {
  struct figure f[N_FIGURES];
  memset(f, 0, sizeof f);
  int rc = figures_of(run, f);
  char line[512];
  summary(run, line, sizeof line);
  mr_text_add(o, "# Run %s\n\n%s\n", run->dir, line);
  if (run->job_id[0] != '\0')
    mr_text_add(o, "\njob %s, %d ranks on %d node%s\n", run->job_id, run->world, run->nodes,
                run->nodes == 1 ? "" : "s");
  mr_text_add(o, "\n## Plan\n\n");
  if (run->n_groups == 0) {
    mr_text_add(o, "no plan recorded (%s)\n", run->have_log ? "no group has started"
                : "no run.jsonl: a run of an earlier meshrun");
  } else {
    const struct mr_run_group *g = &run->groups[run->n_groups - 1];
    mr_text_add(o, "- ranks: %d on %d node%s (group %d)\n- mesh: %s\n- schedule: %s\n",
                g->world, g->nodes, g->nodes == 1 ? "" : "s", g->restart, g->mesh, g->schedule);
    mr_text_add(o, "- predicted step: %.4g s\n- MFU input: %.4g s (a step at peak FLOP/s on "
                "one device)\n- placements:\n", g->predicted_s, g->peak_device_s);
    for (int i = 0; i < g->n_placements; i++)
      mr_text_add(o, "  - %s\n", g->placements[i]);
    for (int i = 0; run->n_groups > 1 && i < run->n_groups; i++)
      mr_text_add(o, "%s- launch %d, group %d from step %lld: %d ranks, %s, predicted %.4g s\n",
                  i == 0 ? "\nEach group's plan:\n\n" : "", run->groups[i].launch + 1,
                  run->groups[i].restart, (long long)run->groups[i].first_step,
                  run->groups[i].world, run->groups[i].mesh, run->groups[i].predicted_s);
  }
  for (int i = 0; rc == 0 && i < N_FIGURES; i++)
    md_figure(o, &f[i]);
  mr_text_add(o, "\n## Restarts and failures\n\n");
  if (run->n_events == 0)
    mr_text_add(o, "none recorded\n");
  else
    mr_text_add(o, "| time (UTC) | launch | group | event | rank | what |\n"
                "|---|---|---|---|---|---|\n");
  for (int i = 0; i < run->n_events; i++) {
    const struct mr_run_event *e = &run->events[i];
    char when[32];
    utc(e->time, when, sizeof when);
    mr_text_add(o, "| %s | %d | %d | %s | ", when, e->launch + 1, e->restart, event_name(e->kind));
    if (e->rank >= 0)
      mr_text_add(o, "%d", e->rank);
    mr_text_add(o, " | ");
    for (const char *p = e->text; *p != '\0'; p++) { /* one row: newlines and bars escaped */
      size_t run_len = strcspn(p, "\n|");
      mr_text_add(o, "%.*s", (int)run_len, p);
      if ((p += run_len)[0] == '\0')
        break;
      mr_text_add(o, "%s", *p == '\n' ? "<br>" : "\\|");
    }
    mr_text_add(o, " |\n");
  }
  for (int i = 0; i < N_FIGURES; i++)
    figure_close(&f[i]);
}

/* ---- the command ------------------------------------------------------ */

static void usage(FILE *f) {
  fprintf(f, "usage: meshrun report RUN_DIR [--format html|md] [--out FILE]\n"
             "  RUN_DIR: a launch's --log-dir, of a run finished, failed or still running.\n"
             "  html (the default): one self-contained page (SVG charts, no script, nothing\n"
             "  fetched) of the loss and validation curves, throughput and MFU, predicted and\n"
             "  measured step time, memory per rank, the plan, the restarts and failures;\n"
             "  written to RUN_DIR/report.html unless --out.  md: the same figures as\n"
             "  Markdown tables, on stdout unless --out.  --out - writes to stdout.\n");
}

int mr_cmd_report(int argc, char **argv) {
  static const struct option longs[] = {{"format", required_argument, NULL, 'f'},
                                         {"out", required_argument, NULL, 'o'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
  const char *format = "html", *out = NULL;
  int c;
  optind = 1;
  while ((c = getopt_long(argc, argv, "ho:", longs, NULL)) != -1) {
    if (c == 'h') {
      usage(stdout);
      return 0;
    }
    if (c == 'f')
      format = optarg;
    else if (c == 'o')
      out = optarg;
    else {
      usage(stderr);
      return 2;
    }
  }
  int md = strcmp(format, "md") == 0;
  if (!md && strcmp(format, "html") != 0) {
    fprintf(stderr, "meshrun report: --format %s: expected html or md\n", format);
    return 2;
  }
  if (optind != argc - 1) {
    fprintf(stderr, "meshrun report: expected one run folder\n");
    usage(stderr);
    return 2;
  }
  struct mr_run run;
  if (mr_run_read(argv[optind], &run) < 0) {
    fprintf(stderr, "meshrun report: %s\n", mr_error_message());
    mr_run_close(&run);
    return 2;
  }
  struct mr_text t = {0};
  if (md)
    mr_report_md(&run, &t);
  else
    mr_report_html(&run, &t);
  char *text = mr_text_take(&t);
  char path[4200];
  if (out == NULL && !md)
    snprintf(path, sizeof path, "%s/report.html", run.dir), out = path;
  int code = 0;
  if (text == NULL) {
    fprintf(stderr, "meshrun report: out of memory for the report\n");
    code = 2;
  } else if (out == NULL || strcmp(out, "-") == 0) {
    if (fputs(text, stdout) < 0 || fflush(stdout) != 0) {
      fprintf(stderr, "meshrun report: cannot write to stdout\n");
      code = 2;
    }
  } else if (mr_file_write_text(out, text, MR_FILE_ATOMIC) < 0) {
    fprintf(stderr, "meshrun report: --out: %s\n", mr_error_message());
    code = 2;
  } else if (!md) {
    printf("meshrun: report of %s written to %s\n", run.dir, out);
  }
  free(text);
  mr_run_close(&run);
  return code;
}
