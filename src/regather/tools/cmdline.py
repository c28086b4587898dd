"""What every ``regather`` sub-command's command line shares: how it refuses bad input, how its help reads.

- :class:`Parser`: a user mistake argparse sees (an unknown choice, a size that is not a positive
  integer) ends the command with **one line** on stderr, ``regather <command>: <what and the accepted
  values>``, and exit status 2 — no usage block, no traceback. A mistake a command finds after parsing
  (a layout that cannot exist, an unknown target) ends it the same way with exit status 1:
  ``raise SystemExit("regather <command>: ...")``.
- :class:`HelpFormatter`: ``--help`` shows an option's default only where it says something (not
  ``(default: True)`` under ``--no-sp``, which turns something off; not ``None`` for an option whose
  help says what it defaults to).
- :func:`positive` / :func:`non_negative`: the ``type=`` of sizes, counts and ranks.
- :func:`names`: the ``type=`` of a comma list of known names (targets, strategies).
- :func:`wrapped`: a report's text lines at most :data:`WIDTH` columns wide (tables fit it by
  their own layout; ``--json`` / ``--out`` carry everything whole).
"""

from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``prog: message``) and exit status 2."""

    def error(self, message: str):
        print(f"{self.prog}: {message} (--help lists the options)", file=sys.stderr)
        raise SystemExit(2)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help where they inform: not for flags (``store_true`` / ``store_false``) nor
    for a default of ``None`` or ``False``."""

    def _get_help_string(self, action):
        if action.nargs == 0 or action.default in (None, False, argparse.SUPPRESS):
            return action.help or ""
        return super()._get_help_string(action)


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


def names(value: str, known, what: str) -> tuple:
    """A comma list of some of ``known`` (``what``: how the refusal calls one, e.g. ``"targets"``)."""
    given = tuple(v.strip() for v in value.split(",") if v.strip())
    unknown = [n for n in given if n not in known]
    if unknown or not given:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown or repr(value)}; expected some of "
                                         f"{', '.join(known)}")
    return given


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
