"""The LoRA-A paths: their interface, the table of all of them, and the one lookup per forward.

A path computes ``mid = LoRA-A(x)`` for one forward and owns its backward: what it saves, what
it sends, how ``dA`` and ``dX`` come back. The adapter looks one up per forward from its
decision, its layout and its input source, and calls it with a :class:`PathArgs`; the path reads
only what it needs. The functions live in the strategy modules; what each saves and sends is
said here, once.

=================== ================================ ==========================================
path                function (module)                when
=================== ================================ ==========================================
``gather``          :mod:`.gather`                   column-parallel, SP, gather decision
``pregathered``     :mod:`.pregathered`              gather decision on an input gathered by the
                                                     caller, or once for base and adapter
``regather``        :mod:`.regather`                 column-parallel, SP, regather decision
``regather-shared`` :mod:`.regather`                 the same on a shared forward gather
``lowrank``         :mod:`.lowrank`                  column-parallel, SP, lowrank decision
``row``             :mod:`.local`                    row-parallel base
``replicated``      :mod:`.local`                    column-parallel base without SP
``dispatched``      :mod:`.local`                    column-parallel base whose caller does its TP
                                                     communication (MoE experts)
``predispatched``   :mod:`.predispatched`            the same, when the source is a
                                                     :class:`~.predispatched.PreDispatched` (a
                                                     shared expert LoRA-A before the dispatch)
=================== ================================ ==========================================

Where a path's saved input comes from — kept or recomputed — is a separate piece they share
(:mod:`regather.core.recompute.sources`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from regather.core.strategies import Strategy
from regather.core.strategies.gather import gather_linear_a
from regather.core.strategies.local import local_linear_a, replicated_linear_a
from regather.core.strategies.lowrank import lowrank_linear_a
from regather.core.strategies.predispatched import PreDispatched, predispatched_linear_a
from regather.core.strategies.pregathered import pregathered_linear_a
from regather.core.strategies.regather import regather_linear_a, regather_shared_linear_a


@dataclass(frozen=True)
class PathArgs:
    """Everything a path may use besides its input and weight."""

    group: Any                      # the TP process group (a torch.distributed group)
    fuse: bool                      # gradient-accumulation fusion into main_grad
    pool: Any = None                # regather's scratch pool
    slot: Any = None                # early re-gather's per-forward slot
    source: Any = None              # recompute.sources.KEEP, a Recomputed or a front end's ready source
    x_full: torch.Tensor | None = None   # an input gathered once for base and adapter
    reduce_dA: bool = True          # lowrank: sum dA over TP inside backward
    share: Any = None               # regather: a SharedGather with the other adapters on this input
    splits: Any = None              # per-expert adapters: the m_splits row blocks, one weight each
    seq_dim: int = 0                # the sequence dim of x: 0 for [s, b, h] (megatron), 1 for [b, s, h]
    junction: Any = None            # (InputGradParts, group or None): dX added into the base's in place, all-
                                    # reduced over group first (regather.core.peak.junction); None: autograd


@dataclass(frozen=True)
class LoraAPath:
    """One way to run LoRA-A: its name, what it saves and sends, and the call."""

    name: str
    saves: str                      # what stays alive from forward to backward
    sends: str                      # collectives it adds (forward; backward)
    recomputes: bool                # may save what the input's producer keeps instead
    fn: Callable[[torch.Tensor, torch.Tensor, PathArgs], torch.Tensor]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, args: PathArgs) -> torch.Tensor:
        return self.fn(x, weight, args)


GATHER = LoraAPath(
    "gather", saves="x_full [s, b, h]", sends="forward: all-gather x; backward: reduce-scatter dX",
    recomputes=False, fn=lambda x, weight, args: gather_linear_a(x, weight, args.group, args.fuse, args.seq_dim))
# the caller's gather (LoRALinear's shared one) sends; this path adds nothing
PREGATHERED = LoraAPath(
    "pregathered", saves="x_full [s, b, h]", sends="none (the base layer's gather)", recomputes=False,
    fn=lambda x, weight, args: pregathered_linear_a(x if args.x_full is None else args.x_full, weight, args.fuse))
REGATHER = LoraAPath(
    "regather", saves="x_local [s/t, b, h] (or what its producer keeps)",
    sends="forward: all-gather x (scratch); backward: all-gather x again, reduce-scatter dX", recomputes=True,
    fn=lambda x, weight, args: regather_linear_a(x, weight, args.group, args.fuse, args.pool, args.slot, args.source,
                                                 args.share, args.seq_dim))
REGATHER_SHARED = LoraAPath(
    "regather-shared", saves="x_local [s/t, b, h] (or what its producer keeps)",
    sends="backward: all-gather x again (forward gather and dX reduce-scatter shared with the base)",
    recomputes=True,
    fn=lambda x, weight, args: regather_shared_linear_a(args.x_full, x, weight, args.group, args.fuse, args.pool,
                                                        args.slot, args.source, args.seq_dim))
LOWRANK = LoraAPath(
    "lowrank", saves="x_local [s/t, b, h] (or what its producer keeps)",
    sends="forward: all-gather mid (r wide); backward: reduce-scatter dmid, all-reduce dA (r x h)", recomputes=True,
    fn=lambda x, weight, args: lowrank_linear_a(x, weight, args.group, args.fuse, args.reduce_dA, args.source,
                                                args.seq_dim))
ROW = LoraAPath("row", saves="x_i [s, b, h/t] (or what its producer keeps)", sends="none",
                recomputes=True, fn=local_linear_a)
DISPATCHED = LoraAPath("dispatched", saves="x [n, h] (the dispatched tokens)",
                       sends="none (dX is reduced over expert TP by the dispatcher, with the base's)",
                       recomputes=False, fn=local_linear_a)
REPLICATED = LoraAPath("replicated", saves="x [s, b, h] (or what its producer keeps)",
                       sends="backward: all-reduce dX", recomputes=True, fn=replicated_linear_a)
PREDISPATCHED = LoraAPath(
    "predispatched", saves="nothing new: the router's input [T, h] (which the router keeps)",
    sends="forward: r more columns on the tokens' dispatch; backward: the same on its reverse, "
          "reduce-scatter dA over expert TP",
    recomputes=True, fn=predispatched_linear_a)

PATHS = {p.name: p for p in (GATHER, PREGATHERED, REGATHER, REGATHER_SHARED, LOWRANK, ROW, REPLICATED, DISPATCHED,
                             PREDISPATCHED)}

__all__ = ["PATHS", "LoraAPath", "PathArgs", "lookup"]


def lookup(used: Strategy, *, column: bool, sequence_parallel: bool, shared: bool = False,
           gathered: bool = False, explicit_comm: bool = False, source: object = None) -> LoraAPath:
    """The path for a forward that uses ``used`` on this layout (``shared``: an ``x_full``
    gathered once for base and adapter; ``gathered``: the input itself is already gathered;
    ``explicit_comm``: the base's caller does its TP communication; ``source``: where ``dA``'s
    input comes from — a :class:`~.predispatched.PreDispatched` one runs before the dispatch)."""
    if not column:
        return ROW
    if explicit_comm:
        return PREDISPATCHED if isinstance(source, PreDispatched) else DISPATCHED
    if not sequence_parallel:
        return REPLICATED
    if used == Strategy.LOWRANK:
        return LOWRANK
    if used == Strategy.REGATHER:
        return REGATHER_SHARED if shared else REGATHER
    return PREGATHERED if (shared or gathered) else GATHER
