"""The shipped Grafana dashboard and alert rules against a real Prometheus scraping a real run.

`streamgrpo up` (tiny demo: embedded Redis, two learner ranks under torchrun, one generator, each
serving /metrics on a free port recorded in ``<run_dir>/ports/<role>.json``) runs as a subprocess; a
real Prometheus (apt's ``/usr/bin/prometheus``) scrapes all three every second with
deploy/prometheus/rules.yml loaded, both ranks in the ``learner`` job as docker-compose.yml has them.
Then EVERY PromQL expression of deploy/grafana/dashboards/streamgrpo.json must return data, every
alert rule expression must evaluate without error (and Prometheus' own rule manager must report
every rule healthy), and every metric name they mention must be exported by a scraped process, and the learner's totals summed
over its ranks must equal the audit logs' count. Both servers are stopped by PID.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from streamgrpo.runtime.processes import free_port
from tests.paths import REPO

pytestmark = [pytest.mark.slow, pytest.mark.prometheus]

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "streamgrpo.json"
RULES = REPO / "deploy" / "prometheus" / "rules.yml"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"

START_TIMEOUT_S = 420  # tiny model load + demo data on 2 busy cores
DATA_TIMEOUT_S = 360  # after the first trained step, until every dashboard query has data
MIN_VERSION = 3  # learner steps before queries are judged (weights applied, staleness observed)
RATE_WINDOW = "2m"  # what $__rate_interval stands for here (scrape interval 1 s)

PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "inf", "nan",
}


# ------------------------------------------------------------------------------------- helpers
def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel (rows included)."""
    dash = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((p["title"], t["expr"]))
            walk(p.get("panels", []))

    walk(dash["panels"])
    return out


def rule_exprs() -> list[tuple[str, str]]:
    doc = yaml.safe_load(RULES.read_text())
    return [(r.get("alert") or r.get("record"), r["expr"]) for g in doc["groups"] for r in g["rules"]]


def grafana_to_promql(expr: str) -> str:
    """Replace Grafana's interval variables by a concrete range."""
    for var in ("$__rate_interval", "${__rate_interval}", "$__interval", "${__interval}", "$__range"):
        expr = expr.replace(var, RATE_WINDOW)
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (strings, label matchers, ranges and groupings removed)."""
    s = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        word = m.group(0)
        rest = s[m.end():].lstrip()
        if rest.startswith("(") or word.lower() in PROMQL_WORDS:
            continue
        names.add(word)
    return names


def family_candidates(name: str) -> set[str]:
    """Names under which Prometheus' metadata API may list the family of ``name``."""
    out = {name}
    for suffix in ("_total", "_bucket", "_sum", "_count", "_created"):
        if name.endswith(suffix):
            out.add(name[: -len(suffix)])
    return out


def api(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:  # Prometheus answers 400/422 with a JSON error body
        return json.loads(exc.read())


def query(port: int, expr: str) -> dict:
    return api(port, "/api/v1/query", query=expr)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop_pid(proc: subprocess.Popen, sig: int, grace_s: float) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def kill_recorded_children(run_dir: Path) -> None:
    """If `up` did not clean up, stop what it recorded it started (by PID, never by name)."""
    pids = []
    for name in ("processes.json", "redis.json"):
        f = run_dir / name
        if f.is_file():
            data = json.loads(f.read_text())
            pids += list(data.values()) if name == "processes.json" else [data.get("pid")]
    for pid in pids:
        if isinstance(pid, int) and pid > 0:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ------------------------------------------------------------------------------------- fixture
@pytest.fixture(scope="module")
def live_run(tmp_path_factory, tiny_model_dir):
    """A running `streamgrpo up` scraped by a running Prometheus: yields (prometheus port, run dir, log)."""
    if not Path(PROMETHEUS).is_file():
        pytest.skip(f"prometheus binary not found at {PROMETHEUS} (apt-get install prometheus)")
    tmp = tmp_path_factory.mktemp("prom_e2e")
    run_dir = tmp / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    env.pop("STREAMGRPO_REDIS_URL", None)
    argv = [
        sys.executable, "-m", "streamgrpo", "up", "--config", "demo", "--run-dir", str(run_dir), "--generators", "1",
        "--learner-ranks", "2", "--set", "launch.agreement_check=false",
        "--set", f"model.name_or_path={tiny_model_dir}",
        "--set", "demo.tiny_model=false",
        "--set", f"data.train_path={tmp / 'data' / 'train.jsonl'}",
        "--set", "demo.make_data=true",
        "--set", "demo.size=40",
        "--set", "rollout.num_generations=4",
        "--set", "rollout.prompts_per_batch=2",
        "--set", "learner.groups_per_step=2",
        "--set", "learner.max_steps=100000",
        "--set", "learner.save_steps=100000",
        "--set", "learner.get_timeout_s=1",
        "--set", "queue.max_pending=4",
        "--set", "metrics.port=0",
        "--set", f"data.eval_path={tmp / 'data' / 'test.jsonl'}",  # the evaluator: every third version, frames shuffled too
        "--set", "eval.every_versions=3",
        "--set", "eval.max_records=4",
        "--set", "eval.shuffle_frames=true",
    ]
    up_log = tmp / "up.log"
    log_fh = open(up_log, "wb")
    up = subprocess.Popen(argv, cwd=tmp, env=env, stdout=log_fh, stderr=subprocess.STDOUT, start_new_session=True)
    prom = None
    try:
        ports = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        roles = ("learner", "learner-rank1", "generator-0", "evaluator")
        while time.monotonic() < deadline and len(ports) < len(roles):
            if up.poll() is not None:
                pytest.fail(f"`streamgrpo up` exited with {up.returncode} before serving metrics:\n"
                            + _tail(up_log) + _tail_logs(run_dir))
            for role in roles:
                f = run_dir / "ports" / f"{role}.json"
                if role not in ports and f.is_file():
                    port = json.loads(f.read_text())["metrics"]
                    if http_ok(f"http://127.0.0.1:{port}/healthz"):
                        ports[role] = port
            time.sleep(1.0)
        if len(ports) < len(roles):
            pytest.fail(f"no /metrics from {', '.join(roles)} after {START_TIMEOUT_S}s (got {ports}):\n"
                        + _tail(up_log) + _tail_logs(run_dir))

        prom_port = free_port()
        prom_dir = tmp / "prometheus"
        (prom_dir / "data").mkdir(parents=True)
        shutil.copy(RULES, prom_dir / "rules.yml")
        (prom_dir / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yml"],
            "scrape_configs": [
                {"job_name": "learner", "static_configs": [{"targets": [f"127.0.0.1:{ports['learner']}",
                                                                         f"127.0.0.1:{ports['learner-rank1']}"]}]},
                {"job_name": "generator", "static_configs": [{"targets": [f"127.0.0.1:{ports['generator-0']}"]}]},
                {"job_name": "evaluator", "static_configs": [{"targets": [f"127.0.0.1:{ports['evaluator']}"]}]},
            ],
        }))
        prom_log = open(prom_dir / "prometheus.log", "wb")
        prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={prom_dir / 'prometheus.yml'}", f"--storage.tsdb.path={prom_dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--storage.tsdb.retention.time=1d"],
            stdout=prom_log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while not http_ok(f"http://127.0.0.1:{prom_port}/-/ready"):
            if prom.poll() is not None or time.monotonic() > deadline:
                pytest.fail("prometheus did not become ready:\n" + _tail(prom_dir / "prometheus.log"))
            time.sleep(0.5)
        yield prom_port, run_dir, up_log
    finally:
        if prom is not None:
            stop_pid(prom, signal.SIGTERM, 20)
        stop_pid(up, signal.SIGINT, 90)  # `up` stops its children by PID on Ctrl-C
        if up.returncode not in (0, 130):
            kill_recorded_children(run_dir)
        log_fh.close()


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else f"({path} missing)"


def _tail_logs(run_dir: Path) -> str:
    logs = sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []
    return "".join(f"\n--- {p.name}\n{_tail(p, 1500)}" for p in logs)


def _has_data(result: dict) -> bool:
    return result.get("status") == "success" and bool(result["data"]["result"])


def _wait_for_training(prom_port: int, run_dir: Path, up_log: Path) -> None:
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while time.monotonic() < deadline:
        r = query(prom_port, 'max(streamgrpo_policy_version{role="learner"})')
        if _has_data(r) and float(r["data"]["result"][0]["value"][1]) >= MIN_VERSION:
            time.sleep(5)  # a few more scrapes so every rate() window holds two points after the change
            return
        time.sleep(2)
    pytest.fail(f"the learner did not reach version {MIN_VERSION} in {DATA_TIMEOUT_S}s:\n"
                + _tail(up_log) + _tail_logs(run_dir))


# ------------------------------------------------------------------------------------- tests
def test_every_dashboard_expression_returns_data(live_run):
    prom_port, run_dir, up_log = live_run
    _wait_for_training(prom_port, run_dir, up_log)
    exprs = dashboard_exprs()
    assert len(exprs) >= 20, "the dashboard lost most of its panels"
    missing: dict[str, str] = {}
    deadline = time.monotonic() + 90  # some series appear only after a weight sync or a full rate window
    while True:
        missing = {}
        for title, expr in exprs:
            r = query(prom_port, grafana_to_promql(expr))
            if r.get("status") != "success":
                missing[f"{title}: {expr}"] = f"error: {r.get('error')}"
            elif not r["data"]["result"]:
                missing[f"{title}: {expr}"] = "no data"
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert not missing, "dashboard queries without data:\n" + "\n".join(f"  {k} -> {v}" for k, v in missing.items())


def test_every_metric_named_is_exported_by_a_scraped_process(live_run):
    """A name in the dashboard or the rules that no process exports fails (HELP/TYPE counts as exported)."""
    prom_port, run_dir, up_log = live_run
    _wait_for_training(prom_port, run_dir, up_log)
    names = set()
    for _, expr in dashboard_exprs() + rule_exprs():
        names |= metric_names(expr)
    assert {"streamgrpo_reward_sum", "streamgrpo_groups_total", "up"} <= names, names
    metadata = api(prom_port, "/api/v1/metadata")["data"]
    unknown = []
    for name in sorted(names):
        if name == "up":
            continue
        series = api(prom_port, "/api/v1/series", **{"match[]": name})
        if series.get("data") or family_candidates(name) & set(metadata):
            continue
        unknown.append(name)
    assert not unknown, f"metrics named in the dashboard/rules but exported by no scraped process: {unknown}"


def test_every_alert_rule_evaluates_without_error(live_run):
    prom_port, run_dir, up_log = live_run
    _wait_for_training(prom_port, run_dir, up_log)
    rules = rule_exprs()
    assert {name for name, _ in rules} == {
        "StreamgrpoLearnerDown", "StreamgrpoNoGroupsTrained", "StreamgrpoStalenessP90OverBound",
        "StreamgrpoRewardNaN", "StreamgrpoQueueFull", "StreamgrpoGeneratorWithoutWeights", "StreamgrpoMediaDeadLetters",
        "StreamgrpoGeneratorLearnerMismatch", "StreamgrpoHugeGroupDeadLetters", "StreamgrpoRedisFull",
        "StreamgrpoLearnerAgreementDrift",
    }
    for name, expr in rules:
        r = query(prom_port, expr)
        assert r.get("status") == "success", f"{name}: {r.get('error')}"
    # Prometheus' own rule manager evaluated the same file every second: every rule healthy.
    deadline = time.monotonic() + 30
    while True:
        groups = api(prom_port, "/api/v1/rules")["data"]["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        evaluated = all(r.get("lastEvaluation", "").startswith("20") for r in loaded.values())
        if set(loaded) == {n for n, _ in rules} and evaluated or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert set(loaded) == {n for n, _ in rules}
    bad = {n: (r.get("health"), r.get("lastError")) for n, r in loaded.items() if r.get("health") != "ok"}
    assert not bad, f"unhealthy rules: {bad}"
    # The run is healthy: the learner is up, nothing is NaN.
    firing = {a["labels"]["alertname"] for a in api(prom_port, "/api/v1/alerts")["data"]["alerts"]
              if a["state"] == "firing"}
    assert not firing & {"StreamgrpoLearnerDown", "StreamgrpoRewardNaN", "StreamgrpoGeneratorWithoutWeights",
                         "StreamgrpoMediaDeadLetters", "StreamgrpoGeneratorLearnerMismatch",
                         "StreamgrpoHugeGroupDeadLetters", "StreamgrpoRedisFull"}, firing


def test_learner_totals_over_both_ranks_equal_the_audit_logs(live_run):
    """Each rank counts its own groups; summed over the scraped ranks they are the audit logs' count. The
    generators are paused (SIGSTOP by PID) so that the learner settles and the numbers hold still."""
    prom_port, run_dir, up_log = live_run
    _wait_for_training(prom_port, run_dir, up_log)
    gens = [pid for name, pid in json.loads((run_dir / "processes.json").read_text()).items()
            if name.startswith("generator")]
    for pid in gens:
        os.kill(pid, signal.SIGSTOP)
    try:
        last, still_since = None, time.monotonic()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the learner takes what is queued, then waits: nothing moves
            r = query(prom_port, 'sum(streamgrpo_groups_total{job="learner", event="trained"})')
            now = r["data"]["result"][0]["value"][1] if _has_data(r) else None
            if now != last:
                last, still_since = now, time.monotonic()
            elif time.monotonic() - still_since > 6:
                break
            time.sleep(1)
        trained = [g for name in ("learner", "learner-rank1") for line in
                   (run_dir / "audit" / f"{name}.jsonl").read_text().splitlines() if line.strip()
                   for g in (json.loads(line).get("group_ids") or []) if json.loads(line).get("event") == "trained"]
        per_rank = query(prom_port, 'streamgrpo_groups_total{job="learner", event="trained"}')["data"]["result"]
        assert len(per_rank) == 2 and all(float(x["value"][1]) > 0 for x in per_rank)  # both ranks count
        assert float(last) == len(trained) == len(set(trained)), (last, len(trained))
        steps = query(prom_port, 'max(streamgrpo_policy_version{role="learner"})')["data"]["result"][0]["value"][1]
        assert len(trained) == 2 * int(float(steps))  # groups_per_step 2: one on each rank, every step
        loss = query(prom_port, 'streamgrpo_loss{job="learner"}')["data"]["result"]
        assert len(loss) == 1  # the step's gauges come from rank 0 alone
    finally:
        for pid in gens:
            os.kill(pid, signal.SIGCONT)
