"""The three collectives TE's linears call (``transformer_engine/pytorch/distributed.py``:
``gather_along_first_dim``, ``reduce_scatter_along_first_dim``, ``allreduce``), as plain
``torch.distributed`` calls on the first dimension: inside an autograd Function, like TE's. Looked up
on ``torch.distributed`` at each call, so regather's byte accounting (which wraps those functions)
counts them as it would count NCCL's."""

from __future__ import annotations

import torch
import torch.distributed as dist


def size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def gather_along_first_dim(inp: torch.Tensor, group) -> torch.Tensor:
    """``[n, ...]`` from every rank into a new ``[t * n, ...]`` (rank order)."""
    t = size(group)
    if t == 1:
        return inp
    inp = inp.contiguous()
    out = torch.empty((inp.shape[0] * t,) + tuple(inp.shape[1:]), dtype=inp.dtype, device=inp.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)
    return out


def reduce_scatter_along_first_dim(inp: torch.Tensor, group) -> torch.Tensor:
    """The sum over ranks of ``[t * n, ...]``, this rank's ``[n, ...]`` block."""
    t = size(group)
    if t == 1:
        return inp
    inp = inp.contiguous()
    out = torch.empty((inp.shape[0] // t,) + tuple(inp.shape[1:]), dtype=inp.dtype, device=inp.device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, inp, group=group)
    return out


def allreduce(inp: torch.Tensor, group) -> torch.Tensor:
    """The sum over ranks, in place on a contiguous ``inp`` (as TE's ``allreduce``)."""
    if size(group) == 1:
        return inp
    inp = inp.contiguous()
    dist.all_reduce(inp, group=group)
    return inp
