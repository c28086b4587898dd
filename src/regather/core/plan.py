"""What one forward of an adapter does, decided before it runs: the same record for every front end.

A front end decides once per forward (its :class:`~regather.core.decision.Decision`, where the
saved input comes from, which early re-gather slot and shared gather it joins), then executes
the plan; nothing downstream decides again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from regather.core.decision import Decision
from regather.core.recompute.sources import KEEP


@dataclass
class Plan:
    """One forward's decision and what carries it out."""

    decision: Decision
    source: Any = KEEP  # where dA's input comes from: KEEP, a Recomputed or a front end's ready source
    slot: Any = None  # early re-gather's RegatherSlot, if this forward re-gathers early
    share: Any = None  # a SharedGather with the other adapters on this input (CanonicalLoRA)
    path: Any = None  # the LoRA-A path (regather.core.strategies.paths) this forward runs
    layout: Any = None  # the front end's layout (torchtitan: its layout.Layout, column or row)
    gathered: Any = None  # the front end's record of the gather its input came from (torchtitan)
    lean: bool = False  # LoRA's output added into the base's in place, in chunks (regather.core.peak)
    junction: Any = None  # InputGradParts: LoRA-A's input gradient added into the base's (regather.core.peak.junction)
