#!/usr/bin/env bash
# Instructions per routing decision, counted by valgrind's callgrind: the decision-time figure
# a shared, noisy machine does not move.
#
#   deploy/perf/decision-instructions.sh LABEL [BACKENDS]
#
# Runs the decision-time harness (python -m proxy.harness.routing_cost, memory index, 4k-token
# prompts, views kept between decisions as the proxy keeps them) under callgrind twice, for
# SHORT and LONG decisions (default 300 and 600), and prints
#   LABEL  BACKENDS  <instructions per decision>
# the slope between the two: start-up, prompt generation and warm-up cancel out. BACKENDS
# defaults to 1024; PYTHON picks the interpreter. For an older build, run it from that
# checkout (its harness and code are imported from the current directory):
#   git worktree add /tmp/before HEAD~3
#   (cd /tmp/before && PYTHON=$PWD/.venv/bin/python deploy/perf/decision-instructions.sh before)
set -euo pipefail
label=${1:?usage: decision-instructions.sh LABEL [BACKENDS]}
backends=${2:-1024}
command -v valgrind >/dev/null || { echo "decision-instructions: needs valgrind" >&2; exit 2; }
PY=${PYTHON:-python}
SHORT=${SHORT:-300}
LONG=${LONG:-600}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
count() {
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" valgrind --tool=callgrind \
    --callgrind-out-file="$work/out.$1" "$PY" -m proxy.harness.routing_cost \
    --backends "$backends" --requests "$1" --reuse-views >/dev/null 2>"$work/log.$1"
  local n
  n=$(grep -o "Collected : [0-9]*" "$work/log.$1" | awk '{print $3}')
  if [[ -z "$n" ]]; then
    echo "decision-instructions: the harness did not run under callgrind:" >&2
    tail -5 "$work/log.$1" >&2
    exit 1
  fi
  echo "$n"
}
short=$(count "$SHORT")
long=$(count "$LONG")
# (The harness times the last 90% of its decisions: the slope is over all of them.)
printf '%-12s %5s  %.2f M instructions per decision\n' "$label" "$backends" \
  "$(echo "($long - $short) / ($LONG - $SHORT) / 1000000" | bc -l)"
