"""One forward of an adapter: plan it (decide, anchor early re-gather), then run its path.

Column-parallel base, data flow per rank (SP on, input ``x_local [s/t, b, h]``)::

    mid_i = LoRA-A(x_local)            path: gather | regather | ...   [s, b, r/t]
    mid   = gather_last_dim(mid_i)                                    [s, b, r]
    out_i = scale * mid B_i^T          backward all-reduces dmid      [s, b, o/t]

Low-rank strategy (LoRA-A replicated ``[r, h]``)::

    mid   = all_gather_seq(x_local A^T)    backward: reduce-scatter    [s, b, r]
    out_i = scale * mid B_i^T          backward does NOT all-reduce   [s, b, o/t]

Row-parallel base (input ``x_i [s, b, h/t]``)::

    mid   = all_reduce(x_i A_i^T)                                     [s, b, r]
    out   = gather_last_dim(mid B_i^T) -> scatter over sequence       [s/t, b, o]

The LoRA-A path comes from :func:`regather.core.strategies.paths.lookup`; every collective is
:mod:`regather.core.mappings` (megatron-core's ``tensor_parallel.mappings``, bit for bit). What
LoRA-A saves is counted under ``adapter_input:<base>`` (:mod:`regather.core.accounting`).

**Lean transients** (``lean_transients``, :mod:`regather.core.peak`; on by default for every strategy
but the classic gather). The wrapper calls :meth:`AdapterForward.add_into` with the base's output
instead of adding the adapter's own: the scale goes on ``mid`` (rank ``r``), LoRA-B's output is added
into the base's output in row chunks, a row-parallel base's LoRA-B runs on this rank's sequence shard
with its weight gathered (``mid`` reduce-scattered, not all-reduced), and where LoRA-A reads the base's
own input (row-parallel, SP off) its input gradient goes into the base's in place through the
forward's junction (:mod:`regather.core.peak.junction`). No full-width LoRA tensor exists at once
beyond one chunk (docs/design.md §3.7).
"""

from __future__ import annotations

import dataclasses

import torch

from regather.core import accounting, debug, mappings
from regather.core.buffers import default_pool
from regather.core.decision import expected
from regather.core.peak.junction import InputGradParts, attach
from regather.core.peak.output import lora_into_output_
from regather.core.peak.row import row_lora_into_output_
from regather.core.plan import Plan
from regather.core.strategies import Strategy
from regather.core.strategies.lowrank import replicated_shard
from regather.core.strategies.paths import DISPATCHED, LOWRANK, PREDISPATCHED, REPLICATED, ROW, PathArgs
from regather.core.strategies.regather import new_slot
from regather.core.strategies.shared_gather import SharedGather
from regather.core.wgrad import linear

# Applied to the gathered rank-r activation between LoRA-A and LoRA-B.
ACTIVATIONS = {
    "identity": None,
    "relu": torch.nn.functional.relu,
    "gelu": torch.nn.functional.gelu,
    "silu": torch.nn.functional.silu,
    "swish": torch.nn.functional.silu,
}


def partial_output(out_i: torch.Tensor, rank: int, t: int) -> torch.Tensor:
    """A row-parallel adapter's output as its share of a sum over TP, for a base whose caller
    sums partial outputs (an expert ``linear_fc2`` under ``explicit_expert_comm``).

    Such a base returns a *partial* ``[n, o]`` (its input is split over hidden): the token
    dispatcher's combine reduce-scatters the partials of the expert-TP ranks. The adapter's delta
    is complete on every rank once ``mid`` is reduced, ``out_i = mid B_i^T`` being its columns
    ``[rank*o/t, (rank+1)*o/t)``; placed there with zeros elsewhere, the ranks' sum is the delta
    exactly (each column has one non-zero term). Backward takes those columns of the (replicated)
    output gradient. Nothing is saved.
    """
    if t == 1:
        return out_i
    width = out_i.shape[-1]
    return torch.nn.functional.pad(out_i, (rank * width, (t - 1 - rank) * width))


#: Why an adapter asked for lean transients runs the classic output instead (one sentence per cause).
LEAN_POST_DROPOUT = expected("dropout is applied to the adapter output (dropout_position='post'), which needs it "
                             "whole: the classic output is used")
LEAN_OUTPUT_NOT_DENSE = "the base's output is not a contiguous tensor LoRA can add into in place: the classic output is used"


class AdapterForward:
    """The forward half of :class:`~regather.megatron.dense.adapter.ParallelLinearAdapter`."""

    def check_input(self, x: torch.Tensor) -> None:
        """``x`` has the adapter's dtype, device and local input features (else a clear error)."""
        w = self.linear_in.weight
        if x.dtype != w.dtype or x.device != w.device:
            raise TypeError(
                f"LoRA adapter on {self.facts.base_name!r}: input is {x.dtype} on {x.device}, "
                f"but the adapter weights are {w.dtype} on {w.device}"
            )
        if x.dim() < 2 or x.shape[-1] != self.in_features_local:
            raise ValueError(
                f"LoRA adapter on {self.facts.base_name!r}: input shape {tuple(x.shape)} does not end "
                f"in {self.in_features_local} features"
            )

    @property
    def in_features_local(self) -> int:
        return self.linear_in.weight.shape[-1]

    def plan(self, x: torch.Tensor, share: SharedGather | None = None, reads_base_input: bool = True,
             parts: InputGradParts | None = None) -> tuple[torch.Tensor, Plan]:
        """Decide this forward's strategy and whether its output is lean. Where backward work must wait
        for the base's input gradient — a regather's deferred ``dA`` (early re-gather), a lean adapter's
        input-gradient contribution (row-parallel, SP off) — route ``x`` through a junction
        (:mod:`regather.core.peak.junction`); a wrapper (``LoRALinear``) calls this *before* its base
        layer and feeds the returned ``x`` to both. See :mod:`regather.core.strategies.regather`.
        ``reads_base_input=False``: the adapter's input is not ``x`` but what the base makes of it
        (Transformer Engine's LayerNorm output): its input gradient goes back through the base.
        ``parts``: the contributions of the other adapters on this input (CanonicalLoRA), to join."""
        self.check_input(x)
        debug.maybe_check_adapter_input(self, x)  # opt-in: REGATHER_DEBUG_SHAPES=1 / check_shapes
        decision = self.decide()
        self.last_decision = decision
        self.log_fallback(decision)
        slot = None
        share = share if decision.used == Strategy.REGATHER else None  # only regather gathers again
        if decision.used == Strategy.REGATHER and self.early_regather:
            slot = new_slot(x, self.tp_group, self.pool, early=True, share=share)
        lean = self.lean_asked()
        why = self.lean_reason() if lean else None
        if why is not None:
            self.log_lean_fallback(why)
            lean = False
        redirect = (lean and reads_base_input and x.requires_grad and torch.is_grad_enabled()
                    and self.redirects_input_grad)
        parts = (parts if parts is not None else InputGradParts()) if redirect else None
        defer = slot if slot is not None and slot.defer else None
        if parts is not None or defer is not None:
            x = attach(x, self.linear_in.weight, defer, parts)
        return x, Plan(decision, slot=slot, share=share, junction=parts, lean=lean)

    def lean_asked(self) -> bool:
        """``lean_transients``: True / False as set, None (the default) for every strategy but gather."""
        asked = self.lean_transients
        return self.strategy != Strategy.GATHER if asked is None else bool(asked)

    def lean_reason(self) -> str | None:
        """Why this adapter's output cannot be lean (None: it can)."""
        if self.dropout is not None and self.dropout_position == "post":
            return LEAN_POST_DROPOUT
        return None

    @property
    def redirects_input_grad(self) -> bool:
        """LoRA-A reads the base's own full-width input and its gradient joins the base's: a row-parallel
        base, or a column-parallel one without SP (SP's gather sends a column adapter's back through its
        own reduce-scatter, a shard). Whether this forward's path delivers it is known with the path
        (:meth:`_mid`: a shared expert LoRA-A before the dispatch and per-expert blocks do not)."""
        return not self.column_parallel or not self.sequence_parallel

    def shares_input_gather(self, plan: Plan) -> bool:
        """Whether this forward's LoRA-A reads the full input (gather/regather, column-parallel,
        SP) computed from the same tensor as the base layer (no "pre" dropout), so a wrapper may
        gather it once for both (``LoRA(share_sequence_gather=True)``)."""
        return (self.column_parallel and self.sequence_parallel
                and plan.decision.used in (Strategy.GATHER, Strategy.REGATHER)
                and not (self.dropout is not None and self.dropout_position == "pre"))

    def weights_for_forward(self, fuse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """LoRA-A and LoRA-B as this forward reads them (called: DDP's param-gather pre-hooks run).
        An adapter shared over expert parallelism returns copies whose gradients are summed."""
        return self.linear_in(), self.linear_out()

    def row_blocks(self, x: torch.Tensor, m_splits):
        """Row blocks for per-expert weights (``None``: one weight for all rows)."""
        return None

    def forward(self, x: torch.Tensor, plan: Plan | None = None, input_gathered: bool = False,
                x_full: torch.Tensor | None = None, m_splits=None, base_out: torch.Tensor | None = None,
                out_blocks=None):
        """The adapter's own output, ``scale * B(A(x))`` in the base's output layout — or, given the base's
        output ``base_out``, that output with the adapter's added (in place and in chunks when the plan is
        lean: :meth:`add_into`). Wrappers pass ``base_out``, through the module's ``__call__`` so that
        hooks on the adapter run as before; ``out_blocks``: where this adapter's columns lie in it, when
        it is one of several on a fused base (:func:`regather.core.peak.output.blocks_of`).

        ``input_gathered``: ``x`` is ``[s, b, h]``, already gathered over the sequence by the
        caller in a gather whose backward reduce-scatters the gradient it receives
        (:mod:`regather.core.strategies.pregathered`); gather path only. Not TE's gathered
        LayerNorm output: TE >= 2.4 drops its gradient (:mod:`regather.megatron.dense.te`).

        ``x_full``: ``all_gather_seq(x)`` made by the caller for the base layer too, whose
        backward reduce-scatters (:func:`regather.core.mappings.gather_seq`). LoRA-A computes on
        it and returns its *partial* input gradient to it (one reduce-scatter for base +
        adapter); regather still saves only ``x`` and re-gathers it for ``dA``. Only when
        :meth:`shares_input_gather` holds.

        ``m_splits``: grouped experts' tokens per local expert; a shared adapter ignores them,
        a per-expert one (:class:`regather.megatron.moe.adapters.GroupedExpertAdapter`) needs them."""
        if plan is None:
            x, plan = self.plan(x)
        if base_out is not None:
            return self.add_into(base_out, x, plan, input_gathered, x_full, m_splits, out_blocks)
        plan = dataclasses.replace(plan, lean=False, junction=None)
        mid, plan, b, splits = self._mid(x, plan, input_gathered, x_full, m_splits)
        out = linear(mid, b, self.gradient_accumulation_fusion, splits=splits)
        if not self.column_parallel and self.dispatched:  # the caller sums the base's partial outputs
            out = partial_output(out, self.tp_rank, self.tp_size)
        elif not self.column_parallel:
            out = mappings.gather_last_dim(out, self.tp_group)
            if self.sequence_parallel:
                out = mappings.scatter_seq(out, self.tp_group)
        if self.dropout is not None and self.dropout_position == "post":
            out = self.dropout(out)
        # mul.Scalar: autograd keeps the scale as a number (``out * scale`` wraps it in a 0-dim tensor
        # that MulBackward0 saves: 8 bytes per adapter the allocator sees); the same kernel, same bits
        out = torch.ops.aten.mul.Scalar(out, self.scale)
        if plan.slot is not None and out.requires_grad:
            out.register_hook(plan.slot.on_output_grad)  # early re-gather: start when dout arrives
        return out

    def add_into(self, base_out: torch.Tensor, x: torch.Tensor, plan: Plan, input_gathered: bool = False,
                 x_full: torch.Tensor | None = None, m_splits=None, out_blocks=None) -> torch.Tensor:
        """``base_out`` plus this adapter's output: added in place, chunk by chunk, when the plan is lean
        (module doc), else ``base_out + forward(...)``. ``x`` and the keywords as for :meth:`forward`."""
        width = self.base_out_features if out_blocks is None else None
        if plan.lean and not (base_out.is_contiguous() and width in (None, base_out.shape[-1])):
            self.log_lean_fallback(LEAN_OUTPUT_NOT_DENSE)
            plan = dataclasses.replace(plan, lean=False, junction=None)
        if not plan.lean:
            if out_blocks is not None:
                raise ValueError(f"LoRA adapter on {self.facts.base_name!r}: out_blocks needs a lean plan")
            return base_out + self.forward(x, dataclasses.replace(plan, lean=False, junction=None), input_gathered,
                                           x_full, m_splits)
        mid, plan, b, splits = self.lean_mid(x, plan, input_gathered, x_full, m_splits)
        fuse, group = self.gradient_accumulation_fusion, self.tp_group
        if splits is not None:  # per-expert LoRA-B blocks: their output whole, added in place (one W, not three)
            delta = linear(mid, b, fuse, splits=splits)
            if not self.column_parallel and self.tp_size > 1:  # a partial output: this rank's columns of it
                width = delta.shape[-1]
                base_out[..., self.tp_rank * width:(self.tp_rank + 1) * width].add_(delta)
                return base_out
            return base_out.add_(delta)
        slot = plan.slot
        on_grad = (lambda: slot.on_output_grad(None)) if slot is not None else None
        if self.column_parallel:
            return lora_into_output_(base_out, mid, b, fuse, cols=out_blocks, on_grad=on_grad)
        if self.dispatched:  # a partial output: this rank's columns of it
            width = b.shape[0]
            return lora_into_output_(base_out, mid, b, fuse, cols=slice(self.tp_rank * width, (self.tp_rank + 1) * width),
                                     on_grad=on_grad)
        return row_lora_into_output_(base_out, mid, b, group, self.sequence_parallel, fuse, on_grad=on_grad)

    def lean_mid(self, x, plan, input_gathered=False, x_full=None, m_splits=None):
        """A lean forward's LoRA-A and ``mid``'s reduction, the scale on the rank-``r`` side
        (:mod:`regather.core.peak.output`): ``(scale · mid, plan completed with this input, LoRA-B's weight,
        row blocks)``, ``mid`` in LoRA-B's layout (the row path: this rank's sequence shard)."""
        mid, plan, b, splits = self._mid(x, plan, input_gathered, x_full, m_splits)
        return torch.ops.aten.mul.Scalar(mid, self.scale), plan, b, splits

    def before_lora_a(self, plan: Plan, x: torch.Tensor) -> None:
        """Called with the completed plan and LoRA-A's input, before LoRA-A's path saves anything (a
        subclass that reads the same input again in backward takes its source here: DoRA)."""

    @property
    def base_out_features(self) -> int:
        """The width of the base's (local) output this adapter adds into."""
        w = self.linear_out.weight.shape[-2]
        return w if self.column_parallel else w * self.tp_size

    def _mid(self, x, plan, input_gathered, x_full, m_splits):
        """LoRA-A and the reduction to a complete ``mid`` in LoRA-B's layout (the lean row path: this
        rank's sequence shard), with the plan completed by this input; returns
        ``(mid, plan, LoRA-B's weight, row blocks)``."""
        decision, slot = plan.decision, plan.slot
        if x_full is not None and not self.shares_input_gather(plan):
            raise ValueError(f"LoRA adapter on {self.facts.base_name!r}: a shared x_full was given, "
                             f"but this forward ({decision}) cannot use one")
        if input_gathered and not (self.column_parallel and self.sequence_parallel
                                   and decision.used == Strategy.GATHER):
            raise ValueError(f"LoRA adapter on {self.facts.base_name!r}: input_gathered=True needs a "
                             f"column-parallel base with sequence parallelism on the gather path "
                             f"(this forward uses {decision.used.value})")
        # the plan completed with this input (before dropout: x is the producer's output); from here
        # on the forward only executes it
        plan = self.with_input(plan, x, shared=x_full is not None, gathered=input_gathered)
        decision, source, path = plan.decision, plan.source, plan.path
        self.before_lora_a(plan, x)
        if self.dropout is not None and self.dropout_position == "pre":
            x = self.dropout(x)
        group, fuse = self.tp_group, self.gradient_accumulation_fusion
        a, b = self.weights_for_forward(fuse)
        if self.replicated_a and path is not LOWRANK:  # fallback: this rank's rows, grads completed over TP
            a = replicated_shard(a, self.tp_rank, self.tp_size, group, fuse, self.lowrank_reduce_in_backward)
        splits = self.row_blocks(x, m_splits)
        into = None
        if plan.junction is not None and splits is None and path in (ROW, REPLICATED, DISPATCHED):
            # the junction takes LoRA-A's input gradient: summed over TP first on the replicated path
            # (megatron's copy to the TP region), partial as the base's where the dispatcher reduces both
            into = (plan.junction, group if path is REPLICATED else None)
        args = PathArgs(group=group, fuse=fuse, pool=self.pool or default_pool(), slot=slot, source=source,
                        x_full=x_full, reduce_dA=self.lowrank_reduce_in_backward, share=plan.share, splits=splits,
                        junction=into)
        # what LoRA-A saves is counted apart, per base layer (accounting.SavedBytes.of)
        with accounting.label(f"{accounting.ADAPTER_INPUT}:{self.facts.base_name}"):
            mid = path(x, a, args)
        # lowrank gathers mid over the sequence; a shared expert LoRA-A before the dispatch sends it
        # along the tokens' route: either way mid is [.., r] and its route's backward sums dmid over TP
        complete = path in (LOWRANK, PREDISPATCHED)
        lean_row = plan.lean and not self.column_parallel and not self.dispatched
        if self.column_parallel and not complete:
            mid = mappings.gather_last_dim(mid, group)
        elif lean_row and self.sequence_parallel:  # this rank's sequence shard only (regather.core.peak.row)
            mid = mappings.reduce_scatter_seq(mid, group)
        elif not self.column_parallel:
            mid = mappings.reduce_from_group(mid, group)
        if self.activation_fn is not None:
            mid = self.activation_fn(mid)
        if not complete and not lean_row:  # the lean row LoRA-B sums dmid over TP itself
            mid = mappings.copy_to_group(mid, group)
        return mid, plan, b, splits
