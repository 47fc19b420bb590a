#!/usr/bin/env python3
"""check_small_tmpfs.py MESHRUN - small file systems, in a mount namespace
of its own (small tmpfs mounts):
- a /dev/shm too small for the ranks' shared-memory segments at their
  asked size (a container's is 64 MiB unless --shm-size says more; here
  1 MiB, 4 ranks asking 8 MiB) runs on smaller chunks, with a warning
  naming what it made do with, and trains to the same losses, bit for bit,
  as the job on TCP;
- a /dev/shm too small even for the smallest chunks (64 KiB) is an error
  naming /dev/shm and what to do, not a rank killed by SIGBUS when it
  first touches a page: the job exits 1 saying so; the way out it names
  (MESHRUN_COMM_TRANSPORT=tcp) then runs the job;
- a checkpoint folder too small for a checkpoint is warned of at launch,
  with its free space and a checkpoint's size, and the save that does not
  fit fails the job naming the file and ENOSPC.
Exits 77 (skip) where a mount namespace cannot be made (not root, or a
container without CAP_SYS_ADMIN)."""
import json
import os
import random
import subprocess
import sys
import tempfile

SHM = "mount -t tmpfs -o size=%s tmpfs /dev/shm"
SMALL = SHM % "1m"


def main():
    meshrun = os.path.abspath(sys.argv[1])
    probe = subprocess.run(["unshare", "-m", "sh", "-c", SMALL], capture_output=True)
    if probe.returncode != 0:
        print("no mount namespace here (%s): skipped" % probe.stderr.decode().strip())
        sys.exit(77)
    src = os.environ.get("MESHRUN_SOURCE_DIR")
    configs = {"MESHRUN_CONFIGS_DIR": os.path.join(src, "configs")} if src else {}
    with tempfile.TemporaryDirectory() as d:
        rng = random.Random(3)
        with open(os.path.join(d, "train.bin"), "wb") as f:  # raw uint16 tokens
            f.write(bytes(b for _ in range(4000) for b in (rng.randrange(256), 0)))
        # 1.7 M parameters: the gradients' all-reduce fills every staging
        # buffer, so a segment merely sized (sparse) would be touched whole
        job = {"model": {"model_type": "llama", "vocab_size": 256, "hidden_size": 256,
                         "intermediate_size": 688, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "max_position_embeddings": 16},
               "data": {"train": "train.bin"},
               "train": {"steps": 3, "global_batch": 4, "seq_len": 16},
               "strategy": {"auto_mode": "manual", "data_parallel": {"degree": 4}}}
        with open(os.path.join(d, "job.json"), "w") as f:
            json.dump(job, f)

        def launch(logs, env, job="job.json", shm="1m"):
            cmd = ('%s && mkdir -p "$3" && mount -t tmpfs -o size=1m tmpfs "$3" && '
                   'exec "$0" launch --nproc 4 --threads 1 --log-dir "$1" "$2"' % (SHM % shm))
            return subprocess.run(["unshare", "-m", "sh", "-c", cmd, meshrun,
                                   os.path.join(d, logs), os.path.join(d, job),
                                   os.path.join(d, "small")],
                                  capture_output=True, text=True, timeout=120,
                                  env=dict(os.environ, **configs, **env))

        def losses(logs):
            with open(os.path.join(d, logs, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f]
            return [(m["step"], m["loss"]) for m in rows if "loss" in m and "step" in m]

        r = launch("tiny", {}, shm="64k")
        said = r.stdout + r.stderr
        assert r.returncode == 1, (r.returncode, said)
        assert "signal 7" not in said and "BUS" not in said, said
        # the asked segment by hand: a 4 KiB header, then per rank a 4 KiB
        # control block and two 1 MiB chunks; the smallest: 16 KiB chunks
        for want in ("8212 KiB of shared memory in /dev/shm (148 KiB with the smallest "
                     "chunks): No space left on device", "--shm-size",
                     "MESHRUN_COMM_TRANSPORT=tcp"):
            assert want in said, (want, said)
        r = launch("tcp", {"MESHRUN_COMM_TRANSPORT": "tcp"})
        assert r.returncode == 0, (r.returncode, r.stdout + r.stderr)
        assert "meshrun: done: 3 steps" in r.stdout, r.stdout
        r = launch("fitted", {})
        said = r.stdout + r.stderr
        assert r.returncode == 0, (r.returncode, said)
        assert "meshrun: done: 3 steps" in r.stdout, r.stdout
        assert "/dev/shm has no room for 8212 KiB; made do with" in said, said
        assert "--shm-size" in said, said
        want, got = losses("tcp"), losses("fitted")
        assert len(want) == 3 and got == want, (want, got)

        job["checkpoint"] = {"dir": "small/ck", "save_interval_steps": 2}
        with open(os.path.join(d, "ckpt.json"), "w") as f:
            json.dump(job, f)
        r = launch("ckpt", {"MESHRUN_COMM_TRANSPORT": "tcp"}, "ckpt.json")
        said = r.stdout + r.stderr
        assert r.returncode == 1, (r.returncode, said)
        # the model's parameters by hand: embeddings and head, per layer q, k,
        # v, o, gate, up, down and two norms, the final norm
        h, f, v, n = 256, 688, 256, 2
        params = 2 * v * h + n * (4 * h * h + 3 * h * f + 2 * h) + h
        for want in ("warning: checkpoint.dir %s/small/ck has 1 MiB free; a checkpoint of this "
                     "model takes about %.0f MiB" % (d, 12 * params / 2**20),
                     "checkpoint of step 2: %s/small/ck/step-00000002/rank-" % d,
                     "No space left on device"):
            assert want in said, (want, said)
    print("a small /dev/shm: smaller chunks, warned of, the same losses as TCP; too "
          "small: named, with its way out, which runs; a small checkpoint folder: "
          "warned of, and the save that does not fit named")


if __name__ == "__main__":
    main()
