"""`streamgrpo slurm`'s script on a real Slurm of separate hosts, on this machine.

deploy/slurm-local/local-slurm.sh starts slurmctld, one slurmd per host and munge (Debian's slurm-wlm 22.05):
each host is a network + mount + UTS namespace with its own address on a bridge, hostname, /tmp and
/dev/shm; the run directory is on the file system every host shares. The script `streamgrpo slurm` renders
is submitted with `sbatch`, unchanged: two learner ranks on two hosts (torchrun's c10d rendezvous across
them, gloo, DeepSpeed ZeRO-2 on CPU), a generator on each of the three hosts fed by its host's relay, the
evaluator on the third host (weights over TCP: no relay of the learner's there), Redis where the script puts
it, and a real Prometheus (on the head host) scraping the rendered targets with the shipped alert rules
(StreamgrpoLearnerDown's `for:` cut to seconds): no alert fires while the run is healthy.

Then the job is stopped twice as a cluster stops it: the signal `--signal=B:TERM@...` sends before the time
limit (delivered now with `scancel --batch --signal=TERM`: the script stops the learner first, which writes
its checkpoint, and requeues itself), and `scontrol requeue` (every step killed). Each time it resumes from
its checkpoint, every generator's shard continues where the learner's committed data cursor says (not at
its first record), and at the end the audit reads lost 0, twice 0. Once the job has ended, the learner's
targets stay down and `StreamgrpoLearnerDown` fires.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.paths import REPO

pytestmark = [pytest.mark.slow, pytest.mark.prometheus]

LOCAL_SLURM = REPO / "deploy" / "slurm-local" / "local-slurm.sh"
RULES = REPO / "deploy" / "prometheus" / "rules.yml"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
MAX_STEPS = 1000  # never reached: the last allocation's learner reads a lower learner.max_steps (step 3)
JOB_TIMEOUT_S = 900


def _under_tmp(path: Path) -> Path | None:
    """The folder under /tmp that holds ``path`` (hosts have /tmp of their own: it must be shared), else None."""
    path = path.resolve()
    return path if path.parts[:2] == ("/", "tmp") and len(path.parts) > 2 else None


class Cluster:
    def __init__(self, name: str):
        self.name = name
        self.env = {**os.environ, "STREAMGRPO_SLURM_NAME": name, "STREAMGRPO_SLURM_STATE": f"/var/tmp/{name}"}

    def run(self, *args: str, check: bool = True, timeout: float = 120, host: int = 0, cwd: Path | None = None):
        out = subprocess.run(["bash", str(LOCAL_SLURM), "exec", str(host), *args], env=self.env, cwd=cwd,
                             capture_output=True, text=True, timeout=timeout)
        if check and out.returncode:
            raise AssertionError(f"{' '.join(args)}: exit {out.returncode}: {out.stdout}{out.stderr}")
        return out

    def popen(self, *args: str, host: int = 0, **kw) -> subprocess.Popen:
        return subprocess.Popen(["bash", str(LOCAL_SLURM), "exec", str(host), *args], env=self.env, **kw)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key -> value."""
        text = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(kv.split("=", 1) for kv in text.split() if "=" in kv)

    def get(self, url: str) -> dict:
        """A GET from host 0 (where Prometheus listens), as JSON."""
        code = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
        return json.loads(self.run(sys.executable, "-c", code, url).stdout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    name = f"sgt{os.getpid() % 100000}"
    env = {**os.environ, "STREAMGRPO_SLURM_NAME": name, "STREAMGRPO_SLURM_STATE": f"/var/tmp/{name}"}
    check = subprocess.run(["bash", str(LOCAL_SLURM), "check"], env=env, capture_output=True, text=True)
    if check.returncode == 3:
        pytest.skip(check.stderr.strip())
    if not os.access(PROMETHEUS, os.X_OK):
        pytest.skip("prometheus not installed (apt-get install --no-install-recommends prometheus; `make setup` as root)")
    assert check.returncode == 0, check.stderr
    shares = {p for p in (_under_tmp(tmp_path_factory.getbasetemp()), _under_tmp(Path(sys.prefix)), _under_tmp(REPO))
              if p is not None}
    args = ["up", "--hosts", "3", "--gpus", "2", "--cpus", "8", "--mem-mib", "16000"]
    for s in sorted(shares):
        args += ["--share", str(s)]
    up = subprocess.run(["bash", str(LOCAL_SLURM), *args], env=env, capture_output=True, text=True, timeout=180)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield Cluster(name)
    finally:
        subprocess.run(["bash", str(LOCAL_SLURM), "down"], env=env, capture_output=True, text=True, timeout=120)


def _wait(what: str, cond, timeout: float, logs=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}" + logs())


def _requeued(cluster: Cluster, job_id: str, restarts: int) -> bool:
    """The job requeued ``restarts`` times; once pending again it is made eligible now (Slurm holds a requeued
    batch job back a while, as an impatient operator would not)."""
    info = cluster.job(job_id)
    if info.get("Restarts") != str(restarts) or info["JobState"] not in ("PENDING", "RUNNING"):
        return False
    if info["JobState"] == "PENDING":
        cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)
    return True


def _steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]


def _prometheus_config(run: Path, tmp: Path) -> Path:
    """Prometheus on the head host: the rendered targets, the shipped rules (StreamgrpoLearnerDown's `for:` cut
    from 2m to 5s: the test waits for it to fire)."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "StreamgrpoLearnerDown":
                rule["for"] = "5s"
    (tmp / "rules.yml").write_text(yaml.safe_dump(rules))
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(tmp / "rules.yml")],
           "scrape_configs": [{"job_name": "streamgrpo",
                               "file_sd_configs": [{"files": [str(run / "prometheus" / "targets.json")],
                                                    "refresh_interval": "1s"}]}]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    return tmp / "prometheus.yml"


def test_the_rendered_job_runs_on_a_real_slurm_requeues_and_resumes(cluster, tiny_model_dir, demo_data_dir, tmp_path):
    from benchmarks.audit import audit_run
    from streamgrpo.config import load_config
    from streamgrpo.transport.queue.redis_stream import RedisQueue
    from streamgrpo.transport.queue.server import EmbeddedRedis

    run = tmp_path / "run"
    data = Path(demo_data_dir)
    cfg = load_config("demo", [
        f"model.name_or_path={tiny_model_dir}", "demo.tiny_model=false", "demo.make_data=false",
        f"data.train_path={data / 'train.jsonl'}", f"data.eval_path={data / 'test.jsonl'}", "data.kinds=null",
        "eval.enabled=true", "eval.every_versions=2", "eval.max_records=2",
        f"learner.max_steps={MAX_STEPS}", "learner.save_steps=2", f"run_dir={run}", "learner.groups_per_step=2",
        "rollout.prompts_per_batch=1", "learner.get_timeout_s=1", "learner.max_staleness=100",
        "weights.transport=shm",  # as the recipes: the evaluator on another host must not be sent to unix sockets
        "rollout.stop_grace_s=0"])
    config = tmp_path / "job.yaml"
    config.write_text(cfg.to_yaml())
    script = tmp_path / "job.sbatch"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "WANDB_MODE": "disabled"}
    render = subprocess.run([sys.executable, "-m", "streamgrpo", "slurm", "--config", str(config), "--nodes", "3",
                             "--gpus-per-node", "2", "--learner-ranks", "2", "--learner-nodes", "2",
                             "--generators", "3", "--generators-per-node", "1", "--time", "02:00:00", "--python", sys.executable,
                             "--out", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert render.returncode == 0, render.stderr
    assert "2 learner rank(s) on 2 node(s), 3 generator(s) on 3 node(s), the evaluator" in render.stderr

    def logs() -> str:
        outs = "".join(f"\n--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(tmp_path.glob("*.out")))
        return outs + "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run / "logs").glob("*.log"))) \
            if (run / "logs").is_dir() else outs

    submitted = cluster.run("sbatch", "--parsable", str(script), cwd=tmp_path)
    job_id = submitted.stdout.strip().split(";")[0]
    assert job_id.isdigit(), submitted.stdout

    prom_dir = tmp_path / "prometheus"
    prom_dir.mkdir()
    prometheus = cluster.popen(PROMETHEUS, f"--config.file={_prometheus_config(run, prom_dir)}",
                               f"--storage.tsdb.path={prom_dir / 'data'}", "--web.listen-address=127.0.0.1:9090",
                               stdout=subprocess.DEVNULL, stderr=open(prom_dir / "prometheus.log", "w"))
    try:
        # 1. healthy: trains across the hosts; every target up; no alert fires
        _wait("the first checkpoint", lambda: len(_steps(run)) >= 3 and (run / "checkpoints").is_dir(), JOB_TIMEOUT_S,
              logs)
        info = cluster.job(job_id)
        assert info["JobState"] == "RUNNING" and info["NodeList"] == f"{cluster.name}-[0-2]", info
        targets = json.loads((run / "prometheus" / "targets.json").read_text())
        jobs = {t["labels"]["job"] for t in targets}
        assert {"learner", "generator", "evaluator", "relay"} <= jobs, targets
        assert all("role" not in t["labels"] for t in targets), "`role` is streamgrpo's own metric label"

        def all_up():
            res = cluster.get("http://127.0.0.1:9090/api/v1/query?query=up")["data"]["result"]
            return res if len(res) == len(targets) and all(r["value"][1] == "1" for r in res) else None

        _wait("every target up in Prometheus", all_up, 180, logs)

        def applied():  # the highest weight version each generator applied (through its host's relay)
            out = {}
            for k in range(3):
                path = run / "audit" / f"generator-{k}.jsonl"
                rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
                out[k] = max((r.get("version", 0) for r in rows), default=0)
            return out

        _wait("every generator on a trained version, from its host's relay", lambda: min(applied().values()) >= 1,
              300, lambda: f" applied: {applied()}" + logs())
        time.sleep(8)  # longer than every rule's `for:` here
        alerts = cluster.get("http://127.0.0.1:9090/api/v1/alerts")["data"]["alerts"]
        up = cluster.get("http://127.0.0.1:9090/api/v1/query?query=up")["data"]["result"]
        assert [a for a in alerts if a["state"] == "firing"] == [], (alerts, up)
        evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()] \
            if (run / "eval.jsonl").is_file() else []
        _wait("the evaluator (third host, no relay of the learner's) scores a trained version",
              lambda: (run / "eval.jsonl").is_file() and any(json.loads(x).get("version", 0) >= 1 for x in
                                                            (run / "eval.jsonl").read_text().splitlines()), 300, logs)
        del evals

        # 2. the time limit's signal: the script stops the learner (checkpoint), requeues itself
        cluster.run("scancel", "--batch", "--signal=TERM", job_id)
        _wait("the job requeued by its script", lambda: _requeued(cluster, job_id, 1), 300, logs)
        before = _steps(run)[-1]  # the stopped allocation's last step (read at the signal, a loaded box's learner
        # trained on past it before it stopped: "resumed" was then true while the job was still pending)
        _wait("training resumed after the first requeue", lambda: _steps(run)[-1] > before + 1 if _steps(run) else
              False, JOB_TIMEOUT_S, logs)

        # 3. scontrol requeue: every step killed, the job pending again, then running from its checkpoint; the
        #    config every process reads at start now ends the run a few steps on (the job then ends by itself)
        final = _steps(run)[-1] + 6
        assert config.read_text().count(f"max_steps: {MAX_STEPS}\n") == 1
        config.write_text(config.read_text().replace(f"max_steps: {MAX_STEPS}\n", f"max_steps: {final}\n"))
        cluster.run("scontrol", "requeue", job_id)
        _wait("the job requeued by scontrol", lambda: _requeued(cluster, job_id, 2), 120, logs)
        _wait("the job to finish", lambda: cluster.job(job_id)["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"),
              JOB_TIMEOUT_S, logs)
        info = cluster.job(job_id)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, logs())
        steps = _steps(run)
        assert steps[-1] == final, steps

        # 4. once the learner is gone its targets stay down: StreamgrpoLearnerDown fires
        def learner_down():
            alerts = cluster.get("http://127.0.0.1:9090/api/v1/alerts")["data"]["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "StreamgrpoLearnerDown" and a["state"] == "firing"]

        _wait("StreamgrpoLearnerDown", learner_down, 60, logs)
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
        cluster.run("scancel", job_id, check=False)

    # 5. exactly once over three allocations, and the shards continued where the learner's cursor said
    out = "".join(p.read_text() for p in sorted(tmp_path.glob("*.out")))
    assert out.count("learner finished (exit 0)") == 1 and out.count("requeue(s) before this one") == 3, out[-3000:]
    last = out[out.rindex("2 requeue(s) before this one"):]
    step = int(re.findall(r"resumed from \S+ at step (\d+)", last)[0])
    resumed = last[last.index("resumed from"):]
    moved = []  # the shards whose generator applied the resumed learner's weights
    for k in range(3):  # each shard went on from the cursor the resumed learner committed (its checkpoint's, or a
        # later one's: the learner trains the groups still queued from the last allocation, further on in the shard)
        # (a start line, moves to a later cursor, or "already past" the resumed learner's: each names the step)
        lines = re.findall(rf"generator-{k}: (?:the learner committed a later data cursor: )?shard {k}/3: "
                           r"(?:resuming at epoch \d+, record \d+ of \d+ \(|already past the data cursor )"
                           r"committed by the learner at step (\d+)", last)
        named = [int(at) for at in lines]  # the first may be the last allocation's, read before the resume
        assert lines and named == sorted(named), (k, step, lines, last[-4000:])
        # a generator rereads the cursor with each version: once it applied the resumed learner's weights, it
        # names the resumed step or a later one (on a loaded box a generator still busy with its first group
        # when the learner ended the run applied none: its cursor was read before the learner rolled forward)
        applied = [int(v) for v in re.findall(rf"generator-{k}: applied weights v(\d+)", resumed)]
        if any(v >= step for v in applied):
            moved.append(k)
            assert named[-1] >= step, (k, step, lines, applied, last[-4000:])
    assert moved, ("no generator applied the resumed learner's weights", last[-4000:])
    server = EmbeddedRedis(run / "redis")
    server.start()
    try:
        with RedisQueue(server.url, namespace=cfg.queue.namespace, consumer="test-audit") as q:
            audit = audit_run(run, q)
    finally:
        server.stop()
    assert audit.lost == 0 and audit.twice == 0, audit
