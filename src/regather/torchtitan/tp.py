"""Where a LoRA-A path's local tensors meet the backend's: one object per backend, so the paths
(:mod:`regather.core.strategies`, plain tensors of this rank) are the same on every backend.

A path needs this rank's ``A``, its input (the gathered input or the shard) and hands back
``mid``; the backend says what those are and what gradient each receives, in DTensor's
vocabulary (``Partial`` / ``Replicate`` / ``Shard(d)`` on the tensor-parallel mesh dim):

==================== ===================================== ===================================
                     :class:`DTensorTP` (``partial_dtensor``, :class:`PlainTP` (``spmd_types``)
                     ``full_dtensor``, a model parallelized
                     by hand)
==================== ===================================== ===================================
into a path          ``to_local(grad_placements=...)``:     the tensor itself: its gradient is
                     the gradient placement given on the   this rank's values already (what
                     TP dim; on the other mesh dims the     torchtitan's own LoRA gets there)
                     activation's own, and for a weight
                     ``Partial`` where the activation is
                     sharded over rows (``dA`` sums this
                     rank's rows), else ``Replicate``
out of a path        ``DTensor.from_local`` with the       the tensor itself
                     placement and gradient placement
                     given on the TP dim
==================== ===================================== ===================================

So a column adapter's ``A`` and gathered input enter with ``Partial`` gradients, ``mid`` leaves
``Replicate`` with a ``Partial`` gradient — the placements torchtitan's own column ``lora_a``
produces and receives — and no reduction moves, on any backend.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


class DTensorTP:
    """DTensors on ``mesh``, whose dim ``tp_dim`` is tensor parallel; ``rows``: an activation's
    placements (the other dims' batch / sequence shards; one entry per mesh dim)."""

    def __init__(self, mesh, tp_dim: int = 0, rows=None):
        self.mesh, self.tp_dim = mesh, tp_dim
        self.rows = tuple(rows) if rows is not None else (Replicate(),) * mesh.ndim

    @property
    def group(self):
        return self.mesh.get_group(self.tp_dim)

    def _on_tp(self, placements, placement) -> list:
        out = list(placements)
        out[self.tp_dim] = placement
        return out

    def _weight_grads(self, placement) -> list:
        return self._on_tp([Partial() if isinstance(r, Shard) else Replicate() for r in self.rows], placement)

    def activation(self, t: DTensor, grad) -> torch.Tensor:
        """This rank's values of an activation, its gradient taken as ``grad`` on the TP dim."""
        return t.to_local(grad_placements=self._on_tp(self.rows, grad))

    def weight(self, w: DTensor, grad) -> torch.Tensor:
        """This rank's values of a weight, its gradient taken as ``grad`` on the TP dim."""
        return w.to_local(grad_placements=self._weight_grads(grad))

    def output(self, local: torch.Tensor, placement, grad) -> DTensor:
        """``local`` as an activation placed ``placement`` on the TP dim, its gradient ``grad``."""
        global_shape = all(not isinstance(r, Shard) for i, r in enumerate(self.rows) if i != self.tp_dim)
        shape = dict(shape=local.shape, stride=local.stride()) if global_shape and not isinstance(placement, Shard) \
            else {}
        return DTensor.from_local(local, self.mesh, self._on_tp(self.rows, placement), run_check=False,
                                  grad_placements=self._on_tp(self.rows, grad), **shape)

    def weight_grad(self, grad):
        """A callable turning a weight's plain local gradient into the gradient its DTensor weight
        takes (``grad`` on the TP dim)."""
        placements = self._weight_grads(grad)

        def as_grad(local: torch.Tensor) -> DTensor:
            return DTensor.from_local(local, self.mesh, placements, run_check=False, shape=local.shape,
                                      stride=local.stride())

        return as_grad


class PlainTP:
    """Plain tensors of this rank (``spmd_types``); ``group``: the tensor-parallel process group."""

    def __init__(self, group):
        self.group = group

    def activation(self, t: torch.Tensor, grad) -> torch.Tensor:
        return t

    def weight(self, w: torch.Tensor, grad) -> torch.Tensor:
        return w

    def output(self, local: torch.Tensor, placement, grad) -> torch.Tensor:
        return local

    def weight_grad(self, grad):
        return None
