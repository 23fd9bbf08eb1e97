#!/usr/bin/env bash
# Learner container entrypoint: runs `streamgrpo "$@"` and nothing else.
#
# For `learner` with more than one rank it launches the same command under torchrun:
#   NPROC_PER_NODE  ranks (GPUs) in this container; "auto" = every GPU nvidia-smi lists (default 1)
#   NNODES          containers/pods taking part (default 1); with more than one also set
#   NODE_RANK       this one's index (0..NNODES-1), MASTER_ADDR (node 0's address), MASTER_PORT (29500)
#   LEARNER_GPU_IDS (e.g. 0,1,2,3) the GPUs of this container's ranks (CUDA_VISIBLE_DEVICES), when it
#                   reserves more than its own (compose: every GPU, the generators take the rest)
# STREAMGRPO_DRY_RUN=1 prints the command, one argument per line, instead of running it.
set -euo pipefail

run() {
  if [[ "${STREAMGRPO_DRY_RUN:-0}" == 1 ]]; then
    [[ -n "${CUDA_VISIBLE_DEVICES+x}" ]] && echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES}" >&2
    printf '%s\n' "$@"
    exit 0
  fi
  exec "$@"
}

if [[ "${1:-}" == learner ]]; then
  nproc="${NPROC_PER_NODE:-1}"
  nnodes="${NNODES:-1}"
  if [[ "$nproc" == auto ]]; then
    nproc="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    [[ "$nproc" =~ ^[1-9][0-9]*$ ]] || nproc=1
  fi
  if ! [[ "$nproc" =~ ^[1-9][0-9]*$ && "$nnodes" =~ ^[1-9][0-9]*$ ]]; then
    echo "entrypoint: NPROC_PER_NODE ($nproc) and NNODES ($nnodes) must be positive integers" >&2
    exit 2
  fi
  if [[ -n "${LEARNER_GPU_IDS:-}" ]]; then
    IFS=',' read -r -a ids <<< "$LEARNER_GPU_IDS"
    if (( ${#ids[@]} < nproc )); then
      echo "entrypoint: $nproc learner ranks need a GPU each and LEARNER_GPU_IDS='$LEARNER_GPU_IDS' lists ${#ids[@]}" >&2
      exit 2
    fi
    export CUDA_VISIBLE_DEVICES="$LEARNER_GPU_IDS"
  fi
  if (( nproc > 1 || nnodes > 1 )); then
    launch=(torchrun --nproc_per_node "$nproc" --nnodes "$nnodes")
    if (( nnodes > 1 )); then
      launch+=(--node_rank "${NODE_RANK:?entrypoint: set NODE_RANK for a multi-node learner}"
               --master_addr "${MASTER_ADDR:?entrypoint: set MASTER_ADDR for a multi-node learner}"
               --master_port "${MASTER_PORT:-29500}")
    else
      launch+=(--standalone)
    fi
    run "${launch[@]}" -m streamgrpo "$@"
  fi
fi
run streamgrpo "$@"
