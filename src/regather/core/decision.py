"""What an adapter decided for a forward, and why: the same record for every front end.

A :class:`Decision` names the strategy asked for and the one that runs, and, with
``recompute_adapter_inputs``, whether the saved input is rebuilt (from which producer) or kept.
Each "why not" is a :class:`Reason`: a sentence that is the same for every adapter and layer it
applies to — the fallback log (:mod:`regather.core.fallback_log`) logs a reason once per model —
and, apart from it, a ``detail`` carrying what was measured (a difference, a rank), which
differs per layer and machine. ``str(decision)`` shows both; the log line shows the sentence and
puts the details in its record's attributes.

A reason also carries its log ``level`` where the sentence itself fixes it (:func:`expected`:
INFO for what the moment decides or the design excludes; WARNING for what may surprise a user):
the fallback log reads the field (:func:`level_of`), never the wording.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from regather.core.strategies import Strategy


class Reason(str):
    """A reason sentence (compares and hashes as its text) with an optional measured ``detail``
    and an optional log ``level`` (None: the reporting context's default)."""

    detail: str | None
    level: int | None

    def __new__(cls, text: str, detail: str | None = None, level: int | None = None) -> Reason:
        obj = super().__new__(cls, text)
        obj.detail = detail
        obj.level = level
        return obj

    def __reduce__(self):  # pickled with its detail and level (decisions travel between ranks and tests)
        return (Reason, (str(self), self.detail, self.level))

    def __repr__(self) -> str:
        level = "" if self.level is None else f", level={logging.getLevelName(self.level)}"
        return f"Reason({str(self)!r}, detail={self.detail!r}{level})"


def expected(text: str) -> Reason:
    """``text`` as a reason logged at INFO: what the moment decides (eval, ``no_grad``, activation
    checkpointing) or the design excludes (row-parallel bases, experts)."""
    return Reason(text, level=logging.INFO)


def surprising(text: str, detail: str | None = None) -> Reason:
    """``text`` as a reason logged at WARNING whatever the context (a rebuild that differs)."""
    return Reason(text, detail=detail, level=logging.WARNING)


def with_detail(reason: str, detail: str | None) -> Reason:
    """``reason`` with another ``detail``, its level kept."""
    return Reason(str(reason), detail=detail, level=level_of(reason, None))


def level_of(reason: str | None, default: int | None = logging.WARNING) -> int | None:
    """The log level of ``reason``: its own, else ``default`` (the reporting context's)."""
    level = getattr(reason, "level", None)
    return default if level is None else level


def detail_of(reason: str | None) -> str | None:
    """The measured detail of ``reason`` (None for a plain sentence)."""
    return getattr(reason, "detail", None)


def described(reason: str) -> str:
    """``reason`` with its detail in brackets, as decisions print it."""
    detail = detail_of(reason)
    return str(reason) if detail is None else f"{reason} ({detail})"


@dataclass(frozen=True)
class Decision:
    """Which strategy an adapter asked for, which one runs, and why; and, with
    ``recompute_adapter_inputs``, whether its saved input is recomputed (from which producer)
    or kept (and why)."""

    requested: Strategy
    used: Strategy
    reason: str | None  # None when ``used == requested``
    recompute: str | None = None  # the producer the input is recomputed from
    recompute_reason: str | None = None  # why it is kept although recompute was asked

    def __str__(self) -> str:
        text = f"{self.used.value}"
        if self.used != self.requested:
            text += f" (asked {self.requested.value}: {described(self.reason)})"
        if self.recompute:
            text += f", input recomputed from {self.recompute}"
        elif self.recompute_reason:
            text += f", input kept (recompute asked: {described(self.recompute_reason)})"
        return text
