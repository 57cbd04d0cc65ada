"""The `warmroute` command: serve | sim | demo | bench | doctor.

Each subcommand module exposes ``register(subparsers)``; it adds its parser and sets
``func(args) -> int`` as the default, so this file only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from proxy import __version__

SUBCOMMAND_MODULES = (
    "proxy.server.serve",
    "proxy.sim.cli",
    "proxy.demo.run",
    "proxy.bench.cli",
    "proxy.doctor.cli",
)
COMMANDS = {
    "serve": "proxy.server.serve",
    "sim": "proxy.sim.cli",
    "demo": "proxy.demo.run",
    "bench": "proxy.bench.cli",
    "doctor": "proxy.doctor.cli",
}
# Subcommands that need the `bench` extra (pip install 'warmroute[bench]'): without it they are
# listed all the same and say what to install, while serve and sim work.
BENCH_EXTRA = {"proxy.demo.run": "demo", "proxy.bench.cli": "bench"}
BENCH_EXTRA_MODULES = ("aiohttp", "tqdm", "numpy", "matplotlib")

DESCRIPTION = """\
warmroute: an OpenAI-compatible proxy for LLM backends that measures what users see
(TTFT, ITL, TPOT as OpenTelemetry spans and metrics) and routes each prompt to the backend
whose prefix cache is warm.

  warmroute demo                                   # simulated fleet + proxy + report
  warmroute serve --backend http://127.0.0.1:8000  # proxy in front of your server
  warmroute sim --port 8001                        # a simulated vLLM-like engine
  warmroute bench --base-url http://127.0.0.1:8080 --workload shared-prefix
  warmroute doctor --url http://127.0.0.1:8081     # why is TTFT slow? (--admin-port 8081)

Run `warmroute COMMAND --help` for each command's options.
"""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; with `command`, only that subcommand's module is imported (serve
    then loads nothing of the bench's), else all of them (for --help)."""
    parser = argparse.ArgumentParser(
        prog="warmroute",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"warmroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in [COMMANDS[command]] if command in COMMANDS else SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            missing = (e.name or "").split(".")[0]
            if name in BENCH_EXTRA and missing in BENCH_EXTRA_MODULES:
                _needs_bench_extra(sub, BENCH_EXTRA[name], missing)
            elif e.name != name:
                raise
            continue
        module.register(sub)
    return parser


def _needs_bench_extra(sub: Any, command: str, missing: str) -> None:
    """A stand-in for a subcommand whose dependencies are not installed."""
    fix = "pip install 'warmroute[bench]'"

    def run(args: argparse.Namespace) -> int:
        print(
            f"warmroute {command}: needs {missing}, which a plain `pip install warmroute` "
            f"leaves out (the proxy does not use it); install it with: {fix}",
            file=sys.stderr,
        )
        return 2

    # No option prefix: every word after the command, --help included, is taken as is.
    p = sub.add_parser(command, help=f"(not installed: {fix})", add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs="*")
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The first word that is not an option names the subcommand (the top level's options,
    # --help and --version, take no value).
    parser = build_parser(next((a for a in argv if not a.startswith("-")), None))
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
