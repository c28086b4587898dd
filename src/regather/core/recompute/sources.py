"""Where LoRA-A's saved input comes from: **kept**, or **recomputed** from its producer.

Every LoRA-A path saves one tensor for its weight gradient ``dA = dmid^T x``: the gather
path ``x_full``, regather and lowrank ``x_local``, a row-parallel adapter its ``x``. The
paths hand that tensor to a *source* instead of calling ``save_for_backward`` on it:

============== ========================================= =================================
source         ``save(x)`` (forward)                      ``load(saved)`` (backward)
============== ========================================= =================================
:class:`Kept`  ``(x,)`` — the input itself                ``x``
Recomputed     the tensors the producer of ``x`` already  ``producer.recompute(*saved)``,
               saves for its own backward (the norm's     under ``no_grad``: the same op on
               input, fc1's output before the activation) the same tensors, so bit-identical
============== ========================================= =================================

A recomputed source adds no bytes: the tensors it saves share their storage with tensors
the producer's own autograd node saved (checked when the source is made, see
:mod:`regather.megatron.dense.producers`), and ``saved_tensors_hooks`` accounting deduplicates storages.
The regather strategy then *re-gathers* whatever its source loads; lowrank and the
row-parallel path use it as it is. Sources are made per forward (they carry the captured
tensors until ``save``); a path stores only :meth:`handle` on its ``ctx``.

A producer's ``capture`` answers with a source, never a bare sentence: a :class:`Recomputed`
(or a front end's ready source) when the input can be rebuilt, else ``Kept(reason)`` — the input
is kept, and why (:data:`KEEP`: kept, nothing asked).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class Producer(Protocol):
    """What made the adapter input, and how to make it again."""

    name: str

    def recompute(self, *saved: torch.Tensor) -> torch.Tensor:
        """The adapter input, from the tensors :class:`Recomputed` saved (grad mode is off)."""
        ...


@dataclass(frozen=True)
class Kept:
    """Save the input itself (every path's behaviour without recompute); ``reason``: why it is
    kept where a rebuild was asked (a producer's ``capture`` that failed), else None."""

    reason: str | None = None
    name = "kept"

    def save(self, x: torch.Tensor) -> tuple:
        return (x,)

    def load(self, saved: Sequence[torch.Tensor]) -> torch.Tensor:
        return saved[0]

    def handle(self) -> Kept:
        return self

    def twin(self) -> Kept:
        return self


KEEP = Kept()


class Recomputed:
    """Save what the producer already keeps; rebuild the input in backward."""

    name = "recomputed"
    __slots__ = ("producer", "tensors")

    def __init__(self, producer: Producer, tensors: tuple | None):
        self.producer, self.tensors = producer, tensors

    def save(self, x: torch.Tensor) -> tuple:
        if self.tensors is None:
            raise RuntimeError(f"recompute source of {self.producer.name!r} used twice in one forward")
        tensors, self.tensors = self.tensors, None  # the path's ctx holds them from here on
        return tensors

    def load(self, saved: Sequence[torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return self.producer.recompute(*saved)

    def handle(self) -> Recomputed:
        """What a ``ctx`` keeps: the producer, no tensors."""
        return Recomputed(self.producer, None)

    def twin(self) -> Recomputed:
        """A second source over the same captured tensors (the same storages: no new bytes), for a second
        reader of the rebuilt input in backward (DoRA's magnitude, :mod:`regather.core.peak.rebuild`);
        made before the path saves this one."""
        if self.tensors is None:
            raise RuntimeError(f"recompute source of {self.producer.name!r}: twin() after save()")
        return Recomputed(self.producer, self.tensors)


Captured = Kept | Recomputed  # what a producer's ``capture`` answers (front ends add ready sources)


def describe(source) -> str:
    return source.name if isinstance(source, Kept) else f"recomputed from {source.producer.name}"
