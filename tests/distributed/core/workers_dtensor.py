"""Rank bodies for the core under PyTorch-native tensor parallelism (test_dtensor_core.py): the
N-weight anchor with a per-forward shared gather, recompute graph checks and byte accounting on
DTensor / AsyncCollectiveTensor, DTensor's functional collectives counted. torch and
regather.core only."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from regather.core import mappings
from regather.core.accounting import CollectiveBytes, SavedBytes
from regather.core.buffers import ScratchPool
from regather.core.recompute.producers import NormProducer
from regather.core.recompute.sources import KEEP, Recomputed
from regather.core.strategies.regather import RegatherSlot, regather_shared_linear_a
from regather.core.strategies.shared_anchor import AnchorMembers, anchor_shared
from regather.core.strategies.shared_gather import SharedGather
from regather.core.unwrap import plain
from regather.core.wgrad import linear


def _local(shape, rank, seed):
    g = torch.Generator().manual_seed(seed + 1000 * rank)
    return torch.randn(shape, generator=g)


def _shape(dim: int, s_local=4, b=3, h=16):
    return (s_local, b, h) if dim == 0 else (b, s_local, h)


def anchored_members(rank, world_size, dim: int):
    """Three LoRA-A's on one input gathered once by the caller (w1, w3 of a SwiGLU and a third
    that stays on the gather path): with one anchor for the three weights and a shared backward
    gather opened per forward, against all three on the gather path. Returns mid, dX and dA of
    each, the backward all-gathers, the weight the third member got from the anchor, the pool."""
    group, pool = dist.group.WORLD, ScratchPool()
    torch.manual_seed(3)
    weights = [torch.randn(2, 16) for _ in range(3)]  # this rank's LoRA-A rows [r/t, h]
    x_local = _local(_shape(dim), rank, 5)
    dmids = [_local(_shape(dim, s_local=4 * world_size)[:-1] + (2,), rank, 10 + i) for i in range(3)]  # partial
    out = {}
    for kind in ("gather", "anchored"):
        ws = [w.clone().requires_grad_() for w in weights]
        x = x_local.clone().requires_grad_()
        x_full = mappings.gather_seq(x, group, dim)  # the caller's gather (reduce-scatters dX)
        mids = []
        with CollectiveBytes() as comm:
            if kind == "gather":
                mids = [linear(x_full, w) for w in ws]
            else:
                members = AnchorMembers(3)
                x_full = anchor_shared(x_full, ws, members)
                share = SharedGather.open(group, pool, dim)
                for i, w in enumerate(ws[:2]):
                    slot = RegatherSlot(group, pool, early=True, defer=True, share=share, seq_dim=dim)
                    share.join()
                    members.join(i, slot)
                    mid = regather_shared_linear_a(x_full, x.detach(), w, group, False, pool, slot, KEEP, dim)
                    mid.register_hook(slot.on_output_grad)
                    mids.append(mid)
                mids.append(linear(x_full, ws[2]))  # did not join: the gather path on the anchored input
            comm.reset()  # backward only
            sum((m * d).sum() for m, d in zip(mids, dmids)).backward()
        out[kind] = dict(mid=[m.detach() for m in mids], dx=x.grad, dA=[w.grad for w in ws],
                         gathers=comm.calls.get("all_gather", 0))
    out["in_flight"] = pool.in_flight()
    return out


def _mesh(world_size):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


class _SwappedWeight(torch.nn.Module):
    """Registers a new weight in every forward (as FSDP2 swaps unsharded parameters in)."""

    def forward(self, x):
        self.w = torch.nn.Parameter(torch.ones(16, 16))
        return torch.matmul(x, self.w.t())  # mm saves x and a view of the new weight


def dtensor_accounting(rank, world_size):
    """SavedBytes and CollectiveBytes on DTensor activations, and a norm producer's capture on a
    DTensor norm whose input is an AsyncCollectiveTensor."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh, t = _mesh(world_size), world_size
    out = {}
    shard = _local((2, 4, 16), rank, 1).requires_grad_()
    weight = torch.nn.Parameter(distribute_tensor(torch.randn(8, 16, generator=torch.Generator().manual_seed(0)),
                                                  mesh, [Replicate()]))
    holder = torch.nn.Module()
    holder.weight = weight
    for functional in (False, True):
        with CollectiveBytes(functional=functional) as comm, SavedBytes.for_model(holder) as saved:
            x = DTensor.from_local(shard, mesh, [Shard(1)])
            full = x.redistribute(mesh, [Replicate()], async_op=True)
            y = F.linear(full, weight)  # saves the gathered input (and the weight: not counted)
        out[f"comm_{functional}"] = dict(comm.bytes)
        out[f"saved_{functional}"] = saved.total
        y.to_local().sum().backward()
    out["gathered_bytes"] = 2 * 4 * t * 16 * 4
    # a weight registered during the forward is a parameter when it is saved
    with SavedBytes.for_model(swapped := _SwappedWeight()) as saved:
        swapped(torch.randn(2, 16, requires_grad=True))
    out["swapped"] = saved.total
    # a norm on a sequence shard whose input is an async reduce-scatter's output (ACT)
    norm = torch.nn.RMSNorm(16)
    norm.weight = torch.nn.Parameter(distribute_tensor(norm.weight.detach(), mesh, [Replicate()]),
                                     requires_grad=False)
    producer = NormProducer(norm, "rmsnorm")
    partial = _local((2, 8, 16), rank, 2).requires_grad_()
    inp = DTensor.from_local(partial, mesh, [Partial()]).redistribute(mesh, [Shard(1)], async_op=True)
    out["act"] = type(inp._local_tensor).__name__
    y = norm(inp)
    captured = producer.capture(y)
    saved = captured.tensors if isinstance(captured, Recomputed) else None
    out["captured"] = captured.reason if saved is None else dict(
        plain=type(saved[0]).__name__,
        same_storage=saved[0].untyped_storage().data_ptr() == plain(inp).untyped_storage().data_ptr(),
        rebuilt=torch.equal(F.rms_norm(saved[0], (16,), norm.weight.to_local(), norm.eps), y.to_local()))
    return out
