"""What the two halves of :class:`~.module.ParallelLinearAdapter` read from each other.

The adapter is one ``nn.Module`` assembled from a decision half (:mod:`.decisions`: which strategy,
which path, where ``dA``'s input comes from, the fallback log) and a forward half (:mod:`.forward`:
plan, then execute). Neither reads an attribute the other defines except through these
contracts, which ``tests/unit/megatron/test_adapter_contract.py`` checks against the source:

- :class:`AdapterModule` — what the module itself holds (:mod:`.module`'s constructor and
  layout): both halves read it;
- :class:`AdapterDecider` — what the forward asks of the decision half: it decides, logs, and
  completes a plan with the forward's input; the decision half calls nothing of the forward.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from regather.core.decision import Decision
from regather.core.plan import Plan
from regather.core.strategies import Strategy
from regather.megatron.dense.eligibility import AdapterFacts


@runtime_checkable
class AdapterModule(Protocol):
    """The module's facts and weights (set by its constructor, changed only by a strategy switch)."""

    facts: AdapterFacts
    config: Any  # megatron's TransformerConfig (or None)
    training: bool
    strategy: Strategy
    early_regather: bool
    linear_in: torch.nn.Module  # called for LoRA-A's weight (DDP's param-gather pre-hooks run)
    linear_out: torch.nn.Module
    column_parallel: bool
    sequence_parallel: bool
    dispatched: bool  # the base's caller does its TP communication (experts, shared experts with overlap)
    replicated_a: bool  # lowrank's LoRA-A layout [r, h]
    lowrank_reduce_in_backward: bool
    tp_group: Any
    tp_size: int
    tp_rank: int
    pool: Any
    gradient_accumulation_fusion: bool
    dropout: torch.nn.Module | None
    dropout_position: str
    activation_fn: Any
    scale: float
    lean_transients: bool | None  # None: lean for every strategy but gather (regather.core.peak)


@runtime_checkable
class AdapterDecider(AdapterModule, Protocol):
    """What the forward half asks of the decision half."""

    last_decision: Decision | None

    def decide(self, learned: bool = False) -> Decision: ...

    def log_lean_fallback(self, reason: str) -> None: ...

    def log_fallback(self, decision: Decision) -> None: ...

    def with_input(self, plan: Plan, x: torch.Tensor, shared: bool = False, gathered: bool = False) -> Plan: ...
