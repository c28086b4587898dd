"""Early re-gather for several adapters fed by one gathered input: one anchor, N weights.

Early re-gather (:mod:`regather.core.strategies.regather`) defers each regather adapter's ``dA``
to an identity on its input (a junction, :mod:`regather.core.peak.junction`, one
weight) so that ``dA`` runs once everything that read the input produced its gradient. When a
*caller* gathers the input once for several linears and adapters — PyTorch-native tensor
parallelism gathers ``[b, s/t, h] -> [b, s, h]`` in the attention or feed-forward module's input
redistribution, then ``w1`` and ``w3`` (bases and adapters) all read that one tensor — the
anchor belongs on that tensor, with every adapter's LoRA-A as an input:

================================= =================================================
per forward of the gathering site what happens
================================= =================================================
forward                           ``x_full = SharedDeferredWgrad(x_full, members,
                                  A_1 .. A_n)`` (identity; nothing saved); each
                                  adapter that runs regather joins ``members``
backward, as gradients arrive     each adapter's output-gradient hook starts its
                                  re-gather (a :class:`~regather.core.strategies.
                                  shared_gather.SharedGather` makes it one gather
                                  for the adapters on one shard); its LoRA-A
                                  backward hands ``dmid`` over
backward of the anchor            runs after every consumer of ``x_full`` (bases and
                                  adapters) added its input gradient, i.e. right
                                  before the caller's reduce-scatter of it: computes
                                  each member's ``dA`` there, then the weights'
                                  gradient edges (grad-accumulator hooks) run
================================= =================================================

GEMMs and operands are those of the gather path, so the results stay bit-identical. A weight
whose adapter did not join this forward (it took another path) gets no gradient from the anchor.
Members whose weights are wrapped (``DTensor``) pass ``as_grad``, which turns the plain ``dA``
into the gradient their weight input needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class AnchorMembers:
    """The adapters anchored on one gathered input in one forward, by the position of their weight."""

    __slots__ = ("_as_grad", "_slots")

    def __init__(self, n: int):
        self._slots: list = [None] * n
        self._as_grad: list = [None] * n

    def __len__(self) -> int:
        return len(self._slots)

    def join(self, index: int, slot, as_grad: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """The adapter whose weight is input ``index`` runs with ``slot`` (a deferring
        :class:`~regather.core.strategies.regather.RegatherSlot`) in this forward."""
        if self._slots[index] is not None:
            raise RuntimeError(f"anchor member {index} joined twice in one forward")
        self._slots[index], self._as_grad[index] = slot, as_grad

    def finish(self) -> list:
        """Each member's deferred ``dA`` (``None`` for those that did not join or need none)."""
        grads = []
        for slot, as_grad in zip(self._slots, self._as_grad):
            grad = slot.finish_deferred() if slot is not None else None
            grads.append(as_grad(grad) if grad is not None and as_grad is not None else grad)
        return grads


class SharedDeferredWgrad(torch.autograd.Function):
    """Identity on ``x`` whose backward computes the deferred ``dA`` of every member; the
    weights are inputs so that their gradient edges run after this node. Nothing is saved."""

    @staticmethod
    def forward(ctx, x, members: AnchorMembers, *weights):
        ctx.members = members
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        return (grad_x, None, *ctx.members.finish())


def anchor_shared(x: torch.Tensor, weights: Sequence[torch.Tensor], members: AnchorMembers) -> torch.Tensor:
    """Route ``x`` through one anchor for ``weights`` (member ``i`` owns ``weights[i]``)."""
    if len(weights) != len(members):
        raise ValueError(f"{len(weights)} weights for {len(members)} anchor members")
    return SharedDeferredWgrad.apply(x, members, *weights)
