"""Which tensor-parallel layout a LoRA linear has, and whether an input went through a sequence
gather: read from DTensor placements on every forward, never assumed.

===================== ================== ============================ ===========================
base weight           LoRA-A (torchtitan) the adapter input            kind
===================== ================== ============================ ===========================
``Shard(0)``          ``Replicate``       ``Replicate``, made from a   ``column``: gather /
(column-parallel)     ``[r, h]``          ``Shard(d)`` sequence shard  regather / lowrank
                                          by the gather recorded for
                                          it (:mod:`.pairing`)
``Shard(1)``          ``Shard(1)``        ``Shard(-1)`` (split over    ``row``: its input is never
(row-parallel)        ``[r, h/t]``        hidden)                      gathered
anything else, a plain weight, a mesh with more than one dimension     torchtitan's own path
===================== ================== ============================ ===========================

torchtitan's ``_lora_adapter_sharding`` gives a column-parallel base a TP-replicated LoRA-A and a
row-parallel one a LoRA-A sharded on its input dim (:func:`regather.torchtitan.hand.apply_lora`
does the same for a model parallelized by hand).
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from regather.core.unwrap import plain
from regather.torchtitan import reasons

COLUMN, ROW = "column", "row"


def base_layout(base_weight: torch.Tensor, lora_a_weight: torch.Tensor) -> tuple[str | None, str | None]:
    """``(COLUMN | ROW, None)``, or ``(None, why)``."""
    if not isinstance(base_weight, DTensor) or not isinstance(lora_a_weight, DTensor):
        return None, reasons.NOT_DTENSOR
    if base_weight.device_mesh.ndim != 1:
        return None, reasons.MESH_DIMS.format(n=base_weight.device_mesh.ndim)
    base, a = tuple(base_weight.placements), tuple(lora_a_weight.placements)
    if base == (Shard(0),) and a == (Replicate(),):
        return COLUMN, None
    if base == (Shard(1),) and a == (Shard(1),):
        return ROW, None
    return None, reasons.UNKNOWN_LAYOUT.format(base=list(base), lora_a=list(a))


def sequence_gather_dim(before, after) -> int | None:
    """The sequence dim ``d`` when ``after`` is ``before`` gathered ``Shard(d) -> Replicate`` on a
    1-D mesh (``d`` not the hidden dim), else None."""
    if not (isinstance(before, DTensor) and isinstance(after, DTensor)) or before is after:
        return None
    if before.device_mesh != after.device_mesh or before.device_mesh.ndim != 1:
        return None
    (src,), (dst,) = before.placements, after.placements
    if not (isinstance(src, Shard) and dst == Replicate()):
        return None
    dim = src.dim % before.ndim
    return dim if dim < before.ndim - 1 else None


def data_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``t`` (its local tensor, an async collective's output waited on),
    detached: what a path saves, never differentiated through."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if isinstance(local, AsyncCollectiveTensor):
        local = local.wait()
    return local.detach()


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b`` is ``a`` re-wrapped: the same placements over the same local storage and view geometry
    (a wrapper such as spmd_types' ``local_map`` makes new DTensor objects under a dispatch mode)."""
    if not (isinstance(a, DTensor) and isinstance(b, DTensor)) or a.placements != b.placements:
        return False
    la, lb = plain(a), plain(b)
    return (la.untyped_storage().data_ptr() == lb.untyped_storage().data_ptr() and la.shape == lb.shape
            and la.stride() == lb.stride() and la.storage_offset() == lb.storage_offset())
