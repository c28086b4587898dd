"""A torchtitan adapter inside ``torch.compile`` (torchtitan's ``apply_compile``: each block,
``fullgraph=True``): what it runs and how it says so, with nothing Dynamo cannot trace.

The eager forward pairs its input with the gather recorded for it, checks the moment with
autograd-engine calls and the checkpoint's saved-tensor hooks, and rebuilds inputs from their
producers by storage identity — bookkeeping that breaks a traced graph. A traced forward decides
from what Dynamo guards on instead (the module's ``training``, grad mode, the weights'
placements, the options), a pure function (:func:`traced_decision`) that ``decisions()`` can
evaluate again outside the graph:

=========================== ============================================================
asked                       traced forward
=========================== ============================================================
any strategy, any layout    torchtitan's own ``lora_a``: the same graph as torchtitan's
                            compiled LoRA; regather and lowrank say why (below)
``recompute_adapter_inputs`` the partitioner decides what is saved: the input is kept
=========================== ============================================================

Why regather runs the gather path when traced: a traced regather (one autograd Function saving
the shard, its backward gathering it with functional collectives) compiled and ran, but AOT
autograd's partitioner kept the gathered input anyway and the cut shards beside it — measured
with inductor, +2,128 KiB over the frozen model against torchtitan's +1,872 (docs/torchtitan.md).
A path that costs more than the one it replaces does not run; the reason says so.

Activation checkpointing under compile is not considered here: torchtitan's own compiled blocks
fail with it on CPU (docs/torchtitan.md), so it was not run.
"""

from __future__ import annotations

import torch

from regather.core.decision import Decision
from regather.core.strategies import Strategy
from regather.torchtitan import reasons
from regather.torchtitan.layout import COLUMN, base_layout


def traced_decision(adapter, training: bool, grad_enabled: bool) -> Decision:
    """What ``adapter`` runs in a traced forward in that mode (pure: placements and options)."""
    options = adapter.options
    asked = options.strategy
    recompute = options.recompute_adapter_inputs

    def gather(reason=None) -> Decision:
        keeps = reasons.RECOMPUTE_TRACED if recompute and training and grad_enabled else None
        return Decision(asked, Strategy.GATHER, reason if asked != Strategy.GATHER else None, recompute_reason=keeps)

    if not training:
        return gather(reasons.EVAL)
    if not grad_enabled:
        return gather(reasons.NO_GRAD)
    if not adapter.lora_a.weight.requires_grad:
        return gather(reasons.FROZEN_A)
    layout, why = base_layout(adapter.weight, adapter.lora_a.weight)
    if layout is None:
        return gather(why)
    if layout != COLUMN:
        return gather(reasons.ROW)
    if asked == Strategy.LOWRANK:
        return gather(reasons.LOWRANK_TRACED)
    if asked == Strategy.REGATHER:
        return gather(reasons.REGATHER_TRACED)
    return gather()


def traced_lora_a(adapter, x: torch.Tensor) -> torch.Tensor:
    """LoRA-A of ``adapter`` on ``x`` in a traced forward."""
    adapter.traced = True  # decisions() reports traced_decision from now on
    return adapter.lora_a(x)  # torchtitan's own LoRA-A
