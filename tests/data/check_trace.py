#!/usr/bin/env python3
"""check_trace.py MESHRUN - `meshrun launch --trace`: every rank's timeline
and the merged file, held to the Trace Event Format's rules and to what the
job must have done:

- phases X (complete), b/e (async) and M (metadata) only; every X slice has
  a start and a duration >= 0, every b its one e, later; slices on one
  thread nest (no partial overlaps); ranks are processes (pid = rank) with
  a process name, streams threads with names;
- a "step N" slice on each rank for exactly the steps asked for (the
  --trace-steps range, or the default a few after warm-up from the job
  file's trace section), every compute slice inside one;
- every collective is matched across its group: the members its group
  label names each hold one with the same number on the group, operation
  and bytes; none ends on one member before it began on another (one
  clock: checked across two nodes whose monotonic clocks differ by 1000 s,
  the second node run in a time namespace);
- pipeline sends and receives pair up, rank to rank, with their bytes;
  the data-parallel replicas of a stage run the same kernels in the same
  order; a checkpoint inside the range is on each rank's checkpoint
  thread with the bytes of the weights and both AdamW moments;
- the merged trace.json is the ranks' files together;
- a --trace-steps outside the run, malformed, or without --trace is
  refused (exit 2, naming the flag and the value), as is a trace.steps in
  the job file; a trace folder that cannot be made is said once and the
  job trains to the end."""
import json
import os
import re
import socket
import subprocess
import sys
import tempfile

STEPS = 6
H, INTER, LAYERS, VOCAB, HEADS = 64, 128, 2, 256, 4


def fail(msg, out=""):
    print("FAIL: %s" % msg)
    if out:
        print(out[-4000:])
    sys.exit(1)


def param_count():
    per_layer = 4 * H * H + 3 * H * INTER + 2 * H  # q k v o, gate up down, two norms
    return 2 * VOCAB * H + LAYERS * per_layer + H  # embedding, lm_head, final norm


def write_job(d, name, strategy, trace=None, steps=STEPS):
    job = {"model": {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": H,
                     "intermediate_size": INTER, "num_hidden_layers": LAYERS,
                     "num_attention_heads": HEADS, "max_position_embeddings": 32},
           "data": {"train": "train.bin"},
           "train": {"steps": steps, "global_batch": 8, "seq_len": 32},
           "strategy": dict(strategy, auto_mode="manual"),
           "checkpoint": {"dir": name + "-ck", "save_interval_steps": 4}}
    if trace is not None:
        job["trace"] = trace
    with open(os.path.join(d, name + ".json"), "w") as f:
        json.dump(job, f)
    return name + ".json"


def group_ranks(label):
    m = re.fullmatch(r"[^{]*\{([0-9,]*)\}", label)
    if not m:
        fail("group label %r is not name{ranks}" % label)
    return [int(x) for x in m.group(1).split(",")]


def check_nesting(slices, where):
    stack = []
    for s in sorted(slices, key=lambda s: (s["ts"], -s["dur"])):
        end = s["ts"] + s["dur"]
        while stack and s["ts"] >= stack[-1] - 0.01:
            stack.pop()
        if stack and end > stack[-1] + 0.01:
            fail("%s: slice %s (%.3f..%.3f) overlaps its parent's end %.3f"
                 % (where, s["name"], s["ts"], end, stack[-1]))
        stack.append(end)


def check_trace(events, ranks_info, world, first, last, ckpt_steps):
    """Everything the module docstring lists, for one run's merged events."""
    by_pid = {}
    for e in events:
        if e.get("ph") not in ("X", "b", "e", "M"):
            fail("event with phase %r: %s" % (e.get("ph"), e))
        if not isinstance(e.get("pid"), int) or not 0 <= e["pid"] < world:
            fail("event outside the ranks: %s" % e)
        if e["ph"] != "M" and not isinstance(e.get("ts"), (int, float)):
            fail("event without a time: %s" % e)
        by_pid.setdefault(e["pid"], []).append(e)
    if sorted(by_pid) != list(range(world)):
        fail("ranks with events: %s, expected 0..%d" % (sorted(by_pid), world - 1))
    err_us = {r["rank"]: r["clock_error_ns"] / 1e3 for r in ranks_info}
    collectives, sends, recvs, kernels = {}, {}, {}, {}
    for pid, evs in by_pid.items():
        meta = {(e["name"], e.get("tid")): e["args"] for e in evs if e["ph"] == "M"}
        if "rank %d" % pid not in meta.get(("process_name", None), {}).get("name", ""):
            fail("rank %d: no process name" % pid)
        for tid, name in ((1, "compute"), (2, "comm"), (3, "checkpoint")):
            if meta.get(("thread_name", tid), {}).get("name") != name:
                fail("rank %d: thread %d is not named %s" % (pid, tid, name))
        xs = [e for e in evs if e["ph"] == "X"]
        for e in xs:
            if not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0:
                fail("rank %d: slice without a duration >= 0: %s" % (pid, e))
        for tid in (1, 3):
            check_nesting([e for e in xs if e["tid"] == tid], "rank %d thread %d" % (pid, tid))
        steps = sorted((e for e in xs if e["cat"] == "step"), key=lambda e: e["ts"])
        if [e["name"] for e in steps] != ["step %d" % s for s in range(first, last + 1)]:
            fail("rank %d: step slices %s, expected steps %d..%d"
                 % (pid, [e["name"] for e in steps], first, last))
        for e in xs:
            if e["tid"] == 1 and e["cat"] != "step" and not any(
                    s["ts"] - 0.01 <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 0.01
                    for s in steps):
                fail("rank %d: %s outside every step slice" % (pid, e["name"]))
        for s in steps:
            n = s["args"]["step"]
            ks = [(e["cat"], e["name"]) for e in xs if e["cat"] in ("forward", "backward")
                  and e["args"]["step"] == n]
            if not any(c == "forward" for c, _ in ks) or not any(c == "backward" for c, _ in ks):
                fail("rank %d step %d: no forward or no backward kernels" % (pid, n))
            kernels[(pid, n)] = ks
        for e in xs:
            m = re.fullmatch(r"recv from rank (\d+)", e["name"])
            if m and e["cat"] != "bubble":
                fail("rank %d: a pipeline receive not marked as bubble: %s" % (pid, e))
        ckpt = [e for e in xs if e["name"] == "checkpoint write"]
        want = [s for s in ckpt_steps if first <= s <= last]
        if len(ckpt) != len(want) or any(e["tid"] != 3 or e["args"]["bytes"] < 0 for e in ckpt):
            fail("rank %d: checkpoint writes %s for saves at %s" % (pid, ckpt, want))
        opened = {}
        for e in sorted((e for e in evs if e["ph"] in "be"), key=lambda e: (e["ts"], e["ph"])):
            if e["ph"] == "b":
                if e["id"] in opened:
                    fail("rank %d: async id %s begun twice" % (pid, e["id"]))
                opened[e["id"]] = e
                continue
            b = opened.pop(e["id"], None)
            if b is None:
                fail("rank %d: end without a begin: %s" % (pid, e))
            a = b["args"]
            ranks = group_ranks(a["group"])
            if pid not in ranks:
                fail("rank %d: an operation on a group without it: %s" % (pid, b))
            rec = (pid, b["name"], a["bytes"], b["ts"], e["ts"])
            if b["name"] in ("Send", "Recv"):
                peer = ranks[a["peer"]]
                (sends if b["name"] == "Send" else recvs).setdefault(
                    (pid, peer) if b["name"] == "Send" else (peer, pid), []).append(a["bytes"])
            else:
                collectives.setdefault((a["group"], a["seq"]), []).append(rec)
        if opened:
            fail("rank %d: %d async slices never end" % (pid, len(opened)))
    if not collectives:
        fail("no collective in the trace")
    data_groups = set()
    for (label, seq), recs in collectives.items():
        ranks = group_ranks(label)
        if sorted(r[0] for r in recs) != sorted(ranks):
            fail("%s #%d: traced on ranks %s, its members are %s"
                 % (label, seq, sorted(r[0] for r in recs), ranks))
        if len({(r[1], r[2]) for r in recs}) != 1:
            fail("%s #%d: members disagree on the operation: %s" % (label, seq, recs))
        if recs[0][1] in ("AllReduce", "AllGather", "ReduceScatter", "AllToAll"):
            for p in recs:
                for q in recs:
                    tol = err_us[p[0]] + err_us[q[0]] + 5
                    if p[3] > q[4] + tol:
                        fail("%s #%d %s: rank %d began it at %.1f us, after rank %d had it done "
                             "at %.1f us: the ranks are not on one clock"
                             % (label, seq, p[1], p[0], p[3], q[0], q[4]))
        if recs[0][1] == "AllReduce" and label.startswith("data"):
            data_groups.add(tuple(ranks))
    if sends != recvs:
        fail("pipeline sends %s and receives %s do not pair up" % (sends, recvs))
    for ranks in data_groups:
        for n in range(first, last + 1):
            seqs = [kernels[(r, n)] for r in ranks]
            if any(s != seqs[0] for s in seqs):
                fail("step %d: data-parallel replicas %s ran different kernels" % (n, ranks))
    return collectives, sends


def load_run(tdir, world):
    merged = json.load(open(os.path.join(tdir, "trace.json")))
    per_rank = []
    for r in range(world):
        t = json.load(open(os.path.join(tdir, "rank-%d.json" % r)))
        if t["otherData"]["rank"] != r:
            fail("rank-%d.json says it is rank %s" % (r, t["otherData"]["rank"]))
        per_rank.extend(t["traceEvents"])
    key = lambda e: json.dumps(e, sort_keys=True)
    if sorted(map(key, merged["traceEvents"])) != sorted(map(key, per_rank)):
        fail("trace.json is not the ranks' files together")
    if [r["rank"] for r in merged["otherData"]["ranks"]] != list(range(world)):
        fail("trace.json's ranks: %s" % merged["otherData"]["ranks"])
    return merged


def run(argv, cwd, env, expect=0, timeout=240):
    p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != expect:
        fail("%s: exit %d, expected %d" % (" ".join(argv[1:]), p.returncode, expect),
             p.stdout + p.stderr)
    return p.stdout + p.stderr


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def main():
    meshrun = os.path.abspath(sys.argv[1])
    env = dict(os.environ)
    src = os.environ.get("MESHRUN_SOURCE_DIR")
    if src:
        env["MESHRUN_CONFIGS_DIR"] = os.path.join(src, "configs")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "train.bin"), "wb") as f:
            f.write(bytes(b for i in range(20000) for b in ((i * 7919) % 251, 0)))
        launch = [meshrun, "launch", "--threads", "1"]
        # 1. data x pipeline on two nodes, the second's clock 1000 s ahead
        dp_pp = write_job(d, "dppp", {"data_parallel": {"degree": 2},
                                      "pipeline_parallel": {"degree": 2}})
        port = free_port()
        nodes = ["--nnodes", "2", "--nproc", "2", "--master", "127.0.0.1:%d" % port,
                 "--token-file", "tok", "--trace", "tr1", "--trace-steps", "3:4"]
        tenv = dict(env, MESHRUN_COMM_TRANSPORT="tcp")
        n1 = subprocess.Popen(["unshare", "--time", "--monotonic", "1000"] + launch + nodes +
                              ["--node-rank", "1", "--log-dir", "log1b", dp_pp], cwd=d,
                              env=tenv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        out0 = run(launch + nodes + ["--node-rank", "0", "--log-dir", "log1", dp_pp], d, tenv)
        out1 = n1.communicate(timeout=120)[0]
        if n1.returncode != 0:
            fail("node 1 (its clock 1000 s ahead): exit %d" % n1.returncode, out1)
        merged = load_run(os.path.join(d, "tr1"), 4)
        info = merged["otherData"]["ranks"]
        skews = [r["clock_offset_ns"] / 1e9 for r in info]
        if not (all(abs(s) < 0.01 for s in skews[:2]) and all(abs(s + 1000) < 0.01
                                                             for s in skews[2:])):
            fail("clock offsets %s s: expected about 0 on node 0 and -1000 on node 1" % skews,
                 out0)
        _, sends = check_trace(merged["traceEvents"], info, 4, 3, 4, [4])
        if not sends:
            fail("a pipeline of two stages traced no send")
        writes = sum(e["args"]["bytes"] for e in merged["traceEvents"]
                     if e.get("name") == "checkpoint write")
        if not 12 * param_count() <= writes <= 12 * param_count() * 1.01:
            fail("checkpoint writes of %d bytes; weights and two moments are %d"
                 % (writes, 12 * param_count()))
        # 2. tensor x data from the job file's trace section: the default steps
        tp_dp = write_job(d, "tpdp", {"data_parallel": {"degree": 2},
                                      "tensor_parallel": {"degree": 2}}, trace={"dir": "tr2"})
        run(launch + ["--nproc", "4", "--log-dir", "log2", tp_dp], d, env)
        merged = load_run(os.path.join(d, "tr2"), 4)
        colls, _ = check_trace(merged["traceEvents"], merged["otherData"]["ranks"], 4, 3, 5, [4])
        if not any(label.startswith("model") for label, _ in colls):
            fail("tensor parallelism traced no collective on a model group")
        # 3. refused: exit 2, naming the flag (or field) and the value
        one = write_job(d, "one", {"data_parallel": {"degree": 1}})
        for flags, said in ((["--trace", "x", "--trace-steps", "5:9"], "outside the run"),
                            (["--trace", "x", "--trace-steps", "0:3"], "1 <= FIRST <= LAST"),
                            (["--trace", "x", "--trace-steps", "4:2"], "1 <= FIRST <= LAST"),
                            (["--trace", "x", "--trace-steps", "three"], "FIRST:LAST"),
                            (["--trace-steps", "2:3"], "--trace DIR")):
            out = run(launch + ["--nproc", "1"] + flags + [one], d, env, expect=2)
            if "--trace-steps" not in out or said not in out or flags[-1] not in out:
                fail("%s: the refusal does not name the flag, the value and why" % flags, out)
        bad = write_job(d, "bad", {"data_parallel": {"degree": 1}},
                        trace={"dir": "t", "steps": "2:99"})
        out = run(launch + ["--nproc", "1", bad], d, env, expect=2)
        if "bad.json" not in out or "trace.steps" not in out or "2:99" not in out:
            fail("trace.steps 2:99: the refusal does not name the file, field and value", out)
        # 4. a trace folder that cannot be made: said once, the job trains on
        out = run(launch + ["--nproc", "1", "--log-dir", "log4", "--trace", "/proc/no/trace",
                            one], d, env)
        if out.count("/proc/no/trace") != 1 or "done: %d steps" % STEPS not in out:
            fail("an unmakeable trace folder: expected one warning and a finished job", out)
    print("trace: ok")


if __name__ == "__main__":
    main()
