"""Transformer Engine bases: LoRA beside megatron-core's TE linears.

megatron-core builds ``linear_qkv`` / ``linear_fc1`` as
``TELayerNormColumnParallelLinear`` (LayerNorm fused into the column-parallel
GEMM, ``megatron.core.extensions.transformer_engine``) when TE is used. Its
input ``x`` is the *pre-norm* hidden state ``[s/t, b, h]``; LoRA-A needs the
LayerNorm *output*, which only TE computes. TE hands it back when asked:

=================================== ===================================================
flags set on the TE module          what the adapter receives (``ln_out``)
=================================== ===================================================
``return_layernorm_output=True``    the local LayerNorm output ``[s/t, b, h]``:
                                    regather and low-rank (they gather it themselves)
``..._gathered=True`` (as well)     TE's already all-gathered LayerNorm output
                                    ``[s, b, h]``: the gather path (no second gather,
                                    :mod:`regather.core.strategies.pregathered`)
=================================== ===================================================

With these flags TE returns ``(out, ln_out)``, or ``(out, bias, ln_out)`` with
``return_bias``; megatron's wrapper passes the latter through unchanged and
wraps the former as ``((out, ln_out), None)`` (megatron-core 0.16.1,
``TELayerNormColumnParallelLinear.forward``). :func:`split_output` accepts
both. The flags are set only for the duration of one call (TE reads them in
every forward) and restored afterwards, so the strategy can change between
forwards and the module behaves as built for anyone else calling it.

The gathered output is used only when TE's all-gather is a plain one: with
userbuffers (``ub_overlap_ag``) TE's gathered buffer is reused across layers,
so the local output is requested and the adapter gathers it itself (megatron
Bridge does the same). If a TE version ignores ``return_layernorm_output_gathered``
(older than 1.5) the returned rows say so and the adapter gathers itself.

``TEColumnParallelLinear`` (no fused norm) takes the LayerNorm output as its
input like megatron's own ``ColumnParallelLinear``: nothing changes for it
except how its sizes are read (:func:`linear_sizes`).

Transformer Engine is never imported here: the classes are recognised by name
(so a CPU machine, where TE cannot be installed, imports and tests this module
with a stand-in class). Known limits: an fp8 LayerNorm output (TE's quantized
tensor types) and ``fp32_residual_connection`` (pre-norm input in fp32, adapter
weights in bf16) are rejected with the adapter's dtype error.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("regather")

TE_LAYERNORM_COLUMN = "TELayerNormColumnParallelLinear"
TE_COLUMN = "TEColumnParallelLinear"
TE_ROW = "TERowParallelLinear"
TE_CLASSES = (TE_LAYERNORM_COLUMN, TE_COLUMN, TE_ROW)
_TE_MODULES = ("megatron.core.extensions.transformer_engine", "transformer_engine")

__all__ = [
    "TE_CLASSES",
    "call_with_layernorm_output",
    "fuses_layernorm",
    "is_te_linear",
    "layernorm_output",
    "linear_sizes",
    "lora_forward",
    "split_output",
    "wants_gathered",
]


def _class_names(module: nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def is_te_linear(module: nn.Module) -> bool:
    """A Transformer Engine linear (megatron's wrapper or TE's own class)."""
    if _class_names(module) & set(TE_CLASSES):
        return True
    return any(cls.__module__.startswith(_TE_MODULES) for cls in type(module).__mro__)


def fuses_layernorm(module: nn.Module) -> bool:
    """True for a base whose input is pre-norm and that can return its LayerNorm output."""
    names = _class_names(module)
    return bool(names & {TE_LAYERNORM_COLUMN, "LayerNormLinear"}) and hasattr(module, "return_layernorm_output")


def linear_sizes(base: nn.Module, column_parallel: bool, tp_size: int) -> tuple[int, int]:
    """``(input_size, output_size)`` of the *unsharded* base layer.

    megatron's own linears store them (``input_size``, ``output_size``). TE's
    store per-rank ``in_features`` / ``out_features`` instead, so they are read
    from the weight ``[out_local, in_local]`` and the parallel mode:
    column ``(in, out * t)``, row ``(in * t, out)``, duplicated ``(in, out)``.
    """
    if hasattr(base, "input_size") and hasattr(base, "output_size"):
        return int(base.input_size), int(base.output_size)
    weight = getattr(base, "weight", None)
    if weight is None or weight.dim() != 2:
        raise TypeError(f"{type(base).__name__}: cannot read its sizes (no input_size/output_size and "
                        f"no 2-D weight; TE's split parameters are not supported)")
    out_local, in_local = weight.shape
    mode = getattr(base, "parallel_mode", "column" if column_parallel else "row")
    if mode == "column":
        return int(in_local), int(out_local) * tp_size
    if mode == "row":
        return int(in_local) * tp_size, int(out_local)
    return int(in_local), int(out_local)


def ub_overlap_ag(base: nn.Module) -> bool:
    """TE's forward all-gather runs through userbuffers (its gathered buffer is shared)."""
    return bool(getattr(base, "ub_overlap_ag_fprop", False) or getattr(base, "ub_overlap_ag", False))


def wants_gathered(base: nn.Module, adapter, decision) -> bool:
    """Ask TE for its gathered LayerNorm output: gather path, column-parallel, SP on, t > 1."""
    from regather.core.strategies import Strategy

    return (
        decision.used == Strategy.GATHER
        and adapter.column_parallel
        and adapter.sequence_parallel
        and not ub_overlap_ag(base)
    )


def split_output(result: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(out, bias, ln_out)`` from what megatron's TE wrapper returned with the flags set.

    Accepted forms: ``((out, ln_out), bias_or_None)`` (TE ``return_bias=False``)
    and ``(out, bias, ln_out)`` (TE ``return_bias=True``).
    """
    if isinstance(result, (tuple, list)):
        if len(result) == 3:
            out, bias, ln_out = result
            return out, bias, ln_out
        if len(result) == 2 and isinstance(result[0], (tuple, list)) and len(result[0]) == 2:
            (out, ln_out), bias = result
            return out, bias, ln_out
    shape = type(result).__name__ + (f" of {len(result)}" if isinstance(result, (tuple, list)) else "")
    raise TypeError(
        "Transformer Engine base did not return its LayerNorm output: expected ((out, ln_out), bias) "
        f"or (out, bias, ln_out), got a {shape}; is this a TE version without return_layernorm_output?"
    )


def call_with_layernorm_output(base: nn.Module, x: torch.Tensor, gathered: bool, *args, **kwargs):
    """Call ``base(x, ...)`` with TE's LayerNorm-output flags set for this call only.

    Returns ``(out, bias, ln_out)``; ``ln_out`` is ``[s/t, b, h]``, or
    ``[s, b, h]`` when ``gathered`` and TE honoured it.
    """
    saved = (base.return_layernorm_output, getattr(base, "return_layernorm_output_gathered", False))
    base.return_layernorm_output = True
    base.return_layernorm_output_gathered = bool(gathered)
    try:
        result = base(x, *args, **kwargs)
    finally:
        base.return_layernorm_output, base.return_layernorm_output_gathered = saved
    return split_output(result)


_warned_ignored: set[str] = set()


def _received_gathered(ln_out: torch.Tensor, x: torch.Tensor, requested: bool, adapter) -> bool:
    """Whether ``ln_out`` is the gathered one, checked from its rows (never trusted blindly)."""
    rows, local = ln_out.shape[0], x.shape[0]
    t = adapter.tp_size
    if requested and rows == local * t:
        return True
    if rows == local:
        if requested:
            name = type(adapter).__name__ + ":" + getattr(adapter, "qualified_name", adapter.facts.base_name)
            if name not in _warned_ignored:
                _warned_ignored.add(name)
                logger.info("LoRA adapter on %s: Transformer Engine returned its local LayerNorm output "
                            "although the gathered one was requested (TE < 1.5?); gathering it here", name)
        return False
    raise RuntimeError(
        f"LoRA adapter on {adapter.facts.base_name!r}: Transformer Engine returned a LayerNorm output of "
        f"{rows} rows for an input of {local} rows (expected {local}" + (f" or {local * t}" if requested else "")
        + ")"
    )


def lora_forward(base: nn.Module, adapter, x: torch.Tensor, plan, *args, **kwargs):
    """``(base(x) + adapter(LayerNorm(x)), bias)`` for a TE LayerNorm-fused base.

    ``x`` is the pre-norm input ``[s/t, b, h]`` (already through
    ``adapter.plan``); the adapter gets TE's LayerNorm output, gathered or not
    as :func:`wants_gathered` decides for this forward's strategy.
    """
    return lora_forward_many(base, [(adapter, plan)], x, lambda outs: outs[0], *args, **kwargs)


def lora_forward_many(base: nn.Module, members, x: torch.Tensor, combine, *args, **kwargs):
    """The same for several adapters on one TE base (``CanonicalLoRA``'s q/k/v or gate/up):
    one LayerNorm output for all — gathered only if every member takes the gather path —
    and ``combine([outputs])`` places their outputs in the base's layout."""
    requested = all(wants_gathered(base, adapter, plan.decision) for adapter, plan in members)
    out, bias, ln_out = call_with_layernorm_output(base, x, requested, *args, **kwargs)
    for adapter, _ in members:
        adapter.check_input(ln_out)
    gathered = _received_gathered(ln_out, x, requested, members[0][0])
    return out + combine([adapter(ln_out, plan=plan, input_gathered=gathered) for adapter, plan in members]), bias


def layernorm_output(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The (local) LayerNorm output of a LayerNorm-fused TE base for its pre-norm input ``x``,
    from the module's own norm parameters: ``layer_norm_weight`` (``+ 1`` with
    ``zero_centered_gamma``), ``layer_norm_bias``, ``eps``, ``normalization``
    ("LayerNorm" | "RMSNorm"). Used to recompute the adapter input in backward
    (:mod:`regather.megatron.dense.producers`); the adapter checks once that it reproduces TE's output bit
    for bit and keeps its input otherwise, so TE's own kernel is never replaced silently.
    """
    weight = base.layer_norm_weight
    if getattr(base, "zero_centered_gamma", False):
        weight = weight + 1
    shape = (x.shape[-1],)
    if getattr(base, "normalization", "LayerNorm") == "RMSNorm":
        return nn.functional.rms_norm(x, shape, weight, base.eps)
    return nn.functional.layer_norm(x, shape, weight, getattr(base, "layer_norm_bias", None), base.eps)
