"""LoRA-A of a row-parallel base (``w2``) whose input is rebuilt in backward, exactly as torchtitan's.

``recompute_adapter_inputs`` saves, instead of ``w2``'s input ``x = silu(w1 h) * w3 h``
(``[b, s, ffn/t]``), the two operands its multiply already keeps (:mod:`.producers`). The gradient
of a row-parallel LoRA-A arrives ``Replicate`` when the block's output is reduce-scattered
(sequence parallelism) and ``Partial`` when it is all-reduced: DTensor then picks other
collectives and GEMM operands. So the path does not redo DTensor's backward by hand:

=========== ============================================================================
forward     ``F.linear(x, A)`` on the DTensors (torchtitan's ``lora_a`` op), autograd off;
            saves what the source saves (the operands), not ``x``
backward    rebuild ``x`` (the multiply again, bit-identical), re-run ``F.linear`` on it
            with autograd on and take DTensor's own gradients for ``x`` and ``A`` under the
            gradient as it arrived
=========== ============================================================================

The same ops on equal operands as torchtitan's ``lora_a``, in every layout and on every backend
(DTensors, or under ``spmd_types`` plain tensors, where the op is the plain ``F.linear``); the
price is the rank-r GEMM ``x Aᵀ`` once more in backward (``r / out`` of the base GEMM's cost).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


class RebuiltRowLinearA(torch.autograd.Function):
    """``F.linear(x, weight)`` on DTensors or plain tensors, ``x`` saved through ``source`` (see
    the module doc)."""

    @staticmethod
    def forward(ctx, x, weight, source):
        dtensor = isinstance(x, DTensor)
        ctx.save_for_backward(*source.save(x.to_local() if dtensor else x.detach()))
        ctx.source, ctx.weight = source.handle(), weight  # a parameter: no new bytes
        ctx.spec = (x.device_mesh, x.placements, x.shape, x.stride()) if dtensor else None
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_mid):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x = ctx.source.load(ctx.saved_tensors)
        if ctx.spec is not None:
            mesh, placements, shape, stride = ctx.spec
            x = DTensor.from_local(x, mesh, placements, run_check=False, shape=shape, stride=stride)
        weight = ctx.weight.detach()
        with torch.enable_grad():
            x.requires_grad_(need_x)
            weight.requires_grad_(need_w)
            mid = F.linear(x, weight)
            wanted = [t for t, need in ((x, need_x), (weight, need_w)) if need]
            grads = iter(torch.autograd.grad(mid, wanted, grad_mid))
        return (next(grads) if need_x else None), (next(grads) if need_w else None), None


def rebuilt_row_lora_a(x: torch.Tensor, weight: torch.Tensor, source) -> torch.Tensor:
    """LoRA-A of a row-parallel base on ``x`` (``Shard(-1)``), ``x`` rebuilt by ``source`` in backward."""
    return RebuiltRowLinearA.apply(x, weight, source)
