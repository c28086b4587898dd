"""The `regather` command line: one sub-command per module.

Each sub-command lives in its own module exposing ``register(subparsers)``,
which adds an argparse sub-parser whose ``func`` default runs it. Modules are
imported only when listed here, and each keeps its heavy imports (megatron-core,
torchtitan, matplotlib) inside the function that runs it, so ``regather --help``
loads none of them. Nor torch: parsing, ``--help``, ``--version``, the refusals made while parsing
and ``estimate`` itself run without it (the reason tables they read are torch-free;
tests/unit/tools/test_cli.py holds it), a fraction of a second each where torch's import is one to
two. Every command's flags come from one table
(:mod:`regather.tools.estimate.vocabulary`); bad input ends a command with one line
(:mod:`regather.tools.cmdline`).
"""

from __future__ import annotations

import importlib
import os
import sys

from regather.tools.cmdline import Parser

# sub-command name -> module that registers it
_COMMANDS = {
    "demo": "regather.tools.demo",
    "bench": "regather.tools.bench.cli",
    "estimate": "regather.tools.estimate.cli",
    "doctor": "regather.tools.doctor.cli",
}


def build_parser() -> Parser:
    from regather import __version__

    parser = Parser(prog="regather", description="regather's tools: demo (a short fine-tune on CPU ranks), bench "
                    "(measured on CPU ranks), estimate (analytic), doctor (your run's LoRA-A decisions and settings)")
    parser.add_argument("--version", action="version", version=f"regather {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in _COMMANDS.values():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and (module + ".").startswith(exc.name + "."):  # not written yet
                continue
            raise
        mod.register(sub)
    parser.commands = dict(sub.choices)  # an unknown flag is refused by the sub-command it was given to
    return parser


def main(argv: list[str] | None = None) -> int:
    from regather.tools.cpu.quiet import quiet_command

    args = build_parser().parse_args(argv)
    quiet_command()  # before any rank starts: framework chatter stays out of the report
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `regather estimate | head`: the reader left early, not a failure of the command
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit stays quiet
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
