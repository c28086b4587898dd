"""Which tensor-parallel layout a LoRA linear has, and whether an input went through a sequence
gather: read on every forward, never assumed — from DTensor placements, or under torchtitan's
``spmd_types`` backend from the sharding configs it declares (:mod:`.spmd`).

===================== ================== ============================ ===========================
base weight           LoRA-A (torchtitan) the adapter input            kind
===================== ================== ============================ ===========================
``Shard(0)`` on TP    ``Replicate``       ``Replicate``, made from a   ``column``: gather /
(column-parallel)     ``[r, h]``          ``Shard(d)`` sequence shard  regather / lowrank
                                          by the gather recorded for
                                          it (:mod:`.pairing`)
``Shard(1)`` on TP    ``Shard(1)``        ``Shard(-1)`` (split over    ``row``: its input is never
(row-parallel)        ``[r, h/t]``        hidden)                      gathered
anything else, a plain weight no ``spmd_types`` config declares          torchtitan's own path
===================== ================== ============================ ===========================

"On TP": the mesh's only dim (``partial_dtensor``, a model parallelized by hand), or the dim
named ``tp`` of a multi-dimensional mesh (``full_dtensor``) where the weights are replicated on
every other dim; under ``spmd_types``, the ``tp`` axis of the declared layouts. torchtitan's
``_lora_adapter_sharding`` gives a column-parallel base a TP-replicated LoRA-A and a
row-parallel one a LoRA-A sharded on its input dim (:func:`regather.torchtitan.hand.apply_lora`
does the same for a model parallelized by hand).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from regather.core.unwrap import plain
from regather.torchtitan import reasons, spmd
from regather.torchtitan.tp import DTensorTP, PlainTP

COLUMN, ROW = "column", "row"
TP_NAME = "tp"  # the tensor-parallel dim of a multi-dimensional mesh (torchtitan's name)


@dataclass(frozen=True)
class Layout:
    """A LoRA linear's kind and where its tensors live: a DTensor mesh and its TP dim, or plain
    tensors (``mesh`` None: ``spmd_types``)."""

    kind: str
    mesh: object = None
    tp_dim: int = 0

    def tp(self, x: torch.Tensor | None = None, group=None) -> DTensorTP | PlainTP:
        """The boundary of a path on input ``x`` (its placements on the other mesh dims) or, for
        plain tensors, on ``group`` (the group the input was gathered on)."""
        if self.mesh is None:
            return PlainTP(group)
        rows = x.placements if isinstance(x, DTensor) and x.device_mesh == self.mesh else None
        return DTensorTP(self.mesh, self.tp_dim, rows)


def _tp_dim(mesh) -> int | None:
    if mesh.ndim == 1:
        return 0
    names = mesh.mesh_dim_names or ()
    return names.index(TP_NAME) if TP_NAME in names else None


def layout_of(module) -> tuple[Layout | None, str | None]:
    """``(Layout, None)`` of a LoRA linear (``module.weight``, ``module.lora_a.weight``), or ``(None, why)``."""
    if spmd.declares(module):
        kind, why = spmd.layout(module)
        return (Layout(kind), None) if kind is not None else (None, why)
    base_weight, lora_a_weight = module.weight, module.lora_a.weight
    if not isinstance(base_weight, DTensor) or not isinstance(lora_a_weight, DTensor):
        return None, reasons.NOT_DTENSOR
    mesh = base_weight.device_mesh
    tp = _tp_dim(mesh)
    if tp is None or lora_a_weight.device_mesh != mesh:
        return None, reasons.MESH_DIMS.format(n=mesh.ndim)
    base, a = tuple(base_weight.placements), tuple(lora_a_weight.placements)
    if any(p != Replicate() for i, p in enumerate(base + a) if i % mesh.ndim != tp):
        return None, reasons.SHARDED_ELSEWHERE.format(base=list(base), lora_a=list(a))
    if base[tp] == Shard(0) and a[tp] == Replicate():
        return Layout(COLUMN, mesh, tp), None
    if base[tp] == Shard(1) and a[tp] == Shard(1):
        return Layout(ROW, mesh, tp), None
    return None, reasons.UNKNOWN_LAYOUT.format(base=list(base), lora_a=list(a))


def _dtensor_gather(before, after) -> tuple[int, object] | None:
    if not (isinstance(before, DTensor) and isinstance(after, DTensor)) or before is after:
        return None
    mesh = before.device_mesh
    tp = _tp_dim(mesh)
    if after.device_mesh != mesh or tp is None:
        return None
    src, dst = before.placements, after.placements
    if not (isinstance(src[tp], Shard) and dst[tp] == Replicate()):
        return None
    if any(s != d for i, (s, d) in enumerate(zip(src, dst)) if i != tp):
        return None
    dim = src[tp].dim % before.ndim
    return (dim, mesh.get_group(tp)) if dim < before.ndim - 1 else None


def sequence_gather(site_module, name: str | None, before, after) -> tuple[int, object] | None:
    """``(d, group)`` when ``after`` is ``before`` gathered over the sequence dim ``d`` on the
    tensor-parallel group ``group`` (``Shard(d) -> Replicate`` on TP, every other mesh dim
    unchanged, ``d`` not the hidden dim), else None. ``site_module``'s config declares it under
    ``spmd_types`` (input ``name``)."""
    if isinstance(before, DTensor) or isinstance(after, DTensor):
        return _dtensor_gather(before, after)
    if site_module is not None and spmd.declares(site_module):
        return spmd.sequence_gather(site_module, name, before, after)
    return None


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
