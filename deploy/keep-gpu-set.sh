#!/usr/bin/env bash
# `make setup`'s guard of a venv that `make setup-gpu` set up (deploy/setup-gpu.sh leaves MARK: `pip freeze` of
# the whole GPU set): constraints.txt's releases would replace some of it (transformers 5.24 over vLLM's <5.20...).
# Without FORCE it says, on one line, what `make setup` would change and exits 1 (nothing installed); with
# nothing to change, or FORCE=1, it exits 0 and `make setup` goes on.
#
#   deploy/keep-gpu-set.sh MARK CONSTRAINTS [FORCE] [VENV]
set -euo pipefail
mark=$1 constraints=$2 force=${3:-} venv=${4:-.venv}
[ -f "$mark" ] || exit 0
changes=$(awk '
  function key(s) { s = tolower(s); gsub(/[_.]/, "-", s); return s }
  FNR == NR { if (split($0, a, "==") == 2) have[key(a[1])] = a[2]; next }
  { line = $0; sub(/[;#].*/, "", line); gsub(/[ \t]/, "", line)
    if (split(line, a, "==") != 2) next
    k = key(a[1]); if ((k in have) && have[k] != a[2]) printf "%s%s %s -> %s", (n++ ? ", " : ""), a[1], have[k], a[2] }
' "$mark" "$constraints")
[ -n "$changes" ] || exit 0
if [ -n "$force" ] && [ "$force" != 0 ]; then
  echo "make setup: FORCE=$force: replacing the GPU set's $changes"
  rm -f "$mark"
  exit 0
fi
echo "make setup: $venv holds the GPU set (make setup-gpu); make setup would change $changes -- nothing done." \
     "FORCE=1 make setup to change it anyway, or VENV=.venv-cpu make setup for a separate venv" >&2
exit 1
