"""Comparisons that hold on any machine, for results that are not the same GEMMs on the same operands.

Two computations of one function that sum in another order (a TP reduction, other GEMM splits, a
sum over sequence halves) agree only to rounding, and how much rounding depends on the machine's
kernels: the BLAS / oneDNN build, its vector width, the thread count. A fixed bound on the
difference of two such results holds on the machine where it was measured and may not elsewhere.
So such a result is compared with an fp64 reference of the same function, and its error is bounded
by a multiple of the error that the reference computation (the gather path, the one-rank run) makes
in the same precision against that reference — flash-attention's rule (k = 3: two orders of one sum were measured up to 1.9x apart in their errors)::

    err(ours) <= k * err(reference computation, same precision) + ulps * eps(dtype) * max|fp64|

The floor (a few units in the last place of the largest entry) covers a reference computation that
happens to be almost exact. Errors are norm-relative: ``max|got - fp64| / max|fp64|``. A real error
(a missing TP sum, misplaced rows, a stale weight) is O(1e-2 .. 1), orders of magnitude above both.

Where the maths is the same GEMMs on the same operands, the results are compared bit for bit
instead (``rtol=0, atol=0``).
"""

from __future__ import annotations

import torch

__all__ = ["ULPS", "K", "check_rounding", "max_rel_err", "rounding_bound"]

#: The multiple of the reference computation's own error that another summation order may make.
K = 3.0
#: The floor, in units of the dtype's epsilon times the reference's largest entry.
ULPS = 4.0


def max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|got - ref| / max|ref|``, in fp64."""
    got, ref = got.double(), ref.double()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def rounding_bound(same_precision: torch.Tensor, fp64: torch.Tensor, dtype: torch.dtype | None = None, *,
                   k: float = K, ulps: float = ULPS) -> float:
    """The norm-relative error allowed to a result whose reference computation gave ``same_precision``
    (in ``dtype``, by default its own) and whose fp64 reference is ``fp64``."""
    eps = torch.finfo(dtype or same_precision.dtype).eps
    return k * max_rel_err(same_precision, fp64) + ulps * eps


def check_rounding(got: torch.Tensor, same_precision: torch.Tensor, fp64: torch.Tensor, what: str = "", *,
                   dtype: torch.dtype | None = None, k: float = K, ulps: float = ULPS) -> None:
    """Assert ``max_rel_err(got, fp64) <= rounding_bound(same_precision, fp64)`` (module doc)."""
    assert got.shape == fp64.shape == same_precision.shape, (what, got.shape, same_precision.shape, fp64.shape)
    assert fp64.abs().max() > 0, f"{what}: the fp64 reference is zero (nothing compared)"
    err = max_rel_err(got, fp64)
    ref_err = max_rel_err(same_precision, fp64)
    bound = rounding_bound(same_precision, fp64, dtype or got.dtype, k=k, ulps=ulps)
    assert err <= bound, (f"{what}: relative error {err:.3g} against fp64 > {bound:.3g} "
                          f"({k:g} x the reference computation's own {ref_err:.3g} + {ulps:g} ulps)")
