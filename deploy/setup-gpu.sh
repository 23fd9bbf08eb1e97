#!/usr/bin/env bash
# Install the GPU set (constraints-gpu.txt) in the order and with the flags it needs: `make setup-gpu` and the
# GPU images (services/*/Dockerfile) run this, so the order, the flags and the versions live in one place.
#
#   deploy/setup-gpu.sh [--python PY] [--parts torch,vllm,deepspeed,flash-attn,streamgrpo] [--spec SPEC]
#                       [--dry-run] [--download-dir DIR] [--without-gpu]
#
# Steps (each one of --parts; default all):
#   torch       torch, torchvision (PyPI's Linux wheels are CUDA builds)
#   vllm        vLLM, resolved against that torch
#   deepspeed   built against the installed torch: --no-build-isolation
#   flash-attn  the same (compiles CUDA kernels: set MAX_JOBS to bound its memory)
#   streamgrpo  SPEC (default: -e '.[deepspeed]'), every dependency held to constraints-gpu.txt
# --dry-run prints the set and the commands and installs nothing. On a machine without CUDA (no nvidia-smi,
# or STREAMGRPO_SETUP_GPU_CPU=1) nothing is installed either: the whole set is resolved (pip --dry-run, its
# report in DIR/resolve.json), vLLM, DeepSpeed and flash-attn are downloaded into DIR, and one line says
# what was skipped. --without-gpu installs anyway (an image is built on a machine without GPUs).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
constraints=${STREAMGRPO_GPU_CONSTRAINTS:-$here/constraints-gpu.txt}
py=python3
parts=torch,vllm,deepspeed,flash-attn,streamgrpo
spec="-e $here[deepspeed]"
dry_run=0
without_gpu=0
download_dir=$here/.gpu-downloads

while [ $# -gt 0 ]; do
  case $1 in
    --python) py=$2; shift 2 ;;
    --parts) parts=$2; shift 2 ;;
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

install() {  # one part, in the set's order, with its flags
  local pip=("$py" -m pip install -q -c "$constraints")
  case $1 in
    torch) run "${pip[@]}" "torch==$(pin torch)" "torchvision==$(pin torchvision)" ;;
    vllm) run "${pip[@]}" "vllm==$(pin vllm)" ;;
    deepspeed) run "${pip[@]}" --no-build-isolation "deepspeed==$(pin deepspeed)" ;;
    flash-attn) run "${pip[@]}" --no-build-isolation "flash-attn==$(pin flash-attn)" ;;
    streamgrpo) if [ "${spec:0:3}" = "-e " ]; then run "${pip[@]}" -e "${spec:3}"; else run "${pip[@]}" "$spec"; fi ;;
    *) echo "setup-gpu: unknown part $1 (torch, vllm, deepspeed, flash-attn, streamgrpo)" >&2; exit 2 ;;
  esac
}

IFS=, read -r -a todo <<< "$parts"
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
    -c "$constraints" $names "$here" 2>&1 | grep -v '^WARNING: Location' || true
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

"$py" -m pip install -q --upgrade pip setuptools wheel packaging ninja psutil  # what the builds below import
for p in "${todo[@]}"; do install "$p"; done
"$py" -m streamgrpo --version 2>/dev/null || true
