"""`python -m toolkit COMMAND [options]`. Known errors (an unknown model, a bad folder, a bad
option value) print one line to stderr and exit 2; a bug still shows its traceback."""
from __future__ import annotations

import argparse
import sys

from toolkit import demo
from toolkit.errors import ToolkitError

COMMANDS = {
    "demo": "serve four prompts on a model, printing each step's batch and metadata and the outputs",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m toolkit",
        description="runnerscope: a steppable, inspectable MRV2-style runner for hybrid and "
                    "attention-free LLMs.",
        epilog="Run `python -m toolkit COMMAND --help` for a command's options.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                title="commands")
    demo_parser = sub.add_parser("demo", help=COMMANDS["demo"], description=COMMANDS["demo"] + ".")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ToolkitError, ValueError) as err:   # the toolkit's refusals (and config values)
        print(f"error: {err}".splitlines()[0], file=sys.stderr)
        return 2
