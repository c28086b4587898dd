"""A shared expert LoRA-A before the token dispatch: send its rank-``r`` output, not the tokens.

Grouped experts with one LoRA-A for all local experts (``share_expert_adapters=True``, Megatron
Bridge's default) under ``recompute_adapter_inputs``. The dispatch ``D`` (permute, all-to-all over
EP, all-gather over expert TP, sort by local expert; a front end supplies it, e.g.
:mod:`regather.megatron.moe.dispatch`) only moves
rows, so ``D(x) A^T = D(x A^T)``:

============ ================== ===================================== ==============================
tensor       shape (per rank)   forward                               backward
============ ================== ===================================== ==============================
x            ``[T, h]``         the MoE layer input (router's input)  ``dx += dmid_local A`` (complete)
A            ``[r/e, h]``       this expert-TP rank's rows            ``dA`` reduce-scattered over
                                                                      expert TP (then summed over EP)
A_full       ``[r, h]``         all-gather of A over expert TP        —
mid_local    ``[T, r]``         ``x A_full^T``                        ``dmid_local`` (complete)
mid          ``[n, r]``         ``D(mid_local)``: the tokens' route   reverse route: the expert-TP
                                                                      reduce-scatter sums the LoRA-B
                                                                      partials, ``index_add`` the
                                                                      ``k`` rows of each token
============ ================== ===================================== ==============================

(``T`` local tokens, ``n`` routed rows here, ``e`` expert TP; ``B`` gets the complete ``mid``, so
the adapter neither gathers ``mid`` over expert TP nor all-reduces ``dmid`` — the route does both,
as lowrank's sequence gather does for dense adapters.)

Saved for backward: for ``dA = dmid_local^T x`` the router's saved tensor (the source is a
:class:`~regather.core.recompute.sources.Recomputed` of it: zero new bytes), nothing else beyond
the route's index tensor, which megatron's permute already saved. Against keeping the dispatched
tokens (``n x h``): ``n x h`` fewer bytes kept, ``r`` more columns on every routed row of the
dispatch (``r/h`` of its bytes) in forward and in backward, and a ``dA`` GEMM over ``T`` rows
instead of ``n`` (``k x`` fewer at top-k). Numerics: the same products in another summation order
(``dA`` per token, not per routed row; ``dx`` once per token): fp32 rounding, not bit for bit.
"""

from __future__ import annotations

from typing import Protocol

import torch

from regather.core import comm
from regather.core.wgrad import linear, main_grad_placeholder


class GatherRows(torch.autograd.Function):
    """``A_full = all_gather_rows(A)`` over expert TP; backward reduce-scatters ``dA_full`` (the
    sum over the expert-TP ranks' tokens) into ``A``'s rows — into ``main_grad`` with
    gradient-accumulation fusion (megatron's placeholder convention, :mod:`.wgrad`)."""

    @staticmethod
    def forward(ctx, weight, group, fuse):
        ctx.weight, ctx.group, ctx.fuse = weight, group, fuse
        return comm.all_gather_seq(weight, group)

    @staticmethod
    def backward(ctx, grad_full):
        part = comm.reduce_scatter_seq(grad_full, ctx.group)
        weight = ctx.weight
        if ctx.fuse and getattr(weight, "main_grad", None) is not None:
            weight.main_grad.add_(part)
            return main_grad_placeholder(weight), None, None
        return part.to(weight.dtype), None, None


class Route(Protocol):
    """The tokens' route of one forward (:class:`regather.megatron.moe.dispatch.Route`)."""

    def send(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [T, w]`` dispatched like the tokens, differentiably (backward: the reverse route)."""
        ...


class PreDispatched:
    """A shared LoRA-A's input, the source this path reads (made by a front end's producer,
    :class:`regather.megatron.moe.inputs.ExpertInputProducer`): the layer's input ``x_local``
    ``[T, h]`` (with its history, so ``dx`` reaches it), the source of what ``dA`` reads (a
    Recomputed of the router's kept tensor), and the route the rank-``r`` output takes. Its type
    selects this path (:func:`regather.core.strategies.paths.lookup`)."""

    name = "predispatched"
    __slots__ = ("kept", "route", "x_local")

    def __init__(self, x_local: torch.Tensor, kept, route: Route):
        self.x_local, self.kept, self.route = x_local, kept, route


def predispatched_linear_a(x, weight, args):
    """``D(x_local A^T)``: LoRA-A before the dispatch, its rank-``r`` output sent along the route."""
    src: PreDispatched = args.source
    if comm.world_size(args.group) > 1:
        a_full = GatherRows.apply(weight, args.group, args.fuse and torch.is_grad_enabled())
        mid_local = linear(src.x_local, a_full, False, src.kept)
    else:
        mid_local = linear(src.x_local, weight, args.fuse, src.kept)
    return src.route.send(mid_local)
