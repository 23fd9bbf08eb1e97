"""The Slurm template, run for real on this machine: `deploy/slurm/streamgrpo.sbatch` under stand-ins for
`scontrol` and `srun` (two "nodes", both this host; srun runs its command here), with the real
redis-server, torchrun + DeepSpeed learner on gloo and a generator whose weights come through the
host's relay. The job trains to learner.max_steps and ends by itself; the generator got its weights
from the relay (which it started), and every group trained was produced."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCONTROL = "#!/bin/sh\n# scontrol show hostnames <list>: two nodes, both this host\necho 127.0.0.1\necho 127.0.0.1\n"
SRUN = '#!/bin/bash\n# srun [--opt=value | --flag]... command: run the command here\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n'


def test_the_sbatch_template_trains_with_a_relay_and_ends_with_the_learner(tiny_model_dir, demo_data_dir, tmp_path):
    from streamgrpo.config import load_config
    from streamgrpo.runtime import free_port

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    shm = tmp_path / "shm"
    shm.mkdir()
    run = tmp_path / "run"
    cfg = load_config("demo", [f"model.name_or_path={tiny_model_dir}", "demo.tiny_model=false", "demo.make_data=false",
                               f"data.train_path={Path(demo_data_dir) / 'train.jsonl'}", "data.kinds=null",
                               "eval.enabled=false", "learner.max_steps=6", "learner.save_steps=3",
                               "learner.groups_per_step=4", "rollout.prompts_per_batch=2", "learner.get_timeout_s=1",
                               "loss.max_staleness=100", "metrics.port=0", f"weights.pub_port={free_port()}",
                               f"weights.snapshot_port={free_port()}", f"weights.shm_dir={shm}"])
    config = tmp_path / "job.yaml"
    config.write_text(cfg.to_yaml())
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_JOB_NAME": "sgtest", "SLURM_JOB_ID": "4242",
           "CONFIG": str(config), "LEARNER_NODES": "1", "GPUS_PER_NODE": "1", "RUN_DIR": str(run),
           "REDIS_PORT": str(free_port()), "RDZV_PORT": str(free_port()), "REDIS_PASSWORD": "sbatch-test-pw",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    env.pop("STREAMGRPO_REDIS_URL", None)
    from streamgrpo.relay.keeper import lock_path

    lock = lock_path(cfg.weights)
    try:
        out = subprocess.run(["bash", str(ROOT / "deploy" / "slurm" / "streamgrpo.sbatch")], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=900)
        logs = "".join(f"\n--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted((run / "logs").glob("*.log"))) \
            if (run / "logs").is_dir() else ""
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + logs
        assert "learner finished; stopping generators and Redis" in out.stdout
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, 7)) and rows[-1]["groups_trained"] == 24
        relay_logs = list((run / "logs").glob("relay-*.log"))
        assert relay_logs, "the generator did not start its host's relay"
        events = [json.loads(x) for x in (run / "audit" / "generator-0.jsonl").read_text().splitlines()]
        assert max(e.get("version", 0) for e in events) >= 1, "the generator never applied a trained version"
        assert "relay: 127.0.0.1" in relay_logs[0].read_text()
    finally:
        if lock.is_file() and lock.read_text().strip():  # the relay outlives the job here (Slurm's cgroup ends it)
            try:
                os.kill(int(lock.read_text()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass
