#!/usr/bin/env bash
# Install the GPU set (constraints-gpu.txt) in the order and with the flags it needs: `make setup-gpu` and the
# GPU images (services/*/Dockerfile) run this, so the order, the flags and the versions live in one place.
#
#   deploy/setup-gpu.sh [--python PY] [--parts torch,vllm,deepspeed,flash-attn,streamgrpo] [--skip PART]
#                       [--spec SPEC] [--dry-run] [--download-dir DIR] [--without-gpu]
#
# Steps (each one of --parts; default all; --skip PART, repeatable or comma-separated, leaves one out):
#   torch       torch, torchvision: the CUDA 13 builds (+cu130 in constraints-gpu.txt, from PyTorch's index,
#               TORCH_INDEX), after a check that the NVIDIA driver is new enough (>= 580; one line, exit 1, if not)
#   vllm        vLLM, resolved against that torch
#   deepspeed   built against the installed torch: --no-build-isolation            (optional)
#   flash-attn  the same (compiles CUDA kernels: set MAX_JOBS to bound its memory)   (optional)
#   streamgrpo  SPEC (default: -e '.[deepspeed]'; without the extra when DeepSpeed is not installed), every
#               dependency held to constraints-gpu.txt
# An optional part that fails does not stop the script: one line says what failed and the fix, and streamgrpo
# is installed all the same (exit status 0 when every required part went in). A required part that fails stops
# it. After the whole set went in, the venv is marked (.streamgrpo-gpu-set in its prefix, its `pip freeze`):
# `make setup` then leaves the GPU set alone (deploy/keep-gpu-set.sh: it says what it would change and stops,
# unless FORCE=1).
# --dry-run prints the set and the commands and installs nothing. On a machine without CUDA (no nvidia-smi,
# or STREAMGRPO_SETUP_GPU_CPU=1) nothing is installed either: the whole set is resolved (pip --dry-run, its
# report in DIR/resolve.json), vLLM, DeepSpeed and flash-attn are downloaded into DIR, and one line says
# what was skipped. --without-gpu installs anyway (an image is built on a machine without GPUs; no driver check).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
constraints=${STREAMGRPO_GPU_CONSTRAINTS:-$here/constraints-gpu.txt}
py=python3
parts=torch,vllm,deepspeed,flash-attn,streamgrpo
spec="-e $here[deepspeed]"
dry_run=0
without_gpu=0
download_dir=$here/.gpu-downloads
skip=""
min_driver=580  # CUDA 13.x needs an NVIDIA driver of this major version or newer
optional=" deepspeed flash-attn "
failed=""

while [ $# -gt 0 ]; do
  case $1 in
    --python) py=$2; shift 2 ;;
    --parts) parts=$2; shift 2 ;;
    --skip) skip="$skip,$2"; shift 2 ;;
    --spec) spec=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --without-gpu) without_gpu=1; shift ;;
    --download-dir) download_dir=$2; shift 2 ;;
    *) echo "setup-gpu: unknown argument $1" >&2; exit 2 ;;
  esac
done

pin() {  # the pinned version of $1 in constraints-gpu.txt
  local v
  v=$(sed -n "s/^$1==\([^ ;#]*\).*/\1/p" "$constraints")
  if [ -z "$v" ]; then echo "setup-gpu: $constraints pins no $1" >&2; exit 2; fi
  echo "$v"
}

run() {  # print the command (--dry-run) or run it
  if [ "$dry_run" = 1 ]; then echo "  $*"; else echo "setup-gpu: $*"; "$@"; fi
}

torch_index() {  # PyTorch's index of the CUDA build the torch pin names (+cu130 -> .../whl/cu130)
  local tag
  tag=$(pin torch); tag=${tag#*+}
  echo "${TORCH_INDEX:-https://download.pytorch.org/whl/$tag}"
}

fix() {  # the one line an optional part's failure gets
  case $1 in
    deepspeed) echo "setup-gpu: deepspeed $(pin deepspeed) did not install (above): it builds against the torch above" \
      "(--no-build-isolation; DS_BUILD_OPS=1 also needs a CUDA 13 toolkit, nvcc, on PATH). streamgrpo goes in" \
      "without it; fix that and rerun: deploy/setup-gpu.sh --parts deepspeed,streamgrpo" ;;
    flash-attn) echo "setup-gpu: flash-attn $(pin flash-attn) did not install (above): it compiles CUDA kernels" \
      "(a CUDA 13 toolkit, nvcc, on PATH; MAX_JOBS=4 bounds its memory) unless a prebuilt wheel matches." \
      "The learner uses sdpa meanwhile (model.attn_implementation: auto); to retry: deploy/setup-gpu.sh --parts flash-attn" ;;
  esac
}

install() {  # one part, in the set's order, with its flags
  local pip=("$py" -m pip install -q -c "$constraints" --extra-index-url "$(torch_index)")
  local s=$spec
  case $1 in
    torch) run "${pip[@]}" "torch==$(pin torch)" "torchvision==$(pin torchvision)" ;;
    vllm) run "${pip[@]}" "vllm==$(pin vllm)" ;;
    deepspeed) run "${pip[@]}" --no-build-isolation "deepspeed==$(pin deepspeed)" ;;
    flash-attn) run "${pip[@]}" --no-build-isolation "flash-attn==$(pin flash-attn)" ;;
    streamgrpo)
      case ",$failed,${skip#,}," in *,deepspeed,*) s=${s//\[deepspeed\]/} ;; esac  # pip would try to build it again
      if [ "${s:0:3}" = "-e " ]; then run "${pip[@]}" -e "${s:3}"; else run "${pip[@]}" "$s"; fi ;;
    *) echo "setup-gpu: unknown part $1 (torch, vllm, deepspeed, flash-attn, streamgrpo)" >&2; exit 2 ;;
  esac
}

check_driver() {  # CUDA 13 wheels on an older driver fail at the first CUDA call: say so before installing them
  local found major
  found=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ') || true
  major=${found%%.*}
  if ! [[ $major =~ ^[0-9]+$ ]]; then
    echo "setup-gpu: nvidia-smi shows no NVIDIA driver version (${found:-nothing}); the CUDA 13 builds of torch" \
         "$(pin torch) need driver >= $min_driver (--without-gpu installs without this check)" >&2
    exit 1
  fi
  if [ "$major" -lt "$min_driver" ]; then
    echo "setup-gpu: NVIDIA driver $found found; the CUDA 13 builds of torch $(pin torch) need >= $min_driver:" \
         "update the driver (nothing installed)" >&2
    exit 1
  fi
  echo "setup-gpu: NVIDIA driver $found (>= $min_driver for CUDA 13)"
}

IFS=, read -r -a asked <<< "$parts"
IFS=, read -r -a skipped <<< "${skip#,}"
for p in "${asked[@]}" "${skipped[@]}"; do
  case $p in torch|vllm|deepspeed|flash-attn|streamgrpo) ;;
    *) echo "setup-gpu: unknown part $p (torch, vllm, deepspeed, flash-attn, streamgrpo)" >&2; exit 2 ;;
  esac
done
todo=()
for p in "${asked[@]}"; do
  case ",${skip#,}," in *,"$p",*) echo "setup-gpu: skipping $p (--skip)" ;; *) todo+=("$p") ;; esac
done
for name in torch torchvision vllm transformers deepspeed flash-attn peft; do pin "$name" >/dev/null; done  # all pinned

if [ "$dry_run" = 1 ]; then
  echo "the GPU set ($constraints):"
  grep -E '^[A-Za-z]' "$constraints" | sed 's/^/  /'
  echo "steps:"
  for p in "${todo[@]}"; do install "$p"; done
  exit 0
fi

if [ "$without_gpu" = 0 ] && { [ "${STREAMGRPO_SETUP_GPU_CPU:-0}" = 1 ] || ! command -v nvidia-smi >/dev/null 2>&1; }; then
  # No CUDA: resolve the set as pip would install it, download the three packages streamgrpo pins for the
  # GPU; the CUDA wheels are neither installed nor downloaded (GBs that could not run here).
  mkdir -p "$download_dir"
  names="torch==$(pin torch) torchvision==$(pin torchvision) vllm==$(pin vllm) transformers==$(pin transformers) peft==$(pin peft)"
  builds="deepspeed==$(pin deepspeed) flash-attn==$(pin flash-attn)"
  nobuild=""
  if "$py" -c "import torch, setuptools" >/dev/null 2>&1; then
    names="$names $builds"  # their setup.py imports torch: it must be importable (--no-build-isolation)
  else
    nobuild=" (deepspeed and flash-attn left out of the resolve: $py has no torch to read their metadata with)"
  fi
  export FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE DS_BUILD_OPS=0  # metadata only: no kernels compiled
  # shellcheck disable=SC2086
  "$py" -m pip install -q --dry-run --ignore-installed --no-build-isolation --report "$download_dir/resolve.json" \
    --extra-index-url "$(torch_index)" -c "$constraints" $names "$here" 2>&1 | grep -v '^WARNING: Location' || true
  test -s "$download_dir/resolve.json" || { echo "setup-gpu: the GPU set did not resolve (above)" >&2; exit 1; }
  n=$("$py" -c "import json, sys; print(len(json.load(open(sys.argv[1]))['install']))" "$download_dir/resolve.json")
  # shellcheck disable=SC2086
  "$py" -m pip download -q --no-deps --no-build-isolation -d "$download_dir" "vllm==$(pin vllm)" $builds 2>&1 \
    | grep -v '^WARNING: Location' || true
  echo "setup-gpu: no CUDA here (no nvidia-smi): resolved the GPU set ($n packages, $download_dir/resolve.json)$nobuild" \
       "and downloaded vllm $(pin vllm), deepspeed $(pin deepspeed), flash-attn $(pin flash-attn) to $download_dir;" \
       "skipped: installing torch $(pin torch) (CUDA build) and vLLM, building DeepSpeed and flash-attn (need CUDA)"
  exit 0
fi

case " ${todo[*]} " in *" torch "*) [ "$without_gpu" = 1 ] || check_driver ;; esac
"$py" -m pip install -q --upgrade pip setuptools wheel packaging ninja psutil  # what the builds below import
for p in "${todo[@]}"; do
  if [[ $optional == *" $p "* ]]; then
    install "$p" || { failed="$failed,$p"; fix "$p" >&2; }
  else
    install "$p"  # a required part: its failure stops here (set -e)
  fi
done
"$py" -m streamgrpo --version 2>/dev/null || true
if [ -z "$failed" ] && [ ${#todo[@]} -eq 5 ]; then  # the whole set went in: `make setup` keeps its hands off it
  prefix=$("$py" -c "import sys; print(sys.prefix)")
  "$py" -m pip freeze 2>/dev/null > "$prefix/.streamgrpo-gpu-set" || true  # what deploy/keep-gpu-set.sh guards
fi
if [ -n "$failed" ]; then
  echo "setup-gpu: installed ${todo[*]} except ${failed#,} (the lines above say why and how to retry)" >&2
fi
