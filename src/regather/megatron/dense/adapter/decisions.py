"""What an adapter does on a forward, and why: its strategy, its LoRA-A path, and whether its
input is rebuilt. The decision half of the adapter: everything it reads from the module is named
by :class:`~regather.megatron.dense.adapter.contract.AdapterModule`; it calls nothing of the
forward half.

Every forward re-evaluates :func:`regather.megatron.dense.eligibility.unsupported_reason`
(a mode change — ``eval()``, ``no_grad``, activation recompute — takes effect at once): when the
requested strategy cannot run, the gather path runs with unchanged numerics. With
``recompute_adapter_inputs`` it then asks the adapter's producer whether the input can be
rebuilt from what the producer keeps (:mod:`regather.megatron.dense.producers`); the first
rebuild of each adapter is compared with the forward's input bit for bit, and a producer that
fails is switched off for that adapter. Each outcome is a :class:`~regather.core.decision.Decision`;
the first reason of each kind is reported to the model's fallback log
(:mod:`regather.core.fallback_log`: one line per reason and model).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from regather.core import fallback_log
from regather.core.decision import Decision, level_of, surprising, with_detail
from regather.core.plan import Plan
from regather.core.recompute.graph import reason_now
from regather.core.recompute.sources import KEEP, Kept, Recomputed
from regather.core.recompute.verify import first_rebuild
from regather.core.strategies import Strategy
from regather.core.strategies.paths import DISPATCHED, LoraAPath, lookup
from regather.megatron.dense.eligibility import RunState, checkpointed_by_config, run_state, unsupported_reason
from regather.megatron.reasons import EXPERT_INPUT_KEPT, IN_CHECKPOINT, kept_as_is

# A fallback is a WARNING unless its reason says INFO (regather.core.decision.expected: the
# moment, or what the design excludes); a kept input is INFO unless its reason says WARNING
# (a rebuild that differs from the input).
NOT_REPRODUCED = "does not reproduce the adapter input bit for bit; the input is kept"


class AdapterDecisions:
    """The decision half of :class:`~regather.megatron.dense.adapter.ParallelLinearAdapter`."""

    def init_decisions(self, recompute_inputs: bool) -> None:
        """The decision state of a new adapter (called by its constructor)."""
        # LoRA(recompute_adapter_inputs=True): save what the input's producer keeps; the producer
        # is attached by regather.LoRA from the model
        self.recompute_inputs = bool(recompute_inputs)
        self.producer = None
        self.producer_reason: str | None = "no producer attached (the adapter was built outside regather.LoRA)"
        self.fallback_log = None  # the model's fallback_log.FallbackLog, attached by regather.LoRA
        self.last_decision: Decision | None = None
        self._recompute_verified = False
        self._last_capture_reason: str | None = None  # why the last forward kept its input, if it did
        self._logged_recompute = False
        self._logged = False
        self._logged_lean: set[str] = set()

    def reset_fallback_log(self) -> None:
        """Report the next fallback again (after a strategy switch)."""
        self._logged = False

    @property
    def log_name(self) -> str:
        """The adapter's name in decisions and log lines (its path in the model once wrapped)."""
        return getattr(self, "qualified_name", self.facts.base_name)

    def decide(self, learned: bool = False) -> Decision:
        """The strategy this adapter would use if called now, and why (the recompute part as far
        as it is known before a forward: each forward also checks its producer, see ``last_decision``).

        ``learned``: where the last forward found the input could not be rebuilt (a check only a
        forward can make — a norm that keeps nothing because its input needs no gradient, layer 0
        under frozen embeddings), say so, marked "in the last forward" (what ``regather.decisions``
        reports; a forward itself always asks its producer again)."""
        state = run_state(self, self.linear_in.weight)
        if self.strategy == Strategy.GATHER:
            decision = Decision(Strategy.GATHER, Strategy.GATHER, None)
        else:
            reason = unsupported_reason(self.facts, self.config, state)
            decision = Decision(self.strategy, Strategy.GATHER if reason else self.strategy, reason)
        if not self.recompute_inputs or not (state.training and state.grad_enabled):
            return decision  # nothing is saved for backward in eval / no_grad
        why = self._recompute_unsupported(decision, state)
        if why is not None:
            return replace(decision, recompute_reason=why)
        if learned and self._last_capture_reason is not None:
            return replace(decision, recompute_reason=with_detail(self._last_capture_reason, "in the last forward"))
        return replace(decision, recompute=self.producer.name)

    def path_for(self, used: Strategy, shared: bool = False, gathered: bool = False, source=None) -> LoraAPath:
        """The LoRA-A path of a forward that uses ``used`` on this adapter's layout (the arguments
        of :func:`regather.core.strategies.paths.lookup` the module does not know itself)."""
        return lookup(used, column=self.column_parallel, sequence_parallel=self.sequence_parallel, shared=shared,
                      gathered=gathered, explicit_comm=self.dispatched, source=source)

    def _recompute_unsupported(self, decision: Decision, state: RunState) -> str | None:
        path = self.path_for(decision.used)
        if path is DISPATCHED and (self.producer is None or not self.facts.is_expert):
            # expert fc1: from the router's input (regather.megatron.moe.inputs), when a producer was found
            return (self.producer_reason if self.facts.is_expert else None) or EXPERT_INPUT_KEPT
        if not path.recomputes and path is not DISPATCHED:
            return kept_as_is(path.name)
        if state.in_recompute:
            return IN_CHECKPOINT
        if self.dropout is not None and self.dropout_position == "pre":
            return "dropout is applied to the adapter input (dropout_position='pre')"
        if self.producer is None:
            return self.producer_reason
        if checkpointed_by_config(self.config, self.facts.base_name, expert=self.facts.is_expert):
            # every forward of this adapter will run inside megatron's activation checkpoint: say
            # now what each of them will say (decisions() before a forward must not promise more)
            return IN_CHECKPOINT
        return reason_now(self.producer)

    def with_input(self, plan: Plan, x: torch.Tensor, shared: bool = False, gathered: bool = False) -> Plan:
        """``plan`` completed with what only this forward's LoRA-A input can tell: where ``dA``'s
        input comes from (kept, or this forward's producer, checked), the decision's outcome and
        the path that runs. The input exists only here: under Transformer Engine it is the
        LayerNorm output the base returns (:mod:`regather.megatron.dense.te`)."""
        decision, source = plan.decision, KEEP
        if decision.recompute is not None:
            captured = self.producer.capture(x)
            self._last_capture_reason = captured.reason if isinstance(captured, Kept) else None
            if isinstance(captured, Recomputed) and not self._recompute_verified:
                captured = self._verify_recompute(x, captured)
            if isinstance(captured, Kept):
                decision = self.last_decision = replace(decision, recompute=None, recompute_reason=captured.reason)
            else:
                source = captured  # Recomputed, or a ready source (expert inputs, verified per MoE layer)
        self._log_recompute(decision)
        path = self.path_for(decision.used, shared=shared, gathered=gathered, source=source)
        return replace(plan, decision=decision, source=source, path=path)

    def _verify_recompute(self, x: torch.Tensor, captured: Recomputed) -> Kept | Recomputed:
        """First recompute of this adapter: bit-identical to the forward's input, or switched off."""
        diff = first_rebuild(self.producer, captured.tensors, x)
        if diff is None:
            self._recompute_verified = True
            return captured
        # the sentence names the producer only: the measured difference is the reason's detail
        self.producer_reason = surprising(f"recomputing {self.producer.name} {NOT_REPRODUCED}", detail=diff)
        self.producer = None
        return Kept(self.producer_reason)

    def _log_recompute(self, decision: Decision) -> None:
        if self._logged_recompute or decision.recompute_reason is None:
            return
        self._logged_recompute = True
        fallback_log.report(self.fallback_log, "recompute_adapter_inputs requested, keeping the input",
                            decision.recompute_reason, self.log_name, level_of(decision.recompute_reason, logging.INFO))

    def log_lean_fallback(self, reason: str) -> None:
        """Report, once per adapter and reason, that a lean adapter ran the classic output (``reason``)."""
        if str(reason) in self._logged_lean:
            return
        self._logged_lean.add(str(reason))
        fallback_log.report(self.fallback_log, "lean_transients requested, using the classic output", reason,
                            self.log_name, level_of(reason))

    def log_fallback(self, decision: Decision) -> None:
        """Report the first fallback of this adapter to the model's log."""
        if self._logged or decision.reason is None:
            return
        self._logged = True
        fallback_log.report(self.fallback_log, f"{decision.requested.value} requested, using the gather path",
                            decision.reason, self.log_name, level_of(decision.reason))
