"""torchtitan's ``spmd_types`` backend (its default, ``parallelism.spmd_backend``): what regather
reads there, where the DTensor backends have placements.

Under ``spmd_types`` every weight and activation is a plain ``torch.Tensor`` holding this rank's
values; what is sharded how is declared, not carried: each module's sharding config
(``state_shardings`` for its weights, ``in_src_shardings`` / ``in_dst_shardings`` for its inputs)
gives an ``SpmdLayout`` per mesh axis, and ``Module.parallelize`` redistributes a module's inputs
from the first to the second with ``spmd_types.redistribute`` on the *current SPMD mesh*'s group
(the trainer's ``train_context`` sets it). The SP all-gather is that redistribution: the
attention's ``x_BLD`` and the feed-forward's ``x`` go ``S(1) -> R`` on the ``tp`` axis
(``_AllGatherShard``: its forward saves nothing, its backward reduce-scatters). Type annotations
on tensors (``spmd.get_local_type``) exist only under type checking (a debug option), and FSDP's
unsharded parameters carry none: regather reads the configs.

=================================== ===============================================================
what                                where it is read
=================================== ===============================================================
a LoRA linear's layout              its config's ``state_shardings["weight"]`` on ``tp`` (the base:
                                    ``S(0)`` column, ``S(1)`` row) and its ``lora_a``'s (``R`` /
                                    ``S(1)``: torchtitan's ``_lora_adapter_sharding``)
the sequence gather of an input     the site module's ``in_src`` -> ``in_dst`` on ``tp``:
                                    ``S(d) -> R`` (``d`` not the hidden dim), checked against the
                                    tensors it made (``after`` is ``before`` with dim ``d`` times
                                    the group size)
its process group                   the current SPMD mesh's ``tp`` group: the one torchtitan's
                                    redistribution used
=================================== ===============================================================
"""

from __future__ import annotations

import torch

from regather.torchtitan import compat, reasons

TP = "tp"  # torchtitan's MeshAxisName.TP


def active() -> bool:
    """torchtitan runs its ``spmd_types`` backend (``set_spmd_backend``, from the trainer's config)."""
    from torchtitan.distributed.utils import get_spmd_backend

    return get_spmd_backend() == "spmd_types"


def declares(module) -> bool:
    """``module``'s layout is declared by an ``spmd_types`` sharding config (not carried by its tensors)."""
    return active() and compat.sharding_config(module) is not None


def tp_group():
    """The ``tp`` group of the current SPMD mesh, or None (no mesh set: torchtitan's
    redistributions do nothing then; no ``tp`` axis, or one of size 1)."""
    from torchtitan.distributed.spmd_types import current_spmd_mesh

    mesh = current_spmd_mesh()
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if TP not in names or mesh.size(names.index(TP)) == 1:
        return None
    return mesh.get_group(TP)


def tp_type(layout):
    """The per-axis ``spmd_types`` type of an ``SpmdLayout`` on ``tp`` (None: not declared)."""
    if layout is None:
        return None
    return {str(axis): t for axis, t in layout.per_axis_spmd_types().items()}.get(TP)


def weight_type(module):
    """The ``tp`` type of ``module``'s declared weight layout, or None."""
    config = compat.sharding_config(module)
    return tp_type(config.state_shardings.get("weight")) if config is not None else None


def _shard_dim(t) -> int | None:
    import spmd_types as spmd

    return t.dim if isinstance(t, spmd.Shard) else None


def layout(module) -> tuple[str | None, str | None]:
    """``("column" | "row", None)`` from the declared layouts of ``module`` (a LoRA linear) and of
    its ``lora_a``, or ``(None, why)``."""
    import spmd_types as spmd

    base, a = weight_type(module), weight_type(module.lora_a)
    if base is None or a is None:
        return None, reasons.NOT_DECLARED
    if _shard_dim(base) == 0 and a is spmd.R:
        return "column", None
    if _shard_dim(base) == 1 and _shard_dim(a) == 1:
        return "row", None
    return None, reasons.UNKNOWN_LAYOUT.format(base=base, lora_a=a)


def sequence_gather(module, name: str, before, after) -> tuple[int, object] | None:
    """``(d, group)`` when ``module``'s input ``name`` went ``before -> after`` through the sequence
    all-gather its config declares (``S(d) -> R`` on ``tp``, ``d`` not the hidden dim), on the
    current mesh's ``tp`` group; else None."""
    import spmd_types as spmd

    config = compat.sharding_config(module)
    if config is None or not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
        return None
    src = tp_type((config.in_src_shardings or {}).get(name))
    dst = tp_type((config.in_dst_shardings or {}).get(name))
    dim = _shard_dim(src)
    if dim is None or dst is not spmd.R or before is after or before.ndim != after.ndim:
        return None
    dim %= before.ndim
    group = tp_group()
    if dim == before.ndim - 1 or group is None:
        return None
    world = group.size()
    want = list(before.shape)
    want[dim] *= world
    return (dim, group) if list(after.shape) == want else None
