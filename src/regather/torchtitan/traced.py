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
gather; any row-parallel    torchtitan's own ``lora_a``: the same graph as torchtitan's
base; eval / no_grad        compiled LoRA
regather (column base)      :func:`regather.core.strategies.traced.traced_regather`: the
                            shard is this rank's block of the gathered input, saved; the
                            backward gathers it with functional collectives
lowrank                     the gather path, with the reason (not traced yet)
``recompute_adapter_inputs`` the partitioner decides what is saved: the input is kept
=========================== ============================================================

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

#: torchtitan's activations are ``[b, s, h]``: the sequence dim of a gathered column input
SEQ_DIM = 1


def traced_decision(adapter, training: bool, grad_enabled: bool) -> Decision:
    """What ``adapter`` runs in a traced forward in that mode (pure: placements and options)."""
    options = adapter.options
    asked = options.strategy
    recompute = options.recompute_adapter_inputs

    def gather(reason=None) -> Decision:
        keeps = reason if reason is not None else reasons.RECOMPUTE_TRACED
        return Decision(asked, Strategy.GATHER, reason if asked != Strategy.GATHER else None,
                        recompute_reason=keeps if recompute and training and grad_enabled else None)

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
    if asked == Strategy.GATHER:
        return gather()
    return Decision(asked, asked, None, recompute_reason=reasons.RECOMPUTE_TRACED if recompute else None)


def traced_lora_a(adapter, x: torch.Tensor) -> torch.Tensor:
    """LoRA-A of ``adapter`` on ``x`` in a traced forward."""
    decision = traced_decision(adapter, adapter.training, torch.is_grad_enabled())
    adapter.traced = True
    if decision.used != Strategy.REGATHER or not isinstance(x, DTensor):
        return adapter.lora_a(x)  # torchtitan's own LoRA-A
    weight = adapter.lora_a.weight
    mesh = weight.device_mesh
    a_local = weight.to_local(grad_placements=[Partial()])
    x_local = x.to_local(grad_placements=[Partial()])
    mid = traced_regather(x_local, a_local, mesh.get_group(), SEQ_DIM, mesh.get_local_rank(), mesh.size())
    return DTensor.from_local(mid, mesh, [Replicate()], run_check=False, shape=mid.shape, stride=mid.stride(),
                              grad_placements=[Partial()])
