#!/usr/bin/env python3
"""check_tensorboard.py MESHRUN - the TensorBoard event files a run writes,
read back by TensorBoard's own reader (installed from PyPI into the build's
pydeps folder; never a dependency of meshrun) and checked against
metrics.jsonl:

- every file is TFRecords end to end, each length and payload under its
  masked CRC32C (worked here from the Castagnoli polynomial), and opens
  with the file-version record;
- a run whose group restarts (a rank killed) and whose launcher is killed
  and launched again writes each step once over its files, with the
  values of the step's first record in metrics.jsonl: loss, lr, grad
  norm, loss scale, tokens/s, step time, communication wait, peak memory,
  restarts;
- MFU is the plan's (`meshrun plan --json`) scaled by the predicted over
  the measured step time, and the predicted step time is the plan's.

Exits 77 (skip) where tensorboard cannot be had."""
import glob
import json
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import time

import pydeps

SKIP = 77
STEPS = 14


def fail(msg, out=""):
    print("FAIL: %s" % msg)
    if out:
        print(out[-4000:])
    sys.exit(1)


def crc32c(data):
    table = crc32c.table
    c = 0xffffffff
    for b in data:
        c = table[(c ^ b) & 0xff] ^ (c >> 8)
    return c ^ 0xffffffff


def _table():
    t = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82f63b78 if c & 1 else c >> 1
        t.append(c)
    return t


crc32c.table = _table()


def masked(c):
    return (((c >> 15) | (c << 17)) + 0xa282ead8) & 0xffffffff


def check_framing(path):
    """The file's payloads, each checked against its CRCs."""
    data = open(path, "rb").read()
    out, i = [], 0
    while i < len(data):
        if len(data) - i < 12:
            fail("%s: %d bytes of a record header at offset %d" % (path, len(data) - i, i))
        n, hcrc = struct.unpack_from("<QI", data, i)
        if masked(crc32c(data[i:i + 8])) != hcrc:
            fail("%s: the length at offset %d fails its CRC" % (path, i))
        body = data[i + 12:i + 12 + n]
        if len(body) != n or len(data) < i + 16 + n:
            fail("%s: a record of %d bytes cut short at offset %d" % (path, n, i))
        (dcrc,) = struct.unpack_from("<I", data, i + 12 + n)
        if masked(crc32c(body)) != dcrc:
            fail("%s: the record at offset %d fails its CRC" % (path, i))
        out.append(body)
        i += 16 + n
    return out


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def metrics_records(path):
    firsts = {}
    for line in open(path):
        r = json.loads(line)
        firsts.setdefault(r["step"], r)
    return firsts


def wait_for(what, pred, limit=90):
    t0 = time.time()
    while time.time() - t0 < limit:
        if pred():
            return
        time.sleep(0.01)
    fail("%s: not within %d s" % (what, limit))


def records_with(path, cond):
    try:
        return [r for r in (json.loads(line) for line in open(path) if line.endswith("\n"))
                if cond(r)]
    except FileNotFoundError:
        return []


def main():
    meshrun = os.path.abspath(sys.argv[1])
    if not pydeps.ensure(["tensorboard"], "tensorboard==2.21.0"):
        sys.exit(SKIP)
    from tensorboard.backend.event_processing import event_file_loader
    from tensorboard.compat.proto import event_pb2
    src = os.environ.get("MESHRUN_SOURCE_DIR")
    env = dict(os.environ, MESHRUN_TEST_COMM_WAIT_MS="10")  # steps long enough to aim at
    if src:
        env["MESHRUN_CONFIGS_DIR"] = os.path.join(src, "configs")
    with tempfile.TemporaryDirectory() as d:
        rng = random.Random(9)
        with open(os.path.join(d, "train.bin"), "wb") as f:
            f.write(bytes(b for _ in range(8000) for b in (rng.randrange(256), 0)))
        job = {"model": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
                         "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "max_position_embeddings": 32},
               "data": {"train": "train.bin"},
               "train": {"steps": STEPS, "global_batch": 4, "seq_len": 32},
               "checkpoint": {"dir": "ck", "save_interval_steps": 4}}
        with open(os.path.join(d, "job.json"), "w") as f:
            json.dump(job, f)
        argv = [meshrun, "launch", "--nproc", "2", "--threads", "1", "--max-restarts", "2",
                "--log-dir", "run", "job.json"]
        metrics = os.path.join(d, "run", "metrics.jsonl")
        # launch A: a rank killed after step 6 (the group resumes at 5),
        # then the launcher killed after step 10 of the restarted group
        a = subprocess.Popen(argv, cwd=d, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        try:
            wait_for("step 6", lambda: records_with(metrics, lambda r: r["step"] >= 6))
            kids = subprocess.run(["pgrep", "-P", str(a.pid)], capture_output=True,
                                  text=True).stdout.split()
            if len(kids) != 2:
                fail("expected 2 workers, found %s" % kids)
            os.kill(int(kids[1]), signal.SIGKILL)
            wait_for("step 10 after the restart", lambda: records_with(
                metrics, lambda r: r["restart"] == 1 and r["step"] >= 10))
            os.kill(a.pid, signal.SIGKILL)
            a.communicate(timeout=30)
        finally:
            if a.poll() is None:
                a.kill()
                a.communicate()
        time.sleep(0.5)  # its workers end with it
        b = subprocess.run(argv, cwd=d, env=env, capture_output=True, text=True, timeout=120)
        if b.returncode != 0:
            fail("the launch again: exit %d" % b.returncode, b.stdout + b.stderr)
        firsts = metrics_records(metrics)
        if sorted(firsts) != list(range(1, STEPS + 1)):
            fail("metrics.jsonl has steps %s" % sorted(firsts))
        redone = sum(1 for _ in open(metrics)) - STEPS
        if redone < 2:
            fail("only %d steps trained again: the kills did not land as meant" % redone)
        files = sorted(glob.glob(os.path.join(d, "run", "events.out.tfevents.*")))
        if len(files) != 2:
            fail("expected an event file for each launch, found %s" % files)
        seen = {}
        for path in files:
            bodies = check_framing(path)
            events = [event_pb2.Event.FromString(r) for r in
                      event_file_loader.RawEventFileLoader(path).Load()]
            if len(events) != len(bodies) or events[0].file_version != "brain.Event:2":
                fail("%s: %d events for %d records, first %r" % (path, len(events), len(bodies),
                                                                  events[0]))
            for ev in events[1:]:
                if ev.step in seen:
                    fail("step %d written twice (%s and %s)" % (ev.step, seen[ev.step][0], path))
                seen[ev.step] = (path, {v.tag: v.simple_value for v in ev.summary.value})
        if sorted(seen) != list(range(1, STEPS + 1)):
            fail("the event files hold steps %s" % sorted(seen))
        plan = json.loads(subprocess.run([meshrun, "plan", "--nproc", "2", "--json", "job.json"],
                                         cwd=d, env=env, capture_output=True, text=True,
                                         check=True).stdout)
        chosen = plan.get("chosen", plan)
        pred_step, pred_mfu = chosen["step_time_s"], chosen["mfu"]
        pairs = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm",
                 "train/loss_scale": "loss_scale", "perf/tokens_per_s": "tokens_per_s",
                 "perf/step_time_s": "step_time_s", "perf/comm_wait_s": "comm_wait_s",
                 "train/restarts": "restart"}
        for step, (path, vals) in sorted(seen.items()):
            r = firsts[step]
            for tag, key in pairs.items():
                # metrics.jsonl prints timings to 6 digits, the rest to 9: a
                # float's every bit, a double's to within a float's rounding
                tol = 6e-6 if key in ("tokens_per_s", "step_time_s", "comm_wait_s") else \
                    0.0 if key in ("loss", "lr", "restart") else 1.2e-7
                v = vals.get(tag)
                if v is None or (v != f32(r[key]) if tol == 0 else
                                 abs(v - r[key]) > tol * abs(r[key])):
                    fail("step %d: %s is %r in %s, metrics.jsonl says %r" %
                         (step, tag, v, path, r[key]))
            if vals["memory/peak_mib"] != f32(r["peak_memory_bytes"] / 1048576.0):
                fail("step %d: memory/peak_mib %r, metrics.jsonl %r bytes" %
                     (step, vals["memory/peak_mib"], r["peak_memory_bytes"]))
            if abs(vals["perf/predicted_step_s"] - pred_step) > 1e-6 * pred_step:
                fail("step %d: predicted step %r, the plan's %r" %
                     (step, vals["perf/predicted_step_s"], pred_step))
            want = pred_mfu * pred_step / r["step_time_s"]
            if abs(vals["perf/mfu"] - want) > 1e-4 * want + 1e-9:
                fail("step %d: MFU %r, the plan's %r x %r / %r = %r" %
                     (step, vals["perf/mfu"], pred_mfu, pred_step, r["step_time_s"], want))
            for k in range(2):
                if "memory/peak_mib/rank_%d" % k not in vals:
                    fail("step %d: no memory/peak_mib/rank_%d" % (step, k))
        print("ok: %d steps over %d event files, each once (%d trained again), every scalar "
              "metrics.jsonl's" % (STEPS, len(files), redone))


if __name__ == "__main__":
    main()
