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
regather, column-parallel   :func:`regather.core.strategies.traced.traced_regather`: the
                            LoRA-A GEMM on the gathered input, this rank's sequence block
                            saved, gathered again in backward (functional collectives)
lowrank, other layouts      torchtitan's own ``lora_a``: the same graph as torchtitan's
                            compiled LoRA; lowrank says why (below)
``recompute_adapter_inputs`` the partitioner decides what is saved: no producer rebuilds it
=========================== ============================================================

The traced regather keeps the shard under AOT autograd because its backward gather reads the
output gradient (:func:`regather.core.strategies.traced.after`); without that edge the
partitioner ran the backward's gather in the forward and saved the gathered input.

The sequence block is cut from the local gathered input (``[b, s, h]``, dim ``s``): the same on
every rank of the TP group, so the backward gather rebuilds it whichever dim SP sharded. A
length not divisible by the group runs the gather path, with the reason.

No early re-gather and no shared backward gather under compile (an output-gradient hook, a
shared gather and a deferred ``dA`` are eager bookkeeping): where the backward gather runs
relative to the neighbouring GEMMs is the compiler's choice.

Activation checkpointing under compile is not considered here: torchtitan's own compiled blocks
fail with it on CPU (docs/torchtitan.md), so it was not run.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from regather.core.decision import Decision
from regather.core.strategies import Strategy
from regather.core.strategies.traced import traced_regather
from regather.torchtitan import reasons
from regather.torchtitan.layout import COLUMN, base_layout


def traced_decision(adapter, training: bool, grad_enabled: bool) -> Decision:
    """What ``adapter`` runs in a traced forward in that mode (pure: placements and options)."""
    options = adapter.options
    asked = options.strategy
    recompute = options.recompute_adapter_inputs

    keeps = reasons.RECOMPUTE_TRACED if recompute and training and grad_enabled else None

    def gather(reason=None) -> Decision:
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
        if adapter.traced_input_reason is not None:  # what the traced forward found in its input
            return gather(adapter.traced_input_reason)
        return Decision(asked, Strategy.REGATHER, None, recompute_reason=keeps)
    return gather()


def traced_lora_a(adapter, x: torch.Tensor) -> torch.Tensor:
    """LoRA-A of ``adapter`` on ``x`` in a traced forward."""
    adapter.traced = True  # decisions() reports traced_decision from now on
    if traced_decision(adapter, adapter.training, torch.is_grad_enabled()).used != Strategy.REGATHER:
        return adapter.lora_a(x)  # torchtitan's own LoRA-A
    weight = adapter.lora_a.weight
    mesh = weight.device_mesh
    world, seq_dim = mesh.size(), x.ndim - 2
    if not isinstance(x, DTensor) or tuple(x.placements) != (Replicate(),):
        adapter.traced_input_reason = reasons.NOT_GATHERED_TRACED  # decided again, with the reason
        return adapter.lora_a(x)
    if x.shape[seq_dim] % world:
        adapter.traced_input_reason = reasons.INDIVISIBLE_TRACED.format(length=x.shape[seq_dim], world=world)
        return adapter.lora_a(x)
    x_full = x.to_local(grad_placements=[Partial()])  # as the gather path: dX TP-partial
    a_local = weight.to_local(grad_placements=[Partial()])
    mid = traced_regather(x_full, a_local, mesh.get_group(), seq_dim, mesh.get_local_rank(), world)
    return DTensor.from_local(mid, mesh, [Replicate()], run_check=False, shape=mid.shape, stride=mid.stride(),
                              grad_placements=[Partial()])
