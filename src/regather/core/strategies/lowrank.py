"""The low-rank strategy: replicated LoRA-A on the local shard, gather the rank-r output.

Column-parallel base under sequence parallelism, per rank (``t`` TP size):

=========== ================== ===================== ===============================
tensor      shape              forward               backward
=========== ================== ===================== ===============================
x_local     ``[s/t, b, h]``    input; **saved**      read by ``dA`` (no gather)
A           ``[r, h]``         replicated weight     ``dA`` summed over TP
mid_local   ``[s/t, b, r]``    ``x_local A^T``       ``dmid_local`` (reduce-scatter)
mid         ``[s, b, r]``      all-gather over s     ``dmid`` partial over TP
=========== ================== ===================== ===============================

Equations (``B_i: [o/t, r]``, ``out_i = scale * mid B_i^T``)::

    mid        = all_gather_s(x_local A^T)
    dmid_i     = scale * dout_i B_i              partial: sum_i dmid_i = dmid
    dmid_local = reduce_scatter_s(dmid_i)        the sum is done here, so LoRA-B
                                                 must NOT all-reduce its input grad
    dx_local   = dmid_local A                    complete, no communication
    dA         = all_reduce(dmid_local^T x_local)   each rank sees s/t rows only

Communication added on top of the base layer: forward all-gather ``s*b*r``
elements, backward reduce-scatter ``s*b*r`` and all-reduce ``r*h`` — against
the gather path's all-gather and reduce-scatter of ``s*b*h`` each. Saved for
backward: ``x_local`` (``s*b*h/t``). Numerics: the same maths as the gather
path, with another summation order (``dA`` is summed over the sequence in two
halves, ``dx`` is one GEMM over the full rank ``r``).

``dA`` reduction, chosen by ``reduce_dA``:

- ``True`` (default, :data:`GRAD_ALLREDUCE_BACKWARD`): the partial ``dA`` is
  all-reduced asynchronously inside this backward (overlapping ``dx``'s GEMM),
  so a plain training loop is correct. With gradient-accumulation fusion the
  micro-batch's partial is formed in a fp32 temporary, reduced, then added to
  ``main_grad`` (reducing ``main_grad`` itself would re-sum earlier micro-batches).
- ``False`` (:data:`GRAD_ALLREDUCE_FINALIZE`): the partial is left in ``.grad``
  / ``main_grad`` and the parameter is tagged ``sequence_parallel=True``, the
  tag megatron-core's ``finalize_model_grads`` (``_allreduce_non_tensor_model_
  parallel_grads``, gated on ``config.sequence_parallel``) uses to sum
  LayerNorm gradients over TP. One coalesced all-reduce per step instead of one
  per micro-batch and adapter.

Fallback (ineligible forward, e.g. eval, ``no_grad``, recompute): the gather
path runs on ``A[rank*r/t:(rank+1)*r/t]`` (:func:`replicated_shard`), bit-exact
with an adapter holding that shard. Its gradient is zero outside this rank's
rows; the same reduction completes it (``dA_j + 0`` is exact), so the
replicated copies stay identical.
"""

from __future__ import annotations

import torch

from regather.core import comm
from regather.core.recompute.sources import KEEP
from regather.core.wgrad import main_grad_placeholder, weight_grad

GRAD_ALLREDUCE_BACKWARD = "backward"
GRAD_ALLREDUCE_FINALIZE = "finalize_model_grads"
GRAD_ALLREDUCE_MODES = (GRAD_ALLREDUCE_BACKWARD, GRAD_ALLREDUCE_FINALIZE)


class _PartialGrad:
    """One micro-batch's TP-partial ``dA`` on its way to ``.grad`` or ``main_grad``."""

    def __init__(self, weight: torch.Tensor, partial: torch.Tensor, group, reduce: bool, into_main: bool):
        self.weight, self.partial, self.into_main = weight, partial, into_main
        self.pending = comm.all_reduce_(partial, group, async_op=True) if reduce else None

    def finish(self) -> torch.Tensor | None:
        if self.pending is not None:
            self.pending.wait()
        if not self.into_main:
            return self.partial.to(self.weight.dtype)
        self.weight.main_grad.add_(self.partial)
        return main_grad_placeholder(self.weight)


def _fused(weight: torch.Tensor, fuse: bool) -> bool:
    return fuse and getattr(weight, "main_grad", None) is not None


def _partial_dA(weight, grad_mid_local, x_local, group, fuse, reduce: bool) -> _PartialGrad | torch.Tensor | None:
    """This rank's ``dmid_local^T x_local``: accumulated straight into ``main_grad`` when it
    needs no reduction here (finalize mode; returns the weight gradient for autograd, see
    :func:`~regather.core.wgrad.main_grad_placeholder`), else formed in a temporary
    (fp32 when fused) whose reduction starts now (returns the pending :class:`_PartialGrad`)."""
    if _fused(weight, fuse):
        if not reduce:
            return weight_grad(weight, grad_mid_local, x_local, fuse)  # into main_grad
        from regather.ops import wgrad_accumulate_

        buf = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        wgrad_accumulate_(buf, grad_mid_local.reshape(-1, grad_mid_local.shape[-1]),
                          x_local.reshape(-1, x_local.shape[-1]))
        return _PartialGrad(weight, buf, group, reduce, into_main=True)
    return _PartialGrad(weight, weight_grad(weight, grad_mid_local, x_local, False), group, reduce, into_main=False)


class LowRankLinearA(torch.autograd.Function):
    """``mid = all_gather_s(x_local A^T)`` with ``dA`` summed over the TP group (see module doc)."""

    @staticmethod
    def forward(ctx, x_local, weight, group, fuse, reduce_dA, source, seq_dim):
        mid_local = torch.matmul(x_local, weight.t())
        mid = comm.all_gather_seq(mid_local, group, dim=seq_dim)
        ctx.save_for_backward(*source.save(x_local))  # x_local, or what its producer keeps
        ctx.weight = weight  # a parameter: kept on ctx so main_grad survives (see LinearWithWgrad)
        ctx.group, ctx.fuse, ctx.reduce_dA, ctx.source, ctx.seq_dim = group, fuse, reduce_dA, source.handle(), seq_dim
        return mid

    @staticmethod
    def backward(ctx, grad_mid):
        weight, group = ctx.weight, ctx.group
        grad_mid_local = comm.reduce_scatter_seq(grad_mid, group, dim=ctx.seq_dim)  # sums the TP partials
        grad_w = None
        if ctx.needs_input_grad[1]:
            x_local = ctx.source.load(ctx.saved_tensors)
            grad_w = _partial_dA(weight, grad_mid_local, x_local, group, ctx.fuse, ctx.reduce_dA)
        grad_x = grad_mid_local.matmul(weight) if ctx.needs_input_grad[0] else None  # overlaps the all-reduce
        if isinstance(grad_w, _PartialGrad):
            grad_w = grad_w.finish()
        return grad_x, grad_w, None, None, None, None, None


def lowrank_linear_a(x_local, weight, group, fuse: bool, reduce_dA: bool = True, source=KEEP,
                     seq_dim: int = 0) -> torch.Tensor:
    """``[s/t, b, h] -> [s, b, r]`` (sequence dim ``seq_dim``) with a replicated ``weight [r, h]``."""
    return LowRankLinearA.apply(x_local, weight, group, fuse, reduce_dA, source, seq_dim)


def shard_rows(r: int, rank: int, t: int) -> slice:
    """The rows of a replicated ``[r, h]`` LoRA-A that rank ``rank`` holds in the sharded layout."""
    if r % t:
        raise ValueError(f"LoRA rank {r} is not divisible by the tensor-parallel size {t}")
    n = r // t
    return slice(rank * n, (rank + 1) * n)


class ReplicatedShard(torch.autograd.Function):
    """``weight[rows]`` of a weight replicated over ``group``, with the gradient completed over it.

    Two users: the gather path of a replicated LoRA-A (``rows`` = this rank's rows, ``group`` =
    TP, :func:`replicated_shard`), and the shared adapter of grouped MoE experts (``rows`` = all,
    ``group`` = EP, :func:`replicated_copy`: every EP rank holds the same weights and sees other
    tokens, so the weight's gradient is the sum over EP).

    Forward returns a copy of the rows. With gradient-accumulation fusion the copy carries a
    fp32 ``main_grad`` of its own, so the path's fused wgrad is the same kernel as for a sharded
    adapter; backward scatters it into a zero tensor of the weight's shape and hands it to the
    same reduction as :class:`LowRankLinearA`.
    """

    @staticmethod
    def forward(ctx, weight, rows, group, fuse, reduce_dA):
        shard = weight[rows].clone()
        if _fused(weight, fuse):  # (fuse is False under no_grad: see replicated_shard)
            shard.main_grad = torch.zeros(shard.shape, dtype=torch.float32, device=shard.device)
            if hasattr(weight, "grad_added_to_main_grad"):
                shard.grad_added_to_main_grad = False
        ctx.weight, ctx.shard, ctx.rows = weight, shard, rows
        ctx.group, ctx.fuse, ctx.reduce_dA = group, fuse, reduce_dA
        return shard

    @staticmethod
    def backward(ctx, grad_shard):
        weight, shard = ctx.weight, ctx.shard
        fused = getattr(shard, "main_grad", None) is not None
        part = shard.main_grad if fused else grad_shard
        if fused and not ctx.reduce_dA:  # finalize mode: leave the zero-padded partial in main_grad
            weight.main_grad[ctx.rows].add_(part)
            return main_grad_placeholder(weight), None, None, None, None
        full = torch.zeros(weight.shape, dtype=part.dtype, device=part.device)
        full[ctx.rows] = part
        grad_w = _PartialGrad(weight, full, ctx.group, ctx.reduce_dA, fused).finish()
        return grad_w, None, None, None, None


def replicated_shard(weight, rank: int, t: int, group, fuse: bool, reduce_dA: bool = True):
    # grad mode is off inside Function.forward: decide here whether a main_grad buffer is needed
    rows = shard_rows(weight.shape[0], rank, t)
    return ReplicatedShard.apply(weight, rows, group, fuse and torch.is_grad_enabled(), reduce_dA)

def replicated_copy(weight, group, fuse: bool):
    """``weight`` (the same on every rank of ``group``) with its gradient summed over ``group``."""
    return ReplicatedShard.apply(weight, slice(None), group, fuse and torch.is_grad_enabled(), True)

