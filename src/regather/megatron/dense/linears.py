"""What regather reads off a megatron parallel linear: its kind, its TP group, its communication.

Recognised by class name and attributes (megatron's ``ColumnParallelLinear`` /
``RowParallelLinear`` and their Transformer Engine wrappers, :mod:`regather.megatron.dense.te`),
so CPU stand-ins with the same names work and TE is never imported.
"""

from __future__ import annotations

import torch
from torch import nn

from regather.megatron import compat
from regather.megatron.dense import te


def is_parallel_linear(module: nn.Module) -> bool:
    """A megatron column- or row-parallel linear with one weight (grouped expert linears are
    :func:`regather.megatron.moe.experts.is_grouped_linear`)."""
    name = type(module).__name__
    return ("ColumnParallel" in name or "RowParallel" in name) and hasattr(module, "weight")


def is_column_parallel(module: nn.Module) -> bool:
    """Column-parallel (its output is split over TP) rather than row-parallel."""
    if te.is_te_linear(module) and getattr(module, "parallel_mode", None) in ("column", "row"):
        return module.parallel_mode == "column"  # TE's own record (TEColumn..., TELayerNormColumn...)
    return "ColumnParallel" in type(module).__name__ or "LayerNormColumn" in type(module).__name__


def explicit_comm(module: nn.Module) -> bool:
    """The linear does no TP communication of its own (its caller does: MoE experts, shared
    experts with overlap)."""
    return bool(getattr(module, "explicit_expert_comm", False)) or (
        hasattr(module, "parallel_mode") and module.parallel_mode is None)


def tp_group_of(module: nn.Module):
    """The TP group the linear's weights are split over, if it records one: megatron's TE
    wrappers keep it as ``_tp_group`` (TE's own ``tp_group`` is None once megatron hid expert TP
    from TE)."""
    group = compat.private(module, compat.TE_TP_GROUP)
    return group if group is not None else getattr(module, "tp_group", None)


def tp_group(base: nn.Module):
    """The linear's TP group, or megatron's tensor-parallel group when it records none."""
    group = tp_group_of(base)
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def group_size(group) -> int:
    """The size of ``group`` (1 without an initialised process group)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group)
