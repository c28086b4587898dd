"""Which LoRA-A path runs: one lookup per forward from the adapter's decision.

================== ================================ ==========================================
path               module                           when
================== ================================ ==========================================
``gather``         :mod:`.gather`                   column-parallel, SP, gather decision
``pregathered``    :mod:`.pregathered`              gather decision on an input gathered by the
                                                    base (TE) or once for base and adapter
``regather``       :mod:`.regather`                 column-parallel, SP, regather decision
``regather-shared`` :mod:`.regather`                the same on a shared forward gather
``lowrank``        :mod:`.lowrank`                  column-parallel, SP, lowrank decision
``row``            :mod:`.local`                    row-parallel base
``replicated``     :mod:`.local`                    column-parallel base without SP
``dispatched``     :mod:`.local`                    column-parallel base whose caller does its TP
                                                    communication (MoE experts)
================== ================================ ==========================================

Each path says what it saves and sends (:class:`~regather.core.strategies.path.LoraAPath`);
where its saved input comes from — kept or recomputed — is a separate piece they share
(:mod:`regather.core.recompute.sources`).
"""

from __future__ import annotations

from regather.core.strategies import Strategy
from regather.core.strategies.gather import GATHER
from regather.core.strategies.local import DISPATCHED, REPLICATED, ROW
from regather.core.strategies.lowrank import LOWRANK
from regather.core.strategies.path import LoraAPath, PathArgs
from regather.core.strategies.pregathered import PREGATHERED
from regather.core.strategies.regather import REGATHER, REGATHER_SHARED

PATHS = {p.name: p for p in (GATHER, PREGATHERED, REGATHER, REGATHER_SHARED, LOWRANK, ROW, REPLICATED, DISPATCHED)}

__all__ = ["PATHS", "LoraAPath", "PathArgs", "lookup"]


def lookup(used: Strategy, *, column: bool, sequence_parallel: bool, shared: bool = False,
           gathered: bool = False, explicit_comm: bool = False) -> LoraAPath:
    """The path for a forward that uses ``used`` on this layout (``shared``: an ``x_full``
    gathered once for base and adapter; ``gathered``: the input itself is already gathered;
    ``explicit_comm``: the base's caller does its TP communication)."""
    if not column:
        return ROW
    if explicit_comm:
        return DISPATCHED
    if not sequence_parallel:
        return REPLICATED
    if used == Strategy.LOWRANK:
        return LOWRANK
    if used == Strategy.REGATHER:
        return REGATHER_SHARED if shared else REGATHER
    return PREGATHERED if (shared or gathered) else GATHER
