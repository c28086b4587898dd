"""TE's ``_Linear`` autograd Function on CPU (``transformer_engine/pytorch/module/linear.py``, read
at v2.18, "v2.18:N"; v2.3 does the same for what is modelled here), high precision only.

- column-parallel under SP: the input is gathered for the GEMM and the gathered copy freed after it
  (v2.18:342-377, 511-513); backward reduce-scatters the dgrad (all-reduces it without SP, TP > 1);
- row-parallel: the GEMM output is reduce-scattered over the sequence (SP) or all-reduced
  (v2.18:524-533); backward gathers the output gradient under SP;
- it **saves its input only for the weight gradient** (``saved_inputmat = inputmat if
  backward_needs_input``, v2.18:575-577, ``backward_needs_input = is_grad_enabled and
  weight.requires_grad``, v2.18:306): a frozen ``linear_proj`` / ``linear_fc2`` keeps no input, so a
  LoRA-A input there is new bytes;
- the input, weight and bias are cast to the activation dtype (the same tensors when it matches,
  v2.18:364, 403, 449, 459).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.harness.te_model import comm
from tests.harness.te_model.layernorm_linear import cast_if_needed


@dataclass(frozen=True)
class LinearArgs:
    tp_group: object
    tp_size: int
    sequence_parallel: bool
    parallel_mode: str | None  # "column" | "row" | None (duplicated)
    is_grad_enabled: bool
    activation_dtype: torch.dtype


class LinearFunction(torch.autograd.Function):
    """``_Linear``: ``forward(ctx, inp, weight, bias, args) -> out`` (see the module doc)."""

    @staticmethod
    def forward(ctx, inp, weight, bias, args: LinearArgs):
        with torch.autocast("cpu", enabled=False):  # TE's kernels are not autocast ops
            return _forward(ctx, inp, weight, bias, args)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast("cpu", enabled=False):
            return _backward(ctx, grad_out)


def _forward(ctx, inp, weight, bias, args: LinearArgs):
    out_features, in_features = weight.shape
    inp_shape = inp.shape
    dtype = args.activation_dtype  # cast for AMP: the same tensor when the dtype matches (v2.18:364, 403, 449, 459)
    inputmat = cast_if_needed(inp.reshape(-1, in_features), dtype)
    weightmat, bias = cast_if_needed(weight, dtype), cast_if_needed(bias, dtype)
    backward_needs_input = args.is_grad_enabled and weight.requires_grad  # v2.18:306
    gather = args.parallel_mode == "column" and args.sequence_parallel
    inputmat_total = comm.gather_along_first_dim(inputmat, args.tp_group) if gather else inputmat
    out = torch.matmul(inputmat_total, weightmat.t())
    if bias is not None and not (args.parallel_mode == "row" and args.tp_size > 1):
        out = out + bias
    if gather:
        inputmat_total = None  # v2.18:511-513 (a separate allocation, freed)
    if args.parallel_mode == "row" and args.tp_size > 1:  # v2.18:524-533
        out = (comm.reduce_scatter_along_first_dim(out, args.tp_group) if args.sequence_parallel
               else comm.allreduce(out, args.tp_group))
        if bias is not None:
            out = out + bias
    out = out.view(-1, *inp_shape[1:-1], out_features)
    if args.is_grad_enabled:
        ctx.save_for_backward(inputmat if backward_needs_input else None, weightmat, bias)  # v2.18:575-617
        ctx.args, ctx.inp_shape = args, inp_shape
        ctx.requires_wgrad = weight.requires_grad
    return out


def _backward(ctx, grad_out):
    args = ctx.args
    inputmat, weight, bias = ctx.saved_tensors
    grad_output = grad_out.reshape(-1, weight.shape[0])
    if args.parallel_mode == "row" and args.sequence_parallel and args.tp_size > 1:
        grad_output = comm.gather_along_first_dim(grad_output, args.tp_group)
    dgrad = torch.matmul(grad_output, weight)
    if args.parallel_mode == "column" and args.tp_size > 1:
        dgrad = (comm.reduce_scatter_along_first_dim(dgrad, args.tp_group) if args.sequence_parallel
                 else comm.allreduce(dgrad, args.tp_group))
    wgrad = None
    if ctx.requires_wgrad:
        total = inputmat
        if args.parallel_mode == "column" and args.sequence_parallel:
            total = comm.gather_along_first_dim(inputmat, args.tp_group)
        wgrad = torch.matmul(grad_output.t(), total)
    grad_bias = grad_output.sum(0) if bias is not None and bias.requires_grad else None
    return dgrad.view(ctx.inp_shape), wgrad, grad_bias, None
