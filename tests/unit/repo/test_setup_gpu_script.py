"""deploy/setup-gpu.sh's decisions and `make setup`'s guard of the GPU set (issue 65), without a GPU: stand-ins
for `nvidia-smi` (the driver version it reports) and for the venv's python (it logs every command, and a pip
install of a named part fails as a build without a CUDA toolkit would) on PATH in a tmp dir. What is under test
is the shell logic -- order, what goes in after a failure, the lines said -- not pip or the driver."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.paths import REPO

SCRIPT = REPO / "deploy" / "setup-gpu.sh"

PY_STANDIN = """#!/bin/bash
echo "$*" >> "$STANDIN_LOG"
case "$1 $2 $3" in
  "-m pip install")
    for a in "$@"; do
      if [ -n "${STANDIN_FAIL:-}" ] && [[ $a == $STANDIN_FAIL* ]]; then echo "error: building $a failed" >&2; exit 1; fi
    done ;;
  "-m pip freeze"*) echo "transformers==5.19.0"; echo "torch==2.13.0+cu130" ;;
esac
case "$1" in -c) echo "$STANDIN_PREFIX" ;; esac
exit 0
"""

SMI_STANDIN = """#!/bin/bash
[ -n "${STANDIN_DRIVER:-}" ] || { echo "NVIDIA-SMI has failed" >&2; exit 9; }
echo "$STANDIN_DRIVER"
"""


@pytest.fixture
def box(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("py", PY_STANDIN), ("nvidia-smi", SMI_STANDIN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "prefix").mkdir()
    return tmp_path


def setup_gpu(box: Path, *args: str, driver: str = "580.65.06", fail: str = "") -> tuple[subprocess.CompletedProcess,
                                                                                         list[str]]:
    log = box / "log"
    log.write_text("")
    env = {**os.environ, "PATH": f"{box / 'bin'}:{os.environ['PATH']}", "STANDIN_LOG": str(log),
           "STANDIN_DRIVER": driver, "STANDIN_FAIL": fail, "STANDIN_PREFIX": str(box / "prefix")}
    env.pop("STREAMGRPO_SETUP_GPU_CPU", None)
    out = subprocess.run(["bash", str(SCRIPT), "--python", str(box / "bin" / "py"), *args], env=env,
                         capture_output=True, text=True, timeout=60)
    return out, log.read_text().splitlines()


def installs(log: list[str]) -> list[str]:
    """The part each `pip install` of the log installs (its last argument's name)."""
    out = []
    for line in log:
        if line.startswith("-m pip install") and "--upgrade pip" not in line:
            last = line.split()[-1]
            out.append("streamgrpo" if last.startswith(str(REPO)) else last.split("==")[0])
    return out


def test_the_whole_set_in_order_cuda_builds_pinned_and_the_venv_marked(box):
    out, log = setup_gpu(box)
    assert out.returncode == 0, out.stderr
    assert installs(log) == ["torchvision", "vllm", "deepspeed", "flash-attn", "streamgrpo"]  # torch step: 2 names
    torch_line = next(x for x in log if "torch==" in x)
    # the CUDA build by its local tag, from PyTorch's CUDA 13 index: a resolver cannot take the CPU 2.13.0
    assert "torch==2.13.0+cu130 torchvision==0.28.0+cu130" in torch_line
    assert "--extra-index-url https://download.pytorch.org/whl/cu130" in torch_line
    assert "setup-gpu: NVIDIA driver 580.65.06 (>= 580 for CUDA 13)" in out.stdout
    assert log[-1] == "-m pip freeze" and "transformers==5.19.0" in (box / "prefix" / ".streamgrpo-gpu-set").read_text()
    assert out.stderr == ""


@pytest.mark.parametrize("part", ["flash-attn", "deepspeed"])
def test_an_optional_part_that_fails_leaves_streamgrpo_installed(box, part):
    out, log = setup_gpu(box, fail=f"{part}==")
    assert out.returncode == 0, out.stderr
    assert installs(log)[-1] == "streamgrpo"
    streamgrpo = [x for x in log if x.startswith("-m pip install") and x.split()[-1].startswith(str(REPO))][0]
    # without DeepSpeed, the [deepspeed] extra would have pip build it again (and fail again)
    assert streamgrpo.endswith(f"-e {REPO}" if part == "deepspeed" else f"-e {REPO}[deepspeed]")
    said = [x for x in out.stderr.splitlines() if x.startswith("setup-gpu:")]
    assert len(said) == 2, out.stderr
    assert said[0].startswith(f"setup-gpu: {part} ") and "did not install" in said[0]
    assert f"deploy/setup-gpu.sh --parts {part}" in said[0] and "CUDA 13 toolkit" in said[0]  # the fix
    assert said[1].startswith("setup-gpu: installed torch vllm deepspeed flash-attn streamgrpo except " + part)
    assert not (box / "prefix" / ".streamgrpo-gpu-set").exists()  # not the whole set: `make setup` is not held


def test_a_required_part_that_fails_stops(box):
    out, log = setup_gpu(box, fail="vllm==")
    assert out.returncode != 0 and installs(log) == ["torchvision", "vllm"]


def test_skip_leaves_parts_out(box):
    out, log = setup_gpu(box, "--skip", "flash-attn", "--skip", "deepspeed")
    assert out.returncode == 0, out.stderr
    assert installs(log) == ["torchvision", "vllm", "streamgrpo"] and log[-2].endswith(f"-e {REPO}")
    assert "setup-gpu: skipping flash-attn (--skip)" in out.stdout
    out, _ = setup_gpu(box, "--skip", "flash_attn")
    assert out.returncode == 2 and out.stderr.startswith("setup-gpu: unknown part flash_attn")


@pytest.mark.parametrize("driver", ["570.86.15", ""])
def test_a_driver_older_than_cuda_13_needs_stops_before_installing(box, driver):
    out, log = setup_gpu(box, driver=driver)
    assert out.returncode == 1 and installs(log) == [] and not any("pip" in x for x in log)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and ">= 580" in lines[0]
    if driver:
        assert lines[0].startswith("setup-gpu: NVIDIA driver 570.86.15 found; the CUDA 13 builds of torch 2.13.0+cu130 "
                                   "need >= 580")
    # an image built without a GPU has no driver to check
    out, log = setup_gpu(box, "--without-gpu", "--parts", "torch", driver=driver)
    assert out.returncode == 0 and installs(log) == ["torchvision"]


# ------------------------------------------------------------------------------- make setup's guard
@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_setup_leaves_the_gpu_set_alone_unless_forced(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "log"
    for name in ("python", "pip"):
        (venv / "bin" / name).write_text(f'#!/bin/bash\necho "{name} $*" >> {log}\nexit 0\n')
        (venv / "bin" / name).chmod(0o755)
    mark = venv / ".streamgrpo-gpu-set"
    mark.write_text("torch==2.13.0+cu130\ntransformers==5.19.0\nvllm==0.32.0\n")  # as setup-gpu.sh leaves it
    stamp = venv / ".streamgrpo-setup"

    def make(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["make", "--no-print-directory", f"VENV={venv}", *extra, str(stamp)], cwd=REPO,
                              capture_output=True, text=True, timeout=60)

    out = make()
    assert out.returncode != 0 and not log.exists() and not stamp.exists()  # nothing installed
    lines = [x for x in out.stderr.splitlines() if x.startswith("make setup:")]
    assert len(lines) == 1 and "would change transformers 5.19.0 -> 5.24.0" in lines[0] and "FORCE=1" in lines[0]
    assert "vllm" not in lines[0] and "torch" not in lines[0]  # constraints.txt pins neither

    out = make("FORCE=1")
    assert out.returncode == 0, out.stderr
    assert stamp.exists() and any("-c constraints.txt -e .[dev]" in x for x in log.read_text().splitlines())
    assert not mark.exists()  # no longer the GPU set
