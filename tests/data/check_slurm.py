#!/usr/bin/env python3
"""check_slurm.py MESHRUN - meshrun under a real Slurm (Debian's slurm-wlm
and munge), started here on the loopback: munged with a key of its own,
slurmctld, and two slurmd (nodes n1 and n2, one host, two ports), in a
mount namespace whose /etc/hosts names n1 and n2.  Through srun, sbatch
and scancel as a user types them:

- one node (`srun -N1 -n1 meshrun launch --nproc 2`): the same losses as
  the job launched outside Slurm;
- one CPU given (`srun -N1 -n1`, task/none, so no affinity mask to see):
  one rank, not one a core, said so;
- two nodes with no meshrun flags: the step's nodes, node 0's address and
  the token found by themselves, the losses of two ranks on one launcher;
  the token files of ended jobs gone;
- node 0's Slurm name not resolving: both nodes say the name, where it
  came from and --master HOST:PORT, and exit 2;
- the README's sbatch script, `scancel --signal=TERM` mid-run: node 0
  checkpoints, every worker gone within seconds, exit 143; the script
  again resumes from that checkpoint and finishes; again, and it says the
  job is complete and exits 0 at once;
- a plain `scancel` of an interactive two-node srun (SIGTERM to every
  process of the step): node 0 checkpoints, every worker gone within
  seconds; srun again resumes there;
- `kill -9` of each node's launcher in turn: the other exits non-zero
  saying so, and no worker and no token file is left.

It stops exactly the daemons it started.  Exits 77 (skip) with the reason
where Slurm is not installed, this is not root, or no mount namespace can
be made."""
import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scancel", "squeue", "sinfo", "scontrol")
NS_MARK = "MESHRUN_SLURM_NAMESPACE"


def skip(why):
    print("skipped: %s" % why)
    sys.exit(77)


def fail(msg, out=""):
    print("FAIL: %s" % msg)
    if out:
        print(out[-6000:])
    sys.exit(1)


def free_ports(n):
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def wait_until(what, pred, limit, step=0.1):
    t0 = time.time()
    while time.time() - t0 < limit:
        v = pred()
        if v:
            return v
        time.sleep(step)
    fail("%s: not within %.0f s" % (what, limit))


class Slurm:
    """munged, slurmctld and two slurmd of a cluster of their own in d."""

    def __init__(self, d):
        self.d = d
        self.procs = []
        self.env = None

    def start(self):
        d = self.d
        mdir = os.path.join(d, "munge")
        os.makedirs(mdir, mode=0o700)
        key = os.path.join(mdir, "key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = os.path.join(mdir, "sock")
        self.spawn("munged", ["munged", "-F", "--force", "--key-file=" + key,
                              "--socket=" + sock, "--pid-file=" + os.path.join(mdir, "pid"),
                              "--log-file=" + os.path.join(mdir, "log"),
                              "--seed-file=" + os.path.join(mdir, "seed")])
        wait_until("munged's socket", lambda: os.path.exists(sock), 10)
        ctld, p1, p2 = free_ports(3)
        for sub in ("state", "spool/n1", "spool/n2"):
            os.makedirs(os.path.join(d, sub))
        conf = os.path.join(d, "slurm.conf")
        with open(conf, "w") as f:
            f.write("\n".join([
                "ClusterName=mrtest",
                "SlurmctldHost=localhost",
                "SlurmctldPort=%d" % ctld,
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                "AuthInfo=socket=%s" % sock,
                "StateSaveLocation=%s/state" % d,
                "SlurmdSpoolDir=%s/spool/%%n" % d,
                "SlurmctldPidFile=%s/slurmctld.pid" % d,
                "SlurmdPidFile=%s/spool/%%n/slurmd.pid" % d,
                "SlurmctldLogFile=%s/slurmctld.log" % d,
                "SlurmdLogFile=%s/spool/%%n/slurmd.log" % d,
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "SlurmdParameters=config_overrides",
                "MpiDefault=none",
                "ReturnToService=2",
                "FirstJobId=%d" % random.randrange(1000, 15000),
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "KillWait=10",
                "NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=%d CPUs=2" % p1,
                "NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=%d CPUs=2" % p2,
                "PartitionName=p Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP",
                ""]))
        self.env = dict(os.environ, SLURM_CONF=conf)
        for k in list(self.env):
            if k.startswith("SLURM_") and k != "SLURM_CONF":
                del self.env[k]
        self.spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", conf])
        for n in ("n1", "n2"):
            self.spawn("slurmd " + n, ["slurmd", "-D", "-N", n, "-f", conf])

        def idle():
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env,
                               capture_output=True, text=True, timeout=20)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            return states.get("n1") == "idle" and states.get("n2") == "idle"
        wait_until("nodes n1 and n2 idle (logs in %s)" % d, idle, 60, 0.5)

    def spawn(self, name, argv):
        log = open(os.path.join(self.d, name.replace(" ", "-") + ".out"), "w")
        self.procs.append((name, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                  env=self.env or os.environ)))
        time.sleep(0.1)
        if self.procs[-1][1].poll() is not None:
            fail("%s exited at once: %s" % (name, open(log.name).read()))

    def stop(self):
        if self.env is not None:
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env,
                           capture_output=True, timeout=20)
            t0 = time.time()
            while time.time() - t0 < 20 and self.jobs():
                time.sleep(0.2)
        for name, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def jobs(self):
        r = subprocess.run(["squeue", "-h", "-o", "%A"], env=self.env, capture_output=True,
                           text=True, timeout=20)
        return r.stdout.split()

    def job_info(self, job):
        r = subprocess.run(["scontrol", "-o", "show", "job", str(job)], env=self.env,
                           capture_output=True, text=True, timeout=20)
        return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)


def procs_of(job, want):
    """pids of the processes of Slurm job `job` whose command line (argv,
    joined by spaces) `want` accepts, with their environment."""
    found = []
    for p in glob.glob("/proc/[0-9]*"):
        try:
            argv = open(p + "/cmdline", "rb").read().split(b"\0")
            env = open(p + "/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in argv if a]
        envd = dict(e.decode(errors="replace").split("=", 1) for e in env if b"=" in e)
        if envd.get("SLURM_JOB_ID") == str(job) and argv and want(argv):
            found.append((int(p[6:]), envd))
    return found


def is_worker(argv):
    return os.path.basename(argv[0]) == "meshrun-worker"


def is_launcher(argv):
    return os.path.basename(argv[0]) == "meshrun" and len(argv) > 1 and argv[1] == "launch"


def losses(text):
    return [float(x) for x in re.findall(r"^step \d+/\d+ loss (\S+)", text, re.M)]


class Suite:
    def __init__(self, meshrun, d, slurm):
        self.meshrun = meshrun
        self.d = d
        self.slurm = slurm
        self.home = os.path.join(d, "home")
        self.tokens = os.path.join(self.home, ".cache", "meshrun")
        os.makedirs(self.tokens)
        self.work = os.path.join(d, "work")
        os.makedirs(self.work)
        src = os.environ.get("MESHRUN_SOURCE_DIR")
        self.env = dict(slurm.env, HOME=self.home, PATH=os.path.dirname(meshrun) + ":" +
                        os.environ.get("PATH", "/usr/bin:/bin"))
        if src:
            self.env["MESHRUN_CONFIGS_DIR"] = os.path.join(src, "configs")
        rng = random.Random(5)
        with open(os.path.join(self.work, "train.bin"), "wb") as f:  # raw uint16 tokens
            f.write(bytes(b for _ in range(20000) for b in (rng.randrange(256), 0)))

    def job(self, name, steps, ckpt=False, hidden=64):
        job = {"model": {"model_type": "llama", "vocab_size": 256, "hidden_size": hidden,
                         "intermediate_size": 2 * hidden, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "max_position_embeddings": 32},
               "data": {"train": "train.bin"},
               "train": {"steps": steps, "global_batch": 4, "seq_len": 32,
                         "log_interval_steps": 1}}
        if ckpt:
            job["checkpoint"] = {"dir": "ckpt-" + name, "save_interval_steps": 1000000}
        path = os.path.join(self.work, name + ".json")
        with open(path, "w") as f:
            json.dump(job, f)
        return name + ".json"

    def run(self, argv, limit=120, env=None):
        t0 = time.time()
        r = subprocess.run(argv, cwd=self.work, env=env or self.env, capture_output=True,
                           text=True, timeout=limit)
        return r.returncode, r.stdout + r.stderr, time.time() - t0

    def reference(self, job, nproc):
        """The job launched outside Slurm with nproc ranks: its losses."""
        env = {k: v for k, v in self.env.items() if not k.startswith("SLURM_")}
        code, out, _ = self.run([self.meshrun, "launch", "--nproc", str(nproc), "--log-dir",
                                 "runs/ref-%s-%d" % (job, nproc), job], env=env)
        if code != 0 or not losses(out):
            fail("the reference run of %s on %d ranks: exit %d" % (job, nproc, code), out)
        return losses(out)

    def tokens_left(self):
        return sorted(os.listdir(self.tokens))

    def no_workers(self, job, limit):
        wait_until("job %s's workers gone" % job,
                   lambda: not procs_of(job, is_worker), limit, 0.05)

    # ---- the cases ----

    def one_node(self):
        job = self.job("one", 6)
        code, out, _ = self.run(["srun", "-N1", "-n1", "meshrun", "launch", "--nproc", "2",
                                 "--log-dir", "runs/one", job])
        if code != 0 or "2 ranks" not in out:
            fail("srun -N1 -n1 meshrun launch --nproc 2: exit %d" % code, out)
        if losses(out) != self.reference(job, 2):
            fail("one node under srun: other losses than outside Slurm", out)
        print("ok: srun -N1 -n1 meshrun launch --nproc 2: trains, the losses of outside Slurm")

    def one_cpu(self):
        job = self.job("onecpu", 4)
        code, out, _ = self.run(["srun", "-N1", "-n1", "meshrun", "launch", "--log-dir",
                                 "runs/onecpu", job])
        if code != 0 or "1 ranks" not in out:
            fail("srun -N1 -n1 (one CPU given) without --nproc: exit %d, expected 1 rank" % code,
                 out)
        if (os.cpu_count() or 1) > 1 and \
                "Slurm gives this node 1 CPU (SLURM_CPUS_PER_TASK)" not in out and \
                "Slurm gives this node 1 CPU (SLURM_CPUS_ON_NODE)" not in out:
            fail("one CPU given: the launcher did not say why it starts one rank", out)
        print("ok: srun -N1 -n1 without --nproc: one rank for the one CPU Slurm gave")

    def two_nodes(self):
        job = self.job("two", 6)
        # a token of a job that has ended (its launcher killed): removed by
        # the next launch, never taken for this job's
        stale = os.path.join(self.tokens, "slurm-mrtest-999999.0.token")
        with open(stale, "w") as f:
            f.write("00" * 32 + "\n")
        os.chmod(stale, 0o600)
        code, out, _ = self.run(["srun", "-N2", "--ntasks-per-node=1", "meshrun", "launch",
                                 "--log-dir", "runs/two", job])
        if code != 0:
            fail("srun -N2 --ntasks-per-node=1 meshrun launch: exit %d" % code, out)
        for want in ("node 0 of 2, node 0 at n1:", "node 1 of 2, node 0 at n1:", "2 ranks"):
            if want not in out:
                fail("two nodes: no \"%s\" in what they printed" % want, out)
        if losses(out) != self.reference(job, 2):
            fail("two nodes under srun: other losses than two ranks outside Slurm", out)
        if self.tokens_left():
            fail("two nodes: token files left: %s" % self.tokens_left(), out)
        print("ok: srun -N2 --ntasks-per-node=1 with no flags: two nodes found by themselves, "
              "the losses of one launcher, no token left (the stale one removed)")

    def unresolvable(self, hosts, good):
        job = self.job("nohost", 4)
        with open(hosts, "w") as f:  # n1 and n2 unknown
            f.write(good.split("# slurm nodes")[0])
        try:
            code, out, took = self.run(["srun", "-N2", "--ntasks-per-node=1", "meshrun",
                                        "launch", "--log-dir", "runs/nohost", job])
        finally:
            with open(hosts, "w") as f:
                f.write(good)
        if code != 2:
            fail("node 0's name unresolvable: exit %d, expected 2" % code, out)
        for node in (0, 1):
            want = "node 0's host \"n1\" (the first node of Slurm's SLURM_STEP_NODELIST " \
                   "\"n[1-2]\") does not resolve on node %d" % node
            if want not in out:
                fail("unresolvable: node %d did not say \"%s\"" % (node, want), out)
        if out.count("--master HOST:PORT") < 2:
            fail("unresolvable: not both nodes named --master HOST:PORT", out)
        if took > 30:
            fail("unresolvable: took %.0f s" % took, out)
        print("ok: node 0's name unresolvable: both nodes say so and what to do, exit 2 "
              "(%.1f s)" % took)

    def sbatch(self, script, name):
        code, out, _ = self.run(["sbatch", "--parsable", script])
        if code != 0:
            fail("sbatch %s: exit %d" % (script, code), out)
        return out.strip().split(";")[0]

    def wait_job(self, job, limit):
        wait_until("job %s done" % job, lambda: job not in self.slurm.jobs(), limit, 0.2)
        info = self.slurm.job_info(job)
        return info.get("JobState"), info.get("ExitCode")

    def batch_preempt_resume(self):
        job = self.job("batch", 300, ckpt=True, hidden=128)
        script = os.path.join(self.work, "train.sbatch")
        with open(script, "w") as f:
            f.write("\n".join([
                "#!/bin/bash",
                "#SBATCH --job-name=batch",
                "#SBATCH --nodes=2",
                "#SBATCH --ntasks-per-node=1       # one launcher a node",
                "#SBATCH --signal=TERM@120         # SIGTERM 2 minutes before the time limit",
                "#SBATCH --output=%x-%j.out        # every node's launcher output, one file",
                "srun meshrun launch " + job,
                ""]))
        first = self.sbatch(script, "batch")
        metrics = os.path.join(self.work, "runs", "batch", "metrics.jsonl")
        wait_until("job %s at step 10" % first,
                   lambda: os.path.exists(metrics) and '"step": 10,' in open(metrics).read(),
                   90)
        t0 = time.time()
        subprocess.run(["scancel", "--signal=TERM", first], env=self.env, check=True,
                       timeout=20)
        self.no_workers(first, 20)
        gone = time.time() - t0
        state, code = self.wait_job(first, 30)
        out = open(os.path.join(self.work, "batch-%s.out" % first)).read()
        m = re.search(r"the next launch resumes from step (\d+)", out)
        if m is None or code != "143:0":
            fail("scancel --signal=TERM: no checkpoint said, or exit %s (expected 143)" % code,
                 out)
        step = int(m.group(1))
        if gone > 10:
            fail("scancel --signal=TERM: workers still there %.1f s later" % gone, out)
        print("ok: scancel --signal=TERM of a two-node sbatch job: checkpoint of step %d, "
              "workers gone in %.1f s, exit 143" % (step, gone))
        again = self.sbatch(script, "batch")
        state, code = self.wait_job(again, 120)
        out = open(os.path.join(self.work, "batch-%s.out" % again)).read()
        if code != "0:0" or ("continuing at step %d" % (step + 1)) not in out \
                or "step 300/300" not in out:
            fail("the script again: exit %s; expected it to resume at step %d and finish" %
                 (code, step + 1), out)
        print("ok: the script again resumes at step %d and finishes" % (step + 1))
        t0 = time.time()
        done = self.sbatch(script, "batch")
        state, code = self.wait_job(done, 60)
        took = time.time() - t0
        out = open(os.path.join(self.work, "batch-%s.out" % done)).read()
        if code != "0:0" or "the job is complete" not in out or "step 301" in out:
            fail("the finished job again: exit %s; expected \"the job is complete\"" % code, out)
        if self.tokens_left():
            fail("sbatch jobs: token files left: %s" % self.tokens_left(), out)
        print("ok: the finished job again: says it is complete, exit 0 (%.1f s)" % took)

    def scancel_srun(self):
        """A plain `scancel` of an interactive two-node srun: Slurm's
        SIGTERM to every process of the step, SIGKILL KillWait later."""
        job = self.job("cancel", 100000, ckpt=True)
        argv = ["srun", "-N2", "--ntasks-per-node=1", "meshrun", "launch", "--log-dir",
                "runs/cancel", job]
        p = subprocess.Popen(argv, cwd=self.work, env=self.env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        metrics = os.path.join(self.work, "runs", "cancel", "metrics.jsonl")
        try:
            wait_until("training began", lambda: os.path.exists(metrics) and
                       '"step": 10,' in open(metrics).read(), 90)
            slurm_job = self.slurm.jobs()[0]
            t0 = time.time()
            subprocess.run(["scancel", slurm_job], env=self.env, check=True, timeout=20)
            self.no_workers(slurm_job, 20)
            gone = time.time() - t0
            out, _ = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
        m = re.search(r"the next launch resumes from step (\d+)", out)
        if m is None or gone > 5:
            fail("scancel of an srun step: no checkpoint said, or workers there %.1f s later" %
                 gone, out)
        step = int(m.group(1))
        # the relaunch resumes there: a job of a few more steps
        with open(os.path.join(self.work, job)) as f:
            spec = json.load(f)
        spec["train"]["steps"] = step + 3
        with open(os.path.join(self.work, job), "w") as f:
            json.dump(spec, f)
        code, out, _ = self.run(argv)
        if code != 0 or ("continuing at step %d" % (step + 1)) not in out or \
                "step %d/%d" % (step + 3, step + 3) not in out:
            fail("srun again after scancel: exit %d; expected it to resume at step %d" %
                 (code, step + 1), out)
        if self.tokens_left():
            fail("scancel: token files left: %s" % self.tokens_left(), out)
        print("ok: scancel of a two-node srun: checkpoint of step %d, workers gone in %.1f s; "
              "srun again resumes at step %d" % (step, gone, step + 1))

    def kill_launcher(self, victim):
        job = self.job("kill%d" % victim, 100000)
        p = subprocess.Popen(["srun", "-N2", "--ntasks-per-node=1", "meshrun", "launch",
                              "--log-dir", "runs/kill%d" % victim, job], cwd=self.work,
                             env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        metrics = os.path.join(self.work, "runs", "kill%d" % victim, "metrics.jsonl")
        try:
            wait_until("training began", lambda: os.path.exists(metrics) and
                       '"step": 3,' in open(metrics).read(), 90)
            jobs = self.slurm.jobs()
            if len(jobs) != 1:
                fail("expected one Slurm job, got %s" % jobs)
            slurm_job = jobs[0]
            target = [pid for pid, env in procs_of(slurm_job, is_launcher)
                      if env.get("SLURM_NODEID") == str(victim)]
            if len(target) != 1:
                fail("node %d's launcher: found %s" % (victim, target))
            os.kill(target[0], signal.SIGKILL)
            out, _ = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
        other = 1 - victim
        said = {0: "node 1: lost node 0's launcher", 1: "the launcher of node 1 disconnected"}[victim]
        if p.returncode == 0 or said not in out:
            fail("kill -9 of node %d's launcher: srun exit %d, node %d did not name %s" %
                 (victim, p.returncode, other, said), out)
        self.no_workers(slurm_job, 10)
        if self.tokens_left():
            fail("kill -9 of node %d's launcher: token files left: %s" %
                 (victim, self.tokens_left()), out)
        print("ok: kill -9 of node %d's launcher: node %d stops saying so, no worker and no "
              "token left" % (victim, other))
        print("   " + "\n   ".join(l for l in out.splitlines() if said in l))


def main():
    meshrun = os.path.abspath(sys.argv[1])
    if os.environ.get(NS_MARK) is None:
        missing = [p for p in DAEMONS + CLIENTS if shutil.which(p) is None and
                   not os.path.exists("/usr/sbin/" + p)]
        if missing:
            skip("Slurm is not installed (no %s; scripts/setup installs slurm-wlm and munge)" %
                 ", ".join(missing))
        if os.geteuid() != 0:
            skip("slurmd runs tasks as their user only as root")
        probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            skip("no mount namespace here for an /etc/hosts of its own (%s)" %
                 probe.stderr.strip())
        # again, in a mount namespace where n1 and n2 resolve
        os.environ["PATH"] = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
        r = subprocess.run(["unshare", "-m", sys.executable] + sys.argv,
                           env=dict(os.environ, **{NS_MARK: "1"}))
        sys.exit(r.returncode)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="mr-slurm-") as d:
        hosts = os.path.join(d, "hosts")
        good = open("/etc/hosts").read() + "\n# slurm nodes\n127.0.0.1 n1 n2\n"
        with open(hosts, "w") as f:
            f.write(good)
        resolv = os.path.join(d, "resolv.conf")
        with open(resolv, "w") as f:  # no name server: unknown names fail at once
            f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        for src, dst in ((hosts, "/etc/hosts"), (resolv, "/etc/resolv.conf")):
            subprocess.run(["mount", "--bind", src, dst], check=True)
        slurm = Slurm(os.path.join(d, "slurm"))
        os.makedirs(slurm.d)
        try:
            slurm.start()
            print("Slurm up in %.1f s" % (time.time() - t0))
            s = Suite(meshrun, d, slurm)
            s.one_node()
            s.one_cpu()
            s.two_nodes()
            s.unresolvable(hosts, good)
            s.batch_preempt_resume()
            s.scancel_srun()
            s.kill_launcher(1)
            s.kill_launcher(0)
        finally:
            slurm.stop()
    print("all Slurm cases passed in %.1f s" % (time.time() - t0))


if __name__ == "__main__":
    main()
