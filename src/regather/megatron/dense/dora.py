"""DoRA beside a megatron linear: :class:`DoRAAdapter` (LoRA + ``weight_magnitude``) and :class:`DoRALinear`.

``y = m / ||W0 + s·B A||_row ⊙ (W0 x + s·B A x)`` (Megatron Bridge's ``DoRALinear``; the norm detached).
The LoRA part is regather's adapter, every strategy on its input (TE's local LayerNorm output included,
:mod:`regather.megatron.dense.te`); the magnitude is :mod:`regather.core.peak.magnitude`. Names and
checkpoint entries are Bridge's: ``<path>.adapter.weight_magnitude``, ``[o/t]`` and TP-sharded on a
column-parallel base, ``[o]`` whole on a row-parallel one.

One forward, by the adapter's plan (docs/design.md §3.9):

=============================== =================================================================================
plan                            what runs
=============================== =================================================================================
classic (the gather path        Bridge's expression: ``(m / n) * (base(x) + adapter(x))``, ``n`` from the merged
by default)                     weight (:func:`~regather.core.peak.magnitude.row_norm_direct`): bit for bit
                                Bridge's where Bridge is right (column bases; any base at TP1)
lean (every other strategy,     LoRA added into the base's output in place (:mod:`regather.core.peak.output`),
``lean_transients=True``)       ``n`` without the merged weight (:func:`~regather.core.peak.magnitude.row_norm_lean`),
                                ``y = g ⊙ z`` keeping ``z``
lean + ``recompute_output``     ``z`` scaled in place and not kept: backward rebuilds its rows from the input
                                LoRA-A keeps and ``mid`` (:mod:`regather.core.peak.rebuild`): one more base GEMM
=============================== =================================================================================

``norm``: :data:`~regather.core.peak.magnitude.WHOLE_ROW` (default: a row-parallel base's squares summed
over TP, so the model means the same at any TP) or :data:`~regather.core.peak.magnitude.PER_RANK_SLICE`
(Bridge 0.6.2's norm of each rank's slice, for checkpoints trained with it at TP > 1).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from regather.core import accounting, comm, mappings
from regather.core.peak.magnitude import (
    NORMS,
    PER_RANK_SLICE,
    WHOLE_ROW,
    row_norm_direct,
    row_norm_lean,
    scale_by_magnitude,
    scale_by_magnitude_ref,
)
from regather.core.peak.output import lora_into_output_
from regather.core.peak.rebuild import GATHER, LOCAL, ROW, ROW_SP, SLOT, OutputRebuild
from regather.core.peak.row import row_lora_into_output_
from regather.core.strategies import Strategy
from regather.core.strategies.paths import LOWRANK, PREGATHERED, REGATHER, REPLICATED
from regather.core.strategies.regather import new_slot
from regather.megatron.dense import checkpoint, te
from regather.megatron.dense.adapter import ParallelLinearAdapter
from regather.megatron.dense.adapter.forward import LEAN_OUTPUT_NOT_DENSE
from regather.megatron.dense.wrapper import LoRALinear

__all__ = ["DORA_OUTPUT", "NORMS", "PER_RANK_SLICE", "WHOLE_ROW", "DoRAAdapter", "DoRALinear", "bias_in_output"]

#: The saved-bytes label of what DoRA's magnitude keeps (regather.core.accounting): ``dora_output:<base>``.
DORA_OUTPUT = "dora_output"

def bias_in_output(base: nn.Module) -> torch.Tensor | None:
    """The base's bias where the base adds it into its output (megatron's ``skip_bias_add=False``), else None
    (no bias, or returned apart for the caller to add)."""
    bias = getattr(base, "bias", None)
    if not isinstance(bias, torch.Tensor) or bias.numel() == 0:
        return None
    return None if getattr(base, "skip_bias_add", False) or getattr(base, "te_return_bias", False) else bias


class DoRAAdapter(ParallelLinearAdapter):
    """A :class:`ParallelLinearAdapter` with DoRA's magnitude (``weight_magnitude``, Bridge's name).

    Its forward needs the base's output and the base (``base_out=``, ``base=``): it returns the DoRA
    output in the base's layout. The magnitude is set by :class:`DoRALinear` from the base's weight."""

    def __init__(self, *args, norm: str = WHOLE_ROW, recompute_output: bool = False, **kwargs):
        if norm not in NORMS:
            raise ValueError(f"DoRA norm must be one of {NORMS}, got {norm!r}")
        super().__init__(*args, **kwargs)
        if self.dispatched:
            raise ValueError(f"DoRA on {self.facts.base_name!r}: expert linears (and linears whose caller does their "
                             "TP communication) are not supported; leave them out of target_modules")
        if self.dropout is not None or self.facts.activation != "identity":
            raise ValueError(f"DoRA on {self.facts.base_name!r}: dropout={self.dropout.p if self.dropout else 0.0}, "
                             f"activation={self.facts.activation!r}; DoRA takes dropout 0 and the identity")
        self.norm = norm
        self.recompute_output = bool(recompute_output)
        self.weight_magnitude: nn.Parameter | None = None
        self._rebuild_input = None  # (source, input) of this forward's LoRA-A, for the rebuild

    # -- the magnitude and the norm ------------------------------------------------------------------
    def init_weight_magnitude(self, value: torch.Tensor) -> None:
        """``weight_magnitude`` (Bridge's name): ``[o/t]`` TP-sharded on a column base, ``[o]`` whole on a row
        base (its gradient is summed over TP in backward where the ranks saw different tokens)."""
        self.weight_magnitude = nn.Parameter(value.detach().clone(), requires_grad=True)
        self.weight_magnitude.tensor_model_parallel = self.column_parallel and self.tp_size > 1
        self.weight_magnitude.partition_dim = 0 if self.column_parallel else -1
        self.weight_magnitude.partition_stride = 1

    def get_weight_magnitude(self) -> nn.Parameter:
        """Megatron Bridge's accessor."""
        return self.weight_magnitude

    @property
    def norm_group(self):
        """The group a row's squares are summed over (a row base's whole row at TP > 1), or None."""
        if self.column_parallel or self.norm == PER_RANK_SLICE or self.tp_size == 1:
            return None
        return self.tp_group

    def lora_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, B)`` as this rank's rows of ``W0 + s·B A`` need them: all of LoRA-A ``[r, h]`` and this rank's
        LoRA-B (column base), or this rank's LoRA-A ``[r, h/t]`` and all of LoRA-B ``[o, r]`` (row base); a
        collective over TP where a factor is sharded (Bridge gathers the same)."""
        a, b = self.linear_in().detach(), self.linear_out().detach()
        if self.column_parallel and not self.replicated_a:
            a = comm.all_gather_dim(a.contiguous(), self.tp_group, 0)
        elif not self.column_parallel:
            b = comm.all_gather_dim(b.contiguous(), self.tp_group, 0)
        return a, b

    def weight_norm(self, base_weight: torch.Tensor, lean: bool) -> torch.Tensor:
        """``||W0 + s·B A||`` of this rank's output rows, detached: Bridge's expression (``lean=False``) or
        without the merged weight (:func:`~regather.core.peak.magnitude.row_norm_lean`)."""
        with torch.no_grad():
            a, b = self.lora_factors()
            norm = row_norm_lean if lean else row_norm_direct
            return norm(base_weight.detach(), a, b, self.scale, self.norm_group)

    # -- the plan ------------------------------------------------------------------------------------
    def lean_asked(self) -> bool:
        """As LoRA's; ``recompute_output`` needs the lean path, so it asks for it on the gather path too
        (unless ``lean_transients=False``)."""
        if self.recompute_output and self.lean_transients is None:
            return True
        return super().lean_asked()

    def plan(self, x, share=None, reads_base_input=True, parts=None):
        x, plan = super().plan(x, share, reads_base_input, parts)
        if (plan.lean and self.recompute_output and plan.slot is None and plan.decision.used == Strategy.REGATHER
                and self.column_parallel and self.sequence_parallel):
            plan.slot = new_slot(x, self.tp_group, self.pool, early=False)  # the rebuild reads its re-gather
        return x, plan

    def before_lora_a(self, plan, x) -> None:
        if plan.lean and self.recompute_output:
            self._rebuild_input = (plan.source.twin(), x)

    # -- forward -------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, plan=None, input_gathered: bool = False, x_full=None, m_splits=None,
                base_out: torch.Tensor | None = None, out_blocks=None, base: nn.Module | None = None):
        """The DoRA output ``(m / n) ⊙ (base_out + s·B A x)`` in the base's layout (module doc)."""
        if base_out is None or base is None:
            raise ValueError(f"DoRA adapter on {self.facts.base_name!r}: its forward needs the base's output and the "
                             "base (base_out=, base=); DoRALinear passes them")
        if plan is None:
            x, plan = self.plan(x)
        if out_blocks is not None or m_splits is not None:
            raise ValueError(f"DoRA adapter on {self.facts.base_name!r}: one adapter on the whole base only")
        magnitude = self.weight_magnitude
        if plan.lean and not base_out.is_contiguous():
            self.log_lean_fallback(LEAN_OUTPUT_NOT_DENSE)
            plan = dataclasses.replace(plan, lean=False, junction=None)
        sum_group = self.tp_group if (not self.column_parallel and self.sequence_parallel) else None
        if not plan.lean:
            out = super().forward(x, dataclasses.replace(plan, lean=False, junction=None), input_gathered, x_full)
            if sum_group is not None:  # each rank scales its sequence shard: dm summed over TP (Bridge does not)
                magnitude = mappings.copy_to_group(magnitude, sum_group)
            with accounting.label(f"{DORA_OUTPUT}:{self.facts.base_name}"):  # Bridge's expression keeps z
                return scale_by_magnitude_ref(base_out + out, magnitude, self.weight_norm(base.weight, lean=False))
        rebuild_asked = self.recompute_output and magnitude.requires_grad and torch.is_grad_enabled()
        if (rebuild_asked and self.column_parallel and self.sequence_parallel and not input_gathered
                and plan.decision.used == Strategy.GATHER):
            # the gather path's x_full, made here: the rebuild reads the same tensor LoRA-A keeps
            x, input_gathered = mappings.gather_seq(x, self.tp_group), True
        self._rebuild_input = None
        mid_s, plan, b, _ = self.lean_mid(x, plan, input_gathered, x_full)
        slot = plan.slot
        on_grad = (lambda: slot.on_output_grad(None)) if slot is not None else None
        z = self._add_lora(base_out, mid_s, b, on_grad)
        norm = self.weight_norm(base.weight, lean=True)
        rebuild = self._rebuild(plan, base, mid_s, b) if rebuild_asked else None
        self._rebuild_input = None
        with accounting.label(f"{DORA_OUTPUT}:{self.facts.base_name}"):  # z kept for dm (none with the rebuild)
            return scale_by_magnitude(z, magnitude, norm, rebuild, sum_group)

    def _add_lora(self, base_out, mid_s, b, on_grad):
        fuse = self.gradient_accumulation_fusion
        if self.column_parallel:
            return lora_into_output_(base_out, mid_s, b, fuse, on_grad=on_grad)
        return row_lora_into_output_(base_out, mid_s, b, self.tp_group, self.sequence_parallel, fuse, on_grad=on_grad)

    def _rebuild(self, plan, base, mid_s, b) -> OutputRebuild:
        """How backward makes ``z`` again (:mod:`regather.core.peak.rebuild`), by this forward's path."""
        weight, bias = base.weight.detach(), bias_in_output(base)
        bias = bias.detach() if bias is not None else None
        source, x = self._rebuild_input
        path, group = plan.path, self.tp_group
        if not self.column_parallel:
            kind = LOCAL if self.tp_size == 1 else (ROW_SP if self.sequence_parallel else ROW)
        elif path is REGATHER:
            return OutputRebuild(SLOT, weight, b.detach(), mid_s, slot=plan.slot, bias=bias)
        elif path is LOWRANK:
            kind = GATHER
        elif path in (REPLICATED, PREGATHERED):
            kind = LOCAL
        else:
            raise RuntimeError(f"DoRA adapter on {self.facts.base_name!r}: no output rebuild for path {path.name!r}")
        return OutputRebuild(kind, weight, b.detach(), mid_s, x=x, source=source, group=group, bias=bias)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """LoRA's entries, and ``weight_magnitude`` as Bridge declares it (TP-sharded on axis 0 for a column
        base, replicated for a row base)."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        out.update(checkpoint.magnitude_sharded_state_dict(self, prefix, sharded_offsets, metadata))
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", dora norm={self.norm}, recompute_output={self.recompute_output}"


class DoRALinear(LoRALinear):
    """A frozen megatron linear with DoRA: ``((m / n) ⊙ (base(x) + adapter(x)), bias)`` (module doc)."""

    def __init__(self, to_wrap: nn.Module, adapter: DoRAAdapter):
        super().__init__(to_wrap, adapter)
        self.adapter.init_weight_magnitude(self.adapter.weight_norm(to_wrap.weight, lean=False))

    def delta_weight(self, delta_of) -> torch.Tensor:
        raise ValueError(f"cannot merge the DoRA adapter on {self.adapter.log_name!r}: regather.merge folds LoRA "
                         "deltas (B A) into the base weight; DoRA also rescales its rows")

    def forward(self, x: torch.Tensor, *args, **kwargs):
        if not self.adapter_enabled:
            return self.to_wrap(x, *args, **kwargs)
        base = self.to_wrap
        x, plan = self.adapter.plan(x, reads_base_input=not self.te_layernorm)
        if self.te_layernorm:
            return te.lora_forward_many(base, [(self.adapter, plan)], x,
                                        lambda out, ln_out: self.adapter(ln_out, plan=plan, base_out=out, base=base),
                                        *args, **kwargs)
        out, bias = base(x, *args, **kwargs)
        return self.adapter(x, plan=plan, base_out=out, base=base), bias
