"""A LoRA linear's output ``z = x W0ᵀ (+ bias) + mid_s Bᵀ`` made again in backward, one row chunk at a time.

DoRA's magnitude gradient is ``dm_j = Σ_tokens dy_tj z_tj / n_j`` (:mod:`.magnitude`): it needs the
pre-magnitude output ``z`` — full width, ``[s, b, o/t]`` per rank — which Megatron Bridge keeps from
forward to backward. Here ``z`` is rebuilt from what LoRA keeps anyway: the adapter input LoRA-A saves
(kept, or rebuilt from its producer, :mod:`regather.core.recompute.sources`) and ``mid_s`` (LoRA-B's
input), with the frozen weight. Each chunk is used and dropped; nothing full-width is made. Its cost is
the base's forward GEMM once more (and, by layout, the communication that GEMM's output needs):

================= ================================ ============================================ ===========
kind              layout                           a chunk of this rank's output rows           sends
================= ================================ ============================================ ===========
:data:`LOCAL`     the input's rows are the         ``x[rows] W0ᵀ + mid_s[rows] Bᵀ``             nothing
                  output's: TP1, column without
                  SP, a kept ``x_full``
:data:`SLOT`      column + SP, regather            the same on the slot's re-gathered ``x_full``  nothing new
                                                   (its gather for ``dA``, started here; held
                                                   until ``dA`` as early re-gather holds it)
:data:`GATHER`    column + SP, ``x_local`` kept    ``x_local[rows]`` of every rank gathered      ``s·b·h``
                  (lowrank)                        (``t`` row blocks), ``W0ᵀ``, ``mid_s`` rows   ``·(t−1)/t``
:data:`ROW_SP`    row-parallel + SP (output        the partial ``x_i[rows of every rank] W0_iᵀ``  ``s·b·o``
                  ``[s/t, b, o]``)                 reduce-scattered, + ``mid_s[rows] Bᵀ``        ``·(t−1)/t``
:data:`ROW`       row-parallel, SP off, TP > 1     ``all_reduce(x_i[rows] W0_iᵀ)`` + LoRA        ``2·s·b·o``
                                                                                                ``·(t−1)/t``
================= ================================ ============================================ ===========

``B`` is this rank's LoRA-B ``[o/t, r]`` for a column base and all of it ``[o, r]`` for a row base
(gathered here, a weight's size). ``bias``: the base's bias where the base adds it into its output.
"""

from __future__ import annotations

import torch

from regather.core import comm
from regather.core.peak.chunks import row_chunks
from regather.core.recompute.sources import KEEP

LOCAL, SLOT, GATHER, ROW_SP, ROW = "local", "slot", "gather", "row_sp", "row"
KINDS = (LOCAL, SLOT, GATHER, ROW_SP, ROW)


class OutputRebuild:
    """How to rebuild one forward's ``z`` (module doc). Made in forward; :meth:`save` gives the tensors
    the magnitude's autograd node saves (the adapter input's source and ``mid_s``: storages LoRA keeps
    anyway), :meth:`chunks` reads them back in backward."""

    __slots__ = ("bias", "group", "kind", "lora_b", "mid_s", "slot", "source", "weight", "x")

    def __init__(self, kind: str, weight: torch.Tensor, lora_b: torch.Tensor, mid_s: torch.Tensor, x=None,
                 source=KEEP, group=None, slot=None, bias: torch.Tensor | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown output rebuild {kind!r}; expected one of {KINDS}")
        if (kind == SLOT) != (slot is not None) or (kind != SLOT and x is None):
            raise ValueError(f"output rebuild {kind!r}: the regather slot goes with {SLOT!r} only, an input with "
                             "every other kind")
        self.kind, self.weight, self.lora_b, self.mid_s, self.x = kind, weight, lora_b, mid_s, x
        self.source, self.group, self.slot, self.bias = source, group, slot, bias

    def save(self) -> tuple:
        """What to save for backward: the input's source tensors (none for :data:`SLOT`: the slot holds
        them), then ``mid_s``. The input and ``mid_s`` are released here (the node holds them now)."""
        xs = () if self.kind == SLOT else tuple(self.source.save(self.x))
        self.source = self.source.handle()
        tensors = xs + (self.mid_s,)
        self.x = self.mid_s = None
        return tensors

    def chunks(self, saved: tuple):
        """``(output row slices, z rows)`` covering this rank's output rows once, in order; the rows of
        ``z`` are those of the slices, one after the other."""
        mid = saved[-1]
        mid = mid.reshape(-1, mid.shape[-1])
        b = self.lora_b if self.kind not in (ROW_SP, ROW) else comm.all_gather_seq(self.lora_b.contiguous(), self.group)
        if self.kind == SLOT:
            x = self.slot.gathered()
        else:
            x = self.source.load(saved[:-1])
        x = x.reshape(-1, x.shape[-1])
        yield from getattr(self, f"_{self.kind}")(x, mid, b)

    def _z(self, x_rows: torch.Tensor, mid_rows: torch.Tensor, b: torch.Tensor, reduce=None) -> torch.Tensor:
        z = torch.matmul(x_rows, self.weight.t())
        if reduce is not None:
            z = reduce(z)
        z.addmm_(mid_rows, b.t())
        if self.bias is not None:
            z.add_(self.bias)
        return z

    def _row_bytes(self, t: int = 1) -> int:
        return t * self.weight.shape[0] * self.weight.element_size()

    def _local(self, x, mid, b):
        for rows in row_chunks(x.shape[0], self._row_bytes()):
            yield [rows], self._z(x[rows], mid[rows], b)

    _slot = _local

    def _gather(self, x_local, mid, b):
        t, n = comm.world_size(self.group), x_local.shape[0]
        for rows in row_chunks(n, self._row_bytes(t)):
            blocks = [slice(j * n + rows.start, j * n + rows.stop) for j in range(t)]
            x_rows = comm.all_gather_seq(x_local[rows], self.group)  # rank j's rows, rank order
            yield blocks, self._z(x_rows, torch.cat([mid[r] for r in blocks]), b)

    def _row_sp(self, x, mid, b):
        t = comm.world_size(self.group)
        n = x.shape[0] // t  # this rank's output rows
        for rows in row_chunks(n, self._row_bytes(t)):
            x_rows = torch.cat([x[j * n + rows.start: j * n + rows.stop] for j in range(t)])
            yield [rows], self._z(x_rows, mid[rows], b, reduce=lambda p: comm.reduce_scatter_seq(p, self.group))

    def _row(self, x, mid, b):
        for rows in row_chunks(x.shape[0], self._row_bytes()):
            yield [rows], self._z(x[rows], mid[rows], b, reduce=lambda p: comm.all_reduce_(p, self.group))
