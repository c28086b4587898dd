"""``regather.DoRA``: Weight-Decomposed Low-Rank Adaptation for megatron-core models (Megatron Bridge's fields).

Usage::

    peft = DoRA(dim=16, alpha=32, sequence_parallel_input_strategy="regather", recompute_adapter_inputs=True,
                recompute_dora_output=True)
    model = peft(model, training=True)

Each selected linear becomes a :class:`~regather.megatron.dense.dora.DoRALinear`:
``y = m / ||W0 + s·B A||_row ⊙ (W0 x + s·B A x)``, LoRA's part run by any regather strategy, ``m`` the
trainable ``weight_magnitude`` (initialised to the row norms, as Bridge does). Bridge's ``DoRA`` fields and
defaults (``dim=32``, ``alpha=64``, all four linears), regather's LoRA fields (strategy, early re-gather,
recompute, ``lean_transients``), and two of DoRA's own:

- ``dora_norm``: ``"whole_row"`` (default) — a row-parallel base's row norm over the whole row (squares
  summed over TP), so the model means the same at any TP; ``"per_rank_slice"`` — Megatron Bridge 0.6.2's
  norm of each TP rank's slice, a function of the TP size, **only for checkpoints trained with it** (at TP1,
  and on column-parallel bases, both are the same);
- ``recompute_dora_output``: keep no full-width tensor for the magnitude's gradient — the pre-magnitude
  output is rebuilt in backward, one row chunk at a time, from the input LoRA-A keeps (one more base GEMM
  per adapter; docs/design.md §3.9). Off: it is kept, ``[s, b, o/t]`` per adapter, as Bridge keeps it.

Refused, each before the model changes: ``dropout > 0`` (Bridge runs the base a second time on the dropout's
difference, and on a LayerNorm-fused TE base that applies the norm to the difference), a
``dropout_position`` other than ``"pre"`` (Bridge's assertion), an activation, ``share_sequence_gather``,
and expert linears.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from regather.core.peak.magnitude import NORMS, WHOLE_ROW
from regather.megatron.dense.dora import DoRAAdapter, DoRALinear
from regather.megatron.lora import LoRA
from regather.megatron.moe import experts


@dataclass
class DoRA(LoRA):
    """DoRA for megatron-core models (Megatron Bridge's ``DoRA`` fields and defaults; see module doc)."""

    alpha: int = 64
    dora_norm: str = WHOLE_ROW
    recompute_dora_output: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.dropout:
            raise ValueError(f"DoRA(dropout={self.dropout!r}): regather's DoRA takes dropout=0.0 (Bridge's default); "
                             "Bridge's dropout correction runs the base a second time on the dropout's difference")
        if self.dropout_position != "pre":
            raise ValueError(f"DoRA(dropout_position={self.dropout_position!r}): DoRA only supports 'pre' "
                             "(as Megatron Bridge's DoRA asserts)")
        if self.activation != "identity":
            raise ValueError(f"DoRA(activation={self.activation!r}): DoRA's adapter is linear ('identity')")
        if self.share_sequence_gather:
            raise ValueError("DoRA(share_sequence_gather=True) is not supported: DoRA's wrapper runs its base alone")
        if self.dora_norm not in NORMS:
            raise ValueError(f"DoRA(dora_norm={self.dora_norm!r}): expected one of {NORMS}")
        if not isinstance(self.recompute_dora_output, bool):
            raise ValueError(f"DoRA(recompute_dora_output={self.recompute_dora_output!r}): expected True or False")

    def make_adapter(self, path: str, base: nn.Module, out_features: int | None = None,
                     qualified_name: str | None = None) -> DoRAAdapter:
        if experts.is_grouped_linear(base) or experts.is_expert_linear(path, base):
            raise ValueError(f"DoRA target {path!r} is an expert linear; DoRA adapts dense linears only (leave the "
                             "experts out of target_modules, e.g. exclude_modules=['*.experts.*'])")
        return super().make_adapter(path, base, out_features, qualified_name)

    def dense_adapter(self, in_features: int, out_features: int, rank: int, **kwargs) -> DoRAAdapter:
        return DoRAAdapter(in_features, out_features, rank, norm=self.dora_norm,
                           recompute_output=self.recompute_dora_output, **kwargs)

    def wrap(self, module: nn.Module, adapter: DoRAAdapter) -> DoRALinear:
        return DoRALinear(module, adapter)
