"""Opt-in debug checks that cost a collective, so they are off by default.

Shape check: under tensor/sequence parallelism every TP rank must hand its
adapter an input of the *same* local shape (``[s/t, b, h]`` for a
column-parallel base under SP, ``[s, b, h/t]`` for a row-parallel base). A
rank with a different local sequence length makes the sequence all-gather
fail in an obscure way, or hang, or silently mix shapes. With the check on,
each adapter forward all-gathers the input shape over the TP group first and
raises a ``ValueError`` naming every rank's shape.

Turn it on with the environment variable ``REGATHER_DEBUG_SHAPES=1`` (read at
every call) or per adapter with ``adapter.check_shapes = True``. It must be on
for *all* ranks of the group, or the check's own collective waits for the
ranks that skip it (until the process-group timeout).

Model level: the base linear gathers its input before the adapter runs, so to
catch a mismatch before megatron's own collectives, call
:func:`regather.megatron.dense.model.install_shape_checks` on the LoRA-wrapped model: it registers
a forward pre-hook on every wrapped linear. (This module imports nothing of
the adapter's, so ``adapter -> debug`` stays a leaf import.)
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from regather.core import comm

ENV_VAR = "REGATHER_DEBUG_SHAPES"
_MAX_DIMS = 8


def shapes_enabled(module=None) -> bool:
    """True when the env var is set to a true value or ``module.check_shapes`` is true."""
    if module is not None and getattr(module, "check_shapes", False):
        return True
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def check_same_shape(x: torch.Tensor, group, what: str = "input") -> None:
    """All-gather ``x.shape`` over ``group``; raise ``ValueError`` naming each rank's shape if they differ."""
    if not dist.is_available() or not dist.is_initialized():
        return
    t = dist.get_world_size(group)
    if t == 1:
        return
    if x.dim() > _MAX_DIMS:
        raise ValueError(f"{what}: shape check supports up to {_MAX_DIMS} dimensions, got {tuple(x.shape)}")
    mine = torch.full((_MAX_DIMS + 1,), -1, dtype=torch.int64)
    mine[0] = x.dim()
    mine[1 : 1 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    everyone = comm.all_gather_seq(mine.view(1, -1), group)  # [t, _MAX_DIMS + 1]
    shapes = [tuple(int(d) for d in row[1 : 1 + int(row[0])]) for row in everyone]
    if any(s != shapes[0] for s in shapes):
        ranks = ", ".join(f"rank {r}: {s}" for r, s in enumerate(shapes))
        raise ValueError(
            f"{what}: the TP ranks hold inputs of different local shapes ({ranks}); under tensor/"
            "sequence parallelism every rank must hold an equal shard (same local sequence length, "
            "micro-batch and hidden size)"
        )


def maybe_check_adapter_input(adapter, x: torch.Tensor) -> None:
    """The adapter's hook: check ``x`` across the TP group when the check is on."""
    if shapes_enabled(adapter):
        name = getattr(adapter, "qualified_name", None) or adapter.facts.base_name
        check_same_shape(x, adapter.tp_group, f"LoRA adapter on {name!r}")
