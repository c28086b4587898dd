"""The regather strategy: save the sequence-local shard, gather it again in backward.

Column-parallel base under sequence parallelism, per rank (``t`` TP size):

=========== ================== ===================== ==========================
tensor      shape              forward               backward
=========== ================== ===================== ==========================
x_local     ``[s/t, b, h]``    input; **saved**      gathered again into scratch
x_full      ``[s, b, h]``      scratch, freed        scratch, freed after dA
A_i         ``[r/t, h]``       weight                weight
mid_i       ``[s, b, r/t]``    ``x_full A_i^T``      ``dmid_i`` arrives
dX_full     ``[s, b, h]``      —                     ``dmid_i A_i`` (partial)
dX_local    ``[s/t, b, h]``    —                     reduce-scatter of dX_full
=========== ================== ===================== ==========================

Equations (identical GEMMs to :mod:`regather.strategies.gather`, so the
results are bit-identical):

    mid_i    = all_gather(x_local) A_i^T
    dX_local = reduce_scatter(dmid_i A_i)
    dA_i     = dmid_i^T all_gather(x_local)

Why ``x_local`` and not ``x_full`` is saved: the frozen base layer needs no
input in backward, so ``x_full`` was kept only for ``dA_i``. Keeping the shard
costs ``s*b*h/t`` elements instead of ``s*b*h``; the price is one more
all-gather in backward (``s*b*h*(t-1)/t`` elements received per rank).

Backward order, chosen so the gather overlaps compute:

1. start the async all-gather of ``x_local`` into a scratch buffer;
2. ``dX_full = dmid_i A_i`` while it runs;
3. start the async reduce-scatter of ``dX_full``;
4. wait for the gather, ``dA_i = dmid_i^T x_full`` (into ``main_grad`` when
   fused), release the scratch buffer;
5. wait for the reduce-scatter, return ``dX_local``.
"""

from __future__ import annotations

import torch

from regather import comm
from regather.buffers import ScratchPool, default_pool
from regather.strategies.wgrad import weight_grad

FORWARD_SCRATCH = "regather.forward.x_full"
BACKWARD_SCRATCH = "regather.backward.x_full"


def _full_shape(x_local: torch.Tensor, t: int):
    return (x_local.shape[0] * t,) + tuple(x_local.shape[1:])


class RegatherLinearA(torch.autograd.Function):
    """LoRA-A under SP that saves ``x_local`` and re-gathers it in backward."""

    @staticmethod
    def forward(ctx, x_local, weight, group, fuse, pool):
        t = comm.world_size(group)
        lease = pool.acquire(FORWARD_SCRATCH, _full_shape(x_local, t), x_local.dtype, x_local.device)
        x_full = comm.all_gather_seq(x_local, group, out=lease.tensor)
        mid = torch.matmul(x_full, weight.t())
        lease.release()  # the GEMM above is the last reader (rule 3 in regather.buffers)
        ctx.save_for_backward(x_local)
        ctx.weight = weight  # a parameter: no new memory (see LinearWithWgrad on why not saved)
        ctx.group, ctx.fuse, ctx.pool = group, fuse, pool
        return mid

    @staticmethod
    def backward(ctx, grad_mid):
        (x_local,), weight = ctx.saved_tensors, ctx.weight
        group, pool = ctx.group, ctx.pool
        t = comm.world_size(group)
        need_w = ctx.needs_input_grad[1]

        if need_w:
            lease = pool.acquire(BACKWARD_SCRATCH, _full_shape(x_local, t), x_local.dtype, x_local.device)
            gather = comm.all_gather_seq(x_local, group, out=lease.tensor, async_op=True)
        scatter = None
        if ctx.needs_input_grad[0]:
            grad_full = grad_mid.matmul(weight)
            scatter = comm.reduce_scatter_seq(grad_full, group, async_op=True)
        grad_w = None
        if need_w:
            x_full = gather.wait()
            grad_w = weight_grad(weight, grad_mid, x_full, ctx.fuse)
            lease.release()
        grad_x = scatter.wait() if scatter is not None else None
        return grad_x, grad_w, None, None, None


def regather_linear_a(
    x_local: torch.Tensor, weight: torch.Tensor, group, fuse: bool, pool: ScratchPool | None = None
) -> torch.Tensor:
    return RegatherLinearA.apply(x_local, weight, group, fuse, pool or default_pool())
