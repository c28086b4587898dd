"""The first rebuild of an adapter's input, compared with the input bit for bit.

Every front end checks a producer once per adapter (a norm rerun on what it keeps, the SwiGLU
multiply, MoE's route replayed on the router's input) before trusting it: the rebuilt tensor
must equal the forward's tensor exactly, else the input is kept and the reason says what was
measured. Pure functions with no state: the caller keeps whether it checked (plain module state,
set outside any traced region).
"""

from __future__ import annotations

import torch


def mismatch(again: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when ``again`` is ``want`` bit for bit (shape, dtype, values); else what differs, as
    a reason's detail (``max |diff| 1e-07``, or the shapes / dtypes)."""
    if again.shape != want.shape:
        return f"shape {tuple(again.shape)} vs {tuple(want.shape)}"
    if again.dtype != want.dtype:
        return f"dtype {again.dtype} vs {want.dtype}"
    if torch.equal(again, want):
        return None
    return f"max |diff| {(again.float() - want.float()).abs().max().item()}"


def first_rebuild(producer, tensors: tuple, want: torch.Tensor) -> str | None:
    """Rebuild with ``producer.recompute(*tensors)`` and compare with ``want``: None when bit for
    bit, else the difference (:func:`mismatch`). Runs under ``no_grad``: the check itself leaves
    no graph (nothing saved, no bytes)."""
    with torch.no_grad():
        return mismatch(producer.recompute(*tensors), want)
