"""What every ``regather`` sub-command's command line shares: how it refuses bad input, how its help reads.

- :class:`Parser`: a user mistake argparse sees (an unknown choice, a size that is not a positive
  integer, a flag no command has) ends the command with **one line** on stderr, ``regather <command>:
  <what and the accepted values>``, and exit status 2 — no usage block, no traceback. An unknown flag
  is named by the sub-command it was given to, with the nearest flags that command has. A mistake a
  command finds after parsing (a layout that cannot exist, flags that contradict each other) ends it
  the same way with exit status 1: ``raise SystemExit("regather <command>: ...")``. Every option the
  parser stores records that it was on the command line (:func:`given`).
- :class:`HelpFormatter`: ``--help`` shows an option's default only where it says something (not
  ``(default: True)`` under ``--no-sp``, which turns something off; not ``None`` for an option whose
  help says what it defaults to).
- :func:`positive` / :func:`non_negative` / :func:`positive_number` / :func:`seconds`: the ``type=``
  of sizes, counts, scales and time limits.
- :func:`names`: the ``type=`` of a comma list of known names (targets, strategies).
- :func:`writable_folder`: an output folder checked (created, written to) before a run starts.
- :func:`wrapped`: a report's text lines at most :data:`WIDTH` columns wide (tables fit it by
  their own layout; ``--json`` / ``--out`` carry everything whole).

The flags themselves, one definition for every command: :mod:`regather.tools.estimate.vocabulary`.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys


def _record(namespace, dest: str) -> None:
    namespace.given = frozenset(getattr(namespace, "given", ())) | {dest}


class _Store(argparse.Action):
    """argparse's ``store``, recording the option as given."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        _record(namespace, self.dest)


class _Switch(argparse.Action):
    """argparse's ``store_const``, recording the option as given."""

    def __init__(self, option_strings, dest, const=None, default=None, required=False, help=None, metavar=None):
        super().__init__(option_strings, dest, nargs=0, const=const, default=default, required=required, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const)
        _record(namespace, self.dest)


class _SwitchOn(_Switch):
    def __init__(self, option_strings, dest, default=False, required=False, help=None):
        super().__init__(option_strings, dest, const=True, default=default, required=required, help=help)


class _SwitchOff(_Switch):
    def __init__(self, option_strings, dest, default=True, required=False, help=None):
        super().__init__(option_strings, dest, const=False, default=default, required=required, help=help)


def given(args) -> frozenset:
    """The destinations of the options on the command line (whatever their value: ``--tp 2`` is given
    although 2 is the default)."""
    return frozenset(getattr(args, "given", ()))


#: flags that were renamed, and what a user writes now (the refusal says it)
RENAMED = {
    "--per-expert": "--expert-lora per-expert",
    "--no-share-expert-adapters": "--expert-lora per-expert",
}


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``prog: message``) and exit status 2, whose
    options record that they were given (:func:`given`), and whose unknown flags are refused by the
    sub-command they were given to (:attr:`commands`: the sub-commands' parsers by name)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name, action in ((None, _Store), ("store", _Store), ("store_const", _Switch),
                             ("store_true", _SwitchOn), ("store_false", _SwitchOff)):
            self.register("action", name, action)
        self.commands: dict[str, Parser] = {}

    def error(self, message: str):
        print(f"{self.prog}: {message} (--help lists the options)", file=sys.stderr)
        raise SystemExit(2)

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            owner = self.commands.get(getattr(parsed, "command", None), self)
            owner.error(owner.unknown(extra))
        return parsed

    def unknown(self, extra: list[str]) -> str:
        """What is wrong with the arguments this parser does not know: a renamed flag's new name, an
        unknown flag's nearest known ones."""
        known = [s for action in self._actions for s in action.option_strings
                 if s.startswith("--") and s not in ("--help", "--version")]
        said, after_flag = [], False
        for arg in extra:
            flag = arg.split("=", 1)[0]
            if flag in RENAMED:
                said.append(f"{flag} is now {RENAMED[flag]}")
            elif flag.startswith("-"):
                near = difflib.get_close_matches(flag, known, n=3, cutoff=0.6)
                said.append(f"unknown flag {flag}" + (f" (did you mean {' or '.join(near)}?)" if near else ""))
            elif not after_flag:  # a value after an unknown flag is its own
                said.append(f"unexpected argument {arg!r}")
            after_flag = flag.startswith("-") and "=" not in arg
        return "; ".join(said)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help where they inform: not for flags (``store_true`` / ``store_false``) nor
    for a default of ``None`` or ``False``; a list default as the comma list a user types."""

    def _get_help_string(self, action):
        text = (action.help or "").replace("%", "%%")  # help says "0.44 %"; argparse %-formats it
        if action.nargs == 0 or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        if isinstance(action.default, (tuple, list)):
            return text + f" (default: {','.join(map(str, action.default))})"
        return text + " (default: %(default)s)"


def _integer(value: str, least: int, what: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"{n} is not {what}")
    return n


def positive(value: str) -> int:
    """An integer >= 1 (sizes, parallel degrees, sequence length, micro-batches)."""
    return _integer(value, 1, "a positive integer")


def non_negative(value: str) -> int:
    """An integer >= 0 (widths that may be absent: 0 experts, 0 dense ffn)."""
    return _integer(value, 0, "a non-negative integer")


def _number(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not x > 0 or math.isnan(x):
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return x


def positive_number(value: str) -> int | float:
    """A number > 0, an ``int`` where it is whole (``16`` stays ``16``, ``16.5`` is a float): LoRA's alpha."""
    x = _number(value)
    return int(x) if x.is_integer() else x


def seconds(value: str) -> float:
    """A time limit in seconds, > 0 (``inf``: none)."""
    return _number(value)


def names(value: str, known, what: str) -> tuple:
    """A comma list of some of ``known`` (``what``: how the refusal calls one, e.g. ``"targets"``),
    each at most once."""
    given_ = tuple(v.strip() for v in value.split(",") if v.strip())
    unknown = [n for n in given_ if n not in known]
    if unknown or not given_:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown or repr(value)}; expected some of "
                                         f"{', '.join(known)}")
    twice = sorted({n for n in given_ if given_.count(n) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{', '.join(twice)} named more than once in {value!r}")
    return given_


def writable_folder(path: str, command: str, flag: str = "--out") -> str:
    """``path`` as a folder this process can write into, created where missing; exits with one line
    naming the path and the reason where it cannot be (called before a run starts, not after it)."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise SystemExit(f"regather {command}: {flag} {path}: cannot write there "
                         f"({exc.strerror or exc})") from None
    return path


#: the terminal width every report's text fits
WIDTH = 120


def wrapped(lines: list[str], width: int = WIDTH) -> list[str]:
    """Each line wrapped at ``width`` between words, its continuation indented four columns past
    the line's own indent; a line that fits comes back unchanged."""
    import textwrap

    out: list[str] = []
    for text in lines:
        if len(text) <= width:
            out.append(text)
            continue
        lead = " " * (len(text) - len(text.lstrip(" ")))
        out += textwrap.wrap(text.strip(" "), width, initial_indent=lead, subsequent_indent=lead + "    ",
                             break_long_words=False, break_on_hyphens=False)
    return out
