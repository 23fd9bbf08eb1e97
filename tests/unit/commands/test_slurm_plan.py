"""`streamgrpo slurm`'s placement and script (pure): where each process goes, its /metrics port, the refusals;
the script runs under stand-ins in tests/integration/commands/test_slurm.py."""

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
from prometheus_client.metrics import MetricWrapperBase

import streamgrpo.metrics as streamgrpo_metrics
from streamgrpo.commands.slurm import plan_job, render
from streamgrpo.config import ConfigError, load_config
from tests.paths import REPO


def _cfg(*sets: str):
    return load_config("qwen2_5_vl_7b_video", ["eval.enabled=false", *sets])


def test_sixteen_ranks_on_two_nodes_and_generators_on_the_rest():
    job = plan_job(_cfg(), 4, gpus_per_node=8, learner_ranks=16, generators=16)
    assert (job.learner_nodes, job.ranks_per_node) == (2, 8)
    assert [g.node for g in job.generators] == [2] * 8 + [3] * 8 and job.relay_nodes == (2, 3)
    assert [g.id for g in job.generators] == list(range(16))
    ports = [p for _, p in job.ports.values()]
    assert job.ports["learner-8"] == (1, 9100)  # local rank 0 of the second learner node
    assert len({(n, p) for n, p in job.ports.values()}) == len(ports)
    non_learner = [p for k, (_, p) in job.ports.items() if not k.startswith("learner")]
    assert len(set(non_learner)) == len(non_learner) and min(non_learner) == 9108


def test_one_node_shares_its_gpus_and_the_evaluator_takes_the_last():
    job = plan_job(_cfg("eval.enabled=true", "data.eval_path=x.jsonl"), 1, gpus_per_node=8, learner_ranks=4,
                   generators_per_node=2, generators=2)
    assert job.learner_nodes == 1 and job.evaluator_node == 0
    assert [g.node for g in job.generators] == [0, 0] and job.relay_nodes == (0,)
    assert job.ports["evaluator"] == (0, 9100 + 4 + 2)


@pytest.mark.parametrize("nodes, gpus, ranks, eval_on, message", [
    (2, 8, 12, False, "use a multiple of --gpus-per-node"),
    (1, 8, 16, False, "need 2 nodes of 8 GPUs; --nodes is 1"),
    (2, 8, 16, False, r"4 generators \(rollout.num_generators\) need 4 GPUs; 0 are left"),
    (1, 1, 1, True, "no GPU left for the evaluator"),
    (0, 8, 1, False, "each at least 1"),
])
def test_placements_that_cannot_work_are_one_line(nodes, gpus, ranks, eval_on, message):
    sets = ("eval.enabled=true", "data.eval_path=x.jsonl") if eval_on else ()
    with pytest.raises(ConfigError, match=message):
        plan_job(_cfg(*sets), nodes, gpus_per_node=gpus, learner_ranks=ranks)


def test_the_script_names_each_step_with_its_flags(tmp_path):
    cfg = _cfg("eval.enabled=true", "data.eval_path=x.jsonl")
    job = plan_job(cfg, 3, gpus_per_node=8, learner_ranks=8, generators_per_node=2)
    text = render(job, cfg, tmp_path / "my.yaml", overrides=("loss.beta=0.01",))
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    srun = [line for line in text.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1 + 2 + 1 + 1 + 4  # redis, relays, learner, evaluator, generators
    assert sum("--overlap --gpus=0" in line for line in srun) == 3
    assert sum("--gres=gpu:1 --exact" in line for line in srun) == 5  # not --gpus-per-task: see render()
    assert not any("--gpus-per-task" in line or "--gpus-per-node" in line for line in srun)
    learner, = [line for line in srun if "sg-learner" in line]
    assert "--nodes=1 --ntasks=1 --ntasks-per-node=1" in learner and "--gres=gpu:8 --exact" in learner
    names = [re.search(r"--job-name=(\S+)", line).group(1) for line in srun]
    assert names == ["sg-redis", "sg-relay-1", "sg-relay-2", "sg-learner", "sg-evaluator"] + \
        [f"sg-generator-{k}" for k in range(4)]
    assert "--nproc-per-node=8" in text and "--set learner.backend=deepspeed" in text
    assert "--set loss.beta=0.01" in text and "--set queue.url=null" in text  # the config's own Redis is replaced
    assert "find_redis_server" in text and "redis-cli" not in text and "job_conf" in text  # appendfsync always
    assert "#SBATCH --nodes=3" in text and "prometheus/targets.json" in text
    relays = [line for line in srun if " relay " in line]
    assert len(relays) == 2 and all("--set weights.relay_metrics_port=" in line for line in relays)
    assert not any("--set metrics.port=" in line for line in relays)  # a relay never takes a generator's port


def test_the_command_wants_a_config_file(tmp_path):
    out = subprocess.run([sys.executable, "-m", "streamgrpo", "slurm", "--config", "demo", "--nodes", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "the sbatch script names the config file" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_scrape_targets_are_a_file_prometheus_reads(tmp_path):
    """The script's targets writer (its heredoc, run here with the node names Slurm would give), then
    promtool on a Prometheus config that reads the file."""
    import json
    import re
    import shutil

    cfg = _cfg("eval.enabled=true", "data.eval_path=x.jsonl")
    job = plan_job(cfg, 2, gpus_per_node=4, learner_ranks=2)
    text = render(job, cfg, tmp_path / "my.yaml")
    writer = re.search(r"<<'EOF'\n(.*?)\nEOF\n", text, re.S).group(1)
    targets = tmp_path / "targets.json"
    subprocess.run([sys.executable, "-", str(targets), "gpu-a", "gpu-b"], input=writer, text=True, check=True)
    listed = {t["labels"]["process"]: t["targets"] for t in json.loads(targets.read_text())}
    assert listed["learner-1"] == ["gpu-a:9101"] and listed["generator-0"] == ["gpu-a:9102"]
    assert listed["evaluator"] == ["gpu-b:9106"] and listed["relay-1"] == ["gpu-b:9108"]  # after 4 generators
    assert set(listed) == set(job.ports)
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    conf = tmp_path / "prometheus.yml"
    conf.write_text(f"scrape_configs:\n  - job_name: streamgrpo\n    file_sd_configs:\n      - files: ['{targets}']\n")
    out = subprocess.run([tool, "check", "config", str(conf)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    broken = tmp_path / "broken.json"
    broken.write_text('[{"targets": "gpu-a:9100"}]')
    conf.write_text(f"scrape_configs:\n  - job_name: streamgrpo\n    file_sd_configs:\n      - files: ['{broken}']\n")
    assert subprocess.run([tool, "check", "config", str(conf)], capture_output=True).returncode != 0




def _heredoc(text: str, marker: str) -> str:
    """The body of the script's heredoc whose opening line contains ``marker``."""
    return re.search(re.escape(marker) + r"[^\n]*<<'EOF'\n(.*?)EOF\n", text, re.S).group(1)


def _targets(text: str, tmp_path: Path, *hosts: str) -> list[dict]:
    writer = re.search(r"\"\$PYTHON\" - [^\n]*<<'EOF'\n(.*?)\nEOF\n", text, re.S).group(1)
    out = tmp_path / "targets.json"
    subprocess.run([sys.executable, "-", str(out), *hosts], input=writer, text=True, check=True)
    return json.loads(out.read_text())


def _selected_jobs() -> set[str]:
    """Every `job` that deploy/prometheus/rules.yml and the Grafana dashboard select (job="x", job=~"a|b")."""
    exprs = [r["expr"] for g in yaml.safe_load((REPO / "deploy/prometheus/rules.yml").read_text())["groups"]
             for r in g["rules"]]
    exprs += re.findall(r'"expr":\s*"((?:[^"\\]|\\.)*)"', (REPO / "deploy/grafana/dashboards/streamgrpo.json").read_text())
    jobs = set()
    for e in exprs:
        for value in re.findall(r'job\s*=~?\s*\\?"([^"\\]+)', e):
            jobs.update(value.split("|"))
    return jobs


def _metric_label_names() -> set[str]:
    return {n for v in vars(streamgrpo_metrics).values() if isinstance(v, MetricWrapperBase) for n in v._labelnames}


def test_the_targets_carry_the_jobs_the_rules_and_the_dashboard_select(tmp_path):
    """targets.json labels each process with the `job` the alert rules and the dashboard select (learner,
    generator; the evaluator and relays their own), plus process and node, none of them one of streamgrpo's own
    metric labels; the rendered prometheus.yml reads it and the shipped rules (promtool checks both)."""
    cfg = _cfg("eval.enabled=true", "data.eval_path=x.jsonl")
    job = plan_job(cfg, 2, gpus_per_node=4, learner_ranks=2)
    text = render(job, cfg, tmp_path / "my.yaml")
    targets = _targets(text, tmp_path, "gpu-a", "gpu-b")
    jobs = {t["labels"]["process"]: t["labels"]["job"] for t in targets}
    assert jobs["learner-1"] == "learner" and jobs["generator-3"] == "generator"
    assert jobs["evaluator"] == "evaluator" and jobs["relay-0"] == "relay"
    selected = _selected_jobs()
    assert {"learner", "generator"} <= selected, selected  # the parse found the selectors
    assert selected <= set(jobs.values()), f"rules/dashboard select jobs no target has: {selected - set(jobs.values())}"
    own = _metric_label_names()
    assert {"role", "fn", "event", "reason", "side", "stat", "kind"} <= own
    for t in targets:
        assert not set(t["labels"]) & own, f"{t['labels']} would rename streamgrpo's own labels to exported_*"
        assert t["labels"]["node"] == t["targets"][0].split(":")[0]

    conf = tmp_path / "prometheus.yml"
    conf.write_text(_heredoc(text, '"$RUN_DIR/prometheus/prometheus.yml"'))
    doc = yaml.safe_load(conf.read_text())
    assert doc["scrape_configs"][0]["file_sd_configs"] == [{"files": ["targets.json"]}]
    assert doc["rule_files"] == ["rules/*.yml"]
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    (tmp_path / "rules").mkdir()
    shutil.copy(REPO / "deploy/prometheus/rules.yml", tmp_path / "rules" / "rules.yml")
    out = subprocess.run([tool, "check", "config", str(conf)], capture_output=True, text=True)
    assert out.returncode == 0 and "SUCCESS: 1 rule files found" in out.stdout + out.stderr, out.stdout + out.stderr


def test_the_learner_step_finds_its_network_interface(tmp_path):
    """No `ib0` assumed: the learner's step (learner-env.sh) sets NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME to
    the interface that routes to the other learner nodes, keeps what the user set, and leaves them to NCCL's
    own choice when no other learner node is reachable."""
    cfg = _cfg()
    text = render(plan_job(cfg, 4, gpus_per_node=8, learner_ranks=16, generators=8), cfg, tmp_path / "my.yaml")
    assert "ib0" not in text and "NCCL_IB_HCA=" not in text
    assert 'export LEARNER_NODES="${NODES[0]} ${NODES[1]}"' in text
    assert 'bash "$RUN_DIR/slurm/learner-env.sh" "$PYTHON" -m streamgrpo.learner.ranks' in text
    env_sh = tmp_path / "learner-env.sh"
    env_sh.write_text(_heredoc(text, '"$RUN_DIR/slurm/learner-env.sh"'))
    if shutil.which("ip") is None:
        pytest.skip("no `ip` (iproute2) here")
    remote = "192.0.2.1"  # TEST-NET-1: routed like any other host's address (through the default route)
    route = subprocess.run(["ip", "-o", "route", "get", remote], capture_output=True, text=True)
    if route.returncode != 0:
        pytest.skip(f"no route to {remote} here")
    dev = re.search(r" dev (\S+)", route.stdout).group(1)
    show = ["sh", "-c", 'echo "$NCCL_SOCKET_IFNAME|$GLOO_SOCKET_IFNAME"']
    base = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}

    def run(nodes: str, **extra) -> str:
        out = subprocess.run(["bash", str(env_sh), *show], env={**base, "LEARNER_NODES": nodes, **extra},
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert run(f"localhost {remote}") == f"{dev}|{dev}"  # this node's own name routes through lo: the next one
    assert run("localhost") == "|"  # one learner node: NCCL's and gloo's own choice
    assert run(remote, NCCL_SOCKET_IFNAME="eth7") == f"eth7|{dev}"  # what the user set stays


def test_time_limit_signal_requeue_and_memory_per_step(tmp_path):
    """SIGTERM --grace-s before the time limit to the batch shell, requeue, the output appended across requeues,
    every node whole (--mem=0) and each GPU step its share of the memory (none takes all the job's); the
    behaviour under SIGTERM runs in tests/integration/commands/test_slurm.py."""
    cfg = _cfg("eval.enabled=true", "data.eval_path=x.jsonl")
    job = plan_job(cfg, 3, gpus_per_node=8, learner_ranks=8, generators=4)
    text = render(job, cfg, tmp_path / "my.yaml", grace_s=600)
    for line in ("#SBATCH --signal=B:TERM@600", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "#SBATCH --mem=0", "trap on_term TERM", 'scontrol requeue "$SLURM_JOB_ID"',
                 "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}"):
        assert line in text, line
    assert "#SBATCH --signal=B:TERM@300" in render(job, cfg, tmp_path / "my.yaml")  # the default grace
    srun = [line for line in text.splitlines() if line.startswith("srun ")]
    assert all(re.search(r" --mem=\S", line) for line in srun), [x for x in srun if "--mem=" not in x]
    assert sum("--mem=$MEM_PER_GPU " in line for line in srun) == 5  # the evaluator and 4 generators
    assert sum("--overlap --gpus=0 --mem=$MEM_CPU_STEP " in line for line in srun) == 1 + 1  # Redis, a relay
    assert "RealMemory" in text  # --mem=0 leaves SLURM_MEM_PER_NODE unset on Slurm 22.05
    # steps are stopped by name with scancel --signal (srun answers its own SIGTERM with SIGKILL of the step)
    assert "step_signal TERM sg-learner" in text and "step_signal TERM 'sg-generator-*' sg-evaluator" in text
    assert not re.search(r"kill -(TERM|KILL) \"\$(LEARNER|\{STEPS)", text)
    assert "--mem=$(( MEM_PER_GPU * 8 ))" in text
    assert f"[\"step\"] < {cfg.learner.max_steps})" in text  # requeued only short of learner.max_steps


def test_the_generators_follow_the_config_not_every_spare_gpu(tmp_path):
    """By default rollout.num_generators generators (docs/cluster.md's sizing), not one per spare GPU (28 for 4
    learner ranks on 4 nodes); --generators sets the number; the header and the summary say how many and why."""
    cfg = load_config("qwen2_5_vl_7b_1node", ["eval.enabled=false"])
    job = plan_job(cfg, 4, gpus_per_node=8, learner_ranks=4)
    assert len(job.generators) == cfg.rollout.num_generators == 4 and job.relay_nodes == (0,)
    text = render(job, cfg, tmp_path / "my.yaml")
    assert "# Generators: 4 (rollout.num_generators in the config; docs/cluster.md" in text
    assert "rollout.num_generators=4" in text and "24 GPU(s) idle" in text
    job = plan_job(cfg, 4, gpus_per_node=8, learner_ranks=4, generators=28)
    assert len(job.generators) == 28 and job.relay_nodes == (0, 1, 2, 3)
    assert "# Generators: 28 (--generators;" in render(job, cfg, tmp_path / "my.yaml")
    with pytest.raises(ConfigError, match=r"29 generators \(--generators\) need 29 GPUs; 28 are left"):
        plan_job(cfg, 4, gpus_per_node=8, learner_ranks=4, generators=29)


def test_the_evaluator_off_the_learners_node_takes_tcp(tmp_path):
    """A recipe's weights.transport=shm reaches only the learner's node: the evaluator elsewhere gets
    --set weights.transport=tcp (the factory would fall back to TCP as well); on the learner's node it keeps shm."""
    cfg = load_config("qwen2_5_vl_7b_1node", ["eval.enabled=true", "data.eval_path=x.jsonl"])
    assert cfg.weights.transport == "shm"
    text = render(plan_job(cfg, 2, gpus_per_node=8, learner_ranks=4), cfg, tmp_path / "my.yaml")
    evaluator, = [line for line in text.splitlines() if " evaluator " in line and line.startswith("srun ")]
    assert '--nodelist="${NODES[1]}"' in evaluator and "--set weights.transport=tcp" in evaluator
    text = render(plan_job(cfg, 1, gpus_per_node=8, learner_ranks=4, generators=3), cfg, tmp_path / "my.yaml")
    evaluator, = [line for line in text.splitlines() if " evaluator " in line and line.startswith("srun ")]
    assert "weights.transport" not in evaluator


def test_the_monitoring_doc_says_what_the_script_sets(tmp_path):
    """docs/monitoring.md on ports under Slurm: the script gives each process its own metrics.port (no
    --local-index), as the rendered generator steps show."""
    cfg = _cfg()
    text = render(plan_job(cfg, 2, gpus_per_node=8, learner_ranks=8, generators=2), cfg, tmp_path / "my.yaml")
    gens = [line for line in text.splitlines() if " generator " in line and line.startswith("srun ")]
    assert gens and all("--set metrics.port=" in g and "--local-index" not in g for g in gens)
    doc = (REPO / "docs/monitoring.md").read_text()
    slurm = [p for p in doc.split("\n\n") if "slurm" in p.lower()]
    assert slurm and not any("--local-index" in p and "Slurm template passes" in p for p in slurm)
    assert any("metrics.port" in p and "streamgrpo slurm" in p for p in slurm), slurm


def test_learner_nodes_spread_the_ranks_and_leave_gpus_beside_them():
    cfg = _cfg("eval.enabled=true", "data.eval_path=x.jsonl")
    job = plan_job(cfg, 3, gpus_per_node=2, learner_ranks=2, learner_nodes=2, generators=3, generators_per_node=1)
    assert (job.learner_nodes, job.ranks_per_node) == (2, 1)
    assert [g.node for g in job.generators] == [0, 1, 2] and job.evaluator_node == 2
    assert job.ports["learner-1"] == (1, 9100)
    text = render(job, cfg, "my.yaml")
    assert "--nnodes=2 --nproc-per-node=1" in text and '--nodelist="${NODES[0]},${NODES[1]}"' in text
    with pytest.raises(ConfigError, match="--learner-nodes 2: torchrun runs the same number of ranks"):
        plan_job(cfg, 3, gpus_per_node=2, learner_ranks=3, learner_nodes=2, generators=1)


@pytest.mark.parametrize("flag, value, message", [
    ("--job-name", "a\n#SBATCH --wrap=x", "--job-name"), ("--time", "24:00:00\nrm -rf /", "--time"),
    ("--partition", "gpu p", "--partition")])
def test_values_that_would_leave_their_line_are_refused(tmp_path, flag, value, message):
    cfg = _cfg()
    config = tmp_path / "my.yaml"
    config.write_text(cfg.to_yaml())
    out = subprocess.run([sys.executable, "-m", "streamgrpo", "slurm", "--config", str(config), "--nodes", "2",
                          "--generators", "1", flag, value], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
    odd = tmp_path / "a\nb.yaml"
    odd.write_text(cfg.to_yaml())
    out = subprocess.run([sys.executable, "-m", "streamgrpo", "slurm", "--config", str(odd), "--nodes", "2",
                          "--generators", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "a control character" in out.stderr, out.stderr


def test_the_jobs_redis_conf_takes_any_run_directory(tmp_path, redis_factory):
    """A run directory with a space, quotes and a newline: redis-server starts on the job's redis.conf, keeps
    its AOF there, and no line of it is a directive of the path's (issue 62, item 5)."""
    from streamgrpo.transport.queue.server import find_redis_server, free_port, job_conf

    odd = tmp_path / 'run dir "x"\nappendonly no' / "redis"
    odd.mkdir(parents=True)
    port = free_port()
    conf = job_conf(port, 'pw "q"\nx', odd)
    assert len(conf.splitlines()) == 9 and {"appendonly yes", "appendfsync always"} <= set(conf.splitlines())
    (odd / "redis.conf").write_text(conf)
    proc = subprocess.Popen([find_redis_server(), str(odd / "redis.conf")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        import redis

        r = redis.Redis(host="127.0.0.1", port=port, password='pw "q"\nx')
        for _ in range(100):
            try:
                r.set("k", "v")
                break
            except redis.ConnectionError:
                assert proc.poll() is None, proc.stderr.read()
                import time

                time.sleep(0.1)
        assert r.config_get("dir")["dir"] == str(odd) and r.config_get("appendonly")["appendonly"] == "yes"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_free_weight_port_in_the_config_becomes_a_fixed_one_other_nodes_reach():
    """The demo config's weights.pub_port 0 (a free port) is known only on the learner's host: the relays and
    the evaluator on other nodes connected to port 0 and never received a version (seen on the local Slurm)."""
    cfg = load_config("demo", ["eval.enabled=false"])
    text = render(plan_job(cfg, 2, gpus_per_node=2, generators=2), cfg, "my.yaml")
    assert "--set weights.pub_port=${WEIGHTS_PUB_PORT:-5555}" in text
    assert "--set weights.snapshot_port=${WEIGHTS_SNAPSHOT_PORT:-5556}" in text
    fixed = _cfg()  # the recipe's own ports stand
    assert "WEIGHTS_PUB_PORT" not in render(plan_job(fixed, 2, gpus_per_node=8, generators=2), fixed, "my.yaml")
