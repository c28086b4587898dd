"""The interface every LoRA-A path shares (see :mod:`regather.core.strategies.paths`).

A path computes ``mid = LoRA-A(x)`` for one forward and owns its backward: what it saves,
what it sends, how ``dA`` and ``dX`` come back. The adapter looks one up per forward from
its decision and calls it with a :class:`PathArgs`; the path reads only what it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PathArgs:
    """Everything a path may use besides its input and weight."""

    group: Any                      # the TP process group (a torch.distributed group)
    fuse: bool                      # gradient-accumulation fusion into main_grad
    pool: Any = None                # regather's scratch pool
    slot: Any = None                # early re-gather's per-forward slot
    source: Any = None              # saved_input.KEEP or a Recomputed source
    x_full: torch.Tensor | None = None   # an input gathered once for base and adapter
    reduce_dA: bool = True          # lowrank: sum dA over TP inside backward
    share: Any = None               # regather: a SharedGather with the other adapters on this input
    splits: Any = None              # per-expert adapters: the m_splits row blocks, one weight each
    seq_dim: int = 0                # the sequence dim of x: 0 for [s, b, h] (megatron), 1 for [b, s, h]


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
