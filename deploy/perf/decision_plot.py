#!/usr/bin/env python3
"""Decision time against fleet size, before and after, as one PNG.

Each input is the JSON that `python -m proxy.harness.routing_cost --json FILE` writes (one
row per store, backend count and seed); for a before/after, run the harness of both
checkouts back to back on the same machine:

  git archive OLD | tar -x -C /tmp/old
  (cd /tmp/old && python -m proxy.harness.routing_cost --backends 4 16 64 256 1024 \\
      --seeds 1 2 3 --requests 1500 --json /tmp/before.json)
  python -m proxy.harness.routing_cost --backends 4 16 64 256 1024 \\
      --seeds 1 2 3 --requests 1500 --json /tmp/after.json
  python deploy/perf/decision_plot.py before=/tmp/before.json after=/tmp/after.json \\
      --out docs/img/decision-time.png

Plots p50 and p99 (the median over the seeds, the seeds' range as a band) per store.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def load(path: str) -> dict[tuple[str, int], dict[str, list[float]]]:
    """(store, backends) -> {"p50_ms": [per seed], "p99_ms": [...]}."""
    out: dict[tuple[str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in json.loads(Path(path).read_text()):
        cell = out[(row["store"], int(row["backends"]))]
        for q in ("p50_ms", "p99_ms"):
            cell[q].append(float(row[q]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="LABEL=FILE.json, in the order to draw")
    parser.add_argument("--out", default="decision-time.png")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(label, load(path)) for label, path in (r.split("=", 1) for r in args.runs)]
    stores = sorted({store for _, data in runs for store, _ in data})
    fig, axes = plt.subplots(1, len(stores), figsize=(6 * len(stores), 4.2), squeeze=False)
    styles = {"p50_ms": "-", "p99_ms": "--"}
    for ax, store in zip(axes[0], stores, strict=True):
        for i, (label, data) in enumerate(runs):
            sizes = sorted(n for s, n in data if s == store)
            if not sizes:
                continue
            for q, style in styles.items():
                values = [data[(store, n)][q] for n in sizes]
                mid = [statistics.median(v) for v in values]
                ax.plot(sizes, mid, style, marker="o", color=f"C{i}", label=f"{label} {q[:3]}")
                ax.fill_between(
                    sizes, [min(v) for v in values], [max(v) for v in values],
                    color=f"C{i}", alpha=0.15,
                )  # fmt: skip
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.axhline(0.3, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("backends")
        ax.set_ylabel("decision time (ms)")
        ax.set_title(f"Router.route(), {store} index")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
