"""Differentiable collectives over a tensor-parallel group: where the adapters' bytes are sent.

Each is a forward collective paired with its adjoint in backward, built on :mod:`.comm`
(so every byte goes through one implementation, and is counted where ``comm`` is counted).
They are the maps megatron-core's ``tensor_parallel.mappings`` and DTensor redistributions
perform, written once for both front ends; the sequence dimension is an argument.

======================== ================================= =================================
function                 forward                           backward
======================== ================================= =================================
:func:`gather_seq`       all-gather over ``dim``           reduce-scatter over ``dim``
                         (``Shard(dim) -> Replicate``)     (the partial input gradients summed)
:func:`scatter_seq`      keep this rank's block of ``dim`` all-gather over ``dim``
:func:`reduce_scatter_seq` reduce-scatter over ``dim``     all-gather over ``dim``
                         (partial -> this rank's block)
:func:`copy_to_group`    identity                          all-reduce (partial -> complete)
:func:`reduce_from_group` all-reduce                       identity
:func:`gather_last_dim`  all-gather, concatenated on the   this rank's block of the last dim
                         last dim (rank order)
======================== ================================= =================================

With a group of one rank each is the identity (a copy where the forward would write a new
tensor), as megatron's are.
"""

from __future__ import annotations

import torch

from regather.core import comm


def _size_rank(group) -> tuple[int, int]:
    t = comm.world_size(group)
    return t, (torch.distributed.get_rank(group) if t > 1 else 0)


def _block(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    t, rank = _size_rank(group)
    if x.shape[dim] % t:
        raise ValueError(f"dimension {dim} of {tuple(x.shape)} ({x.shape[dim]}) is not divisible by the "
                         f"group size {t}")
    return x.chunk(t, dim=dim)[rank].contiguous()


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, reduce_grad):
        ctx.group, ctx.dim, ctx.reduce_grad = group, dim, reduce_grad
        return comm.all_gather_seq(x, group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return comm.reduce_scatter_seq(grad, ctx.group, dim=ctx.dim), None, None, None
        return _block(grad, ctx.group, ctx.dim), None, None, None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _block(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather_seq(grad, ctx.group, dim=ctx.dim), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        if comm.world_size(group) == 1:
            return x
        return comm.reduce_scatter_seq(x, group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather_seq(grad, ctx.group, dim=ctx.dim), None, None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce_(grad.contiguous(), ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if comm.world_size(group) == 1:
            return x
        return comm.all_reduce_(x.contiguous().clone() if x.is_contiguous() else x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        t = comm.world_size(group)
        if t == 1:
            return x
        stacked = comm.all_gather_seq(x.contiguous(), group)  # [t * n0, ...]
        return torch.cat(stacked.chunk(t, dim=0), dim=-1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        if comm.world_size(ctx.group) == 1:
            return grad, None
        return _block(grad, ctx.group, grad.dim() - 1), None


def gather_seq(x: torch.Tensor, group, dim: int = 0, reduce_grad: bool = True) -> torch.Tensor:
    """All-gather ``x`` over ``dim``; backward reduce-scatters (``reduce_grad``: the gathered
    tensor feeds rank-partial computations, e.g. a column-parallel GEMM) or keeps this rank's
    block (the gradient is already complete on every rank)."""
    return _GatherSeq.apply(x, group, dim % x.dim(), reduce_grad)


def scatter_seq(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim``; backward all-gathers."""
    return _ScatterSeq.apply(x, group, dim % x.dim())


def reduce_scatter_seq(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum the ranks' partial ``x`` and keep this rank's block of ``dim``; backward all-gathers."""
    return _ReduceScatterSeq.apply(x, group, dim % x.dim())


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    """Identity whose backward all-reduces (each rank's gradient is a partial sum)."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) of the ranks' partial ``x``; backward passes the gradient on."""
    return _ReduceFromGroup.apply(x, group)


def gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate the ranks' ``x`` on the last dim; backward keeps this rank's block."""
    return _GatherLastDim.apply(x, group)
