"""The gather path (the classic adapter): LoRA-A keeps the gathered input.

Column-parallel base under sequence parallelism, per rank (``t`` TP size):

=========== ================== ==============================================
tensor      shape              role
=========== ================== ==============================================
x_local     ``[s/t, b, h]``    the adapter input (LayerNorm output shard)
x_full      ``[s, b, h]``      ``all_gather(x_local)``, a fresh tensor
A_i         ``[r/t, h]``       this rank's LoRA-A rows
mid_i       ``[s, b, r/t]``    ``x_full A_i^T``
=========== ================== ==============================================

Forward: all-gather ``x_local`` (``s*b*h*(t-1)/t`` elements received), GEMM.
Saved for backward: ``x_full`` — ``s*b*h`` elements, alive until LoRA-A's
weight gradient runs. This is the memory regather removes.
Backward: ``dX_full = dmid_i A_i``; reduce-scatter it to ``dX_local``;
``dA_i = dmid_i^T x_full``.
"""

from __future__ import annotations

import torch

from regather.core import mappings
from regather.core.wgrad import linear


def gather_linear_a(x_local: torch.Tensor, weight: torch.Tensor, group, fuse: bool, seq_dim: int = 0) -> torch.Tensor:
    """``all_gather(x_local) @ weight^T`` over sequence dim ``seq_dim`` (reduce-scatter in backward)."""
    x_full = mappings.gather_seq(x_local, group, seq_dim)
    return linear(x_full, weight, fuse)
