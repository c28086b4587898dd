"""Transformer Engine bases: LoRA beside megatron-core's TE linears.

megatron-core builds ``linear_qkv`` / ``linear_fc1`` as
``TELayerNormColumnParallelLinear`` (LayerNorm fused into the column-parallel
GEMM, ``megatron.core.extensions.transformer_engine``) when TE is used. Its
input ``x`` is the *pre-norm* hidden state ``[s/t, b, h]``; LoRA-A needs the
LayerNorm *output*, which only TE computes. TE hands it back when asked
(``return_layernorm_output=True``): the **local** norm output ``[s/t, b, h]``
(``[s, b, h]`` without SP), on every strategy. Each strategy then does its own
sequence communication (the gather path gathers it, regather gathers it into
scratch, lowrank gathers the rank-r product), and the gradient LoRA sends back
into that local output is the one every TE version adds to its input gradient
(after its dgrad's reduce-scatter: TE v2.3:812-813, v2.18:1105-1106).

regather never asks for TE's *gathered* norm output
(``return_layernorm_output_gathered``), which would spare the gather path one
all-gather: from TE 2.4 on (commit ce0b46c4d) TE's backward drops that output's
gradient (the only read of ``grad_outputs[1]`` is under ``not
ctx.return_layernorm_output_gathered``), so LoRA's share of the input gradient
would never reach the norm and the layers below. TE <= 2.3 added it before its
reduce-scatter (v2.3:695-696). Megatron Bridge's default SP LoRA asks for it
(docs/bridge.md).

With ``return_layernorm_output`` TE returns ``(out, ln_out)``, or
``(out, bias, ln_out)`` with ``return_bias``; megatron's wrapper passes the
latter through unchanged and wraps the former as ``((out, ln_out), None)``
(megatron-core 0.16.1, ``TELayerNormColumnParallelLinear.forward``).
:func:`split_output` accepts both. The flag is set only for the duration of one
call (TE reads it in every forward) and restored afterwards, so the module
behaves as built for anyone else calling it.

TE keeps the ``ln_out`` it returns for its backward, although the weight is
frozen; with ``recompute_adapter_inputs`` the adapters rebuild it from the
norm's input and :mod:`regather.megatron.dense.te_release` frees TE's copy once
every adapter has read it.

``TEColumnParallelLinear`` (no fused norm) takes the LayerNorm output as its
input like megatron's own ``ColumnParallelLinear``: nothing changes for it
except how its sizes are read (:func:`linear_sizes`).

Transformer Engine is never imported here: the classes are recognised by name
(so a CPU machine, where TE cannot be installed, imports and tests this module
with a stand-in class) and the installed version is read from its metadata
(:func:`installed_version`). Known limits: an fp8 LayerNorm output (TE's
quantized tensor types) and ``fp32_residual_connection`` (pre-norm input in
fp32, adapter weights in bf16) are rejected with the adapter's dtype error.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
from typing import Any

import torch
from torch import nn

from regather.megatron.dense import te_release

TE_LAYERNORM_COLUMN = "TELayerNormColumnParallelLinear"
TE_COLUMN = "TEColumnParallelLinear"
TE_ROW = "TERowParallelLinear"
TE_CLASSES = (TE_LAYERNORM_COLUMN, TE_COLUMN, TE_ROW)
_TE_MODULES = ("megatron.core.extensions.transformer_engine", "transformer_engine")

__all__ = [
    "TE_CLASSES",
    "call_with_layernorm_output",
    "fuses_layernorm",
    "installed_version",
    "is_te_linear",
    "layernorm_output",
    "linear_sizes",
    "lora_forward",
    "lora_forward_many",
    "split_output",
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


def installed_version() -> str | None:
    """The installed Transformer Engine's version (``transformer_engine.__version__`` when TE is
    imported already — megatron's TE extension imports it — else the distribution's metadata), or
    None; TE is never imported here."""
    module = sys.modules.get("transformer_engine")
    version = getattr(module, "__version__", None)
    return str(version) if version else _distribution_version()


@functools.lru_cache(maxsize=1)
def _distribution_version() -> str | None:
    for dist in ("transformer-engine", "transformer_engine_torch"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def split_output(result: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(out, bias, ln_out)`` from what megatron's TE wrapper returned with the flag set.

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


def call_with_layernorm_output(base: nn.Module, x: torch.Tensor, *args, **kwargs):
    """Call ``base(x, ...)`` with ``return_layernorm_output=True`` (and the gathered form off) for
    this call only. Returns ``(out, bias, ln_out)``, ``ln_out`` the local norm output, shaped as ``x``."""
    saved = (base.return_layernorm_output, getattr(base, "return_layernorm_output_gathered", False))
    base.return_layernorm_output = True
    if hasattr(base, "return_layernorm_output_gathered"):
        base.return_layernorm_output_gathered = False
    try:
        result = base(x, *args, **kwargs)
    finally:
        base.return_layernorm_output = saved[0]
        if hasattr(base, "return_layernorm_output_gathered"):
            base.return_layernorm_output_gathered = saved[1]
    out, bias, ln_out = split_output(result)
    if ln_out.shape != x.shape:
        raise RuntimeError(
            f"{type(base).__name__}: Transformer Engine returned a LayerNorm output of shape {tuple(ln_out.shape)} "
            f"for an input of shape {tuple(x.shape)} (expected the local output, shaped as the input)")
    return out, bias, ln_out


def lora_forward(base: nn.Module, adapter, x: torch.Tensor, plan, *args, **kwargs):
    """``(base(x) + adapter(LayerNorm(x)), bias)`` for a TE LayerNorm-fused base.

    ``x`` is the pre-norm input ``[s/t, b, h]`` (already through ``adapter.plan``); the adapter gets
    TE's local LayerNorm output and adds its output into TE's (in place when its plan is lean,
    :meth:`~regather.megatron.dense.adapter.forward.AdapterForward.add_into`).
    """
    return lora_forward_many(base, [(adapter, plan)], x, lambda out, ln_out: adapter(ln_out, plan=plan, base_out=out),
                             *args, **kwargs)


def lora_forward_many(base: nn.Module, members, x: torch.Tensor, add, *args, **kwargs):
    """The same for several adapters on one TE base (``CanonicalLoRA``'s q/k/v or gate/up): one
    LayerNorm output for all; ``add(out, ln_out)`` returns the base's output with the adapters' added
    (in the base's layout). Where every adapter rebuilt its input in this forward
    (``recompute_adapter_inputs``), TE's saved copy of the LayerNorm output is released after the last
    one read it (:mod:`regather.megatron.dense.te_release`)."""
    out, bias, ln_out = call_with_layernorm_output(base, x, *args, **kwargs)
    for adapter, _ in members:
        adapter.check_input(ln_out)
    out = add(out, ln_out)
    if ln_out.requires_grad and all(getattr(adapter.last_decision, "recompute", None) for adapter, _ in members):
        te_release.release_or_log(ln_out, members[0][0].log_name)
    return out, bias


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
