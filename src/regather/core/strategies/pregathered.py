"""LoRA-A on an input the base layer has already gathered over the sequence.

Used when one forward gather serves the frozen base and the adapter
(``LoRA(share_sequence_gather=True)``, :class:`regather.megatron.dense.wrapper.LoRALinear`), and by
a caller that hands the adapter an input its base gathered (``input_gathered=True``), so that the
adapter does not gather a second time. The caller's gather must be one whose backward
reduce-scatters the gradient it receives. Transformer Engine's gathered LayerNorm output
(``return_layernorm_output_gathered``) is *not* such a gather from TE 2.4 on — TE drops that
output's gradient — so the TE front end never uses it (:mod:`regather.megatron.dense.te`).

=========== ================== ==============================================
tensor      shape              role
=========== ================== ==============================================
x_full      ``[s, b, h]``      the gathered LayerNorm output (from the base)
A_i         ``[r/t, h]``       this rank's LoRA-A rows
mid_i       ``[s, b, r/t]``    ``x_full A_i^T``
=========== ================== ==============================================

Forward: one GEMM, no communication. Saved for backward: ``x_full`` (as on the
gather path). Backward: ``dA_i = dmid_i^T x_full`` (through
:func:`regather.core.wgrad.weight_grad`) and the rank-*partial*
``dX_full = dmid_i A_i``, returned *without* a reduction: the base layer's
backward of its all-gather is a reduce-scatter over the TP group, which sums
these partials together with its own dgrad. Adding a
TP all-reduce here would count each rank's contribution ``t`` times — the
same reason megatron Bridge builds this adapter with ``disable_grad_reduce``.

The GEMMs and their operands are those of :func:`~regather.core.strategies.gather.gather_linear_a`
after its gather, so the two paths give bit-identical ``mid``, ``dA`` and partial ``dX``.
"""

from __future__ import annotations

import torch

from regather.core.wgrad import linear


def pregathered_linear_a(x_full: torch.Tensor, weight: torch.Tensor, fuse: bool) -> torch.Tensor:
    """``x_full @ weight^T`` for an input already gathered over the sequence (no collective)."""
    return linear(x_full, weight, fuse)


