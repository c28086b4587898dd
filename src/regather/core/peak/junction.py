"""Where a wrapper's input gradient is completed: the base's, then LoRA's contributions, in place.

Autograd sums the gradients of a tensor read twice (by the frozen base and by LoRA-A) by making both and
adding them: for a row-parallel base (``linear_proj``, ``linear_fc2``) both are ``[s, b, h/t]`` — the
largest full-width tensor the base makes — so LoRA adds one ``W`` to the step's peak at that moment;
without SP a column-parallel base's ``[s, b, h]`` likewise. A junction avoids it: an identity on the
wrapper's input (:class:`JunctionFn`) whose backward runs only once everything that read the input
produced its gradient. LoRA-A's backward hands ``dmid`` and its weight to the junction's
:class:`InputGradParts` instead of returning ``dX`` (it returns ``None``: autograd counts the edge and
adds nothing), and the junction adds ``dmid A`` into the base's input gradient one row chunk at a time
(:mod:`.chunks`; without SP each chunk is all-reduced over TP first, as megatron's copy to the TP region
does with the whole).

The same node defers a regather LoRA-A's weight gradient (early re-gather, :mod:`regather.core.
strategies.regather`): the weight is an input so that its gradient edge — DDP's grad-ready hook —
runs after the junction computed ``dA``.

**Bits.** Autograd sums the readers' gradients as they arrive — the adapters' (their nodes were made
after the base's, so they run first), then the base's: ``((dX_1 + dX_2) + ...) + dX_base``. The junction
sums the parts in the order they arrive into a chunk buffer, then adds it to the base's: the same
additions (addition commutes), each chunk a row chunk of the same GEMM. Without SP, a ring all-reduce of
a chunk sums the ranks' values in an order that depends on where the element lies in the buffer: the
same as the whole's at TP2 (two terms), another order at TP > 2 (an fp64 bound there).

**In place** is safe because the gradient that reaches the junction is the frozen base's fresh input
gradient (megatron's and TE's linears return the dgrad GEMM's output, or its reduce-scatter): nobody else
holds it. When it is not a dense tensor (an expanded view), it is made contiguous first — a copy, as
autograd's out-of-place sum would have made.
"""

from __future__ import annotations

import torch

from regather.core import comm
from regather.core.peak.chunks import row_chunks


class InputGradParts:
    """LoRA-A input-gradient contributions waiting for the base's input gradient (module doc). Several
    adapters on one input (CanonicalLoRA's q, k, v) share one: their parts are summed in the order they
    arrive, as autograd sums them, then added to the base's."""

    __slots__ = ("parts",)

    def __init__(self):
        self.parts: list = []

    def contribute(self, grad_mid: torch.Tensor, weight: torch.Tensor, group=None) -> None:
        """From LoRA-A's backward: ``grad_mid @ weight`` belongs to the input gradient (all-reduced over
        ``group`` first, when given)."""
        self.parts.append((grad_mid.reshape(-1, grad_mid.shape[-1]), weight, group))

    def merge_(self, grad_x: torch.Tensor | None, shape, dtype, device) -> torch.Tensor | None:
        """``grad_x`` with every contribution added, one row chunk at a time (in place when it is a dense
        tensor; a fresh one of ``shape`` when no reader of the input sent a gradient)."""
        parts, self.parts = self.parts, []
        if not parts:
            return grad_x
        if grad_x is None:
            grad_x = torch.zeros(shape, dtype=dtype, device=device)
        elif not grad_x.is_contiguous():
            grad_x = grad_x.contiguous()  # a copy: ours to add into
        flat = grad_x.view(-1, grad_x.shape[-1])
        chunks = row_chunks(flat.shape[0], flat.shape[1] * flat.element_size())
        if not chunks:
            return grad_x
        n = chunks[0].stop - chunks[0].start
        bufs = [torch.empty(n, flat.shape[1], dtype=flat.dtype, device=flat.device) for _ in parts[:2]]
        for rows in chunks:
            total = None
            for i, (grad_mid, weight, group) in enumerate(parts):
                part = bufs[min(i, 1)][: rows.stop - rows.start]
                torch.matmul(grad_mid[rows], weight, out=part)
                if group is not None and comm.world_size(group) > 1:
                    comm.all_reduce_(part, group)
                total = part if total is None else total.add_(part)
            flat[rows].add_(total)
        return grad_x


class JunctionFn(torch.autograd.Function):
    """Identity on ``x``; backward: the contributions merged (``parts``), then ``slot``'s deferred ``dA``."""

    @staticmethod
    def forward(ctx, x, weight, slot, parts):
        ctx.set_materialize_grads(False)
        ctx.slot, ctx.parts, ctx.shape, ctx.dtype, ctx.device = slot, parts, x.shape, x.dtype, x.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        if ctx.parts is not None:
            grad_x = ctx.parts.merge_(grad_x, ctx.shape, ctx.dtype, ctx.device)
        grad_w = ctx.slot.finish_deferred() if ctx.slot is not None else None
        return grad_x, grad_w, None, None


def attach(x: torch.Tensor, weight: torch.Tensor, slot=None, parts: InputGradParts | None = None) -> torch.Tensor:
    """Route ``x`` through a junction: ``slot`` (a deferring regather slot) computes LoRA-A's ``dA`` there,
    after the base's input gradient (``weight``: the LoRA-A weight whose gradient edge waits for it);
    ``parts`` are added into that input gradient there. Several adapters on one input each attach in
    turn; the last attached (the one every reader reads) runs first and merges the shared ``parts``."""
    return JunctionFn.apply(x, weight, slot, parts)
