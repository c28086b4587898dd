"""The plain tensor under torch's distributed wrappers, for storage comparisons.

Storage identity is how regather proves that a tensor it saves is already kept (recompute,
:mod:`regather.core.recompute.graph`) and how bytes are deduplicated
(:mod:`regather.core.accounting`). Under PyTorch-native tensor parallelism the tensors autograd
saves are wrappers whose storage is their local tensor's:

======================== ===================================== ==================================
wrapper                  made by                               the plain tensor
======================== ===================================== ==================================
``DTensor``              ``torch.distributed.tensor``          ``_local_tensor`` (this rank's)
``AsyncCollectiveTensor`` an ``async_op=True`` redistribute    ``elem`` (the collective's output
                         (a sequence all-gather's output)      buffer, written when it is waited on)
======================== ===================================== ==================================

A wrapper's own ``untyped_storage()`` is not its data's (an ``AsyncCollectiveTensor`` refuses it).
Torch only: the wrapper types are torch's own.
"""

from __future__ import annotations

import torch

_TYPES: tuple | None = None


def wrapper_types() -> tuple:
    """``(DTensor, AsyncCollectiveTensor)``, or ``()`` on a torch without distributed."""
    global _TYPES
    if _TYPES is None:
        try:
            from torch.distributed._functional_collectives import AsyncCollectiveTensor
            from torch.distributed.tensor import DTensor
        except ImportError:  # a torch built without distributed: nothing is wrapped
            _TYPES = ()
        else:
            _TYPES = (DTensor, AsyncCollectiveTensor)
    return _TYPES


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or the plain tensor under its ``DTensor`` / ``AsyncCollectiveTensor`` wrappers."""
    types = wrapper_types()
    while types and isinstance(t, types):
        t = t._local_tensor if hasattr(t, "_local_tensor") else t.elem
    return t
