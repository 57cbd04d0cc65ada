"""The `warmroute` command: serve | sim | demo | bench.

Each subcommand module exposes ``register(subparsers)``; it adds its parser and sets
``func(args) -> int`` as the default, so this file only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from proxy import __version__

SUBCOMMAND_MODULES = ("proxy.serve", "proxy.sim.cli", "proxy.demo", "proxy.bench.cli")

DESCRIPTION = """\
warmroute: an OpenAI-compatible proxy for LLM backends that measures what users see
(TTFT, ITL, TPOT as OpenTelemetry spans and metrics) and routes each prompt to the backend
whose prefix cache is warm.

  warmroute demo                                   # simulated fleet + proxy + report
  warmroute serve --backend http://127.0.0.1:8000  # proxy in front of your server
  warmroute sim --port 8001                        # a simulated vLLM-like engine
  warmroute bench --base-url http://127.0.0.1:8080 --workload shared-prefix

Run `warmroute COMMAND --help` for each command's options.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="warmroute",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"warmroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
