"""regather for a traced forward (``torch.compile``, ``fullgraph=True``): LoRA-A on the gathered
input, the sequence shard saved, gathered again in backward through functional collectives.

The eager regather path (:mod:`.regather`) issues ``async_op=True`` collectives, keeps scratch
buffers in a pool, shares one backward gather between adapters and defers ``dA`` through an
anchor: Python bookkeeping Dynamo cannot trace. Here the path is one autograd Function whose
backward Dynamo and AOT autograd trace:

========= =========================================================================
forward   ``mid = x_full Aᵀ`` (the GEMM the gather path runs); saves the shard
          (``[b, s/t, h]``), not ``x_full``
backward  ``x_full = wait_tensor(all_gather_tensor(after(shard, dmid)))``,
          ``dX_full = dmid A`` (TP-partial, as the gather path's), ``dA = dmidᵀ x_full``
========= =========================================================================

**Why** :func:`after`. AOT autograd's partitioner (``torch/_functorch/partitioners.py``) puts in
the backward graph only what depends on a tangent; a node of the joint graph that depends on
forward values alone is computed in the forward and its output saved if the backward needs it.
Functional collectives are also marked must-save (``force_save_collectives``: never recomputed).
The backward's ``all_gather(shard)`` depends on the saved shard alone, so without an edge to
``dmid`` it was moved into the forward and the gathered tensor saved — the bytes regather is
there to remove (measured: 264 KiB, the gathered input, instead of 136 on a two-rank toy; not
joint-graph CSE: ``torch._functorch.config.cse=False`` changed nothing). :func:`after` is an
opaque op reading ``dmid`` and returning a copy of the shard: the gather now depends on a
tangent and stays in backward. Its cost: one shard-sized copy in backward (``1/t`` of the gather's
output); Inductor still sees the collective and its wait as graph nodes.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol


@torch.library.custom_op("regather::after", mutates_args=())
def after(x: torch.Tensor, dep: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` that a traced graph computes after ``dep`` (``dep``'s data is not read)."""
    return x.clone()


@after.register_fake
def _after_fake(x: torch.Tensor, dep: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


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
        ordered = after(shard, dmid)  # a tangent edge: the gather stays in the backward graph
        x_full = funcol.wait_tensor(funcol.all_gather_tensor(ordered, ctx.seq_dim, ctx.group))
        d2 = dmid.reshape(-1, dmid.shape[-1])
        dx = (d2 @ a).view(*dmid.shape[:-1], a.shape[-1])
        da = d2.t() @ x_full.reshape(-1, x_full.shape[-1])
        return dx, None, da, None, None


def traced_regather(x_full: torch.Tensor, a: torch.Tensor, group, seq_dim: int, rank: int, world: int) -> torch.Tensor:
    """LoRA-A's output for the local ``x_full`` (``[..., s, ..., h]``, the same on every rank of
    ``group``), keeping only this rank's sequence block for backward."""
    if x_full.shape[seq_dim] % world:
        raise ValueError(f"traced regather: sequence length {x_full.shape[seq_dim]} (dim {seq_dim}) "
                         f"is not divisible by the group size {world}")
    shard = x_full.detach().chunk(world, seq_dim)[rank].contiguous()
    return TracedRegather.apply(x_full, shard, a, group, seq_dim)
