"""Expert ``linear_fc1`` inputs at zero new bytes: from the MoE layer input the router keeps.

An expert ``linear_fc1`` reads the dispatched tokens ``D(x)`` — the MoE layer's input
``x [T, h]`` routed to this rank's experts (:mod:`regather.megatron.moe.dispatch`): ``k`` rows per
token across the expert-parallel group, times the expert-TP size. With frozen experts no op of
the MoE layer keeps them (permute keeps indices, the frozen linears keep no input), so a LoRA-A
on expert fc1 keeps them for ``dA`` — most of what LoRA keeps in a MoE model. But the router
keeps ``x`` itself: its gating linear (``RouterGatingLinearFunction``) saves its input for
its own backward. Under ``LoRA(recompute_adapter_inputs=True)`` the expert fc1 adapters use it:

=================== ================================================ ===========================
LoRA-A              how                                              added (per MoE layer)
=================== ================================================ ===========================
one shared by the   ``x A^T`` on the local tokens, *before* the      dispatch: ``r`` more
local experts       dispatch; the rank-``r`` result is sent along    columns per routed row
(grouped experts,   the same route (``D(x) A^T = D(x A^T)``:         (``r/h`` of the tokens'
``share_expert_     ``D`` only moves rows). Backward returns         bytes, forward and
adapters=True``)    ``d(mid)`` along the reverse route and forms     backward); ``dA`` is a
                    ``dA = d(mid)^T x`` from the router's ``x``.     GEMM over ``T`` rows, not
                    :mod:`regather.core.strategies.predispatched`          ``k T``
one per expert      the router's ``x`` is sent along the forward's   one more dispatch of the
(``SequentialMLP``; route again in backward (started when the        tokens in backward;
``share_expert_     experts' output gradient arrives, so it          opt-in:
adapters=False``)   overlaps the experts' backward), once per layer  ``LoRA(redispatch_expert_
                    for all local experts; each adapter's ``dA``     inputs=True)``
                    reads its rows. Same GEMMs as keeping them:
                    bit-identical
=================== ================================================ ===========================

Either way the adapter saves the router's saved tensor (the same storage: zero new bytes,
counted by the saved-tensor accounting) and no h-wide tensor lives from forward to backward.
The shared-A route changes the order of two sums — ``dA`` over tokens instead of routed rows,
and ``dx`` once per token instead of per routed row — so it matches keeping the input within
fp32 rounding, not bit for bit (tests state the tolerance).

Checked on every forward before anything is used (as for every producer, :mod:`regather.megatron.dense.producers`):
the router's input is the MoE layer's input, unmodified; the router's autograd node saved a
tensor on that storage; the adapter input is the tensor the dispatcher handed the experts (a row
block of it for ``SequentialMLP``), unmodified. The first forward of each MoE layer also sends
``x`` along the route and compares it with the dispatched tokens bit for bit, and the ranks that
take part in the dispatch agree on the outcome (one all-reduce), so they all take the same path.
Kept, with the reason: the flex / DeepEP dispatchers, drop-and-pad, fp8 / fp4 padding,
``moe_apply_probs_on_input``, latent projections, router input jitter, offloading, activation
recompute of ``moe``, "pre" dropout, a router whose input needs no gradient (it keeps nothing).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from regather.core.decision import Reason
from regather.core.recompute.graph import Meta, global_hooks_reason, kept_between
from regather.core.recompute.sources import Kept, Recomputed
from regather.core.recompute.verify import mismatch
from regather.core.strategies.predispatched import PreDispatched
from regather.megatron import compat
from regather.megatron.moe import dispatch
from regather.megatron.reasons import (
    CPU_OFFLOADING,
    IN_CHECKPOINT,
    PREDISPATCH,
    REDISPATCH,
    REDISPATCH_OPT_IN,
    ROUTE_NOT_REPRODUCED,
)


def static_reason(moe: nn.Module) -> str | None:
    """Why no expert fc1 input of this MoE layer can come from the router's input (configuration
    alone), or None."""
    cfg, experts = moe.config, moe.experts
    granularity, modules = getattr(cfg, "recompute_granularity", None), getattr(cfg, "recompute_modules", None) or []
    if granularity == "full" or (granularity == "selective" and "moe" in modules):
        return IN_CHECKPOINT  # the adapters say so first (eligibility.checkpointed_by_config)
    if granularity == "selective" and "layernorm" in modules:
        return ("selective recompute covers 'layernorm': megatron frees the pre-MLP norm's output (the "
                "router's input) after forward and recomputes it in backward")
    why = dispatch.unsupported_reason(moe.token_dispatcher, cfg)
    if why:
        return why
    if getattr(cfg, "moe_apply_probs_on_input", False):
        return "moe_apply_probs_on_input=True: the experts scale their input by the probs before linear_fc1"
    if getattr(cfg, "fp8", None) or getattr(cfg, "fp4", None):
        return "fp8 / fp4 pad each expert's tokens before linear_fc1"
    if getattr(cfg, "moe_latent_size", None):
        return "moe_latent_size: the dispatched tokens are a latent projection of the router's input"
    if getattr(cfg, "moe_input_jitter_eps", None):
        return "moe_input_jitter_eps: the router keeps a jittered copy of its input"
    if getattr(experts, "offload_expert_fc1", False):
        return "the experts' fc1 input is offloaded (fine-grained activation offloading of 'expert_fc1')"
    if getattr(cfg, "cpu_offloading", False) and getattr(cfg, "cpu_offloading_activations", True):
        return CPU_OFFLOADING
    if compat.private(experts, compat.FUSED_GROUPED_MLP, False):
        return "TE's fused grouped MLP runs linear_fc1 inside one op"
    return None


def moe_layer_of(model: nn.Module, path: str) -> nn.Module | None:
    """The megatron ``MoELayer`` (running its own forward) whose experts hold the linear at ``path``."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = model.get_submodule(".".join(parts[:i]))
        if isinstance(module, MoELayer):
            return module if type(module).forward is MoELayer.forward else None
    return None


class MoEForward:
    """One forward of one MoE layer: its route, the router's kept input, the dispatched tokens;
    in backward, the re-dispatched tokens its per-expert adapters share."""

    #: What backward's re-dispatches are seen through: None, or an observer with ``started()``
    #: (a token, taken when a re-dispatch is sent) and ``wait(pending, token, counts)`` (returns
    #: ``pending.wait()``, adding what it measured to the layer's ``counts``). Set only by a
    #: measuring tool for the span it measures (``regather.tools.bench.clocks.redispatch_times``).
    observer = None

    def __init__(self, route, x_live: torch.Tensor, kept: torch.Tensor, dispatched: torch.Tensor,
                 counts: dict | None = None):
        self.route = route
        # the layer's re-dispatches by when they started (and what an observer measured of them)
        self.counts = counts if counts is not None else {}
        self.x_live = x_live  # the layer input [T, h] with its autograd history (shared A)
        self.kept = kept  # the router's saved tensor viewed as [T, h] (no history)
        self._dispatched = weakref.ref(dispatched)
        self._dispatched_version = dispatched._version
        self.n_dispatched = dispatched.shape[0]
        self.consumers = 0  # adapters that read re-dispatched rows in backward
        self._left = 0
        self._resend = None
        self._started = None  # the observer's token for the re-dispatch in flight
        self._rows: torch.Tensor | None = None

    def rows_of(self, x: torch.Tensor) -> slice | str:
        """The rows of the dispatched tokens that ``x`` is (all of them, or a ``SequentialMLP``
        expert's block), unmodified; else why not."""
        d = self._dispatched()
        if d is None:
            return "the dispatched tokens are gone before linear_fc1 ran"
        if d._version != self._dispatched_version:
            return "the dispatched tokens were modified in place before linear_fc1 read them"
        if x is d:
            return slice(0, d.shape[0])
        same = StorageWeakRef(x.untyped_storage()) == StorageWeakRef(d.untyped_storage())
        row = d.stride(0) if d.dim() == 2 else 0
        if not (same and x.dim() == 2 and d.dim() == 2 and x.shape[1] == d.shape[1] and x.stride() == d.stride()
                and row > 0 and (x.storage_offset() - d.storage_offset()) % row == 0):
            return "the adapter input is not the tokens the dispatcher handed the experts"
        start = (x.storage_offset() - d.storage_offset()) // row
        if start < 0 or start + x.shape[0] > d.shape[0]:
            return "the adapter input is not the tokens the dispatcher handed the experts"
        return slice(start, start + x.shape[0])  # (a view: it shares the version checked above)

    # -- backward: the re-dispatch, once per layer ---------------------------------------------
    def start(self, *_):
        """Send the router's input along the route again (the experts' output gradient arrived)."""
        if self._resend is None and self._rows is None and self.kept is not None and self.consumers:
            self._started = None if self.observer is None else self.observer.started()
            self._resend = self.route.start(self.kept)
            self._left = self.consumers
            self.counts["early"] = self.counts.get("early", 0) + 1

    def rows(self, kept: torch.Tensor, rows: slice) -> torch.Tensor:
        if self._rows is None:
            if self._resend is None:  # the experts' output gradient hook did not run (e.g. no consumer then)
                self._started = None if self.observer is None else self.observer.started()
                self._resend = self.route.start(kept)
                self._left = self.consumers
                self.counts["late"] = self.counts.get("late", 0) + 1
            pending, self._resend = self._resend, None
            self._rows = pending.wait() if self.observer is None else self.observer.wait(pending, self._started,
                                                                                          self.counts)
        out = self._rows[rows]
        self._left -= 1
        if self._left <= 0:  # every adapter of this forward has its rows: free the tokens
            self._rows, self.kept = None, None
        return out


class Redispatched:
    """A per-expert adapter's saved-input source: saves the router's kept tensor (zero new bytes),
    loads its rows of that tensor dispatched again (:class:`MoEForward`). Bit-identical to keeping
    the dispatched rows: the same values reach the same ``dA`` GEMM."""

    name = "redispatched"
    __slots__ = ("fwd", "kept", "rows_slice")

    def __init__(self, fwd: MoEForward, rows: slice, kept: torch.Tensor | None):
        self.fwd, self.rows_slice, self.kept = fwd, rows, kept

    def save(self, x: torch.Tensor) -> tuple:
        kept, self.kept = self.kept, None
        return (kept,)

    def load(self, saved) -> torch.Tensor:
        return self.fwd.rows(saved[0], self.rows_slice)

    def handle(self) -> Redispatched:
        return Redispatched(self.fwd, self.rows_slice, None)


class _RouterKept:
    """The producer of ``dA``'s input under the shared route: the router's saved tensor itself."""

    name = "the router's input"

    @staticmethod
    def recompute(kept: torch.Tensor) -> torch.Tensor:
        return kept


class ExpertInputs:
    """The hooks on one MoE layer that find, every forward, the router's kept input, the route
    and the dispatched tokens (see the module doc). One per ``MoELayer``, shared by its expert
    fc1 adapters' producers (:class:`ExpertInputProducer`)."""

    def __init__(self, moe: nn.Module):
        self.moe = moe
        self.verified: bool | None = None  # the first forward's route check (all ranks agree)
        self.verify_reason: str | None = None
        self.current: MoEForward | None = None
        self.reason: str | None = None  # why this forward has no MoEForward
        # re-dispatches in backward: "early" (started when the experts' output gradient arrived,
        # overlapping their backward) or "late" (started by the first adapter that needed them); under
        # the bench's clock also "wait_s" / "flight_s" (regather.tools.bench.clocks.redispatch_times)
        self.resends: dict = {}
        self._clear()
        moe.register_forward_pre_hook(self._layer_input, prepend=True)
        moe.router.register_forward_hook(self._routed, prepend=True)
        moe.experts.register_forward_pre_hook(self._dispatched, prepend=True)
        moe.experts.register_forward_hook(self._experts_done)

    def _clear(self):
        self._x, self._x_version, self._kept = None, None, None

    def static_reason(self) -> str | None:
        return global_hooks_reason() or static_reason(self.moe) or (
            self._route_failed() if self.verified is False else None)

    def _route_failed(self) -> Reason:
        """The route check's reason: one sentence for every layer and rank (logged once per model),
        what this rank measured as its detail."""
        return Reason(ROUTE_NOT_REPRODUCED, detail=self.verify_reason)

    # -- forward hooks ---------------------------------------------------------------------------
    def _layer_input(self, module, args):
        self._clear()
        self.current, self.reason = None, "the MoE layer did not run in this forward"
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and torch.is_grad_enabled() and module.training:
            self._x, self._x_version = weakref.ref(x), x._version

    def _routed(self, router, args, result):
        x = self._x() if self._x is not None else None
        self._kept = None
        if x is None:
            return
        if not args or args[0] is not x:
            self.reason = "the router's input is not the MoE layer's input"
            return
        if x._version != self._x_version:
            self.reason = "the MoE layer's input was modified in place before the router read it"
            return
        probs = result[0] if isinstance(result, tuple) else result
        found = kept_between(probs, Meta(x), x.grad_fn, limit=64) if isinstance(probs, torch.Tensor) else \
            Kept("its output is not a tensor")
        if isinstance(found, Kept):
            self.reason = f"the router: {found.reason}"
            return
        self._kept = found[0]

    def _dispatched(self, experts, args):
        x = self._x() if self._x is not None else None
        kept, self._kept = self._kept, None
        if x is None or kept is None or not args or not isinstance(args[0], torch.Tensor):
            return
        why = static_reason(self.moe)
        if why:
            self.reason = why
            return
        if x._version != self._x_version:
            self.reason = "the MoE layer's input was modified in place before the dispatch"
            return
        route = dispatch.Route(self.moe.token_dispatcher, self.moe.config)
        rows = kept.reshape(-1, kept.shape[-1])
        why = route.check_rows(rows)
        if why:
            self.reason = f"the route: {why}"
            return
        if self.verified is None:
            self._verify(route, rows, args[0])
        if not self.verified:
            self.reason = self._route_failed()
            return
        self.current = MoEForward(route, x.reshape(-1, x.shape[-1]), rows, args[0], self.resends)
        self.reason = None

    def _verify(self, route, rows: torch.Tensor, dispatched: torch.Tensor) -> None:
        """First forward: the route replayed on ``x`` gives the dispatched tokens bit for bit, on
        every rank of the dispatch (one all-reduce: they all take the same path afterwards)."""
        diff = mismatch(route.start(rows).wait(), dispatched)
        ok = diff is None
        if not ok:
            self.verify_reason = f"{diff} on this rank"
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=rows.device)
        group = self.moe.token_dispatcher.tp_ep_group
        if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
        self.verified = bool(flag.item())
        if not self.verified and self.verify_reason is None:
            self.verify_reason = "on another rank of the dispatch"

    def _experts_done(self, experts, args, result):
        fwd, self.current = self.current, None
        if fwd is not None:
            fwd.x_live = None  # forward only (the shared route's dx edge): not kept past it
        out = result[0] if isinstance(result, tuple) else result
        if fwd is not None and fwd.consumers and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(fwd.start)  # backward: re-dispatch while the experts' backward runs
        if fwd is not None and not fwd.consumers:
            fwd.kept = None


class ExpertInputProducer:
    """The producer of one expert fc1 adapter's input (attached by ``regather.LoRA``): its shared
    LoRA-A runs before the dispatch, or (per-expert, opted in) its rows are re-dispatched."""

    def __init__(self, inputs: ExpertInputs, shared: bool):
        self.inputs, self.shared = inputs, shared
        self.name = PREDISPATCH if shared else REDISPATCH

    def static_reason(self) -> str | None:
        return self.inputs.static_reason()

    def capture(self, x: torch.Tensor) -> PreDispatched | Redispatched | Kept:
        """This forward's source (:class:`PreDispatched` or :class:`Redispatched`), or ``Kept(why none)``."""
        fwd = self.inputs.current
        if fwd is None:
            return Kept(self.inputs.reason or "the MoE layer did not run in this forward")
        rows = fwd.rows_of(x)
        if isinstance(rows, str):
            return Kept(rows)
        if self.shared:
            if (rows.start, rows.stop) != (0, fwd.n_dispatched) or fwd.x_live is None:
                return Kept("the adapter input is not all the tokens the dispatcher handed the experts")
            return PreDispatched(fwd.x_live, Recomputed(_RouterKept, (fwd.kept,)), fwd.route)
        fwd.consumers += 1
        return Redispatched(fwd, rows, fwd.kept)


def expert_producer(model: nn.Module, path: str, adapter) -> ExpertInputProducer | str:
    """The producer of the expert fc1 adapter at ``path`` (one :class:`ExpertInputs` per MoE
    layer), or why there is none. A shared grouped adapter runs before the dispatch; a per-expert
    one re-dispatches when ``adapter.redispatch_inputs`` (``LoRA(redispatch_expert_inputs=True)``)."""
    shared = getattr(adapter, "expert_slots", None) is not None  # one adapter for the grouped local experts
    if not shared and not getattr(adapter, "redispatch_inputs", False):
        return REDISPATCH_OPT_IN  # no hooks, no route check: nothing of this layer would use them
    moe = moe_layer_of(model, path)
    if moe is None:
        return f"{path} is not inside a megatron MoELayer running its own forward"
    inputs = expert_inputs_of(moe)
    if inputs is None:
        inputs = ExpertInputs(moe)
        setattr(moe, _ATTR, inputs)
    return ExpertInputProducer(inputs, shared)


_ATTR = "_regather_expert_inputs"  # where a MoE layer holds its ExpertInputs


def expert_inputs_of(moe: nn.Module) -> ExpertInputs | None:
    """The :class:`ExpertInputs` hooked on a MoE layer (its re-dispatch counts: ``.resends``), if any."""
    return getattr(moe, _ATTR, None)
