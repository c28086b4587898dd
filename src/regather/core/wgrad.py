"""The one place a LoRA weight gradient is produced.

Every strategy computes ``dW = dY^T @ X`` (``dY: [K, out]``, ``X: [K, in]``,
``K = s*b``) through :func:`weight_grad`, so the strategies can only differ in
*which* ``X`` they hand over, never in how the product is formed. That is what
makes regather bit-identical to the gather path.

With gradient-accumulation fusion (megatron's ``gradient_accumulation_fusion``)
and a parameter that carries a ``main_grad`` (fp32, or bf16/fp16 with megatron's
``grad_reduce_in_fp32=False``: fp32 product, one rounding), the product is accumulated
into ``main_grad`` by :func:`regather.ops.wgrad_accumulate_` and the weight
gradient returned to autograd is :func:`main_grad_placeholder`'s: megatron's own
convention (``tensor_parallel/layers.py``, ``LinearWithGradAccumulationAndAsync
Communication.backward`` under ``gradient_accumulation_fusion``):

===================================== =============================================
parameter                             returned weight gradient
===================================== =============================================
has ``grad_added_to_main_grad``       a placeholder of the weight's shape (``empty``;
(megatron DDP sets it)                ``zeros`` when ``zero_out_wgrad``), flag set True
no such attribute (no DDP)            ``None``: ``.grad`` stays None
===================================== =============================================

Why not ``None`` under DDP: megatron DDP's grad-ready hook (on the parameter's
grad accumulator) asserts ``param.grad is not None`` with ``overlap_grad_reduce``,
then skips the add into ``main_grad`` because the flag is set and clears
``.grad``. The placeholder is what autograd hands to that hook; its values are
never read.
"""

from __future__ import annotations

import torch

from regather.core.recompute.sources import KEEP


def weight_grad(
    weight: torch.Tensor, grad_output: torch.Tensor, inp: torch.Tensor, fuse: bool
) -> torch.Tensor | None:
    """``dW = grad_output^T @ inp`` over all leading dims, or accumulate it into ``main_grad``."""
    go = grad_output.reshape(-1, grad_output.shape[-1])
    x = inp.reshape(-1, inp.shape[-1])
    main_grad = getattr(weight, "main_grad", None) if fuse else None
    if main_grad is None:
        return go.t().matmul(x)
    from regather.ops import wgrad_accumulate_

    wgrad_accumulate_(main_grad, go, x)
    return main_grad_placeholder(weight)


def main_grad_placeholder(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight gradient to return once ``dW`` went into ``weight.main_grad`` (see module doc).

    Sets ``grad_added_to_main_grad`` when the parameter has the attribute (megatron DDP)
    and returns a tensor of the weight's shape for DDP's grad hook; ``None`` otherwise.
    """
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.shape, dtype=weight.dtype, device=weight.device)


class LinearWithWgrad(torch.autograd.Function):
    """``Y = X W^T`` whose weight gradient goes through :func:`weight_grad`.

    ============ ====================== =====================================
    tensor       shape                  saved for backward
    ============ ====================== =====================================
    X            ``[..., in]``          through ``source`` (needed for dW):
                                        itself, or what its producer keeps
    W            ``[out, in]``          kept on ``ctx`` (see below)
    Y            ``[..., out]``         no
    ============ ====================== =====================================

    No communication: the strategies wrap it with the collectives they need.
    ``source`` (:mod:`regather.core.recompute.sources`) is loaded only when ``dW`` is
    needed, so a recomputed input costs nothing in a backward that skips LoRA-A's gradient.
    ``into``: a ``(parts, group)`` pair (:class:`regather.core.peak.junction.InputGradParts`) that takes the input
    gradient ``dY W`` and adds it into the base's in place (all-reduced over ``group`` first, when not
    None); the Function then returns ``None`` for ``X`` (autograd adds nothing for it).

    The weight is kept as ``ctx.weight``, not through ``save_for_backward``:
    under ``saved_tensors_hooks`` autograd hands back a new Python object for a
    saved parameter, which would lose its ``main_grad`` attribute.
    """

    @staticmethod
    def forward(ctx, x, weight, fuse, source, into):
        ctx.save_for_backward(*source.save(x))
        ctx.weight, ctx.fuse, ctx.source, ctx.into = weight, fuse, source.handle(), into
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, grad_out):
        weight = ctx.weight
        grad_in = None
        if ctx.needs_input_grad[0]:
            if ctx.into is None:
                grad_in = grad_out.matmul(weight)
            else:
                parts, group = ctx.into
                parts.contribute(grad_out, weight, group)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(weight, grad_out, ctx.source.load(ctx.saved_tensors), ctx.fuse)
        return grad_in, grad_w, None, None, None


class GroupedLinearWithWgrad(torch.autograd.Function):
    """``Y_i = X_i W_i^T`` for consecutive row blocks ``X_i`` (``splits[i]`` rows each) and the
    per-expert weights ``W [E, out, in]`` (MoE per-expert adapters; megatron's ``m_splits``).

    ============ ========================== ===================================
    tensor       shape                      saved for backward
    ============ ========================== ===================================
    X            ``[sum(splits), in]``      through ``source`` (needed for dW)
    W            ``[E, out, in]``           kept on ``ctx`` (see LinearWithWgrad)
    Y            ``[sum(splits), out]``     no
    ============ ========================== ===================================

    Each block's product is the 2-D GEMM :class:`LinearWithWgrad` would run on it, and each
    expert's ``dW_i = dY_i^T X_i`` goes through :func:`weight_grad` into ``main_grad[i]`` with
    gradient-accumulation fusion (megatron's convention: a placeholder is returned), else into
    one ``[E, out, in]`` gradient. An expert that got no tokens has a zero gradient.
    """

    @staticmethod
    def forward(ctx, x, weight, splits, fuse, source):
        ctx.save_for_backward(*source.save(x))
        ctx.weight, ctx.splits, ctx.fuse, ctx.source = weight, splits, fuse, source.handle()
        parts = [torch.matmul(xi, weight[i].t()) for i, xi in enumerate(torch.split(x, splits))]
        return torch.cat(parts) if parts else x.new_empty(0, weight.shape[1])

    @staticmethod
    def backward(ctx, grad_out):
        weight, splits = ctx.weight, ctx.splits
        go = torch.split(grad_out, splits)
        grad_in = None
        if ctx.needs_input_grad[0]:
            grad_in = torch.cat([g.matmul(weight[i]) for i, g in enumerate(go)])
        grad_w = None
        if ctx.needs_input_grad[1]:
            xs = torch.split(ctx.source.load(ctx.saved_tensors), splits)
            main_grad = getattr(weight, "main_grad", None) if ctx.fuse else None
            if main_grad is not None:
                from regather.ops import wgrad_accumulate_

                for i, (g, xi) in enumerate(zip(go, xs)):
                    wgrad_accumulate_(main_grad[i], g.reshape(-1, g.shape[-1]), xi.reshape(-1, xi.shape[-1]))
                grad_w = main_grad_placeholder(weight)
            else:
                grad_w = torch.stack([weight_grad(weight[i], g, xi, False) for i, (g, xi) in enumerate(zip(go, xs))])
        return grad_in, grad_w, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, fuse: bool = False, source=KEEP, splits=None,
           into=None) -> torch.Tensor:
    """``x @ weight^T`` (``splits``: per-expert row blocks of ``x`` against ``weight [E, out, in]``;
    ``into``: where the input gradient goes instead of autograd, see :class:`LinearWithWgrad`)."""
    if splits is not None:
        if into is not None:
            raise ValueError("per-expert row blocks hand their input gradient to autograd (into=None)")
        return GroupedLinearWithWgrad.apply(x, weight, list(splits), fuse, source)
    return LinearWithWgrad.apply(x, weight, fuse, source, into)
