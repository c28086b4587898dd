"""LoRA-A for a traced forward (``torch.compile``, ``fullgraph=True``): autograd Functions whose
backward Dynamo and AOT autograd trace, collectives functional.

The eager paths (:mod:`.regather`, :mod:`.lowrank`) issue ``async_op=True`` collectives, keep
scratch buffers in a pool, share one backward gather between adapters and defer ``dA`` through an
anchor: Python bookkeeping Dynamo cannot trace. Here:

============= ======================================= =========================================
path          forward                                 backward
============= ======================================= =========================================
regather      ``mid = x_full Aᵀ`` (the gather path's  ``x_full = all_gather(after(shard))``,
              GEMM); saves the shard ``[b, s/t, h]``  ``dX_full = dmid A`` (TP-partial, as the
                                                      gather path's), ``dA = dmidᵀ x_full``
lowrank       ``all_gather_s(shard Aᵀ)``              reduce-scatter of ``dmid`` (funcol's
                                                      autograd), ``dA`` over this rank's rows
linear        ``mid = x Aᵀ`` (a row-parallel          ``dX = dmid A``, ``dA = dmidᵀ after(x)``
              ``w2``'s local GEMM), saves ``x``
============= ======================================= =========================================

Every saved input is read back through :func:`regather.core.recompute.compiled.after` with the
adapter's ticket: the joint-graph pass there lets the partitioner rebuild it (when
``recompute_adapter_inputs`` asked; ``NO_TICKET`` otherwise).

**Why ``after`` in regather's backward.** AOT autograd's partitioner puts in the backward graph
only what depends on a tangent; a node that depends on forward values alone is computed in the
forward and its output saved if the backward needs it, and functional collectives are must-save
(``force_save_collectives``). The backward's ``all_gather(shard)`` depends on the saved shard
alone, so without an edge to ``dmid`` it ran in the forward and the gathered tensor was saved —
the bytes regather removes (measured: 264 KiB, the gathered input, instead of 136 on a two-rank
toy; not joint-graph CSE: ``torch._functorch.config.cse=False`` changed nothing). ``after`` reads
``dmid`` and returns a copy of the shard: the gather depends on a tangent and stays in backward.
Its cost: one shard-sized copy in backward (``1/t`` of the gather's output).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from regather.core.recompute.compiled import NO_TICKET, after


def _grads(dmid: torch.Tensor, a: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dX, dA)`` of ``mid = x Aᵀ``."""
    d2 = dmid.reshape(-1, dmid.shape[-1])
    dx = (d2 @ a).view(*dmid.shape[:-1], a.shape[-1])
    return dx, d2.t() @ x.reshape(-1, x.shape[-1])


class TracedRegather(torch.autograd.Function):
    """``F.linear(x_full, a)`` saving ``shard`` (``x_full``'s block of this rank on ``seq_dim``)."""

    @staticmethod
    def forward(ctx, x_full: torch.Tensor, shard: torch.Tensor, a: torch.Tensor, group, seq_dim: int, ticket: int):
        ctx.save_for_backward(shard, a)
        ctx.group, ctx.seq_dim, ctx.ticket = group, seq_dim, ticket
        return torch.nn.functional.linear(x_full, a)

    @staticmethod
    def backward(ctx, dmid: torch.Tensor):
        shard, a = ctx.saved_tensors
        ordered = after(shard, dmid, ctx.ticket)  # a tangent edge: the gather stays in the backward graph
        x_full = funcol.wait_tensor(funcol.all_gather_tensor(ordered, ctx.seq_dim, ctx.group))
        dx, da = _grads(dmid, a, x_full)
        return dx, None, da, None, None, None


class TracedLinearA(torch.autograd.Function):
    """``F.linear(x, a)`` whose saved ``x`` the backward reads through ``after`` (its ticket)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor, ticket: int):
        ctx.save_for_backward(x, a)
        ctx.ticket = ticket
        return torch.nn.functional.linear(x, a)

    @staticmethod
    def backward(ctx, dmid: torch.Tensor):
        x, a = ctx.saved_tensors
        dx, da = _grads(dmid, a, after(x, dmid, ctx.ticket))
        return dx, da, None


def traced_regather(x_full: torch.Tensor, shard: torch.Tensor, a: torch.Tensor, group, seq_dim: int, world: int,
                    ticket: int = NO_TICKET) -> torch.Tensor:
    """LoRA-A's output for the local ``x_full`` (``[..., s, ..., h]``, the same on every rank of
    ``group``: ``shard`` gathered on ``seq_dim``), keeping only ``shard`` for backward."""
    if shard.shape[seq_dim] * world != x_full.shape[seq_dim]:
        raise ValueError(f"traced regather: a shard of {shard.shape[seq_dim]} rows on dim {seq_dim} over "
                         f"{world} ranks does not make the gathered input's {x_full.shape[seq_dim]}")
    return TracedRegather.apply(x_full, shard.detach(), a, group, seq_dim, ticket)


def traced_lowrank(shard: torch.Tensor, a: torch.Tensor, group, seq_dim: int, ticket: int = NO_TICKET) -> torch.Tensor:
    """lowrank in a traced forward: ``all_gather_s(shard Aᵀ)``; its backward reduce-scatters
    ``dmid`` (rank-r wide) and sums ``dA`` over this rank's rows (TP-partial, as the eager path's)."""
    return funcol.all_gather_tensor_autograd(TracedLinearA.apply(shard, a, ticket), seq_dim, group)


def traced_linear_a(x: torch.Tensor, a: torch.Tensor, ticket: int) -> torch.Tensor:
    """``F.linear(x, a)`` on local tensors, ``x`` read back in backward under ``ticket``."""
    return TracedLinearA.apply(x, a, ticket)
