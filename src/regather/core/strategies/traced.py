"""regather for a traced forward (``torch.compile``, ``fullgraph=True``): LoRA-A on the gathered
input, the sequence shard saved, gathered again in backward through functional collectives.

The eager regather path (:mod:`.regather`) issues ``async_op=True`` collectives, keeps scratch
buffers in a pool, shares one backward gather between the adapters on a shard and defers ``dA``
through an anchor: Python bookkeeping Dynamo cannot trace (a graph break, an error under
``fullgraph=True``). Here the whole path is one autograd Function whose backward Dynamo and AOT
autograd trace:

========= =========================================================================
forward   ``mid = x_full Aᵀ`` (the GEMM the gather path runs); saves the shard
          (``[b, s/t, h]``), not ``x_full``
backward  ``x_full = wait_tensor(all_gather_tensor(shard, seq_dim))`` (functional
          collectives: Inductor sees the collective and its wait as graph nodes and
          schedules them), ``dX_full = dmid A`` (TP-partial, as the gather path's),
          ``dA = dmidᵀ x_full``
========= =========================================================================

What crosses to the backward is the compiler's choice too: run eagerly (or by Dynamo without AOT
autograd) the Function keeps the shard; under AOT autograd (``aot_eager``, inductor) the
partitioner was measured keeping ``x_full`` instead (torchtitan's bytes; docs/torchtitan.md).

No pool, no shared gather, no early start by a hook: where the backward gather runs relative to
the neighbouring GEMMs is the compiler's choice (Inductor may move the ``wait`` down to the first
use, so the gather overlaps the dgrad issued before it; ``aot_eager`` runs it in program order).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol


class TracedRegather(torch.autograd.Function):
    """``F.linear(x_full, a)`` saving ``shard`` (``x_full``'s block of this rank on ``seq_dim``)."""

    @staticmethod
    def forward(ctx, x_full: torch.Tensor, shard: torch.Tensor, a: torch.Tensor, group, seq_dim: int):
        ctx.save_for_backward(shard, a)
        ctx.group, ctx.seq_dim = group, seq_dim
        return torch.nn.functional.linear(x_full, a)

    @staticmethod
    def backward(ctx, dmid: torch.Tensor):
        shard, a = ctx.saved_tensors
        x_full = funcol.wait_tensor(funcol.all_gather_tensor(shard, ctx.seq_dim, ctx.group))
        d2 = dmid.reshape(-1, dmid.shape[-1])
        dx = (d2 @ a).view(*dmid.shape[:-1], a.shape[-1])
        da = d2.t() @ x_full.reshape(-1, x_full.shape[-1])
        return dx, None, da, None, None


def traced_regather(x_full: torch.Tensor, a: torch.Tensor, group, seq_dim: int, rank: int, world: int) -> torch.Tensor:
    """LoRA-A's output for the local ``x_full`` (``[..., s, ..., h]``, the same on every rank of
    ``group``), keeping only this rank's sequence block for backward."""
    shard = x_full.detach().chunk(world, seq_dim)[rank].contiguous()
    return TracedRegather.apply(x_full, shard, a, group, seq_dim)
