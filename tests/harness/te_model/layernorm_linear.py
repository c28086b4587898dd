"""TE's ``_LayerNormLinear`` autograd Function on CPU, line by line where it matters to LoRA.

Read in ``transformer_engine/pytorch/module/layernorm_linear.py`` at every tag v2.3 - v2.18 and in
PyPI's 2.19.0 / 2.20.2 wheels (byte-identical LL; "2.20.2:N" below, "v2.3:N" where 2.3 differs);
where versions differ, :class:`~.behaviour.Behaviour` says which runs. High precision only (no fp8,
no userbuffers, no FSDP, no CPU offload: the module refuses those settings, :mod:`.modules`),
column-parallel (what megatron's ``TELayerNormColumnParallelLinear`` builds).

What it **copies**: ``inputmat`` is the input viewed as ``[N, h]`` (2.20.2:181-182), cast to the
activation dtype (2.20.2:188), as are the norm weight and bias (189-191) and the GEMM weight (367):
``cast_if_needed`` returns the same tensor when the dtype matches, a copy otherwise (under autocast).
The module's ``prepare_forward`` makes a non-contiguous input contiguous first (base.py
2.20.2:1639-1640), a copy. A distributed weight (GTP, 2.19+) is swapped for the gathered copy its
``materialize_group_for_forward`` makes (2.20.2:326-330), and every ``weight.requires_grad`` below
reads that copy (427, 474, 539).

What it **saves** (2.20.2:526-536): ``inputmat``, the GEMM weight (None for a distributed weight,
523-524), the weight, the bias, the (cast) norm weight, ``ln_out`` (the local norm output,
``[N, h]``), ``mu`` and ``rsigma`` — through ``ctx.save_for_backward``, so the allocator and
saved-tensor hooks see them as they see TE's.

What it **frees**: in forward, with a frozen weight and no returned norm output, ``ln_out`` and its
gathered copy after the GEMM (2.20.2:427-429; v2.3-v2.7 set them to None first, v2.3:333-336); with
the local output returned under SP, the gathered copy (2.20.2:430-435, v2.8+). With
``return_layernorm_output`` ``ln_out`` is kept: it is saved, whatever the weight. In backward, after
the weight gradient, the inputs it no longer needs (2.20.2:1093-1102; v2.3-v2.7 v2.3:786-789), and
``mu`` / ``rsigma`` after the norm backward (2.20.2:1164-1165, v2.3:842-843).

What it **returns** (2.20.2:618-626): ``out`` and, when asked, ``ln_out_return.view(shape)`` — a
*new view* of the saved ``ln_out`` (no SP, or SP with the local output), or of the gathered copy, a
separate allocation (SP with ``return_layernorm_output_gathered``; the local shard is what is saved).

Which **gradients of the returned ln_out** its backward adds: the local one's after the dgrad's
reduce-scatter / all-reduce (2.20.2:1134-1135, v2.3:812-813); the gathered one's before the
reduce-scatter on TE <= 2.3 only (v2.3:695-696); from TE 2.4 on it is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.harness.te_model import comm
from tests.harness.te_model.behaviour import Behaviour, clear_tensor_data
from tests.harness.te_model.distributed_weight import is_distributed_weight


@dataclass(frozen=True)
class LNLinearArgs:
    """The non-tensor arguments TE packs into ``non_tensor_args`` (2.20.2:123-162) that the model reads."""

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
    activation_dtype: torch.dtype


def cast_if_needed(t, dtype):
    """TE's ``cast_if_needed`` (``pytorch/utils.py``, 2.20.2:689-696): the tensor itself when its dtype
    is ``dtype``, else a copy (made with grad enabled, as TE does)."""
    if t is None or t.dtype == dtype:
        return t
    with torch.enable_grad():
        return t.to(dtype=dtype)


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
    """TE's ``layernorm_bwd`` / ``rmsnorm_bwd`` (2.20.2:1138-1163) from the saved statistics (TE saves
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
    directly when grad is disabled, as TE does (2.20.2:1757-1762). TE's kernels are not autocast
    ops: the body runs with autocast off, in ``args.activation_dtype``."""

    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, weight, bias, args: LNLinearArgs):
        with torch.autocast("cpu", enabled=False):
            return _forward(ctx, inp, ln_weight, ln_bias, weight, bias, args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        with torch.autocast("cpu", enabled=False):
            return _backward(ctx, *grad_outputs)


def _forward(ctx, inp, ln_weight, ln_bias, weight, bias, args: LNLinearArgs):
    with_input_all_gather = args.parallel_mode == "column" and args.sequence_parallel  # 2.20.2:174
    out_features, in_features = weight.shape  # 2.20.2:177
    inp_shape = inp.shape
    inp_requires_grad = inp.requires_grad
    inp = inp.view((-1, in_features))  # 2.20.2:181-182: inputmat shares the input's storage...
    dtype = args.activation_dtype
    inputmat = cast_if_needed(inp, dtype)  # 2.20.2:188-191: ...unless cast (a copy)
    ln_weight = cast_if_needed(ln_weight, dtype)
    ln_bias = cast_if_needed(ln_bias, dtype)

    ln_out, mu, rsigma = apply_normalization(inputmat, ln_weight, ln_bias, args.eps, args.normalization,
                                             args.zero_centered_gamma)  # 2.20.2:257-268
    ln_out_return = None  # 2.20.2:271-274
    if args.return_layernorm_output or args.return_layernorm_output_gathered:
        ln_out_return = ln_out

    ln_out_total = None
    if with_input_all_gather:
        ln_out_total = comm.gather_along_first_dim(ln_out, args.tp_group)  # 2.20.2:283-312
        if args.return_layernorm_output_gathered:
            ln_out_return = ln_out_total  # 2.20.2:288: a separate allocation
    else:
        ln_out_total = ln_out  # 2.20.2:317

    origin_weight = weight  # 2.20.2:326-330: a distributed weight (GTP) is swapped for its gathered copy
    is_dist_weight = is_distributed_weight(origin_weight)
    if is_dist_weight:
        weight = origin_weight.materialize_group_for_forward()[0]
        out_features = weight.shape[0]
    weightmat = cast_if_needed(weight, dtype)  # 2.20.2:367
    gemm_out = torch.matmul(ln_out_total, weightmat.t())  # 2.20.2:410-420 (bias fused into the GEMM)
    if bias is not None:
        gemm_out = gemm_out + cast_if_needed(bias, dtype)

    behaviour = args.behaviour
    if behaviour.clears_ln_out:  # 2.20.2:427-435 (v2.8+)
        if not weight.requires_grad and not args.return_layernorm_output:
            clear_tensor_data(ln_out, ln_out_total)
            ln_out = ln_out_total = None
        elif with_input_all_gather and not args.return_layernorm_output_gathered and behaviour.clears_gathered_total:
            if ln_out_total is not ln_out:
                clear_tensor_data(ln_out_total)
            ln_out_total = None
    elif not weight.requires_grad and not args.return_layernorm_output:  # v2.3:333-336, v2.7:355-357: None first
        ln_out = ln_out_total = None
        clear_tensor_data(ln_out, ln_out_total)

    out = gemm_out.view(-1, *inp_shape[1:-1], out_features)  # 2.20.2:458 (column: no output comm)

    if args.is_grad_enabled:  # 2.20.2:468-616
        ctx.ln_out_needs_gather = weight.requires_grad and args.parallel_mode == "column" and args.sequence_parallel
        wt_save = None if is_dist_weight else weightmat  # 2.20.2:523-524
        ctx.save_for_backward(inputmat, wt_save, origin_weight, bias, ln_weight, ln_out, mu, rsigma)  # 526-536
        ctx.requires_dgrad = inp_requires_grad
        ctx.requires_wgrad = weight.requires_grad  # 2.20.2:539: the gathered copy's, for a distributed weight
        ctx.inp_shape = inp_shape
        ctx.args = args
        ctx.use_bias = bias is not None
        ctx.beta_grad = ln_bias is not None and ln_bias.requires_grad

    ln_out_for_return = None  # 2.20.2:618-626
    if args.return_layernorm_output:
        if args.return_layernorm_output_gathered:
            shape = list(inp_shape)
            shape[0] *= args.tp_size if with_input_all_gather else 1
            ln_out_for_return = ln_out_return.view(shape)
        else:
            ln_out_for_return = ln_out_return.view(inp_shape)
    return out, ln_out_for_return


def _backward(ctx, *grad_outputs):
    args = ctx.args
    inputmat, weightmat, saved_weight, bias, ln_weight, ln_out, mu, rsigma = ctx.saved_tensors  # 2.20.2:640-649
    if is_distributed_weight(saved_weight):  # 2.20.2:651-653
        weightmat = saved_weight.materialize_group_for_backward()[0]
    out_features = weightmat.shape[0]
    grad_output = grad_outputs[0].reshape(-1, out_features)

    ln_out_total = None  # 2.20.2:766-795: read only for the weight gradient
    if ctx.requires_wgrad:
        ln_out_total = comm.gather_along_first_dim(ln_out, args.tp_group) if ctx.ln_out_needs_gather else ln_out

    dgrad = torch.matmul(grad_output, weightmat)  # 2.20.2:862-875
    if args.parallel_mode == "column" and args.tp_size > 1:  # 2.20.2:900-911 (v2.3:692-703)
        if args.sequence_parallel:
            if (args.behaviour.adds_gathered_ln_out_grad and args.return_layernorm_output
                    and args.return_layernorm_output_gathered):  # v2.3:695-696, gone since v2.4
                dgrad = dgrad + grad_outputs[1].reshape(dgrad.shape)
            dgrad = comm.reduce_scatter_along_first_dim(dgrad, args.tp_group)
        else:
            dgrad = comm.allreduce(dgrad, args.tp_group)

    wgrad = grad_bias = None
    if ctx.requires_wgrad:  # 2.20.2:946-1107
        wgrad = torch.matmul(grad_output.t(), ln_out_total)
        if is_distributed_weight(saved_weight):
            wgrad = saved_weight.finalize_group_grads([wgrad])[0]
        _free_after_wgrad(ctx, args, ln_out, ln_out_total)
    if ctx.use_bias and bias.requires_grad:
        grad_bias = grad_output.sum(0)

    dgrad = dgrad.view(inputmat.shape)  # 2.20.2:1132-1135 (v2.3:811-813): the local ln_out's gradient
    if args.return_layernorm_output and not args.return_layernorm_output_gathered:
        dgrad = dgrad + grad_outputs[1].reshape(dgrad.shape)

    dgrad, dgamma, dbeta = normalization_backward(dgrad, inputmat, mu, rsigma, ln_weight, ctx.beta_grad,
                                                  args.normalization, args.zero_centered_gamma)
    clear_tensor_data(mu)  # 2.20.2:1164-1165 (v2.3:842-843)
    clear_tensor_data(rsigma)
    return (dgrad.view(ctx.inp_shape) if ctx.requires_dgrad else None, dgamma, dbeta, wgrad, grad_bias, None)


def _free_after_wgrad(ctx, args, ln_out, ln_out_total) -> None:
    """The inputs TE frees after the weight gradient (:class:`~.behaviour.Behaviour`)."""
    if args.behaviour.frees_after_wgrad == "total":  # v2.3:786-789, v2.7:893-896
        if not args.return_layernorm_output:
            clear_tensor_data(ln_out_total)
        return
    if not args.return_layernorm_output and not args.return_layernorm_output_gathered:  # 2.20.2:1093-1102
        clear_tensor_data(ln_out)  # not exposed
    elif ctx.ln_out_needs_gather and args.return_layernorm_output_gathered:
        clear_tensor_data(ln_out)  # only the gathered copy was exposed
    if ctx.ln_out_needs_gather:
        clear_tensor_data(ln_out_total)  # the gathered copy is internal
