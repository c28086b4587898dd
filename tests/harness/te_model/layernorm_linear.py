"""TE's ``_LayerNormLinear`` autograd Function on CPU, line by line where it matters to LoRA.

Read in ``transformer_engine/pytorch/module/layernorm_linear.py`` at v2.18 (27486e03c, "v2.18:N"
below) and v2.3 ("v2.3:N"); where the two differ, :class:`~.behaviour.Behaviour` says which runs.
High precision only (no fp8, no userbuffers, no FSDP, no CPU offload: the module refuses those
settings, :mod:`.modules`), column-parallel (what megatron's ``TELayerNormColumnParallelLinear``
builds).

What it **saves** (v2.18:503-513): ``inputmat`` (the input viewed as ``[N, h]``: the input's own
storage, v2.18:172-179), the GEMM weight, the weight, the bias, the norm weight, ``ln_out`` (the
local norm output, ``[N, h]``), ``mu`` and ``rsigma`` — through ``ctx.save_for_backward``, so the
allocator and saved-tensor hooks see them as they see TE's.

What it **frees**: with a frozen weight and no returned norm output, ``ln_out`` and its gathered copy
after the GEMM (v2.18:409-411; v2.3-v2.7 set them to None first, v2.3:333-336); with the local
output returned under SP, the gathered copy (v2.18:412-417, v2.8+). With ``return_layernorm_output``
``ln_out`` is kept: it is saved, whatever the weight.

What it **returns** (v2.18:593-601): ``out`` and, when asked, ``ln_out_return.view(shape)`` — a *new
view* of the saved ``ln_out`` (no SP, or SP with the local output), or of the gathered copy, a
separate allocation (SP with ``return_layernorm_output_gathered``; the local shard is what is saved).

Which **gradients of the returned ln_out** its backward adds: the local one's after the dgrad's
reduce-scatter / all-reduce (v2.18:1105-1106, v2.3:812-813); the gathered one's before the
reduce-scatter on TE <= 2.3 only (v2.3:695-696); on TE >= 2.4 it is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.harness.te_model import comm
from tests.harness.te_model.behaviour import Behaviour, clear_tensor_data


@dataclass(frozen=True)
class LNLinearArgs:
    """The non-tensor arguments TE packs into ``non_tensor_args`` (v2.18:114-154) that the model reads."""

    eps: float
    tp_group: object
    tp_size: int
    sequence_parallel: bool
    parallel_mode: str
    return_layernorm_output: bool
    return_layernorm_output_gathered: bool
    is_grad_enabled: bool
    zero_centered_gamma: bool
    normalization: str
    behaviour: Behaviour


def apply_normalization(inputmat, ln_weight, ln_bias, eps, normalization, zero_centered_gamma):
    """``(ln_out, mu, rsigma)`` as TE's norm kernels return them (``mu`` None for RMSNorm). The
    kernels here are torch's (TE's CUDA kernels may round otherwise: regather's first-rebuild check
    exists for that); zero-centered gamma normalizes with ``weight + 1``."""
    weight = ln_weight + 1 if zero_centered_gamma else ln_weight
    shape = [inputmat.shape[-1]]
    if normalization == "RMSNorm":
        ln_out, rsigma = torch.ops.aten._fused_rms_norm(inputmat, shape, weight, eps)
        return ln_out, None, rsigma
    if normalization != "LayerNorm":
        raise ValueError(f"TE model: normalization={normalization!r} (TE: 'LayerNorm' or 'RMSNorm')")
    return torch.native_layer_norm(inputmat, shape, weight, ln_bias, eps)


def normalization_backward(dgrad, inputmat, mu, rsigma, ln_weight, beta_grad, normalization, zero_centered_gamma):
    """TE's ``layernorm_bwd`` / ``rmsnorm_bwd`` (v2.18:1112-1133) from the saved statistics (TE saves
    no norm bias: its gradient is the sum of ``dgrad``'s rows): ``(dx, dgamma, dbeta)``."""
    weight = ln_weight + 1 if zero_centered_gamma else ln_weight
    shape = [inputmat.shape[-1]]
    if normalization == "RMSNorm":  # torch has no CPU kernel for _fused_rms_norm_backward: its formula
        x, dy = inputmat.float(), dgrad.float() * weight.float()
        dx = rsigma * dy - x * rsigma.pow(3) * (dy * x).mean(-1, keepdim=True)
        dgamma = (dgrad.float() * x * rsigma).sum(0).to(ln_weight.dtype) if ln_weight.requires_grad else None
        return dx.to(dgrad.dtype), dgamma, None
    dx, dgamma, _ = torch.ops.aten.native_layer_norm_backward(dgrad, inputmat, shape, mu, rsigma, weight, None,
                                                              [True, ln_weight.requires_grad, False])
    return dx, dgamma, dgrad.sum(0) if beta_grad else None


class LayerNormLinearFunction(torch.autograd.Function):
    """``_LayerNormLinear`` (see the module doc). ``forward(ctx, inp, ln_weight, ln_bias, weight,
    bias, args)`` returns ``(out, ln_out_for_return)``; the module calls ``forward(None, ...)``
    directly when grad is disabled, as TE does (v2.18:1728-1733)."""

    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, weight, bias, args: LNLinearArgs):
        with_input_all_gather = args.parallel_mode == "column" and args.sequence_parallel  # v2.18:165
        out_features, in_features = weight.shape  # v2.18:168
        inp_shape = inp.shape
        inp_requires_grad = inp.requires_grad
        inp = inp.view((-1, in_features))  # v2.18:172-173: inputmat shares the input's storage
        inputmat = inp  # (cast_if_needed, v2.18:179: the same tensor for the activation dtype)

        ln_out, mu, rsigma = apply_normalization(inputmat, ln_weight, ln_bias, args.eps, args.normalization,
                                                 args.zero_centered_gamma)  # v2.18:244-255
        ln_out_return = None  # v2.18:259-261
        if args.return_layernorm_output or args.return_layernorm_output_gathered:
            ln_out_return = ln_out

        ln_out_total = None
        if with_input_all_gather:
            ln_out_total = comm.gather_along_first_dim(ln_out, args.tp_group)  # v2.18:271-300
            if args.return_layernorm_output_gathered:
                ln_out_return = ln_out_total  # v2.18:275: a separate allocation
        else:
            ln_out_total = ln_out  # v2.18:304

        gemm_out = torch.matmul(ln_out_total, weight.t())  # v2.18:392-402 (bias fused into the GEMM)
        if bias is not None:
            gemm_out = gemm_out + bias

        behaviour = args.behaviour
        if behaviour.clears_ln_out:  # v2.18:409-417
            if not weight.requires_grad and not args.return_layernorm_output:
                clear_tensor_data(ln_out, ln_out_total)
                ln_out = ln_out_total = None
            elif with_input_all_gather and not args.return_layernorm_output_gathered and behaviour.clears_gathered_total:
                if ln_out_total is not ln_out:
                    clear_tensor_data(ln_out_total)
                ln_out_total = None
        elif not weight.requires_grad and not args.return_layernorm_output:  # v2.3:333-336: None first
            ln_out = ln_out_total = None
            clear_tensor_data(ln_out, ln_out_total)

        out = gemm_out.view(-1, *inp_shape[1:-1], out_features)  # v2.18:441 (column: no output comm)

        if args.is_grad_enabled:  # v2.18:450-575
            ctx.ln_out_needs_gather = weight.requires_grad and args.parallel_mode == "column" and args.sequence_parallel
            ctx.save_for_backward(inputmat, weight, weight, bias, ln_weight, ln_out, mu, rsigma)  # v2.18:503-513
            ctx.requires_dgrad = inp_requires_grad
            ctx.requires_wgrad = weight.requires_grad
            ctx.inp_shape = inp_shape
            ctx.args = args
            ctx.use_bias = bias is not None
            ctx.beta_grad = ln_bias is not None and ln_bias.requires_grad

        ln_out_for_return = None  # v2.18:593-600
        if args.return_layernorm_output:
            if args.return_layernorm_output_gathered:
                shape = list(inp_shape)
                shape[0] *= args.tp_size if with_input_all_gather else 1
                ln_out_for_return = ln_out_return.view(shape)
            else:
                ln_out_for_return = ln_out_return.view(inp_shape)
        return out, ln_out_for_return

    @staticmethod
    def backward(ctx, *grad_outputs):
        args = ctx.args
        inputmat, weightmat, _weight, bias, ln_weight, ln_out, mu, rsigma = ctx.saved_tensors  # v2.18:615-624
        out_features = weightmat.shape[0]
        grad_output = grad_outputs[0].reshape(-1, out_features)

        ln_out_total = None  # v2.18:738-772: read only for the weight gradient
        if ctx.requires_wgrad:
            ln_out_total = comm.gather_along_first_dim(ln_out, args.tp_group) if ctx.ln_out_needs_gather else ln_out

        dgrad = torch.matmul(grad_output, weightmat)  # v2.18:839-852
        if args.parallel_mode == "column" and args.tp_size > 1:  # v2.18:877-887 (v2.3:692-703)
            if args.sequence_parallel:
                if (args.behaviour.adds_gathered_ln_out_grad and args.return_layernorm_output
                        and args.return_layernorm_output_gathered):  # v2.3:695-696, gone since v2.4
                    dgrad = dgrad + grad_outputs[1].reshape(dgrad.shape)
                dgrad = comm.reduce_scatter_along_first_dim(dgrad, args.tp_group)
            else:
                dgrad = comm.allreduce(dgrad, args.tp_group)

        wgrad = grad_bias = None
        if ctx.requires_wgrad:  # v2.18:922-1079
            wgrad = torch.matmul(grad_output.t(), ln_out_total)
        if ctx.use_bias and bias.requires_grad:
            grad_bias = grad_output.sum(0)

        dgrad = dgrad.view(inputmat.shape)  # v2.18:1104-1106 (v2.3:811-813): the local ln_out's gradient
        if args.return_layernorm_output and not args.return_layernorm_output_gathered:
            dgrad = dgrad + grad_outputs[1].reshape(dgrad.shape)

        dgrad, dgamma, dbeta = normalization_backward(dgrad, inputmat, mu, rsigma, ln_weight, ctx.beta_grad,
                                                      args.normalization, args.zero_centered_gamma)
        return (dgrad.view(ctx.inp_shape) if ctx.requires_dgrad else None, dgamma, dbeta, wgrad, grad_bias, None)
