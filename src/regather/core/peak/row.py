"""A row-parallel base's LoRA-B on the rows this rank outputs, its weight gathered instead of its output.

The classic row adapter (``linear_proj``, ``linear_fc2``) reduces ``mid = x_i A_i^T`` over TP for the
whole sequence, computes its output columns ``mid B_i^T [s, b, o/t]``, gathers the other ranks' columns
``[s, b, o]`` and keeps its sequence shard ``[s/t, b, o]``: a gathered tensor ``t`` times the size of the
base's output (for ``linear_proj`` at TP2, twice the base's input gradient), and ``mid [s, b, r]`` kept
for the whole sequence. Here, under SP::

    mid_local = reduce_scatter_seq(x_i A_i^T)                  [s/t, b, r]   (the adapter; kept)
    B         = all_gather(B_i)                                [o, r]        (r·o: a weight, not an activation)
    out[:, block j] += (scale · mid_local) B_j^T    for each rank's block j, in row chunks (in place)

    backward: dmid_local = sum_j dY[:, block j] B_j            in rank order: TP2 adds the same two terms
                                                               as the classic all-reduce
              dB_j       = reduce_scatter_j(dY[:, block j]^T mid_s)   each rank's tokens, then summed

Without SP (every rank holds the whole sequence and the whole output) the classic backward is kept
exactly: ``dB_i = dY[:, block i]^T mid_s`` and ``dmid = all_reduce(dY[:, block i] B_i)``; only the forward
changes (LoRA-B's output made here for every block instead of gathered).

**Bits.** The forward's products are the classic GEMM's per block, and ``reduce_scatter`` sums the same
two partials as ``all_reduce`` at TP2, so the output and ``dmid`` are bit-identical at TP ≤ 2 (other
orders at TP > 2). LoRA-B's weight gradient under SP is summed over the sequence in ``t`` parts
(one per rank's tokens, in fp32, then reduce-scattered) instead of in one GEMM: another order, an fp64
bound (the only one at TP2). Without SP everything is the classic path's, bit for bit.
"""

from __future__ import annotations

import torch

from regather.core import comm
from regather.core.peak.output import add_rows_, flat_rows, in_place_target, lora_into_output_, returned_in_place
from regather.core.wgrad import main_grad_placeholder, weight_grad


def _blocks(width: int, t: int) -> list[slice]:
    return [slice(j * width, (j + 1) * width) for j in range(t)]


class RowLoraIntoOutput(torch.autograd.Function):
    """``out[:, block j] += mid_s B_j^T`` for every rank's block ``j`` (module doc); returns ``out``."""

    @staticmethod
    def forward(ctx, out, mid_s, weight, group, sequence_parallel, fuse, on_grad):
        t = comm.world_size(group)
        width = weight.shape[0]
        if not out.is_contiguous() or out.shape[-1] != width * t:
            raise ValueError(f"row-parallel LoRA-B: the base's output {tuple(out.shape)} (contiguous: "
                             f"{out.is_contiguous()}) does not hold {t} blocks of {width} columns")
        full = comm.all_gather_seq(weight.contiguous(), group)  # [o, r], rank order
        flat, mid = in_place_target(out).view(-1, out.shape[-1]), flat_rows(mid_s)
        for block in _blocks(width, t):
            add_rows_(flat[:, block], mid, full[block].t())
        ctx.save_for_backward(mid_s)
        ctx.weight, ctx.group, ctx.sp, ctx.fuse, ctx.on_grad = weight, group, sequence_parallel, fuse, on_grad
        return returned_in_place(ctx, out)

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.on_grad is not None:
            ctx.on_grad()
        (mid_s,) = ctx.saved_tensors
        weight, group = ctx.weight, ctx.group
        t, rank = comm.world_size(group), torch.distributed.get_rank(group)
        g, mid = flat_rows(grad_out), flat_rows(mid_s)
        blocks = _blocks(weight.shape[0], t)
        grad_mid = grad_w = None
        if not ctx.sp:  # the classic backward: this rank's columns, dmid summed over TP
            g_i = g[:, blocks[rank]]
            if ctx.needs_input_grad[1]:
                grad_mid = comm.all_reduce_(g_i.matmul(weight).contiguous(), group).view(mid_s.shape)
            if ctx.needs_input_grad[2]:
                grad_w = weight_grad(weight, g_i, mid, ctx.fuse)
            return grad_out, grad_mid, grad_w, None, None, None, None
        full = comm.all_gather_seq(weight.contiguous(), group) if ctx.needs_input_grad[1] else None
        if ctx.needs_input_grad[1]:
            grad_mid = g[:, blocks[0]].matmul(full[blocks[0]])
            for block in blocks[1:]:
                grad_mid.add_(g[:, block].matmul(full[block]))
            grad_mid = grad_mid.view(mid_s.shape)
        if ctx.needs_input_grad[2]:
            grad_w = _row_weight_grad(weight, g, mid, blocks, group, ctx.fuse)
        return grad_out, grad_mid, grad_w, None, None, None, None


def _row_weight_grad(weight, g, mid, blocks, group, fuse):
    """``dB_i``: every block's product over this rank's tokens (fp32), reduce-scattered over TP; into
    ``main_grad`` under gradient-accumulation fusion (megatron's placeholder returned)."""
    from regather.ops import wgrad_accumulate_

    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    partial = torch.zeros(weight.shape[0] * len(blocks), weight.shape[1], dtype=dtype, device=weight.device)
    for block in blocks:
        if dtype == torch.float64:  # fp64 references: a plain GEMM (the fused kernels take 16/32-bit inputs)
            partial[block] = g[:, block].t().matmul(mid)
        else:
            wgrad_accumulate_(partial[block], g[:, block], mid)
    mine = comm.reduce_scatter_seq(partial, group)
    main_grad = getattr(weight, "main_grad", None) if fuse else None
    if main_grad is None:
        return mine.to(weight.dtype)
    main_grad.add_(mine)
    return main_grad_placeholder(weight)


def row_lora_into_output_(out, mid_s, weight, group, sequence_parallel: bool, fuse: bool = False, on_grad=None):
    """A row-parallel adapter's ``scale · mid B^T`` added into the base's output ``out`` in place:
    ``out`` is the local sequence shard ``[s/t, b, o]`` under SP (``mid_s`` too), the whole ``[s, b, o]``
    without; one rank: :func:`~regather.core.peak.output.lora_into_output_`."""
    if comm.world_size(group) == 1:
        return lora_into_output_(out, mid_s, weight, fuse, on_grad=on_grad)
    return RowLoraIntoOutput.apply(out, mid_s, weight, group, sequence_parallel, fuse, on_grad)
