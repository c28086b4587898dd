"""torchtitan's ``LoRALinear`` with LoRA-A run through regather's paths.

A regather adapter *is* torchtitan's LoRA class for its base (:func:`.compat.titan_lora_class`: the same
``__init__``, children ``lora_a`` / ``lora_b``, initialisation, TP placements and parameter names)
with one method more: LoRA-A. Its forward is torchtitan's::

    out = base(x) + (alpha / rank) * lora_b(LoRA-A(x))

and LoRA-A, decided on every forward (:class:`~regather.core.decision.Decision`):

============ ========================================== ========================================
path         computes                                   saves for ``dA`` / sends
============ ========================================== ========================================
gather       ``lora_a(x)``: torchtitan's own module     the gathered ``x [b, s, h]`` (torchtitan)
regather     ``mid = x_full A^T`` on the gathered input ``x_shard [b, s/t, h]`` (or what its norm
             the base reads; ``dX_full`` (TP-partial)   keeps); backward all-gathers it again
             joins the base's and is reduce-scattered   (early: started by the output gradient,
             once by the site's redistribution          shared by the adapters on one shard,
                                                        ``dA`` after the site's dgrad)
lowrank      ``mid = all_gather_s(x_shard A^T)``        ``x_shard``; backward reduce-scatters
             (``A`` is TP-replicated already)           ``dmid`` (rank-r wide)
row          ``x A^T`` on the ``Shard(-1)`` input:      with ``recompute_adapter_inputs``: the
             torchtitan's own module, or, when the      SwiGLU operands (``w2``); DTensor's own
             input is rebuilt, its op                   backward on the rebuilt input
                                                        (:mod:`.rebuilt`)
============ ========================================== ========================================

Two forwards skip the per-forward decision: a gather adapter without ``recompute_adapter_inputs``
(always torchtitan's ``lora_a``: ``GATHER_ONLY``), and a traced one under ``torch.compile``
(:mod:`.traced`: decided from what Dynamo guards on). Under torchtitan's ``SelectiveAC`` the LoRA
branch runs unseen by the op policy (:func:`.compat.unseen_by_selective_checkpoint`), so the
frozen model's cached matmuls stay what they were and LoRA's are recomputed.

The column paths are :mod:`regather.core.strategies` Functions on plain local tensors; the
adapter enters and leaves them through its backend's boundary (:mod:`.tp`: on DTensors
``to_local(grad_placements=...)`` / ``DTensor.from_local(..., grad_placements=...)`` with the
placements torchtitan's own column ``lora_a`` produces and receives — output ``Replicate``, its
gradient and ``dA`` ``Partial`` —; under ``spmd_types`` the plain tensors themselves), so no
reduction moves. LoRA-B, the scale and the add are torchtitan's ops.

**One forward, planned then executed** (as the Megatron adapter): :meth:`LoRAAdapter.plan` decides
from what is known without the input — the moment, the layout (:func:`.layout.layout_of`: DTensor
placements or the ``spmd_types`` configs), the strategy, the gather site —;
:meth:`LoRAAdapter.with_input` completes the plan with what only the input tells — the gather it
came from (:meth:`.pairing.GatherSite.find`, whatever the backend) and, with
``recompute_adapter_inputs``, its producer (:mod:`.producers`) —; the forward then runs the plan
and decides nothing. A backend is one more way for the layout and the site to answer, not another
branch through the forward.

**Where lowrank's partial dA is reduced.** ``dA = dmid_localᵀ x_shard`` sums over this rank's
sequence rows only: it is returned as a ``Partial`` gradient — the placement torchtitan's own
LoRA-A gradient already has (its ``dmid`` is TP-partial) — and stays ``Partial`` in ``.grad``.
torchtitan reduces it where it reduces its own: each consumer redistributes a ``Replicate`` copy
(``clip_grad_norm_``'s norm, the optimizer step), once per use, never twice into ``.grad``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from regather.core import accounting, fallback_log
from regather.core.buffers import default_pool
from regather.core.decision import Decision, Reason, expected, level_of
from regather.core.plan import Plan
from regather.core.recompute.sources import Kept, Recomputed
from regather.core.recompute.verify import first_rebuild
from regather.core.strategies import Strategy
from regather.core.strategies.paths import PathArgs, lookup
from regather.core.strategies.regather import RegatherSlot
from regather.core.strategies.shared_gather import SharedGather
from regather.torchtitan import compat, reasons
from regather.torchtitan.layout import COLUMN, ROW, data_of, layout_of
from regather.torchtitan.options import Options
from regather.torchtitan.pairing import Gathered
from regather.torchtitan.producers import SWIGLU, already_saved_by
from regather.torchtitan.rebuilt import rebuilt_row_lora_a
from regather.torchtitan.runstate import moment_reason, saves_for_backward
from regather.torchtitan.traced import traced_decision, traced_lora_a

#: what a gather adapter without recompute_adapter_inputs decides in every forward
GATHER_ONLY = Decision(Strategy.GATHER, Strategy.GATHER, None)


class LoRAAdapter:
    """The regather half of a LoRA linear (mixed into torchtitan's LoRA class, or into
    ``nn.Linear`` by :func:`regather.torchtitan.hand.apply_lora`). Attached by
    :func:`regather.torchtitan.model.attach`: ``site`` (where its gathered input is recorded),
    ``norms`` (recompute producers), ``log_name`` and the model's ``fallback_log``."""

    regather_base_forward = None  # the base linear's forward (set by the class factory)

    def init_regather(self, options: Options) -> None:
        self.options = options
        self.attached = False
        self.site = None
        self.norms: list = []
        self.log_name = type(self).__name__
        self.fallback_log = None
        self.last_decision: Decision | None = None
        self._verified: set = set()
        self._logged: set = set()
        self._slot = None
        self.traced = False  # set by a traced forward (regather.torchtitan.traced)
        self.traced_input_reason = None  # why a traced forward found its input unfit for regather
        self.checkpointed = False  # an activation-checkpoint wrapper holds it (regather.torchtitan.model)
        self.ticket = None  # its input's rebuild under torch.compile (set when attached, with recompute)

    # -- decisions -------------------------------------------------------------------------
    def wants_anchor(self) -> bool:
        """This forward will regather early if it can (asked by the gather site; never traced:
        the anchor and the shared gather are eager bookkeeping, :mod:`.traced`)."""
        if not (self.options.strategy == Strategy.REGATHER and self.options.early_regather
                and not torch.compiler.is_compiling() and saves_for_backward(self)):
            return False
        layout, _ = layout_of(self)
        return layout is not None and layout.kind == COLUMN

    def decide(self) -> Decision:
        """What this adapter would do if called now, as far as is known without its input (its
        pairing with a gather and its producers are checked by each forward: ``last_decision``);
        once it ran traced (``torch.compile``), what its traced forward runs."""
        if self.traced:
            return traced_decision(self, self.training, True)
        return self.plan().decision

    def _gather_plan(self, reason=None, layout=None, recompute_reason=None) -> Plan:
        """torchtitan's own LoRA-A, with why (``reason``) and why the input is kept."""
        asked = self.options.strategy
        decision = Decision(asked, Strategy.GATHER, reason if asked != Strategy.GATHER else None)
        if self.options.recompute_adapter_inputs and recompute_reason is not None:
            decision = replace(decision, recompute_reason=recompute_reason)
        return Plan(decision, layout=layout)

    def plan(self) -> Plan:
        """This forward's plan from what is known without its input: the moment, the layout, the
        strategy and the gather site. A column plan that may regather is completed by
        :meth:`with_input` (its gather and producers); a row plan asks its producer there."""
        asked = self.options.strategy
        why = moment_reason(self, self.lora_a.weight)
        if why is not None:  # nothing is saved in eval / no_grad: no recompute to speak of
            return self._gather_plan(why, recompute_reason=why if saves_for_backward(self) else None)
        layout, why = layout_of(self)
        if layout is None:
            return self._gather_plan(why, recompute_reason=why)
        if layout.kind == ROW:
            return self._gather_plan(reasons.ROW, layout)
        if asked == Strategy.GATHER:
            return self._gather_plan(layout=layout, recompute_reason=reasons.GATHER_KEEPS)
        if self.site is None:
            return self._gather_plan(reasons.NO_GATHER_SITE, layout, reasons.GATHER_KEEPS)
        return Plan(Decision(asked, asked, None), layout=layout)

    def with_input(self, plan: Plan, x: torch.Tensor) -> Plan:
        """``plan`` completed with what only the input ``x`` tells: the gather it came from (a
        column plan that regathers or goes low-rank: else torchtitan's path with the reason) and,
        with ``recompute_adapter_inputs``, where its saved input comes from."""
        layout, used = plan.layout, plan.decision.used
        if layout is None:
            return plan
        if layout.kind == ROW:
            if self.options.recompute_adapter_inputs:
                self._recompute_row(plan, x)
            return plan
        if used == Strategy.GATHER:
            return plan
        plan.gathered, why = self.site.find(x)
        if why is not None:
            return self._gather_plan(why, layout, reasons.GATHER_KEEPS)
        if self.options.recompute_adapter_inputs:
            self._recompute_shard(plan, plan.gathered.shard)
        return plan

    def _recompute_shard(self, plan: Plan, shard: torch.Tensor) -> None:
        norm = next((n for n in self.norms if n.produced(shard)), None)
        if norm is None:
            plan.decision = replace(plan.decision, recompute_reason=reasons.NO_NORM)
            return
        self._source(plan, norm.capture(shard), shard, reasons.NORM_NOT_REPRODUCED.format(name=norm.name))

    def _recompute_row(self, plan: Plan, x: torch.Tensor) -> None:
        captured = SWIGLU.capture(x)
        if isinstance(captured, Recomputed):
            self._source(plan, captured, x, reasons.SWIGLU_NOT_REPRODUCED)
            return
        node = already_saved_by(x)
        why = expected(reasons.ALREADY_SAVED.format(node=node)) if node else reasons.NOT_KEPT
        plan.decision = replace(plan.decision, recompute_reason=why)

    def _source(self, plan: Plan, captured: Kept | Recomputed, x: torch.Tensor, not_reproduced: str) -> None:
        """``plan.source`` from the producer when its capture holds (the first rebuild checked
        against ``x`` bit for bit), else the reason on the decision."""
        if isinstance(captured, Recomputed) and captured.producer.name not in self._verified:
            diff = first_rebuild(captured.producer, captured.tensors, data_of(x))
            if diff is None:
                self._verified.add(captured.producer.name)
            else:
                captured = Kept(Reason(not_reproduced, detail=diff))
        if isinstance(captured, Kept):
            plan.decision = replace(plan.decision, recompute_reason=captured.reason)
            return
        plan.source = captured
        plan.decision = replace(plan.decision, recompute=captured.producer.name)

    def _log(self, decision: Decision) -> None:
        for what, reason in ((f"{decision.requested.value} requested, using the gather path", decision.reason),
                             ("recompute_adapter_inputs requested, keeping the input", decision.recompute_reason)):
            if reason is None or (what, str(reason)) in self._logged:
                continue
            self._logged.add((what, str(reason)))
            fallback_log.report(self.fallback_log, what, reason, self.log_name, level_of(reason))

    # -- forward ---------------------------------------------------------------------------
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        base_out = type(self).regather_base_forward(self, input)
        with compat.unseen_by_selective_checkpoint():  # LoRA must not shift the op policy's matmul count
            lora_out = self.lora_b(self._lora_a(input))
        out = base_out + compat.lora_scaling(self) * lora_out
        slot, self._slot = self._slot, None
        if slot is not None and out.requires_grad:
            out.register_hook(slot.on_output_grad)  # early re-gather: start when dout arrives
        return out

    def _lora_a(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return traced_lora_a(self, x)
        label = f"{accounting.ADAPTER_INPUT}:{self.log_name.rsplit('.', 1)[-1]}"
        if self.options.strategy is Strategy.GATHER and not self.options.recompute_adapter_inputs:
            # the gather path decides nothing: the same decision in every moment and layout
            self.last_decision = GATHER_ONLY
            with accounting.label(label):
                return self.lora_a(x)
        plan = self.with_input(self.plan(), x)
        self.last_decision = plan.decision
        self._log(plan.decision)
        with accounting.label(label):
            return self._execute(x, plan)

    def _execute(self, x: torch.Tensor, plan: Plan) -> torch.Tensor:
        """Run ``plan`` (nothing is decided here)."""
        kind = plan.layout.kind if plan.layout is not None else None
        if kind == COLUMN and plan.decision.used != Strategy.GATHER:
            return self._column(x, plan)
        if kind == ROW and not isinstance(plan.source, Kept):
            return rebuilt_row_lora_a(x, self.lora_a.weight, plan.source)
        return self.lora_a(x)  # torchtitan's own LoRA-A, bit for bit

    def _column(self, x: torch.Tensor, plan: Plan) -> torch.Tensor:
        gathered, dim = plan.gathered, plan.gathered.dim
        tp = plan.layout.tp(x, gathered.group)
        a_local = tp.weight(self.lora_a.weight, Partial())  # dA sums this rank's rows: TP-partial
        lowrank = plan.decision.used == Strategy.LOWRANK
        slot = None if lowrank else self._early_slot(gathered, tp)
        args = PathArgs(group=gathered.group, fuse=False, pool=default_pool(), slot=slot, source=plan.source,
                        x_full=None if lowrank else tp.activation(x, Partial()), reduce_dA=False, seq_dim=dim)
        path = lookup(plan.decision.used, column=True, sequence_parallel=True, shared=not lowrank)
        if lowrank:  # the adapter reads the shard itself: its dX is complete, on the shard's placement
            shard = tp.activation(gathered.shard, Shard(dim))
        else:
            shard = data_of(gathered.shard)
        mid = path(shard, a_local, args)
        return tp.output(mid, Replicate(), Partial())

    def _early_slot(self, gathered: Gathered, tp) -> RegatherSlot | None:
        if gathered.anchor is None or self not in gathered.anchored:
            return None
        group = gathered.group
        if gathered.share is None:
            gathered.share = SharedGather.open(group, default_pool(), gathered.dim)
        gathered.share.join()
        slot = RegatherSlot(group, default_pool(), early=True, defer=True, share=gathered.share, seq_dim=gathered.dim)
        gathered.anchor.join(gathered.anchored.index(self), slot, tp.weight_grad(Partial()))
        self._slot = slot
        return slot


def regather_class(lora_cls: type, base_forward, namespace: dict | None = None) -> type:
    """A regather LoRA class over ``lora_cls`` (torchtitan's LoRA class for a base, or the base
    linear class itself for a linear adapted by hand), whose base forward is ``base_forward``;
    ``namespace`` adds members (a torchtitan ``Config``). Callers make one per base class."""
    name = f"Regather{lora_cls.__name__}"
    body = {"regather_base_forward": base_forward, "__qualname__": name, "__module__": __name__}
    return type(name, (LoRAAdapter, lora_cls), dict(body, **(namespace or {})))
