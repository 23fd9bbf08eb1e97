"""Deployment files checked as data and with the real tools that run offline here.

docker-compose.yml (PyYAML + Debian's docker-compose 1.29 `config`), the service entrypoints and
healthcheck (run for real with bash against a real /healthz), Prometheus config and alert rules
(`promtool check` and `promtool test rules`), the Grafana dashboard and provisioning, and the DeepSpeed
configs (real `deepspeed.initialize` on CPU). The k8s manifests: tests/unit/repo/test_k8s.py.
Every PromQL metric name must be one that streamgrpo/metrics.py exports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from streamgrpo.cli import build_parser
from streamgrpo.runtime.processes import free_port
from tests.paths import REPO

COMPOSE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"
PROM_DIR = REPO / "deploy" / "prometheus"
GRAFANA_DIR = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "streamgrpo.json"
DS_DIR = REPO / "streamgrpo" / "configs" / "deepspeed"
SERVICES = REPO / "services"

PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "inf", "nan",
}
GRAFANA_VARS = ("$__rate_interval", "${__rate_interval}", "$__interval", "${__interval}", "$__range")


# ===================================================================================== helpers
def env_example() -> dict[str, str]:
    env = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(node, env: dict[str, str]):
    """Compose-style ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}`` and ``$$`` on every string."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3)
        value = env.get(name)
        if op in (":-", "-") and (value is None or (op == ":-" and value == "")):
            return arg
        if op in (":?", "?") and (value is None or (op == ":?" and value == "")):
            raise AssertionError(f"compose variable {name} is required: {arg}")
        return value or ""

    return _VAR.sub(sub, node)


def compose() -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), env_example())


def streamgrpo_services(doc: dict) -> dict[str, dict]:
    """Services whose image is one of ours (built from services/*): their command is streamgrpo's argv."""
    out = {}
    for name, svc in doc["services"].items():
        image = svc.get("image", "")
        build = svc.get("build") or {}
        if image.startswith("streamgrpo-") or "services/" in str(build.get("dockerfile", "")):
            out[name] = svc
    return out


def run_entrypoint(service_dir: str, argv: list[str], **env) -> subprocess.CompletedProcess:
    script = SERVICES / service_dir / "entrypoint.sh"
    full_env = {k: v for k, v in os.environ.items() if k not in ("GENERATOR_ID", "NPROC_PER_NODE", "NNODES")}
    full_env.update(STREAMGRPO_DRY_RUN="1", **env)
    return subprocess.run(["bash", str(script), *argv], capture_output=True, text=True, env=full_env, timeout=30)


def streamgrpo_argv(argv: list[str]) -> list[str]:
    """The streamgrpo part of a command: after `streamgrpo` or `-m streamgrpo` (torchrun ... -m streamgrpo ...)."""
    for i, a in enumerate(argv):
        if a == "streamgrpo" and (i == 0 or argv[i - 1] == "-m" or Path(argv[0]).name == "streamgrpo"):
            return argv[i + 1:]
        if Path(a).name == "streamgrpo" and i == 0:
            return argv[1:]
    raise AssertionError(f"not a streamgrpo command: {argv}")


def assert_parses(argv: list[str], where: str):
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse prints the reason to stderr
        raise AssertionError(f"{where}: `streamgrpo {' '.join(argv)}` does not parse") from exc


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict]) -> list[dict]:
    out = []
    for p in panels:
        out.append(p)
        out += all_panels(p.get("panels", []))
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in all_panels(dashboard()["panels"]) for t in p.get("targets", [])
            if t.get("expr")]


def rules_doc() -> dict:
    return yaml.safe_load((PROM_DIR / "rules.yml").read_text())


def rule_exprs() -> list[tuple[str, str]]:
    return [(r.get("alert") or r.get("record"), r["expr"]) for g in rules_doc()["groups"] for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (strings, label matchers, ranges and groupings removed)."""
    s = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        word = m.group(0)
        if s[m.end():].lstrip().startswith("(") or word.lower() in PROMQL_WORDS:
            continue
        names.add(word)
    return names


def exported_names() -> set[str]:
    """Every sample name the processes' registry can expose: streamgrpo/metrics.py objects (Counters as
    ``_total``, Histograms as ``_bucket``/``_count`` and ``_sum`` when prometheus_client exposes it)
    plus the collectors registered by default (process_*, python_*)."""
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    import streamgrpo.metrics as metrics

    names: set[str] = set()
    for obj in vars(metrics).values():
        if isinstance(obj, Counter):
            names |= {obj._name + "_total", obj._name + "_created"}
        elif isinstance(obj, Histogram):
            names |= {obj._name + "_bucket", obj._name + "_count", obj._name + "_created"}
            if obj._upper_bounds[0] >= 0:  # prometheus_client drops _sum when a bucket bound is negative
                names.add(obj._name + "_sum")
        elif isinstance(obj, Gauge):
            names.add(obj._name)
    for family in REGISTRY.collect():
        if not family.name.startswith("streamgrpo_"):
            names |= {s.name for s in family.samples}
    return names


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return path


# ===================================================================================== compose
def test_compose_parses_and_has_the_services():
    doc = compose()
    services = doc["services"]
    assert {"redis", "learner", "generator", "prometheus", "grafana", "learner-cpu", "generator-cpu"} <= set(services)
    redis = services["redis"]
    cmd = redis["command"] if isinstance(redis["command"], str) else " ".join(redis["command"])
    assert "--appendonly yes" in cmd and "--appendfsync always" in cmd and "--requirepass" in cmd
    assert redis["environment"]["REDIS_PASSWORD"] == env_example()["REDIS_PASSWORD"]  # from .env
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    assert any(v.endswith(":/data") for v in redis["volumes"])
    for name in ("learner", "generator"):
        svc = services[name]
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert svc["profiles"] == ["gpu"]
    assert any(v.startswith("runs:") for v in services["learner"]["volumes"]), "learner checkpoints volume"
    raw = yaml.safe_load(COMPOSE.read_text())
    assert raw["services"]["generator"]["deploy"]["replicas"] == "${GENERATOR_REPLICAS:-1}"
    assert services["grafana"]["ports"] == ["3000:3000"]
    assert services["learner-cpu"]["profiles"] == services["generator-cpu"]["profiles"] == ["cpu"]
    # the cpu profile answers to the gpu services' DNS names (Prometheus, weights.connect_host)
    assert services["learner-cpu"]["networks"]["default"]["aliases"] == ["learner"]
    assert services["generator-cpu"]["networks"]["default"]["aliases"] == ["generator"]
    for name, svc in services.items():
        if name.endswith("-cpu") or name.startswith("demo-"):
            assert "resources" not in svc.get("deploy", {}), f"{name} reserves devices in the cpu profile"


def test_every_streamgrpo_service_command_is_a_real_subcommand():
    doc = compose()
    services = streamgrpo_services(doc)
    assert {"learner", "generator", "learner-cpu", "generator-cpu", "keys", "demo-data", "demo-model"} <= set(services)
    for name, svc in services.items():
        argv = [str(a) for a in svc["command"]]
        folder = "generator" if "generator" in svc["image"] else "learner"
        out = run_entrypoint(folder, argv, STREAMGRPO_CONTAINER_NAME=f"streamgrpo-{name}-2")
        assert out.returncode == 0, f"{name}: entrypoint failed: {out.stderr}"
        final = out.stdout.splitlines()
        args = assert_parses(streamgrpo_argv(final), f"compose service {name}")
        if args.command == "generator":
            assert args.id == 1, f"{name}: replica 2 must get --id 1, got {final}"
        if args.command in ("learner", "generator"):
            from streamgrpo.config import load_config

            cfg = load_config(args.config, args.overrides)  # the config and every --set validate
            assert cfg.metrics.port == 9100, f"{name}: Prometheus scrapes port 9100"
            assert cfg.metrics.host == "0.0.0.0", f"{name}: /metrics must listen beyond loopback for Prometheus"
            assert cfg.weights.curve_keys_dir == "/keys"
            replicas_var = "CPU_GENERATOR_REPLICAS" if name.endswith("-cpu") else "GENERATOR_REPLICAS"
            assert cfg.rollout.num_generators == int(env_example()[replicas_var]), name
    for name in ("generator", "generator-cpu"):
        assert int(doc["services"][name]["deploy"]["replicas"]) == int(
            env_example()["CPU_GENERATOR_REPLICAS" if name.endswith("-cpu") else "GENERATOR_REPLICAS"])


def test_services_reach_redis_and_the_learner_by_service_name(monkeypatch):
    from streamgrpo.config import load_config

    doc = compose()
    for name in ("learner", "generator", "learner-cpu", "generator-cpu"):
        svc = doc["services"][name]
        command = [str(a) for a in svc["command"]]
        args = build_parser().parse_args([*command, "--id", "0"] if command[0] == "generator" else command)
        env = {k: str(v) for k, v in svc["environment"].items()}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        cfg = load_config(args.config, args.overrides)  # ${REDIS_PASSWORD} in the GPU config expands here
        url = cfg.queue.url or env["STREAMGRPO_REDIS_URL"]
        assert re.match(rf"redis://:{re.escape(env['REDIS_PASSWORD'])}@redis:6379/\d+$", url), (name, url)
        assert cfg.weights.pub_port == 5555 and cfg.weights.snapshot_port == 5556, name
        if args.command == "generator":
            assert cfg.weights.connect_host == "learner", name
        else:
            assert cfg.weights.bind_host == "0.0.0.0", name


def test_every_file_a_service_mounts_exists():
    doc = compose()
    named = set(doc.get("volumes") or {})
    binds = 0
    for name, svc in doc["services"].items():
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0] if isinstance(vol, str) else vol.get("source", "")
            if source.startswith((".", "/")):
                binds += 1
                assert (REPO / source).exists(), f"{name} mounts {source}, which is not in the repo"
            else:
                assert source in named, f"{name} uses volume {source!r}, not declared under volumes:"
        build = svc.get("build")
        if build:
            assert (REPO / build.get("context", ".") / build["dockerfile"]).is_file(), name
    assert binds >= 4


def test_docker_compose_config_validates(tmp_path):
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose (Debian package docker-compose) is not installed")
    out = subprocess.run([binary, "--env-file", str(ENV_EXAMPLE), "-f", str(COMPOSE), "config"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["services"]["generator"]["deploy"]["replicas"] == int(env_example()["GENERATOR_REPLICAS"])
    # a missing password is refused with the message that says where to set it
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_PASSWORD", "GRAFANA_ADMIN_PASSWORD")}
    empty = tmp_path / "empty.env"
    empty.write_text("")
    bad = subprocess.run([binary, "--env-file", str(empty), "-f", str(COMPOSE), "config", "-q"],
                         cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode != 0 and "REDIS_PASSWORD" in bad.stderr


# ================================================================================ entrypoints
def test_generator_entrypoint_ids():
    base = ["generator", "--config", "demo"]
    out = run_entrypoint("generator", base, GENERATOR_ID="3")
    assert out.stdout.split() == ["streamgrpo", *base, "--id", "3"]
    out = run_entrypoint("generator", base, STREAMGRPO_CONTAINER_NAME="proj_generator_1")  # compose v1 naming
    assert out.stdout.split()[-2:] == ["--id", "0"]
    out = run_entrypoint("generator", [*base, "--id", "7"], GENERATOR_ID="3")  # an explicit --id wins
    assert out.stdout.split() == ["streamgrpo", *base, "--id", "7"]
    out = run_entrypoint("generator", base, STREAMGRPO_CONTAINER_NAME="no-number-here")
    assert out.returncode == 2 and "GENERATOR_ID" in out.stderr
    out = run_entrypoint("generator", base, GENERATOR_ID="x")
    assert out.returncode == 2 and "non-negative integer" in out.stderr
    out = run_entrypoint("generator", ["keys", "--out", "/keys"])  # other commands pass through untouched
    assert out.stdout.split() == ["streamgrpo", "keys", "--out", "/keys"]


def test_learner_entrypoint_launches_ranks_with_torchrun():
    argv = ["learner", "--config", "demo", "--resume"]
    assert run_entrypoint("learner", argv).stdout.split() == ["streamgrpo", *argv]
    out = run_entrypoint("learner", argv, NPROC_PER_NODE="4").stdout.split()
    assert out[0] == "torchrun" and out[out.index("--nproc_per_node") + 1] == "4" and "--standalone" in out
    assert_parses(streamgrpo_argv(out), "learner entrypoint")
    out = run_entrypoint("learner", argv, NPROC_PER_NODE="8", NNODES="2", NODE_RANK="1", MASTER_ADDR="l-0")
    words = out.stdout.split()
    assert words[words.index("--node_rank") + 1] == "1" and words[words.index("--master_addr") + 1] == "l-0"
    missing = run_entrypoint("learner", argv, NNODES="2")
    assert missing.returncode != 0 and "NODE_RANK" in missing.stderr


@pytest.mark.parametrize("folder", ["learner", "generator"])
def test_healthcheck_hits_healthz(folder):
    """The image healthcheck against a real streamgrpo /healthz: 200 -> 0, 503 -> 1, nothing listening -> 1."""
    from streamgrpo.metrics import MetricsServer

    script = SERVICES / folder / "healthcheck.sh"
    state = {"ok": True}
    server = MetricsServer("127.0.0.1", 0, health=lambda: (state["ok"], "ok" if state["ok"] else "stalled"))
    try:
        env = dict(os.environ, METRICS_PORT=str(server.port))
        assert subprocess.run(["bash", str(script)], env=env, timeout=30).returncode == 0
        state["ok"] = False
        out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 1 and "503" in out.stderr
    finally:
        server.close()
    env = dict(os.environ, METRICS_PORT=str(free_port()))
    assert subprocess.run(["bash", str(script)], env=env, capture_output=True, timeout=30).returncode == 1


@pytest.mark.parametrize("dockerfile", ["learner/Dockerfile", "learner/Dockerfile.cpu",
                                        "generator/Dockerfile", "generator/Dockerfile.cpu"])
def test_dockerfiles(dockerfile):
    text = (SERVICES / dockerfile).read_text()
    folder = dockerfile.split("/")[0]
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    if dockerfile.endswith(".cpu"):
        assert froms and "cuda" not in froms[0].lower()
    else:
        assert "ARG CUDA_IMAGE=nvidia/cuda:" in text and froms == ["${CUDA_IMAGE}"]
    for src in re.findall(r"^COPY\s+(\S+)\s", text, re.M):
        assert (REPO / src).exists(), f"{dockerfile}: COPY {src} does not exist (the context is the repo root)"
    assert f"COPY services/{folder}/healthcheck.sh" in text and f"COPY services/{folder}/entrypoint.sh" in text
    assert re.search(r'^HEALTHCHECK .*CMD \["/usr/local/bin/healthcheck.sh"\]', text, re.M)
    assert 'ENTRYPOINT ["/usr/local/bin/entrypoint.sh"]' in text
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert_parses([*cmd, "--id", "0"] if cmd[0] == "generator" else cmd, dockerfile)
    assert re.search(r"^USER streamgrpo$", text, re.M), "run as a non-root user"
    assert "useradd --create-home --uid 1000 " in text, "same uid in every image: the 0600 CURVE keys are shared"
    dockerignore = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in dockerignore and ".env" in dockerignore


# ================================================================================= prometheus
@pytest.mark.prometheus
def test_promtool_check_config_and_rules():
    tool = promtool()
    out = subprocess.run([tool, "check", "config", str(PROM_DIR / "prometheus.yml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 rule files found" in out.stdout + out.stderr  # rules.yml resolved beside the config
    out = subprocess.run([tool, "check", "rules", str(PROM_DIR / "rules.yml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.prometheus
def test_promtool_alert_rule_unit_tests():
    """Each alert fires on the series it is about and stays silent on a healthy run (rules_test.yml)."""
    out = subprocess.run([promtool(), "test", "rules", str(PROM_DIR / "rules_test.yml")],
                         capture_output=True, text=True, cwd=PROM_DIR)
    assert out.returncode == 0, out.stdout + out.stderr
    tested = {t["alertname"] for case in yaml.safe_load((PROM_DIR / "rules_test.yml").read_text())["tests"]
              for t in case["alert_rule_test"]}
    assert tested == {name for name, _ in rule_exprs()}


def test_alert_rules_are_the_five_of_the_issue_weights_missing_media_and_agreement():
    names = {name for name, _ in rule_exprs()}
    assert names == {"StreamgrpoLearnerDown", "StreamgrpoNoGroupsTrained", "StreamgrpoStalenessP90OverBound",
                     "StreamgrpoRewardNaN", "StreamgrpoQueueFull", "StreamgrpoGeneratorWithoutWeights",
                     "StreamgrpoMediaDeadLetters", "StreamgrpoGeneratorLearnerMismatch",
                     "StreamgrpoHugeGroupDeadLetters", "StreamgrpoRedisFull", "StreamgrpoLearnerAgreementDrift"}
    for g in rules_doc()["groups"]:
        for r in g["rules"]:
            assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"], r["alert"]


def test_scrape_configs_use_compose_service_names_and_no_clashing_target_labels():
    doc = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    assert jobs["learner"]["static_configs"][0]["targets"] == [f"learner:{9100 + r}" for r in range(8)]  # every rank
    assert jobs["generator"]["dns_sd_configs"][0]["names"] == ["generator"]
    assert jobs["generator"]["dns_sd_configs"][0]["port"] == 9100
    services = compose()["services"]
    assert "learner" in services and "generator" in services
    ours = {"role", "fn", "event", "reason", "side", "stat", "kind"}
    for job in doc["scrape_configs"]:
        for sc in job.get("static_configs", []):
            assert not ours & set(sc.get("labels", {})), job["job_name"]
        for rc in job.get("relabel_configs", []):
            assert rc.get("target_label") not in ours, job["job_name"]


# =================================================================================== metrics
def test_every_promql_metric_name_is_exported_by_streamgrpo_metrics():
    exported = exported_names()
    assert {"streamgrpo_groups_total", "streamgrpo_reward_bucket", "streamgrpo_reward_sum",
            "streamgrpo_kl", "process_start_time_seconds"} <= exported
    exprs = dashboard_exprs() + rule_exprs()
    used = set()
    for where, expr in exprs:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        unknown = names - exported - {"up"}
        assert not unknown, f"{where}: {sorted(unknown)} not exported by streamgrpo/metrics.py ({expr})"
        used |= names
    # the dashboard covers every metric of docs/design.md "Metrics" (plus backpressure)
    families = {n for n in used if n.startswith("streamgrpo_")}
    base = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in families}
    expected = {
        "streamgrpo_reward", "streamgrpo_kl", "streamgrpo_loss", "streamgrpo_grad_norm", "streamgrpo_entropy",
        "streamgrpo_clip_fraction", "streamgrpo_importance_ratio", "streamgrpo_policy_version",
        "streamgrpo_staleness_steps", "streamgrpo_queue_depth", "streamgrpo_groups", "streamgrpo_groups_dropped",
        "streamgrpo_tokens", "streamgrpo_weight_sync_seconds", "streamgrpo_weight_bytes", "streamgrpo_step_seconds",
        "streamgrpo_idle_seconds", "streamgrpo_errors", "streamgrpo_backpressure", "streamgrpo_off_policy",
        "streamgrpo_learner_tokens_per_second", "streamgrpo_learner_mfu", "streamgrpo_media_cache",
        "streamgrpo_media_decode_seconds", "streamgrpo_media_wait_seconds",
    }
    assert expected <= base, f"metrics not on the dashboard or in the rules: {sorted(expected - base)}"


def test_metric_name_parser():
    assert metric_names('sum by (fn) (rate(streamgrpo_reward_sum{fn="a b"}[5m])) / on() group_left x_total') == {
        "streamgrpo_reward_sum", "x_total"}
    assert metric_names("(a != a) or (b > bool 1) and on() vector(0)") == {"a", "b"}


# ==================================================================================== grafana
@pytest.mark.prometheus
def test_dashboard_promql_is_valid_syntax(tmp_path):
    """Every dashboard expression, as a recording rule, passes `promtool check rules` (a PromQL parse)."""
    tool = promtool()
    rules = []
    for i, (_title, expr) in enumerate(dashboard_exprs()):
        for var in GRAFANA_VARS:
            expr = expr.replace(var, "1m")
        rules.append({"record": f"dashboard:expr_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(rules)} rules found" in out.stdout


def test_dashboard_structure_and_rows():
    dash = dashboard()
    assert dash["uid"] == "streamgrpo" and dash["title"] == "streamgrpo"
    panels = all_panels(dash["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == ["Overview", "Rewards", "Optimisation", "Staleness", "Queue and groups",
                    "Throughput and idle time", "Weights", "Media (visuals by reference)", "Held-out evaluation"]
    titles = " | ".join(p["title"] for p in panels).lower()
    for needle in ("reward per function", "accuracy", "kl", "loss", "clip fractions", "staleness of trained groups",
                   "queue depth", "groups produced", "dropped by reason", "tokens / s by role",
                   "weight sync latency", "idle ratio", "policy version per process", "learner tokens / s",
                   "learner mfu"):
        assert needle in titles, f"no panel for {needle!r}"
    heatmaps = [p for p in panels if p["type"] == "heatmap"]
    assert any("staleness" in p["title"].lower() for p in heatmaps)
    for p in heatmaps:
        assert all(t.get("format") == "heatmap" for t in p["targets"])
    ds_uid = yaml.safe_load((GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml").read_text())[
        "datasources"][0]["uid"]
    occupied: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"panel {p['title']!r} overlaps another"
        occupied |= cells
        if p["type"] != "row":
            assert p["datasource"]["uid"] == ds_uid and p["targets"], p["title"]
            for t in p["targets"]:
                assert t["datasource"]["uid"] == ds_uid


def test_learner_throughput_and_mfu_panels():
    """Tokens/s and MFU of the learner sit in the throughput row, read the learner job only (generators export
    the gauges too: MFU NaN, tokens/s 0) and show MFU as a percentage."""
    panels = all_panels(dashboard()["panels"])
    rows = {p["title"]: p["gridPos"]["y"] for p in panels if p["type"] == "row"}
    by_title = {p["title"]: p for p in panels}
    for title, metric in (("Learner tokens / s (prompt + completion)", "streamgrpo_learner_tokens_per_second"),
                          ("Learner MFU", "streamgrpo_learner_mfu")):
        p = by_title[title]
        assert rows["Throughput and idle time"] < p["gridPos"]["y"] < rows["Weights"], title
        (target,) = p["targets"]
        assert metric_names(target["expr"]) == {metric} and 'job="learner"' in target["expr"], target["expr"]
    assert by_title["Learner MFU"]["fieldConfig"]["defaults"]["unit"] == "percentunit"


def test_grafana_provisioning_matches_compose_mounts():
    ds = yaml.safe_load((GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["apiVersion"] == 1
    source = ds["datasources"][0]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090" and source["isDefault"]
    prov = yaml.safe_load((GRAFANA_DIR / "provisioning" / "dashboards" / "streamgrpo.yml").read_text())
    provider = prov["providers"][0]
    assert provider["type"] == "file"
    grafana = compose()["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("./"))
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/" + DASHBOARD.name


# ================================================================================== deepspeed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_configs_parse(stage):
    cfg = json.loads((DS_DIR / f"zero{stage}.json").read_text())
    assert cfg["zero_optimization"]["stage"] == stage
    flat = json.dumps(cfg)
    assert '"auto"' not in flat, "concrete values only: 'auto' needs the HF Trainer integration"
    assert isinstance(cfg["train_micro_batch_size_per_gpu"], int) and isinstance(cfg["gradient_accumulation_steps"], int)
    assert "optimizer" not in cfg and "scheduler" not in cfg, "the learner passes its own optimizer and schedule"


_DS_SCRIPT = """
import json, os, sys, torch
from streamgrpo.learner.deepspeed_setup import import_deepspeed
deepspeed = import_deepspeed()  # as the learner imports it: no JIT build of the CPU shared-memory op (a minute)
deepspeed.init_distributed(dist_backend="gloo")
out = {}
for stage in (1, 2, 3):
    cfg = json.load(open(os.path.join(sys.argv[1], f"zero{stage}.json")))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    x = torch.randn(4, 8, dtype=torch.bfloat16 if engine.bfloat16_enabled() else torch.float32)
    losses = []
    for _ in range(3):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    out[stage] = {"stage": engine.zero_optimization_stage(), "steps": engine.global_steps, "losses": losses,
                  "bf16": engine.bfloat16_enabled()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    """The three shipped configs through deepspeed.initialize + 3 real steps on CPU (gloo, one rank, one process)."""
    pytest.importorskip("deepspeed")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    out = subprocess.run([sys.executable, "-c", _DS_SCRIPT, str(DS_DIR)], capture_output=True, text=True,
                         timeout=600, env=env, cwd=tmp_path_factory.mktemp("deepspeed"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "shm_comm" not in out.stdout + out.stderr, "DeepSpeed built or loaded its shared-memory op on the CPU"
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_accepts_config_on_cpu(stage, deepspeed_runs):
    """DeepSpeed accepts the JSON as is (no HF Trainer to fill values) with a client AdamW, and steps."""
    result = deepspeed_runs[stage]
    assert result["stage"] == stage and result["steps"] == 3 and result["bf16"]
    assert result["losses"][-1] < result["losses"][0], "the optimizer did not step"


def test_compose_gives_each_generator_its_own_gpu_and_the_learner_the_rest():
    """The GPU profile on one 8-GPU node as .env.example sets it: the learner's ranks and every generator
    replica see different GPUs (each container reserves every GPU; its entrypoint picks its own)."""
    from streamgrpo.commands.placement import parse_gpus

    services, env = compose()["services"], env_example()
    for name in ("learner", "generator"):
        assert svc_devices(services[name])["count"] == "all", name
    learner_env = {k: str(v) for k, v in services["learner"]["environment"].items()}
    out = run_entrypoint("learner", ["learner", "--config", "demo"], NPROC_PER_NODE=learner_env["NPROC_PER_NODE"],
                         LEARNER_GPU_IDS=learner_env["LEARNER_GPU_IDS"])
    seen = {"learner": out.stderr.strip().removeprefix("CUDA_VISIBLE_DEVICES=")}
    assert out.stdout.split()[0] == "torchrun" and seen["learner"] == "0,1,2,3"
    gen_env = {k: str(v) for k, v in services["generator"]["environment"].items()}
    for k in range(int(env["GENERATOR_REPLICAS"])):
        out = run_entrypoint("generator", ["generator", "--config", "demo"], GENERATOR_ID=str(k),
                             GENERATOR_GPU_IDS=gen_env["GENERATOR_GPU_IDS"], GPUS_PER_GENERATOR=gen_env["GPUS_PER_GENERATOR"])
        assert out.returncode == 0, out.stderr
        seen[f"generator-{k}"] = out.stderr.strip().removeprefix("CUDA_VISIBLE_DEVICES=")
    gpus = [g for v in seen.values() for g in v.split(",")]
    assert len(gpus) == len(set(gpus)) == 8 and set(map(int, gpus)) == set(parse_gpus("0-7"))
    too_many = run_entrypoint("generator", ["generator"], GENERATOR_ID="4", GENERATOR_GPU_IDS="4,5,6,7")
    assert too_many.returncode == 2 and "generator 4 needs GPUs 5 to 5 of GENERATOR_GPU_IDS='4,5,6,7', which lists 4" in too_many.stderr
    short = run_entrypoint("learner", ["learner"], NPROC_PER_NODE="4", LEARNER_GPU_IDS="0,1")
    assert short.returncode == 2 and "4 learner ranks need a GPU each" in short.stderr


def svc_devices(svc: dict) -> dict:
    return svc["deploy"]["resources"]["reservations"]["devices"][0]
