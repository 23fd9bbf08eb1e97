"""`streamgrpo slurm`'s placement and script (pure): where each process goes, its /metrics port, the refusals;
the script runs under stand-ins in tests/integration/test_slurm.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from streamgrpo.commands.slurm import plan_job, render
from streamgrpo.config import ConfigError, load_config


def _cfg(*sets: str):
    return load_config("qwen2_5_vl_7b_video", ["eval.enabled=false", *sets])


def test_sixteen_ranks_on_two_nodes_and_generators_on_the_rest():
    job = plan_job(_cfg(), 4, gpus_per_node=8, learner_ranks=16)
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
                   generators_per_node=2)
    assert job.learner_nodes == 1 and job.evaluator_node == 0
    assert [g.node for g in job.generators] == [0, 0] and job.relay_nodes == (0,)
    assert job.ports["evaluator"] == (0, 9100 + 4 + 2)


@pytest.mark.parametrize("nodes, gpus, ranks, eval_on, message", [
    (2, 8, 12, False, "use a multiple of --gpus-per-node"),
    (1, 8, 16, False, "need 2 nodes of 8 GPUs; --nodes is 1"),
    (2, 8, 16, False, "no GPU left for a generator"),
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
    assert sum("--gpus-per-task=1 --exact" in line for line in srun) == 5
    assert any("--gpus-per-node=8 --exact" in line for line in srun)
    assert "--nproc-per-node=8" in text and "--set learner.backend=deepspeed" in text
    assert "--set loss.beta=0.01" in text and "--set queue.url=null" in text  # the config's own Redis is replaced
    assert "find_redis_server" in text and "redis-cli" not in text and "appendfsync always" in text
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
    assert listed["evaluator"] == ["gpu-b:9107"] and listed["relay-1"] == ["gpu-b:9109"]  # after 5 generators
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
