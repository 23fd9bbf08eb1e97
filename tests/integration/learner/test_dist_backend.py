"""learner.dist_backend for real: learner ranks under torchrun join the process group init_distributed picks.

On a CPU host two ranks take gloo on the CPU. On a CUDA host (skipped elsewhere) one rank more than there are
GPUs takes gloo with every rank on the CPU (no ``cuda.set_device`` past the device count), and one rank per GPU
takes NCCL on GPU ``LOCAL_RANK``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.paths import REPO
from tests.sessions import run_session

SCRIPT = """
import json, os, sys
import torch.distributed as dist
from streamgrpo.learner.distributed import init_distributed, share, shutdown
info = init_distributed("deepspeed", timeout_s=120, dist_backend=sys.argv[2])
total = share(info, [info.rank + 1])[:, 0].sum()
with open(os.path.join(sys.argv[1], f"rank{info.rank}.json"), "w") as fh:
    json.dump({"backend": dist.get_backend(), "device": info.device, "sum": float(total),
               "ds_accelerator": os.environ.get("DS_ACCELERATOR")}, fh)
shutdown(info)
"""


def _torchrun(tmp_path: Path, nproc: int, requested: str = "auto") -> list[dict]:
    from streamgrpo.runtime.processes import free_port

    script = tmp_path / "join.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("DS_ACCELERATOR", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()),
           str(script), str(tmp_path), requested]
    out = run_session(cmd, env=env, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_two_ranks_without_a_gpu_each_take_gloo_on_the_cpu(tmp_path):
    n = torch.cuda.device_count() + 1 if torch.cuda.is_available() else 2
    ranks = _torchrun(tmp_path, n)
    assert [r["backend"] for r in ranks] == ["gloo"] * n and [r["device"] for r in ranks] == ["cpu"] * n
    assert {r["sum"] for r in ranks} == {n * (n + 1) / 2}  # the collective went through
    if torch.cuda.is_available():  # DeepSpeed is told to keep these ranks on the CPU too
        assert {r["ds_accelerator"] for r in ranks} == {"cpu"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_rank_per_gpu_takes_nccl_on_its_gpu(tmp_path):
    n = min(torch.cuda.device_count(), 2)
    ranks = _torchrun(tmp_path, n)
    assert [r["backend"] for r in ranks] == ["nccl"] * n
    assert [r["device"] for r in ranks] == [f"cuda:{i}" for i in range(n)]
    assert {r["sum"] for r in ranks} == {n * (n + 1) / 2}
