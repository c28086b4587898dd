"""Where a wrapper's input gradient is completed: the base's, then LoRA's contributions, in place.

Autograd sums the gradients of a tensor read twice (by the frozen base and by LoRA-A) by making both and
adding them: for a row-parallel base (``linear_proj``, ``linear_fc2``) both are ``[s, b, h/t]`` — the
largest full-width tensor the base makes — so LoRA adds one ``W`` to the step's peak at that moment;
without SP a column-parallel base's ``[s, b, h]`` likewise. A :class:`Junction` avoids it: an identity
on the wrapper's input (:class:`JunctionFn`) whose backward runs only once everything that read the
input produced its gradient. LoRA-A's backward hands it ``dmid`` and its weight instead of returning
``dX`` (it returns ``None``: autograd counts the edge and adds nothing), and the junction adds
``dmid A`` into the base's input gradient one row chunk at a time (:func:`regather.core.peak.output.
add_rows_`; without SP the chunk is all-reduced over TP first, as megatron's copy to the TP region does
with the whole).

The same node defers a regather LoRA-A's weight gradient (early re-gather, :mod:`regather.core.
strategies.regather`): the weight is an input so that its gradient edge — DDP's grad-ready hook —
runs after the junction computed ``dA``.

**Bits.** ``base_dX + lora_dX`` is one addition per element either way (addition commutes). Each chunk
of ``dmid A`` is a row chunk of the same GEMM. Without SP, a ring all-reduce of a chunk sums the ranks'
values in an order that depends on where the element lies in the buffer: the same as the whole's at TP2
(two terms), another order at TP > 2 (an fp64 bound there). A third reader of the input (besides base and
adapter) changes the order of a three-term sum likewise.

**In place** is safe because the gradient that reaches the junction is the frozen base's fresh input
gradient (megatron's and TE's linears return the dgrad GEMM's output, or its reduce-scatter): nobody else
holds it. When it is not a dense tensor (autograd handed a broadcast zero, an expanded view), the sum is
made out of place, as autograd would have made it.
"""

from __future__ import annotations

import torch

from regather.core import comm
from regather.core.peak.output import add_rows_


class Junction:
    """One forward's meeting point on a wrapper's input (module doc)."""

    __slots__ = ("parts", "slot")

    def __init__(self, slot=None):
        self.slot = slot  # a deferring regather slot (early re-gather), or None
        self.parts: list = []

    def contribute(self, grad_mid: torch.Tensor, weight: torch.Tensor, group=None) -> None:
        """From LoRA-A's backward: ``grad_mid @ weight`` belongs to the input gradient (all-reduced over
        ``group`` first, when given)."""
        self.parts.append((grad_mid, weight, group))

    def merge_(self, grad_x: torch.Tensor | None, shape, dtype, device) -> torch.Tensor | None:
        """``grad_x`` with every contribution added (in place when it is a dense tensor; a fresh one of
        ``shape`` when no reader of the input sent a gradient)."""
        parts, self.parts = self.parts, []
        if not parts:
            return grad_x
        if grad_x is None:
            grad_x = torch.zeros(shape, dtype=dtype, device=device)
        elif not grad_x.is_contiguous():
            grad_x = grad_x.contiguous()  # a copy: ours to add into
        flat = grad_x.view(-1, grad_x.shape[-1])
        for grad_mid, weight, group in parts:
            reduce = None if group is None or comm.world_size(group) == 1 else (lambda t, g=group: comm.all_reduce_(t, g))
            add_rows_(flat, grad_mid.reshape(-1, grad_mid.shape[-1]), weight, reduce=reduce)
        return grad_x


class JunctionFn(torch.autograd.Function):
    """Identity on ``x``; backward: :meth:`Junction.merge_`, then the slot's deferred ``dA``."""

    @staticmethod
    def forward(ctx, x, weight, junction):
        ctx.set_materialize_grads(False)
        ctx.junction, ctx.shape, ctx.dtype, ctx.device = junction, x.shape, x.dtype, x.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        junction = ctx.junction
        grad_x = junction.merge_(grad_x, ctx.shape, ctx.dtype, ctx.device)
        grad_w = junction.slot.finish_deferred() if junction.slot is not None else None
        return grad_x, grad_w, None


def attach(x: torch.Tensor, weight: torch.Tensor, junction: Junction) -> torch.Tensor:
    """Route ``x`` through ``junction`` (``weight``: the LoRA-A weight whose gradient edge waits for it)."""
    return JunctionFn.apply(x, weight, junction)
