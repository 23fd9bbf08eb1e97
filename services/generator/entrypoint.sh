#!/usr/bin/env bash
# Generator container entrypoint: runs `streamgrpo "$@"` and nothing else.
#
# `generator` without --id gets `--id K` appended, K (0-based) from
#   GENERATOR_ID               when set (the k8s generator pods do not use this entrypoint: they run
#                              streamgrpo.commands.k8s_generator, shard = pod ordinal), else
#   the compose replica number: compose names replica N of a service `<project>-<service>-N`
#   (`<project>_<service>_N` for docker-compose v1) and Docker's DNS answers the reverse lookup of
#   the container's own address with that name; K = N - 1.
# Keep rollout.num_generators equal to the number of replicas so the K shards cover the data once.
# GENERATOR_GPU_IDS (e.g. 4,5,6,7): generator K sees only the K-th GPUS_PER_GENERATOR of them
# (CUDA_VISIBLE_DEVICES), so replicas that all reserve every GPU each get their own.
# STREAMGRPO_DRY_RUN=1 prints the command, one argument per line, instead of running it.
# STREAMGRPO_CONTAINER_NAME overrides the name lookup (tests, or runtimes without that DNS).
set -euo pipefail

run() {
  if [[ "${STREAMGRPO_DRY_RUN:-0}" == 1 ]]; then
    [[ -n "${CUDA_VISIBLE_DEVICES+x}" ]] && echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES}" >&2
    printf '%s\n' "$@"
    exit 0
  fi
  exec "$@"
}

# CUDA_VISIBLE_DEVICES from a comma list of GPU ids ($1), taking $3 of them from position $2 * $3.
pick_gpus() {
  local ids n from count
  IFS=',' read -r -a ids <<< "$1"
  from=$(( $2 * $3 )); count=$3
  if (( from + count > ${#ids[@]} )); then
    echo "entrypoint: $4 needs GPUs $((from + 1)) to $((from + count)) of GENERATOR_GPU_IDS='$1', which lists" \
         "${#ids[@]}: list more, or lower GENERATOR_REPLICAS or GPUS_PER_GENERATOR" >&2
    exit 2
  fi
  local out=("${ids[@]:from:count}")
  (IFS=','; echo "${out[*]}")
}

container_name() {
  if [[ -n "${STREAMGRPO_CONTAINER_NAME:-}" ]]; then
    echo "$STREAMGRPO_CONTAINER_NAME"
    return
  fi
  python3 - <<'PY'
import socket
ip = socket.gethostbyname(socket.gethostname())
print(socket.gethostbyaddr(ip)[0].split(".")[0])
PY
}

has_id() {
  local a
  for a in "$@"; do
    [[ "$a" == --id || "$a" == --id=* ]] && return 0
  done
  return 1
}

if [[ "${1:-}" == generator ]] && ! has_id "$@"; then
  id="${GENERATOR_ID:-}"
  if [[ -z "$id" ]]; then
    name="$(container_name 2>/dev/null || true)"
    if [[ "$name" =~ [-_]([0-9]+)$ ]]; then
      id=$(( 10#${BASH_REMATCH[1]} - 1 ))
    else
      echo "entrypoint: cannot tell this generator's index (container name '${name}' has no replica number);" \
           "set GENERATOR_ID or pass --id" >&2
      exit 2
    fi
  fi
  if ! [[ "$id" =~ ^[0-9]+$ ]]; then
    echo "entrypoint: GENERATOR_ID must be a non-negative integer, got '$id'" >&2
    exit 2
  fi
  set -- "$@" --id "$id"
  if [[ -n "${GENERATOR_GPU_IDS:-}" ]]; then
    per="${GPUS_PER_GENERATOR:-1}"
    gpus="$(pick_gpus "$GENERATOR_GPU_IDS" "$id" "$per" "generator $id")"
    export CUDA_VISIBLE_DEVICES="$gpus"
  fi
fi
run streamgrpo "$@"
