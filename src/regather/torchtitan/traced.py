"""A torchtitan adapter inside ``torch.compile`` (torchtitan's ``apply_compile``: each block,
``fullgraph=True``): what it runs and how it says so, with nothing Dynamo cannot trace.

The eager forward checks the moment with autograd-engine calls and the checkpoint's saved-tensor
hooks, and rebuilds inputs from their producers by storage identity — bookkeeping that breaks a
traced graph. A traced forward decides from what Dynamo guards on instead (the module's
``training``, grad mode, the weights' placements, the options) and from the gather recorded for
its input while tracing (:meth:`.pairing.GatherSite.find_traced`, by identity, which Dynamo
resolves), a pure function (:func:`traced_decision`) that ``decisions()`` evaluates again
outside the graph:

=============================== ===============================================================
asked                           traced forward (:mod:`regather.core.strategies.traced`)
=============================== ===============================================================
regather, column-parallel       the LoRA-A GEMM on the gathered input; the shard the gather was
                                made from saved, gathered again in backward (functional
                                collectives)
lowrank, column-parallel        the rank-r GEMM on the shard, its output all-gathered; ``dmid``
                                reduce-scattered in backward
``recompute_adapter_inputs``    each saved input (the shard; ``w2``'s input) is read back under
                                the adapter's ticket, and regather's joint-graph pass lets the
                                partitioner rebuild it from what the backward reads anyway
                                (:mod:`regather.core.recompute.compiled`)
anything else                   torchtitan's own ``lora_a``: the graph of its compiled LoRA
=============================== ===============================================================

The shard is the DTensor the site's redistribution gathered (``Shard(d) -> Replicate``), so the
backward gather rebuilds the base's input whichever dim SP sharded; a length not divisible by
the group runs the gather path, with the reason.

No early re-gather and no shared backward gather under compile (an output-gradient hook, a
shared gather and a deferred ``dA`` are eager bookkeeping): where the backward gather runs
relative to the neighbouring GEMMs is Inductor's choice.

Inside activation checkpointing (torchtitan's SelectiveAC / FullAC wrapper around a compiled
block) a traced forward cannot see the checkpoint's hooks; the adapter is told it is wrapped
(:func:`regather.torchtitan.model.note_checkpoints`) and runs torchtitan's own ``lora_a``, as in
eager: the checkpointed block keeps no adapter input anyway, and a regather path there would
only add a backward gather to the recomputed forward's.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from regather.core.decision import Decision
from regather.core.recompute import compiled
from regather.core.strategies import Strategy
from regather.core.strategies.traced import traced_linear_a, traced_lowrank, traced_regather
from regather.torchtitan import reasons
from regather.torchtitan.layout import ROW, layout_of


def _rebuilds(adapter) -> bool:
    return adapter.options.recompute_adapter_inputs and getattr(adapter, "ticket", None) is not None


def _with_outcome(decision: Decision, adapter) -> Decision:
    """``decision`` with what the joint-graph pass did with ``adapter``'s input."""
    found = compiled.outcome(adapter.ticket)
    if found is None:
        return replace(decision, recompute_reason=reasons.NOT_COMPILED_HERE)
    if isinstance(found, str):
        return replace(decision, recompute_reason=reasons.KEPT_TRACED.format(why=found))
    return replace(decision, recompute=reasons.REBUILT_TRACED.format(nodes=found), recompute_reason=None)


def traced_decision(adapter, training: bool, grad_enabled: bool) -> Decision:
    """What ``adapter`` runs in a traced forward in that mode (pure: placements, options and what
    its traced forward and the joint-graph pass found)."""
    options = adapter.options
    asked = options.strategy

    def gather(reason=None, keeps=None) -> Decision:
        decision = Decision(asked, Strategy.GATHER, reason if asked != Strategy.GATHER else None)
        return replace(decision, recompute_reason=keeps) if options.recompute_adapter_inputs else decision

    if not training:  # nothing is saved: no recompute to speak of (as in eager)
        return gather(reasons.EVAL)
    if not grad_enabled:
        return gather(reasons.NO_GRAD)
    if not adapter.lora_a.weight.requires_grad:
        return gather(reasons.FROZEN_A, reasons.FROZEN_A)
    if adapter.checkpointed:  # as in eager: the checkpointed block keeps no adapter input anyway
        return gather(reasons.IN_CHECKPOINT, reasons.IN_CHECKPOINT)
    layout, why = layout_of(adapter)
    if layout is None:
        return gather(why, why)
    if layout.kind == ROW:
        return _with_outcome(gather(reasons.ROW), adapter) if _rebuilds(adapter) else gather(reasons.ROW)
    if asked == Strategy.GATHER:
        return gather(keeps=reasons.GATHER_KEEPS)
    if adapter.traced_input_reason is not None:  # what the traced forward found in its input
        return gather(adapter.traced_input_reason, reasons.GATHER_KEEPS)
    decision = Decision(asked, asked, None)
    return _with_outcome(decision, adapter) if _rebuilds(adapter) else decision


def traced_lora_a(adapter, x: torch.Tensor) -> torch.Tensor:
    """LoRA-A of ``adapter`` on ``x`` in a traced forward."""
    adapter.traced = True  # decisions() reports traced_decision from now on
    decision = traced_decision(adapter, adapter.training, torch.is_grad_enabled())
    weight = adapter.lora_a.weight
    ticket = adapter.ticket if _rebuilds(adapter) else compiled.NO_TICKET
    if decision.used == Strategy.GATHER:
        layout = layout_of(adapter)[0]
        if ticket == compiled.NO_TICKET or layout is None or layout.kind != ROW:
            return adapter.lora_a(x)  # torchtitan's own LoRA-A
        return _row(x, weight, layout.tp(x), ticket)
    gathered = adapter.site.find_traced(x) if adapter.site is not None else None
    if gathered is None:
        adapter.traced_input_reason = reasons.NOT_GATHERED_TRACED  # decided again, with the reason
        return adapter.lora_a(x)
    dim, group = gathered.dim, gathered.group
    world = group.size()
    if x.shape[dim] % world:
        adapter.traced_input_reason = reasons.INDIVISIBLE_TRACED.format(length=x.shape[dim], world=world)
        return adapter.lora_a(x)
    tp = layout_of(adapter)[0].tp(x, group)
    a_local = tp.weight(weight, Partial())  # dA sums this rank's rows: TP-partial
    if decision.used == Strategy.LOWRANK:  # the adapter reads the shard itself: its dX is complete, Shard(dim)
        shard = tp.activation(gathered.shard, Shard(dim))
        mid = traced_lowrank(shard, a_local, group, dim, ticket)
    else:
        x_full = tp.activation(x, Partial())  # as the gather path: dX TP-partial
        shard = gathered.shard.to_local() if isinstance(gathered.shard, DTensor) else gathered.shard
        mid = traced_regather(x_full, shard, a_local, group, dim, world, ticket)
    return tp.output(mid, Replicate(), Partial())


def _row(x: torch.Tensor, weight: torch.Tensor, tp, ticket: int) -> torch.Tensor:
    """A row-parallel LoRA-A (``x`` ``Shard(-1)``, ``A`` ``Shard(1)``): the local GEMM torchtitan's
    op runs, its output ``Partial``; the gradient taken ``Replicate`` (as it arrives under
    sequence parallelism, the block's output reduce-scattered)."""
    x_local = tp.activation(x, Shard(x.ndim - 1))
    mid = traced_linear_a(x_local, tp.weight(weight, Shard(1)), ticket)
    return tp.output(mid, Partial(), Replicate())
