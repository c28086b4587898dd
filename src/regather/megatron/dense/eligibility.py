"""When may a LoRA-A skip keeping its gathered input? (docs/design.md §5)

:func:`unsupported_reason` returns ``None`` when the sequence-local strategies
(regather, and later lowrank) may run, otherwise the *first* rule that fails,
as a sentence naming the offending values. The adapter evaluates it on every
forward, so a change of mode (``eval()``, ``no_grad``, recompute) takes effect
at once. Rules are checked in a fixed order; tests pin each message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from regather.core.decision import expected
from regather.core.moment import RunState, in_activation_checkpoint, moment_reason
from regather.megatron import compat
from regather.megatron.reasons import CPU_OFFLOADING, ELIGIBLE_BASES, EXPERT_REASON, IN_CHECKPOINT

__all__ = ["EXPERT_REASON", "IN_CHECKPOINT", "AdapterFacts", "RunState", "checkpointed_by_config",
           "in_activation_recompute", "run_state", "unsupported_reason"]


@dataclass(frozen=True)
class AdapterFacts:
    """What an adapter knows about its base layer; fixed when it is built."""

    base_name: str  # the attribute name of the wrapped linear, e.g. "linear_qkv"
    column_parallel: bool
    sequence_parallel: bool  # the base layer communicates over the sequence
    tp_size: int
    is_expert: bool = False
    a2a_experts: bool = False
    activation: str = "identity"
    # the base does no TP communication of its own: its caller does it (megatron's
    # explicit_expert_comm / TE's parallel_mode=None: MoE experts, shared experts with overlap)
    explicit_comm: bool = False


def in_activation_recompute() -> bool:
    """True where activation checkpointing will run (or is running) this forward again.

    Covers megatron's checkpointed forward and recompute (``is_checkpointing``) besides
    ``torch.utils.checkpoint`` (:func:`regather.core.moment.in_activation_checkpoint`): the
    adapter takes the gather path in both passes instead of failing with a CheckpointError in
    backward.
    """
    return in_activation_checkpoint() or compat.is_checkpointing()


def run_state(module: torch.nn.Module, lora_a: torch.Tensor) -> RunState:
    """The adapter's :class:`~regather.core.moment.RunState` now, megatron's checkpoint included."""
    return RunState.capture(module, lora_a, in_activation_recompute())


def _cuda_graphs_on(config: Any) -> str | None:
    impl = getattr(config, "cuda_graph_impl", "none") or "none"
    if impl != "none":
        return f"CUDA graphs are on (cuda_graph_impl={impl!r})"
    for flag in ("enable_cuda_graph", "external_cuda_graph"):
        if getattr(config, flag, False):
            return f"CUDA graphs are on ({flag}=True)"
    return None


def checkpointed_by_config(config: Any, base_name: str, expert: bool = False) -> bool:
    """Every forward of the adapter on ``base_name`` runs inside megatron's activation
    checkpoint: full recompute, or selective recompute of ``mlp`` (a dense MLP's ``linear_fc1``
    and ``linear_fc2``; ``TransformerLayer`` checkpoints the whole MLP) or, for an ``expert``
    linear, of ``moe`` (``MoELayer`` checkpoints itself; ``mlp`` does not cover MoE layers)."""
    granularity = getattr(config, "recompute_granularity", None)
    if granularity == "full":
        return True
    modules = getattr(config, "recompute_modules", None) or []
    if granularity != "selective":
        return False
    if expert:
        return "moe" in modules
    return "mlp" in modules and base_name in ("linear_fc1", "linear_fc2")


def unsupported_reason(facts: AdapterFacts, config: Any, state: RunState) -> str | None:
    """The first rule that keeps this adapter on the gather path, or None (those the design
    excludes — experts, row-parallel and other bases — are :func:`~regather.core.decision.expected`)."""
    why = moment_reason(state, IN_CHECKPOINT)
    if why is not None:
        return why
    if facts.is_expert:
        return EXPERT_REASON
    if facts.explicit_comm:
        return expected(f"base layer {facts.base_name!r} leaves its TP communication to its caller "
                        "(explicit_expert_comm / parallel_mode=None: a MoE shared expert with overlap)")
    if not facts.column_parallel:
        return expected(f"base layer {facts.base_name!r} is row-parallel (its input is split over hidden, "
                        "not sequence)")
    if not facts.sequence_parallel:
        return f"sequence parallelism is off for {facts.base_name!r}"
    if facts.tp_size <= 1:
        return f"tensor-parallel size is {facts.tp_size}"
    if facts.a2a_experts:
        return expected("adapter uses all-to-all expert communication (a2a_experts=True)")
    if facts.activation != "identity":
        return f"adapter activation is {facts.activation!r}, not 'identity'"
    if getattr(config, "cpu_offloading", False) and getattr(config, "cpu_offloading_activations", True):
        return CPU_OFFLOADING
    if getattr(config, "fine_grained_activation_offloading", False):
        return "fine-grained activation offloading is on"
    if facts.base_name not in ELIGIBLE_BASES:
        return expected(f"base layer {facts.base_name!r} is not one of {', '.join(ELIGIBLE_BASES)}")
    graphs = _cuda_graphs_on(config)
    if graphs:
        return graphs
    granularity = getattr(config, "recompute_granularity", None)
    if granularity == "full":
        return "full activation recompute is on (recompute_granularity='full')"
    modules = getattr(config, "recompute_modules", None) or []
    if granularity == "selective" and facts.base_name == "linear_fc1" and "mlp" in modules:
        return f"selective recompute covers 'mlp' (recompute_modules={list(modules)})"
    return None
