#!/usr/bin/env bash
# Instructions in each routing decision, counted by valgrind's callgrind: the decision-time
# distribution (p50, p99, max) a shared, noisy machine does not move, and the placement upkeep
# the router leaves for after each decision, counted apart.
#
#   deploy/perf/decision-tail.sh LABEL [BACKENDS] [DECISIONS]
#
# Runs `python -m proxy.harness.routing_cost --markers` (memory index, 4k-token prompts, views
# kept as the proxy keeps them) under callgrind with --dump-before=getppid: the harness makes
# that system call before and after each decision and after its upkeep, so each dump holds
# one of them. Prints
#   LABEL  BACKENDS  decision p50 / p99 / max / mean  upkeep mean / p99   (M instructions)
# over the decisions after the first SKIP (default: a tenth, the warm-up). NEW=0.4 makes the
# last 40% of the requests bring system prompts of their own (a first placement each); with
# SKIP set to the rest, the figures are a new prompt's. BACKENDS defaults to 1024, DECISIONS
# to 1000; PYTHON picks the interpreter. The winner's prefix record is counted with the
# upkeep, after the decision, where the proxy makes it (once the request is on the wire);
# RECORD_IN_DECISION=1 counts it in the decision (the figures before December 2026). For another build, run it from that checkout (see
# decision-instructions.sh). ~5 minutes for 1,000 decisions at 1,024 backends.
set -euo pipefail
label=${1:?usage: decision-tail.sh LABEL [BACKENDS] [DECISIONS]}
backends=${2:-1024}
decisions=${3:-1000}
command -v valgrind >/dev/null || { echo "decision-tail: needs valgrind" >&2; exit 2; }
PY=${PYTHON:-python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" valgrind --tool=callgrind --dump-before=getppid \
  --callgrind-out-file="$work/cg" "$PY" -m proxy.harness.routing_cost --markers \
  --backends "$backends" --requests "$decisions" --reuse-views --new-prompts "${NEW:-0}" \
  ${RECORD_IN_DECISION:+--record-in-decision} \
  >/dev/null 2>"$work/log" || { tail -5 "$work/log" >&2; exit 1; }
"$PY" - "$work" "$label" "$backends" "$decisions" "${SKIP:-}" <<'PY'
import glob, sys
work, label, backends, decisions, skip = sys.argv[1:]
decisions = int(decisions)
skip = int(skip) if skip else decisions // 10
dumps = sorted(
    (int(f.rsplit(".", 1)[1]), f) for f in glob.glob(f"{work}/cg.*") if f.rsplit(".", 1)[1].isdigit()
)
counts = []
for _, f in dumps:
    with open(f) as fh:
        for line in fh:
            if line.startswith(("summary:", "totals:")):
                counts.append(int(line.split()[1]))
                break
# The first dump is the start-up; then three per decision: the decision, its upkeep, the rest.
seg = counts[1:]
if len(seg) < 3 * decisions - 1:  # (no dump after the last decision's rest)
    sys.exit(f"decision-tail: {len(seg)} dumps for {decisions} decisions: the markers did not run")
route = sorted(seg[3 * i] for i in range(skip, decisions))
upkeep = sorted(seg[3 * i + 1] for i in range(skip, decisions))
def q(xs, p):
    return xs[min(len(xs) - 1, int(p * len(xs)))] / 1e6
print(
    f"{label:<12} {backends:>5}  decision p50 {q(route, .5):.2f} / p99 {q(route, .99):.2f} / "
    f"max {route[-1] / 1e6:.2f} / mean {sum(route) / len(route) / 1e6:.2f}  "
    f"upkeep mean {sum(upkeep) / len(upkeep) / 1e6:.2f} / p99 {q(upkeep, .99):.2f}"
    "  (M instructions)"
)
PY
