"""`python -m toolkit COMMAND [options]`. Known errors (an unknown model, a bad folder, a bad
option value) print one line to stderr and exit 2; a bug still shows its traceback."""
from __future__ import annotations

import argparse
import sys

from toolkit import demo, doctor
from toolkit.errors import ToolkitError

COMMANDS = {
    "demo": "serve four prompts on a model, printing each step's batch and metadata and the outputs",
    "doctor": "check this machine: versions, the device, kernels, parity with the CPU, graphs vs eager and a "
              "decode timing; one line per check, exit code 1 on any failure",
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
    doctor_parser = sub.add_parser("doctor", help=COMMANDS["doctor"], description=COMMANDS["doctor"] + ". "
                                   "Each line: NAME PASS|FAIL|SKIP VALUE DETAIL (VALUE: a max |logit difference| "
                                   "or a decode step in ms). On a CPU the GPU checks are skipped.")
    doctor.add_arguments(doctor_parser)
    doctor_parser.set_defaults(run=doctor.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ToolkitError, ValueError) as err:   # the toolkit's refusals (and config values)
        print(f"error: {err}".splitlines()[0], file=sys.stderr)
        return 2
