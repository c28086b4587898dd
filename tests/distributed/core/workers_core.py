"""Rank bodies for the core tests: the collectives over a sequence dim and the LoRA-A paths, on
plain tensors and a gloo group (no framework: torch and regather.core only)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from regather.core import comm, mappings
from regather.core.buffers import ScratchPool
from regather.core.peak.junction import attach
from regather.core.recompute.producers import NormProducer
from regather.core.recompute.sources import KEEP, Recomputed
from regather.core.strategies.gather import gather_linear_a
from regather.core.strategies.lowrank import lowrank_linear_a
from regather.core.strategies.regather import new_slot, regather_linear_a
from regather.core.strategies.shared_gather import SharedGather


def _local(shape, rank, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + 1000 * rank)
    return torch.randn(shape, generator=g, dtype=dtype)


def collectives_on_dims(rank, world_size):
    """all_gather_seq / reduce_scatter_seq on dim 0 and dim 1 (b = 1: rank blocks are row blocks;
    b = 3: they are not), sync and async, against DTensor's redistributions of the same tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    group = dist.group.WORLD
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for b in (1, 3):
        for dim, shape in ((0, (4, b, 5)), (1, (b, 4, 5))):
            x = _local(shape, rank, 1)
            ref = DTensor.from_local(x, mesh, [Shard(dim)]).redistribute(mesh, [Replicate()]).to_local()
            sync = comm.all_gather_seq(x, group, dim=dim)
            async_ = comm.all_gather_seq(x, group, dim=dim, async_op=True).wait()
            scratch = torch.full(sync.shape, float("nan"))
            into = comm.all_gather_seq(x, group, out=scratch, dim=dim, async_op=True).wait()
            full = _local(sync.shape, rank, 2)  # a rank-partial tensor
            rs_ref = DTensor.from_local(full, mesh, [Partial()]).redistribute(mesh, [Shard(dim)]).to_local()
            rs = comm.reduce_scatter_seq(full, group, dim=dim)
            rs_async = comm.reduce_scatter_seq(full, group, dim=dim, async_op=True).wait()
            out[(b, dim)] = dict(
                gather=torch.equal(sync, ref) and torch.equal(async_, ref) and torch.equal(into, ref)
                and into.data_ptr() == scratch.data_ptr(),
                scatter=torch.equal(rs, rs_ref) and torch.equal(rs_async, rs_ref),
                shapes=(tuple(sync.shape), tuple(rs.shape)))
    # the differentiable pairs against DTensor's autograd: a gathered value's gradient that is
    # rank-partial (it fed a column-parallel GEMM) is reduce-scattered, DTensor's Partial -> Shard;
    # a replicated gradient is split, DTensor's Replicate -> Shard
    for reduce_grad, grad_placement in ((True, Partial()), (False, Replicate())):
        x = _local((3, 4, 5), rank, 3).requires_grad_()
        y = mappings.gather_seq(x, group, dim=1, reduce_grad=reduce_grad)
        dy = _local(y.shape, rank if reduce_grad else 0, 4)
        (y * dy).sum().backward()
        xd = x.detach().clone().requires_grad_()
        yd = DTensor.from_local(xd, mesh, [Shard(1)]).redistribute(mesh, [Replicate()])
        yd.to_local(grad_placements=[grad_placement]).backward(dy)
        out[f"gather_seq_grad_{reduce_grad}"] = torch.equal(y, yd.to_local()) and torch.equal(x.grad, xd.grad)
    errors = []
    for call in (lambda: comm.all_gather_seq(x.detach(), group, dim=3),
                 lambda: comm.reduce_scatter_seq(torch.ones(2, 3), group, dim=1)):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    return out


def _path(kind: str, x, a, group, dim, pool, source=KEEP, share=None):
    if kind == "gather":
        return gather_linear_a(x, a, group, False, dim)
    if kind == "regather":
        return regather_linear_a(x, a, group, False, pool, None, source, share, dim)
    if kind == "regather-early":
        slot = new_slot(x, group, pool, early=True, share=share, seq_dim=dim)
        anchored = attach(x, a, slot) if slot.defer else x  # the deferred dA's junction (core.peak.junction)
        mid = regather_linear_a(anchored, a, group, False, pool, slot, source, share, dim)
        if mid.requires_grad:
            mid.register_hook(slot.on_output_grad)
        return mid
    if kind == "lowrank":
        return lowrank_linear_a(x, a, group, False, True, source, dim)
    raise ValueError(kind)


def lora_a_paths(rank, world_size, dim: int, recompute: bool):
    """One LoRA-A on a sequence shard (``dim``: 0 for [s, b, h], 1 for [b, s, h]) through each
    path, from the same input, weights and output gradient; optionally with the input rebuilt from
    what a norm keeps. Returns mid, dX and dA per path, and the bytes each path saved."""
    from regather.core.accounting import SavedBytes

    group = dist.group.WORLD
    t = world_size
    s_local, b, h, r = 4, 3, 16, 4
    shape = (s_local, b, h) if dim == 0 else (b, s_local, h)
    torch.manual_seed(7)
    norm = torch.nn.LayerNorm(h)  # the same weights on every rank
    a_full = torch.randn(r, h)
    a_shard = a_full[rank * r // t:(rank + 1) * r // t].clone()
    resid = _local(shape, rank, 5)
    out = {}
    pool = ScratchPool()
    for kind in ("gather", "regather", "regather-early", "lowrank"):
        weight = (a_full if kind == "lowrank" else a_shard).clone().requires_grad_()
        inp = resid.clone().requires_grad_()
        # the norm's forward hook, registered before the forward it watches (gather keeps its input)
        producer = NormProducer(norm, "layernorm") if recompute and kind != "gather" else None
        with SavedBytes(exclude=[weight, *norm.parameters()]) as saved:
            x = norm(inp)
            source = KEEP
            if producer is not None:
                source = producer.capture(x)
                assert isinstance(source, Recomputed), source
            mid = _path(kind, x, weight, group, dim, pool, source)
        if producer is not None:
            producer.remove()
        # mid: [.., r/t] sharded over the rank (gather/regather), [.., r] complete (lowrank). Its
        # gradient arrives as LoRA-B gives it: rank-partial sums (here dmid on rank 0, zeros on the
        # others, so the sum is dmid exactly) that the gather paths all-reduce (an adapter's copy to
        # the TP group) and lowrank's sequence gather reduce-scatters
        if kind != "lowrank":
            mid_full = mappings.copy_to_group(mappings.gather_last_dim(mid, group), group)
        else:
            mid_full = mid
        dmid = _local(mid_full.shape, 0, 9) * (1.0 if rank == 0 else 0.0)
        (mid_full * dmid).sum().backward()
        out[kind] = dict(mid=mid_full.detach(), dx=inp.grad.clone(), dA=weight.grad.clone(),
                         saved=saved.total, in_flight=pool.in_flight())
    out["shared"] = _shared(group, a_shard, resid, norm, dim, pool)
    return out


def _shared(group, a_shard, resid, norm, dim, pool):
    """Two regather LoRA-A's on one input with a SharedGather: each gets what it gets alone."""
    got = {}
    for shared in (False, True):
        w1, w2 = a_shard.clone().requires_grad_(), (a_shard * 2).clone().requires_grad_()
        inp = resid.clone().requires_grad_()
        x = norm(inp)
        share = SharedGather(2, group, pool, seq_dim=dim) if shared else None
        m1 = _path("regather", x, w1, group, dim, pool, share=share)
        m2 = _path("regather", x, w2, group, dim, pool, share=share)
        (m1.sum() + 2 * m2.sum()).backward()
        got[shared] = (m1.detach(), m2.detach(), w1.grad, w2.grad, inp.grad)
    return all(torch.equal(p, q) for p, q in zip(got[False], got[True]))


def fp64_reference(world_size, dim: int):
    """The one-device fp64 result the paths compute, from every rank's shard (for lowrank's
    tolerance): mid, and dA of the full replicated LoRA-A."""
    t = world_size
    s_local, b, h, r = 4, 3, 16, 4
    shape = (s_local, b, h) if dim == 0 else (b, s_local, h)
    torch.manual_seed(7)
    norm = torch.nn.LayerNorm(h)
    a_full = torch.randn(r, h)
    x = torch.cat([norm(_local(shape, k, 5)).detach() for k in range(t)], dim=dim).double()
    w = a_full.double().requires_grad_()
    mid = torch.matmul(x, w.t())
    dmid = _local(mid.shape, 0, 9).double()
    (mid * dmid).sum().backward()
    return {"mid": mid.detach(), "dA": w.grad}
