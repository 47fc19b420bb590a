#!/usr/bin/env python3
"""check_report.py MESHRUN - `meshrun report` of a real run, opened in
headless Chromium (Debian's package `chromium`), and checked against an
independent reading of the run folder:

- a run whose rank 1 is killed after step 6 (the group restarts from its
  checkpoint at step 4) is reported while it runs (state "running") and
  once done;
- Chromium renders the page (a screenshot of the size asked for, of
  charts and not a blank page) and its DOM (--dump-dom) holds every chart
  with points; each point, read back through the chart's axes, is
  metrics.jsonl's (a step's last record): training and validation loss,
  tokens/s, MFU (the plan's, `meshrun plan --json`, scaled by the
  predicted over the measured step time), the measured, predicted and
  communication step times; the memory bars are every rank's, the largest
  the metrics' peak; the restart is marked at the step the second group
  began; the failure is listed with its rank and reason;
- the page fetches nothing and runs no script.

Exits 77 (skip) where chromium is not installed."""
import html.parser
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

SKIP = 77
STEPS = 12


def fail(msg, out=""):
    print("FAIL: %s" % msg)
    if out:
        print(out[-4000:])
    sys.exit(1)


def records(path):
    try:
        return [json.loads(line) for line in open(path) if line.endswith("\n")]
    except FileNotFoundError:
        return []


def wait_for(what, pred, limit=90):
    t0 = time.time()
    while time.time() - t0 < limit:
        if pred():
            return
        time.sleep(0.01)
    fail("%s: not within %d s" % (what, limit))


class Charts(html.parser.HTMLParser):
    """Every <svg class="plot">: its axes, series and marks; the page's
    scripts and external references; the events table's rows."""

    def __init__(self):
        super().__init__()
        self.charts, self.scripts, self.external, self.rows = {}, 0, [], []
        self.cur = None
        self.row = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for k in ("src", "href"):
            if k in a and not a[k].startswith("#"):
                self.external.append(a[k])
        if tag == "script":
            self.scripts += 1
        if tag == "svg" and "plot" in a.get("class", ""):
            self.cur = {"x": [float(v) for v in a["data-x"].split()],
                        "y": [float(v) for v in a["data-y"].split()],
                        "box": [float(v) for v in a["data-box"].split()],
                        "lines": {}, "bars": {}, "marks": []}
            self.charts[a["id"]] = self.cur
        elif self.cur is not None and tag == "polyline":
            pts = [tuple(map(float, p.split(","))) for p in a["points"].split()]
            self.cur["lines"][a["data-series"]] = pts
        elif self.cur is not None and tag == "rect" and a.get("class") == "bar":
            self.cur["bars"].setdefault(a["data-series"], []).append(
                (float(a["y"]), float(a["height"])))
        elif self.cur is not None and tag == "line" and a.get("class") == "mark":
            self.cur["marks"].append(float(a["data-x"]))
        elif tag == "tr":
            self.row = []
        elif tag == "td" and self.row is not None:
            self.row.append("")

    def handle_endtag(self, tag):
        if tag == "svg":
            self.cur = None
        elif tag == "tr" and self.row is not None:
            self.rows.append(self.row)
            self.row = None

    def handle_data(self, data):
        if self.row:
            self.row[-1] += data


def data_of(chart, px, py):
    """A point's pixels back to the data through the chart's axes."""
    (x0, x1), (y0, y1), (left, top, right, bottom) = chart["x"], chart["y"], chart["box"]
    return (x0 + (px - left) / (right - left) * (x1 - x0),
            y0 + (bottom - py) / (bottom - top) * (y1 - y0))


def check_line(charts, cid, series, want):
    """The series of chart cid plots want, {step: value}, point for point."""
    if cid not in charts:
        fail("no chart %s; charts: %s" % (cid, sorted(charts)))
    c = charts[cid]
    pts = c["lines"].get(series)
    if not pts:
        fail("chart %s: no points of %s (series: %s)" % (cid, series, sorted(c["lines"])))
    # points are written to 0.01 px: half of that in data units
    tol_x = 0.006 * (c["x"][1] - c["x"][0]) / (c["box"][2] - c["box"][0])
    tol_y = 0.006 * (c["y"][1] - c["y"][0]) / (c["box"][3] - c["box"][1])
    got = [data_of(c, px, py) for px, py in pts]
    if len(got) != len(want):
        fail("chart %s: %d points of %s, metrics.jsonl has %d" % (cid, len(got), series,
                                                                 len(want)))
    for (x, y), (step, v) in zip(got, sorted(want.items())):
        if abs(x - step) > tol_x or abs(y - v) > tol_y + 1e-9 * abs(v):
            fail("chart %s, %s: the point at step %d reads (%g, %g); metrics.jsonl: %g" %
                 (cid, series, step, x, y, v))
    return len(got)


def png_size(path):
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        fail("%s: not a PNG" % path)
    return struct.unpack(">II", data[16:24]), len(data)


def main():
    meshrun = os.path.abspath(sys.argv[1])
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("skip: no chromium (Debian's package chromium; scripts/setup installs it)")
        sys.exit(SKIP)
    src = os.environ.get("MESHRUN_SOURCE_DIR")
    env = dict(os.environ, MESHRUN_TEST_COMM_WAIT_MS="10")  # steps long enough to aim at
    if src:
        env["MESHRUN_CONFIGS_DIR"] = os.path.join(src, "configs")
    with tempfile.TemporaryDirectory() as d:
        rng = random.Random(5)
        for name in ("train.bin", "val.bin"):
            with open(os.path.join(d, name), "wb") as f:
                f.write(bytes(b for _ in range(8000) for b in (rng.randrange(256), 0)))
        job = {"model": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
                         "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "max_position_embeddings": 32},
               "data": {"train": "train.bin", "val": "val.bin"},
               "train": {"steps": STEPS, "global_batch": 4, "seq_len": 32,
                         "eval_interval_steps": 4, "eval_batches": 1},
               "checkpoint": {"dir": "ck", "save_interval_steps": 4}}
        with open(os.path.join(d, "job.json"), "w") as f:
            json.dump(job, f)
        run = os.path.join(d, "run")
        metrics = os.path.join(run, "metrics.jsonl")
        a = subprocess.Popen([meshrun, "launch", "--nproc", "2", "--threads", "1",
                              "--max-restarts", "1", "--log-dir", "run", "job.json"],
                             cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        try:
            wait_for("step 2", lambda: any(r["step"] >= 2 for r in records(metrics)))
            live = subprocess.run([meshrun, "report", "--format", "md", run], capture_output=True,
                                  text=True, timeout=30)
            if live.returncode != 0 or "\nrunning; step " not in live.stdout:
                fail("the running run's report: exit %d" % live.returncode,
                     live.stdout + live.stderr)
            wait_for("step 6", lambda: any(r["step"] >= 6 for r in records(metrics)))
            kids = subprocess.run(["pgrep", "-P", str(a.pid)], capture_output=True,
                                  text=True).stdout.split()
            if len(kids) != 2:
                fail("expected 2 workers, found %s" % kids)
            os.kill(int(kids[1]), signal.SIGKILL)
            out, _ = a.communicate(timeout=120)
        finally:
            if a.poll() is None:
                a.kill()
                a.communicate()
        if a.returncode != 0:
            fail("the launch: exit %d" % a.returncode, out)
        r = subprocess.run([meshrun, "report", run], capture_output=True, text=True, timeout=30)
        page = os.path.join(run, "report.html")
        if r.returncode != 0 or not os.path.exists(page):
            fail("meshrun report: exit %d" % r.returncode, r.stdout + r.stderr)

        shot = os.path.join(d, "report.png")
        browser = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                   "--user-data-dir=" + os.path.join(d, "profile"), "--window-size=800,2600"]
        benv = dict(os.environ, HOME=d)
        s = subprocess.run(browser + ["--screenshot=" + shot, "file://" + page],
                           capture_output=True, text=True, timeout=120, env=benv)
        if not os.path.exists(shot):
            fail("chromium made no screenshot: exit %d" % s.returncode, s.stderr)
        (w, h), nbytes = png_size(shot)
        if (w, h) != (800, 2600) or nbytes < 30000:  # a blank page compresses to a few KiB
            fail("the screenshot is %dx%d, %d bytes: not the page's charts" % (w, h, nbytes))
        dom = subprocess.run(browser + ["--dump-dom", "file://" + page], capture_output=True,
                             text=True, timeout=120, env=benv)
        if dom.returncode != 0 or "<svg" not in dom.stdout:
            fail("chromium --dump-dom: exit %d" % dom.returncode, dom.stderr)
        p = Charts()
        p.feed(dom.stdout)
        if p.scripts or p.external:
            fail("the page has %d scripts and fetches %s" % (p.scripts, p.external))

        # the independent reading: each step's last record
        recs = records(metrics)
        last = {}
        for rec in recs:
            last[rec["step"]] = rec
        if sorted(last) != list(range(1, STEPS + 1)):
            fail("metrics.jsonl has steps %s" % sorted(last))
        second = min(rec["step"] for rec in recs if rec["restart"] == 1)
        plan = json.loads(subprocess.run([meshrun, "plan", "--nproc", "2", "--json", "job.json"],
                                         cwd=d, env=env, capture_output=True, text=True,
                                         check=True).stdout)
        chosen = plan.get("chosen", plan)
        pred_step, pred_mfu = chosen["step_time_s"], chosen["mfu"]
        col = {k: {s: v[k] for s, v in last.items() if v.get(k) is not None}
               for k in ("loss", "val_loss", "tokens_per_s", "step_time_s", "comm_wait_s")}
        if len(col["val_loss"]) != STEPS // 4:
            fail("metrics.jsonl has validation losses at %s" % sorted(col["val_loss"]))
        n = check_line(p.charts, "plot-loss", "training loss", col["loss"])
        n += check_line(p.charts, "plot-loss", "validation loss", col["val_loss"])
        n += check_line(p.charts, "plot-throughput", "tokens/s", col["tokens_per_s"])
        n += check_line(p.charts, "plot-mfu", "MFU %", {
            s: 100 * pred_mfu * pred_step / t for s, t in col["step_time_s"].items()})
        n += check_line(p.charts, "plot-step_time", "measured", col["step_time_s"])
        n += check_line(p.charts, "plot-step_time", "predicted",
                        {s: pred_step for s in col["step_time_s"]})
        n += check_line(p.charts, "plot-step_time", "communication wait", col["comm_wait_s"])
        for cid in ("plot-loss", "plot-throughput", "plot-mfu", "plot-step_time"):
            if p.charts[cid]["marks"] != [second]:
                fail("%s: restarts marked at %s, the second group began at step %d" %
                     (cid, p.charts[cid]["marks"], second))
        mem = p.charts.get("plot-memory")
        if mem is None or sorted(mem["bars"]) != ["peak memory", "resident peak"] or \
                any(len(b) != 2 for b in mem["bars"].values()):
            fail("the memory chart has bars %s, not 2 series of 2 ranks" %
                 (mem and mem["bars"]))
        if mem["y"][0] != 0:
            fail("the memory chart's axis starts at %g, not 0" % mem["y"][0])
        peaks = [data_of(mem, 0, y)[1] for y, _ in mem["bars"]["peak memory"]]
        want = max(rec["peak_memory_bytes"] for rec in recs) / 1048576.0
        tol = 0.012 * (mem["y"][1] - mem["y"][0]) / (mem["box"][3] - mem["box"][1])
        if abs(max(peaks) - want) > tol or min(peaks) <= 0:
            fail("memory bars %s MiB; metrics.jsonl's peak %g MiB" % (peaks, want))
        n += 4
        fails = [row for row in p.rows if len(row) == 6 and row[3] == "failure"]
        if len(fails) != 1 or fails[0][4] != "1" or "killed by signal 9" not in fails[0][5]:
            fail("the failures listed: %s" % fails)
        if not any(len(row) == 6 and row[3] == "restart" and "after a failure" in row[5]
                   for row in p.rows):
            fail("no restart after a failure listed: %s" % p.rows)
        md = subprocess.run([meshrun, "report", "--format", "md", run], capture_output=True,
                            text=True, timeout=30)
        if md.returncode != 0 or "\ndone (exit 0); step %d of %d" % (STEPS, STEPS) not in md.stdout:
            fail("the finished run's md report: exit %d" % md.returncode, md.stdout + md.stderr)
        print("ok: %d points over %d charts read back from Chromium's page as metrics.jsonl has "
              "them; a %dx%d screenshot of %d bytes" % (n, len(p.charts), w, h, nbytes))


if __name__ == "__main__":
    main()
