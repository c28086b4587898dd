"""Merge LoRA adapters into the frozen base weights under tensor parallelism, and unmerge.

For every :class:`~regather.megatron.dense.wrapper.LoRALinear` the delta ``scale * B @ A`` is
formed in the base layer's own TP layout and added to its weight shard:

================ ================= ================= ===========================
base             base shard        needs             delta on rank ``i``
================ ================= ================= ===========================
column-parallel  ``W_i [o/t, h]``  full ``A [r, h]`` ``scale * B_i @ A``
row-parallel     ``W_i [o, h/t]``  full ``B [o, r]`` ``scale * B @ A_i``
================ ================= ================= ===========================

(all-gathering the factor that is sharded over the rank, resp. over ``o``; a
collective over the TP group, so call :func:`merge` / :func:`unmerge` on every
rank). The product is computed in fp32 and added in fp32, then rounded to the
weight's dtype once.

:func:`merge` then replaces each ``LoRALinear`` by its base layer, so the
merged model runs with no adapter at all; :func:`unmerge` subtracts the same
delta (``keep_original=True`` restores the saved original weights exactly
instead) and puts the ``LoRALinear`` back. In fp32, merged and unmerged
outputs match the adapter model to rounding (tests use ``rtol=1e-5,
atol=1e-5``); in bf16 a merge is a rounding of ``W + delta`` and unmerging by
subtraction is not bit-exact — use ``keep_original=True`` there.

Adapters with dropout (in training) or a non-identity activation cannot be
merged: :func:`merge` raises before changing anything.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from regather.core import comm

_MERGED_ATTR = "_regather_merged"


def delta_weight(adapter) -> torch.Tensor:
    """``scale * B @ A`` in the base layer's TP layout, fp32 (a collective over the TP group)."""
    sd = adapter.state_dict()  # the sharded (Bridge) layout, whatever the strategy
    a, b = sd["linear_in.weight"].float(), sd["linear_out.weight"].float()
    if adapter.column_parallel:
        a = comm.all_gather_dim(a, adapter.tp_group, 0)  # [r, h]
    else:
        b = comm.all_gather_dim(b, adapter.tp_group, 0)  # [o, r]
    return adapter.scale * (b @ a)


def _check_mergeable(path: str, lora_linear) -> None:
    members = lora_linear.named_adapters(path)
    if len(members) > 1 or next(iter(members)) != path:  # CanonicalLoRA: the placed delta is checked
        for name, adapter in members.items():
            _check_linear(name, adapter)
        return
    adapter = lora_linear.adapter
    _check_linear(path, adapter)
    w = lora_linear.to_wrap.weight
    expect = tuple(w.shape)
    if adapter.column_parallel:
        got = (adapter.linear_out.weight.shape[0], adapter.in_features_local)
    else:
        got = (adapter.linear_out.weight.shape[0] * _size(adapter.tp_group), adapter.in_features_local)
    if got != expect:
        raise ValueError(f"cannot merge {path!r}: the adapter's delta would be {got}, the base weight shard is "
                         f"{expect}")


def _check_linear(path: str, adapter) -> None:
    if adapter.dropout is not None and adapter.training:
        raise ValueError(f"cannot merge {path!r}: adapter dropout p={adapter.dropout.p} is active in training "
                         "mode (call model.eval() first)")
    if adapter.facts.activation != "identity":
        raise ValueError(f"cannot merge {path!r}: adapter activation {adapter.facts.activation!r} is not linear")


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def merge(model: nn.Module, keep_original: bool = False) -> list[str]:
    """Fold every adapter into its base weight and unwrap it. Returns the merged paths."""
    from regather.megatron.dense.wrapper import LoRALinear

    wrapped = [(p, m) for p, m in model.named_modules() if isinstance(m, LoRALinear)]
    if not wrapped:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters to merge")
    for path, m in wrapped:  # validate everything before changing anything
        _check_mergeable(path, m)
    deltas = [m.delta_weight(delta_weight) for _, m in wrapped]
    for (path, m), delta in zip(wrapped, deltas):
        if tuple(delta.shape) != tuple(m.to_wrap.weight.shape):
            raise ValueError(f"cannot merge {path!r}: the adapter's delta is {tuple(delta.shape)}, the base "
                             f"weight shard is {tuple(m.to_wrap.weight.shape)}")
    record = getattr(model, _MERGED_ATTR, None) or {}
    for (path, m), delta in zip(wrapped, deltas):
        w = m.to_wrap.weight
        original = w.detach().clone() if keep_original else None
        with torch.no_grad():
            w.copy_((w.float() + delta).to(w.dtype))
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attr, m.to_wrap)
        record[path] = (m, original)
    setattr(model, _MERGED_ATTR, record)
    return [p for p, _ in wrapped]


def unmerge(model: nn.Module, paths: list[str] | None = None) -> list[str]:
    """Undo :func:`merge` (all merged adapters, or ``paths``). Returns the unmerged paths."""
    record = getattr(model, _MERGED_ATTR, None) or {}
    paths = sorted(record) if paths is None else list(paths)
    unknown = [p for p in paths if p not in record]
    if unknown:
        raise ValueError(f"not merged: {unknown}; merged adapters are {sorted(record)}")
    for path in paths:
        m, original = record[path]
        delta = m.delta_weight(delta_weight) if original is None else None
        w = m.to_wrap.weight
        with torch.no_grad():
            if original is not None:
                w.copy_(original)
            else:
                w.copy_((w.float() - delta).to(w.dtype))
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attr, m)
        del record[path]
    return paths


def merged(model: nn.Module) -> list[str]:
    """Paths of the adapters currently merged into ``model``."""
    return sorted(getattr(model, _MERGED_ATTR, None) or {})
