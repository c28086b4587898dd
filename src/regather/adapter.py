"""``ParallelLinearAdapter``: a LoRA adapter beside a megatron tensor-parallel linear.

Layouts (design.md §2; parameter names follow Megatron Bridge checkpoints):

================ ===================== ======================= ==================
base             ``linear_in.weight``  ``linear_out.weight``   adapter output
================ ===================== ======================= ==================
column-parallel  ``A_i: [r/t, h]``     ``B_i: [o/t, r]``       ``[s, b, o/t]``
row-parallel     ``A_i: [r, h/t]``     ``B_i: [o/t, r]``       ``[s/t, b, o]`` (SP)
================ ===================== ======================= ==================

Column-parallel base, data flow per rank (SP on, input ``x_local [s/t, b, h]``)::

    mid_i = LoRA-A(x_local)            strategy: gather | regather   [s, b, r/t]
    mid   = all_gather_last_dim(mid_i)                                [s, b, r]
    out_i = scale * mid B_i^T          backward all-reduces dmid      [s, b, o/t]

Low-rank strategy (column-parallel base, SP on; LoRA-A replicated ``[r, h]``)::

    mid   = all_gather_seq(x_local A^T)    backward: reduce-scatter    [s, b, r]
    out_i = scale * mid B_i^T          backward does NOT all-reduce   [s, b, o/t]
    dA    = all_reduce_tp(dmid_local^T x_local)   (or finalize_model_grads)

Row-parallel base (input ``x_i [s, b, h/t]``)::

    mid   = all_reduce(x_i A_i^T)                                     [s, b, r]
    out   = all_gather_last_dim(mid B_i^T) -> scatter over sequence   [s/t, b, o]

``scale = alpha / dim``; dropout on the adapter input ("pre") or output
("post"). Every forward evaluates :func:`regather.eligibility.unsupported_reason`;
when the requested strategy cannot run, the gather path runs instead with
unchanged numerics and the first reason is logged once (a replicated LoRA-A
then runs as its rank's rows, see :mod:`regather.strategies.lowrank`).

Checkpoints always hold the sharded (Bridge) layout: a low-rank adapter
writes its rank's rows ``A[rank*r/t:(rank+1)*r/t]`` and, on load, all-gathers
the shards over the TP group (so ``load_state_dict`` is a collective for a
low-rank adapter with ``t > 1``: call it on every TP rank, as megatron does). A
full ``[r, h]`` tensor is also accepted by every layout. Any strategy therefore
loads any other's checkpoint and computes the same function.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn

from regather import accounting, checkpoint, comm, debug, fallback_log
from regather.buffers import ScratchPool, default_pool
from regather.eligibility import IN_CHECKPOINT, AdapterFacts, RunState, checkpointed_by_config, unsupported_reason
from regather.producers import EXPERT_INPUT_KEPT, reason_now
from regather.strategies import Strategy
from regather.strategies.lowrank import (
    GRAD_ALLREDUCE_BACKWARD,
    GRAD_ALLREDUCE_FINALIZE,
    GRAD_ALLREDUCE_MODES,
    replicated_copy,
    replicated_shard,
    shard_rows,
)
from regather.strategies.paths import PathArgs, lookup
from regather.strategies.predispatched import PREDISPATCHED
from regather.strategies.regather import RegatherSlot, anchor, new_slot
from regather.strategies.saved_input import KEEP, Recomputed
from regather.strategies.shared_gather import SharedGather
from regather.strategies.wgrad import linear

logger = logging.getLogger("regather")

INIT_METHODS = ("xavier", "normal", "kaiming", "zero")
DROPOUT_POSITIONS = ("pre", "post")
# Applied to the gathered rank-r activation between LoRA-A and LoRA-B.
ACTIVATIONS = {
    "identity": None,
    "relu": torch.nn.functional.relu,
    "gelu": torch.nn.functional.gelu,
    "silu": torch.nn.functional.silu,
    "swish": torch.nn.functional.silu,
}

# Fallbacks logged at INFO: those that depend on the moment (mode, autograd
# state) and those the feature excludes by design (row-parallel, other bases,
# experts). Everything else may surprise a user and is a WARNING.
_INFO_REASONS = ("module is in eval mode", "autograd is disabled", "running inside activation",
                 "base layer")


@dataclass(frozen=True)
class Decision:
    """Which strategy an adapter asked for, which one runs, and why; and, with
    ``recompute_adapter_inputs``, whether its saved input is recomputed (from which producer)
    or kept (and why)."""

    requested: Strategy
    used: Strategy
    reason: Optional[str]  # None when ``used == requested``
    recompute: Optional[str] = None  # the producer the input is recomputed from
    recompute_reason: Optional[str] = None  # why it is kept although recompute was asked

    def __str__(self) -> str:
        text = f"{self.used.value}"
        if self.used != self.requested:
            text += f" (asked {self.requested.value}: {self.reason})"
        if self.recompute:
            text += f", input recomputed from {self.recompute}"
        elif self.recompute_reason:
            text += f", input kept (recompute asked: {self.recompute_reason})"
        return text


def init_weight_(weight: torch.Tensor, method: str) -> torch.Tensor:
    """Bridge's LoRA initialisers, applied to a full (unsharded) master weight."""
    if method == "xavier":
        return nn.init.xavier_normal_(weight)
    if method == "normal":
        return nn.init.normal_(weight, mean=0.0, std=0.2)
    if method == "kaiming":
        return nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if method == "zero":
        return nn.init.zeros_(weight)
    raise ValueError(f"unknown init method {method!r}; expected one of {', '.join(INIT_METHODS)}")


@dataclass
class Plan:
    """What one forward of an adapter does: the decision, the regather slot if any, and the
    gather it shares with other adapters on the same input (``CanonicalLoRA``) if any."""

    decision: Decision
    slot: Optional[RegatherSlot] = None
    share: Optional[SharedGather] = None


class _ShardedWeight(nn.Module):
    """Owns one LoRA weight shard (``linear_in`` / ``linear_out``), the way megatron's
    linears own theirs.

    * The parameter is tagged as megatron tags tensor-parallel parameters.
    * The adapter reads it by *calling* the module (``self.linear_in()``), never as a bare
      attribute: megatron DDP with ``overlap_param_gather`` finishes a bucket's parameter
      all-gather in forward pre-hooks registered on every module, for the parameters the
      module owns directly (``module.parameters(recurse=False)``,
      ``DistributedDataParallel._make_forward_pre_hook``). A holder that is never called
      would be read before its all-gather finished, and DP replicas would diverge.
    * ``_extra_state`` (``None``) as megatron's ``ColumnParallelLinear`` /
      ``RowParallelLinear`` write it, so state dicts of Megatron Bridge's adapters (whose
      ``linear_in`` / ``linear_out`` are megatron linears) load with ``strict=True``.
      A state dict without it (regather 0.1) loads too: the value is always ``None``.
    """

    def __init__(self, master: torch.Tensor, partition_dim: int, rank: int, tp: int):
        super().__init__()
        shard = master.chunk(tp, dim=partition_dim)[rank].contiguous()
        self.weight = nn.Parameter(shard)
        self.weight.tensor_model_parallel = tp > 1
        self.weight.partition_dim = partition_dim
        self.weight.partition_stride = 1
        self._register_load_state_dict_pre_hook(_default_extra_state)

    def forward(self) -> nn.Parameter:
        return self.weight

    def get_extra_state(self) -> None:
        return None

    def set_extra_state(self, state) -> None:
        """Ignored, as in megatron's linears."""


def _default_extra_state(state_dict, prefix, *args):
    state_dict.setdefault(prefix + "_extra_state", None)


class ParallelLinearAdapter(nn.Module):
    """LoRA ``B(A(x)) * alpha/dim`` matched to a megatron column- or row-parallel linear."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dim: int,
        *,
        column_parallel: bool,
        base_name: str,
        config=None,
        tp_group=None,
        sequence_parallel: bool = False,
        is_expert: bool = False,
        explicit_comm: bool = False,
        ep_group=None,
        alpha: Optional[float] = None,
        dropout: float = 0.0,
        dropout_position: str = "pre",
        lora_A_init_method: str = "xavier",
        lora_B_init_method: str = "zero",
        activation: str = "identity",
        a2a_experts: bool = False,
        strategy: Strategy | str = Strategy.GATHER,
        early_regather: bool = True,
        lowrank_grad_allreduce: str = GRAD_ALLREDUCE_BACKWARD,
        gradient_accumulation_fusion: Optional[bool] = None,
        recompute_inputs: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        pool: Optional[ScratchPool] = None,
    ):
        super().__init__()
        tp, rank = _group_size_rank(tp_group)
        _validate(in_features, out_features, dim, dropout, dropout_position, column_parallel, tp,
                  lora_A_init_method, lora_B_init_method, activation)
        self.dim = dim
        self.alpha = float(dim if alpha is None else alpha)
        self.scale = self.alpha / dim
        self.dropout_position = dropout_position
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        self._strategy = Strategy.parse(strategy)
        self.early_regather = bool(early_regather)
        if lowrank_grad_allreduce not in GRAD_ALLREDUCE_MODES:
            raise ValueError(f"lowrank_grad_allreduce must be one of {GRAD_ALLREDUCE_MODES}, "
                             f"got {lowrank_grad_allreduce!r}")
        self.lowrank_grad_allreduce = lowrank_grad_allreduce
        self.tp_size, self.tp_rank = tp, rank
        self.config = config
        self.tp_group = tp_group
        self.column_parallel = column_parallel
        # explicit_comm: the base's caller (MoE token dispatcher) does every TP collective
        self.sequence_parallel = bool(sequence_parallel and tp > 1 and not explicit_comm)
        # a shared grouped-expert adapter: the same weights on every EP rank, gradients summed
        # over EP (Megatron Bridge's share_expert_adapters); None otherwise
        self.ep_group = ep_group if ep_group is not None and _group_size_rank(ep_group)[0] > 1 else None
        self.fallback_log = None  # the model's fallback_log.FallbackLog, attached by regather.LoRA
        if gradient_accumulation_fusion is None:
            gradient_accumulation_fusion = bool(getattr(config, "gradient_accumulation_fusion", False))
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.pool = pool
        # LoRA(recompute_adapter_inputs=True): save what the input's producer keeps
        # (regather.producers); the producer is attached by regather.LoRA from the model
        self.recompute_inputs = bool(recompute_inputs)
        self.producer = None
        self.producer_reason: Optional[str] = "no producer attached (the adapter was built outside regather.LoRA)"
        self._recompute_verified = False
        self._logged_recompute = False
        self._activation = ACTIVATIONS[activation]
        self.facts = AdapterFacts(
            base_name=base_name,
            column_parallel=column_parallel,
            sequence_parallel=self.sequence_parallel,
            tp_size=tp,
            is_expert=is_expert,
            a2a_experts=a2a_experts,
            activation=activation,
            explicit_comm=bool(explicit_comm),
        )
        if params_dtype is None:
            params_dtype = getattr(config, "params_dtype", None) or torch.get_default_dtype()
        self._init_weights(dim, in_features, out_features, lora_A_init_method, lora_B_init_method,
                           params_dtype, rank, tp)
        self._tag_lora_a()
        self._tag_expert(config)
        if device is not None:
            self.to(device)
        if self.ep_group is not None:
            self._broadcast_over_ep()
        self.last_decision: Optional[Decision] = None
        self._logged = False
        self._register_state_dict_hook(_save_sharded_lora_a)
        self._register_load_state_dict_pre_hook(_load_lora_a, with_module=True)

    def _init_weights(self, dim, in_features, out_features, a_init, b_init, dtype, rank, tp) -> None:
        """Full master weights from the default generator, then this rank's shard: every TP size
        starts from the same adapter."""
        a = init_weight_(torch.empty(dim, in_features, dtype=torch.float32), a_init)
        b = init_weight_(torch.empty(out_features, dim, dtype=torch.float32), b_init)
        a, b = a.to(dtype), b.to(dtype)
        self.linear_in = _ShardedWeight(a, 0 if self.column_parallel else 1, rank, tp)
        self.linear_out = _ShardedWeight(b, 0, rank, tp)
        if self._wants_replicated(self._strategy):
            # the full master weight the sharded layouts slice: every strategy starts identical
            self.linear_in.weight = nn.Parameter(a.contiguous())

    def _tag_expert(self, config) -> None:
        """megatron's expert parameters carry ``allreduce=False`` when EP > 1: DDP reduces them
        over the expert data-parallel group, not the dense one (their gradients differ per EP
        rank). An expert adapter's weights are expert parameters too."""
        if not self.facts.is_expert:
            return
        expert_parallel = getattr(config, "expert_model_parallel_size", 1) > 1
        for holder in (self.linear_in, self.linear_out):
            holder.weight.allreduce = not expert_parallel

    def _broadcast_over_ep(self) -> None:
        """Start a shared expert adapter from EP rank 0's weights (as Bridge does): every EP rank
        holds the same adapter, and its gradients, summed over EP, keep it so."""
        src = torch.distributed.get_global_rank(self.ep_group, 0)
        with torch.no_grad():
            for holder in (self.linear_in, self.linear_out):
                torch.distributed.broadcast(holder.weight.data, src=src, group=self.ep_group)

    # -- LoRA-A layout -------------------------------------------------------------
    def _wants_replicated(self, strategy: Strategy) -> bool:
        """lowrank's replicated LoRA-A; experts never run lowrank, so they keep the shards."""
        return (strategy == Strategy.LOWRANK and self.column_parallel and self.tp_size > 1
                and not self.facts.is_expert and not self.facts.explicit_comm)

    @property
    def replicated_a(self) -> bool:
        """LoRA-A holds the full ``[r, h]`` on every rank (low-rank strategy)."""
        w = self.linear_in.weight
        return (w.dim() == 2 and w.shape[0] == self.dim and self.column_parallel and self.tp_size > 1
                and not self.dispatched)

    @property
    def lowrank_reduce_in_backward(self) -> bool:
        return self.lowrank_grad_allreduce == GRAD_ALLREDUCE_BACKWARD

    def _tag_lora_a(self) -> None:
        w = self.linear_in.weight
        if self.replicated_a:
            if not self.lowrank_reduce_in_backward and not getattr(self.config, "sequence_parallel", False):
                raise ValueError(
                    f"LoRA adapter on {self.facts.base_name!r}: lowrank_grad_allreduce="
                    f"{GRAD_ALLREDUCE_FINALIZE!r} needs config.sequence_parallel=True (megatron's "
                    f"finalize_model_grads only sums sequence_parallel-tagged grads then); "
                    f"config.sequence_parallel is {getattr(self.config, 'sequence_parallel', None)!r}"
                )
            w.tensor_model_parallel = False  # replicated: counted once by grad-norm clipping
            w.partition_dim, w.partition_stride = -1, 1
            # megatron's finalize_model_grads sums grads of params tagged like this over TP
            w.sequence_parallel = not self.lowrank_reduce_in_backward
        else:
            w.tensor_model_parallel = self.tp_size > 1
            w.partition_dim = 0 if self.column_parallel else 1
            w.partition_stride = 1
            w.sequence_parallel = False

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @strategy.setter
    def strategy(self, value) -> None:
        """Switch strategy; converts LoRA-A between the sharded and replicated layouts
        (sharded -> replicated all-gathers over TP: call it on every TP rank)."""
        value = Strategy.parse(value)
        want = self._wants_replicated(value)
        if want != self.replicated_a:
            w = self.linear_in.weight
            if getattr(w, "main_grad", None) is not None or w.grad is not None:
                raise RuntimeError(
                    f"LoRA adapter on {self.facts.base_name!r}: cannot switch {self._strategy.value} -> "
                    f"{value.value} (LoRA-A layout {tuple(w.shape)} changes) once gradients or main_grad "
                    "buffers exist; switch before wrapping with DDP / building the optimizer, or go "
                    "through a state dict"
                )
            with torch.no_grad():
                w.data = self._full_lora_a(w.detach()) if want else w.detach()[self._rows()].clone()
        self._strategy = value
        self._tag_lora_a()

    def _rows(self) -> slice:
        return shard_rows(self.dim, self.tp_rank, self.tp_size)

    def _full_lora_a(self, shard: torch.Tensor) -> torch.Tensor:
        """All-gather the rank shards ``[r/t, h]`` into ``[r, h]`` (a collective)."""
        return comm.all_gather_seq(shard.contiguous(), self.tp_group)

    # -- decisions ---------------------------------------------------------------
    def decide(self) -> Decision:
        """The strategy this adapter would use if called now, and why (the recompute part as far
        as it is known before a forward: each forward also checks its producer, see ``last_decision``)."""
        state = RunState.capture(self, self.linear_in.weight)
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
        return replace(decision, recompute=self.producer.name)

    def _recompute_unsupported(self, decision: Decision, state: RunState) -> Optional[str]:
        path = lookup(decision.used, column=self.column_parallel, sequence_parallel=self.sequence_parallel,
                      explicit_comm=self.dispatched)
        if path.name == "dispatched" and (self.producer is None or not self.facts.is_expert):
            # expert fc1: from the router's input (regather.expert_inputs), when a producer was found
            return (self.producer_reason if self.facts.is_expert else None) or EXPERT_INPUT_KEPT
        if not path.recomputes and path.name != "dispatched":
            return (f"the {path.name} path keeps its input as it is (recompute of a column-parallel "
                    f"adapter's input needs regather or lowrank)")
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

    def _input_source(self, x: torch.Tensor, plan: Plan):
        """KEEP, or a Recomputed source when this forward's producer checks pass (updates the
        plan's decision with the outcome)."""
        decision = plan.decision
        if decision.recompute is None:
            self._log_recompute(decision)
            return KEEP
        captured = self.producer.capture(x)
        if not isinstance(captured, (str, tuple)):  # a ready source: expert inputs, verified per MoE layer
            return captured
        if not isinstance(captured, str) and not self._recompute_verified:
            captured = self._verify_recompute(x, captured)
        if isinstance(captured, str):
            plan.decision = self.last_decision = replace(decision, recompute=None, recompute_reason=captured)
            self._log_recompute(plan.decision)
            return KEEP
        return Recomputed(self.producer, captured)

    def _verify_recompute(self, x: torch.Tensor, captured: tuple):
        """First recompute of this adapter: bit-identical to the forward's input, or switched off."""
        with torch.no_grad():  # the check itself must leave no graph (nothing saved, no bytes)
            again = self.producer.recompute(*captured)
            if again.shape == x.shape and again.dtype == x.dtype and torch.equal(again, x):
                self._recompute_verified = True
                return captured
            diff = (again.float() - x.float()).abs().max().item() if again.shape == x.shape else "shape"
        self.producer_reason = (f"recomputing {self.producer.name} does not reproduce the adapter input "
                                f"bit for bit (max |diff| {diff}); the input is kept")
        self.producer = None
        return self.producer_reason

    def _log_recompute(self, decision: Decision) -> None:
        if self._logged_recompute or decision.recompute_reason is None:
            return
        self._logged_recompute = True
        fallback_log.report(self.fallback_log, "recompute_adapter_inputs requested, keeping the input",
                            decision.recompute_reason, getattr(self, "qualified_name", self.facts.base_name),
                            logging.WARNING if "bit for bit" in decision.recompute_reason else logging.INFO)

    def _log_fallback(self, decision: Decision) -> None:
        if self._logged or decision.reason is None:
            return
        self._logged = True
        expected = decision.reason.startswith(_INFO_REASONS) or "expert" in decision.reason
        fallback_log.report(self.fallback_log, f"{decision.requested.value} requested, using the gather path",
                            decision.reason, getattr(self, "qualified_name", self.facts.base_name),
                            logging.INFO if expected else logging.WARNING)

    # -- forward -----------------------------------------------------------------
    def _check_input(self, x: torch.Tensor) -> None:
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
    def dispatched(self) -> bool:
        """The base's caller does its TP communication (MoE experts at any EP x ETP, shared experts
        with overlap): no collective on the input, a partial output for a row-parallel base."""
        return self.facts.explicit_comm or self.facts.is_expert

    @property
    def in_features_local(self) -> int:
        return self.linear_in.weight.shape[-1]

    def plan(self, x: torch.Tensor, share: Optional[SharedGather] = None) -> tuple[torch.Tensor, Plan]:
        """Decide this forward's strategy. For regather with early re-gather, also route ``x``
        through the deferred-``dA`` anchor; a wrapper (``LoRALinear``) calls this *before* its
        base layer so that ``dA`` waits for the base's dgrad too, and feeds the returned ``x``
        to both. See :mod:`regather.strategies.regather`."""
        self._check_input(x)
        debug.maybe_check_adapter_input(self, x)  # opt-in: REGATHER_DEBUG_SHAPES=1 / check_shapes
        decision = self.decide()
        self.last_decision = decision
        self._log_fallback(decision)
        slot = None
        share = share if decision.used == Strategy.REGATHER else None  # only regather gathers again
        if decision.used == Strategy.REGATHER and self.early_regather:
            slot = new_slot(x, self.tp_group, self.pool, early=True, share=share)
            x = anchor(x, self.linear_in.weight, slot)
        return x, Plan(decision, slot, share)

    def shares_input_gather(self, plan: Plan) -> bool:
        """Whether this forward's LoRA-A reads the full input (gather/regather, column-parallel,
        SP) computed from the same tensor as the base layer (no "pre" dropout), so a wrapper may
        gather it once for both (``LoRA(share_sequence_gather=True)``)."""
        return (self.column_parallel and self.sequence_parallel
                and plan.decision.used in (Strategy.GATHER, Strategy.REGATHER)
                and not (self.dropout is not None and self.dropout_position == "pre"))

    def forward(self, x: torch.Tensor, plan: Optional[Plan] = None, input_gathered: bool = False,
                x_full: Optional[torch.Tensor] = None, m_splits=None) -> torch.Tensor:
        """``input_gathered``: ``x`` is ``[s, b, h]``, already gathered over the sequence by the
        base layer (TE's gathered LayerNorm output, :mod:`regather.te`); gather path only.

        ``x_full``: ``all_gather_seq(x)`` made by the caller for the base layer too, whose
        backward reduce-scatters (megatron's ``gather_from_sequence_parallel_region``). LoRA-A
        computes on it and returns its *partial* input gradient to it (one reduce-scatter for
        base + adapter); regather still saves only ``x`` and re-gathers it for ``dA``. Only
        when :meth:`shares_input_gather` holds.

        ``m_splits``: grouped experts' tokens per local expert; a shared adapter ignores them,
        a per-expert one (:class:`regather.experts.GroupedExpertAdapter`) needs them."""
        from megatron.core.tensor_parallel import mappings

        if plan is None:
            x, plan = self.plan(x)
        decision, slot = plan.decision, plan.slot
        if x_full is not None and not self.shares_input_gather(plan):
            raise ValueError(f"LoRA adapter on {self.facts.base_name!r}: a shared x_full was given, "
                             f"but this forward ({decision}) cannot use one")
        if input_gathered and not (self.column_parallel and self.sequence_parallel
                                   and decision.used == Strategy.GATHER):
            raise ValueError(f"LoRA adapter on {self.facts.base_name!r}: input_gathered=True needs a "
                             f"column-parallel base with sequence parallelism on the gather path "
                             f"(this forward uses {decision.used.value})")
        source = self._input_source(x, plan)  # before dropout: x is the producer's output
        decision = plan.decision
        if self.dropout is not None and self.dropout_position == "pre":
            x = self.dropout(x)
        group, fuse = self.tp_group, self.gradient_accumulation_fusion
        a, b = self.linear_in(), self.linear_out()  # called: DDP's param-gather pre-hooks run
        if self.ep_group is not None:  # shared over EP: each rank's gradient is a partial sum
            a, b = replicated_copy(a, self.ep_group, fuse), replicated_copy(b, self.ep_group, fuse)
        lowrank = self.column_parallel and self.sequence_parallel and decision.used == Strategy.LOWRANK
        if self.replicated_a and not lowrank:  # fallback: this rank's rows, grads completed over TP
            a = replicated_shard(a, self.tp_rank, self.tp_size, group, fuse, self.lowrank_reduce_in_backward)
        explicit = self.dispatched
        path = lookup(decision.used, column=self.column_parallel, sequence_parallel=self.sequence_parallel,
                      shared=x_full is not None, gathered=input_gathered, explicit_comm=explicit)
        # a shared expert LoRA-A on the MoE layer's input, its output sent along the tokens' route:
        # mid arrives complete over expert TP (the route gathers it and sums dmid)
        predispatched = source.name == PREDISPATCHED.name
        if predispatched:
            path = PREDISPATCHED
        splits = self._splits(x, m_splits)
        args = PathArgs(group=group, fuse=fuse, pool=self.pool or default_pool(), slot=slot, source=source,
                        x_full=x_full, reduce_dA=self.lowrank_reduce_in_backward, share=plan.share, splits=splits)
        # what LoRA-A saves is counted apart, per base layer (accounting.SavedBytes.of)
        with accounting.label(f"{accounting.ADAPTER_INPUT}:{self.facts.base_name}"):
            mid = path(x, a, args)
        complete = lowrank or predispatched  # mid is [.., r] and its route's backward sums dmid over TP
        if self.column_parallel and not complete:
            mid = mappings.gather_from_tensor_model_parallel_region(mid, group=group)
        elif not self.column_parallel:
            mid = mappings.reduce_from_tensor_model_parallel_region(mid, group=group)

        if self._activation is not None:
            mid = self._activation(mid)
        if not complete:
            mid = mappings.copy_to_tensor_model_parallel_region(mid, group=group)
        out = linear(mid, b, fuse, splits=splits)
        if not self.column_parallel and explicit:  # the caller sums the base's partial outputs
            out = partial_output(out, self.tp_rank, self.tp_size)
        elif not self.column_parallel:
            out = mappings.gather_from_tensor_model_parallel_region(out, group=group)
            if self.sequence_parallel:
                out = mappings.scatter_to_sequence_parallel_region(out, group=group)
        if self.dropout is not None and self.dropout_position == "post":
            out = self.dropout(out)
        out = out * self.scale
        if slot is not None and out.requires_grad:
            out.register_hook(slot.on_output_grad)  # early re-gather: start when dout arrives
        return out

    def _splits(self, x: torch.Tensor, m_splits):
        """Row blocks for per-expert weights (``None``: one weight for all rows)."""
        return None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """megatron ``dist_checkpointing``: Bridge's keys, global shapes and TP axes
        (:mod:`regather.checkpoint`); a replicated LoRA-A is declared as this rank's rows."""
        return checkpoint.adapter_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def extra_repr(self) -> str:
        kind = "column" if self.column_parallel else "row"
        return (f"base={self.facts.base_name}, {kind}-parallel, dim={self.dim}, alpha={self.alpha:g}, "
                f"strategy={self.strategy.value}")


def partial_output(out_i: torch.Tensor, rank: int, t: int) -> torch.Tensor:
    """A row-parallel expert adapter's output as its share of a sum over expert TP.

    An expert ``linear_fc2`` with ``explicit_expert_comm`` returns a *partial* ``[n, o]`` (its
    input is split over hidden): the token dispatcher's combine reduce-scatters the partials of
    the expert-TP ranks. The adapter's delta is complete on every rank once ``mid`` is reduced,
    ``out_i = mid B_i^T`` being its columns ``[rank*o/t, (rank+1)*o/t)``; placed there with
    zeros elsewhere, the ranks' sum is the delta exactly (each column has one non-zero term).
    Backward takes those columns of the (replicated) output gradient. Nothing is saved.
    """
    if t == 1:
        return out_i
    width = out_i.shape[-1]
    return torch.nn.functional.pad(out_i, (rank * width, (t - 1 - rank) * width))


_LORA_A = "linear_in.weight"


def _save_sharded_lora_a(module: ParallelLinearAdapter, state_dict, prefix, local_metadata):
    """Write a replicated LoRA-A as this rank's rows (the Bridge layout)."""
    key = prefix + _LORA_A
    if module.replicated_a and key in state_dict:
        state_dict[key] = state_dict[key][module._rows()].clone()
    return state_dict


def _load_lora_a(module: ParallelLinearAdapter, state_dict, prefix, local_metadata, strict,
                 missing_keys, unexpected_keys, error_msgs):
    """Convert a stored LoRA-A (rank shard or full ``[r, h]``) to this adapter's layout."""
    key = prefix + _LORA_A
    if key not in state_dict or not module.column_parallel or module.tp_size == 1:
        return
    stored, r, t = state_dict[key], module.dim, module.tp_size
    if stored.dim() != 2 or stored.shape[0] not in (r, r // t):
        return  # let load_state_dict report the size mismatch
    if module.replicated_a and stored.shape[0] == r // t:
        state_dict[key] = module._full_lora_a(stored.to(module.linear_in.weight.device))
    elif not module.replicated_a and stored.shape[0] == r and r != r // t:
        state_dict[key] = stored[module._rows()].clone()


def _group_size_rank(group) -> tuple[int, int]:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        if group is not None:
            raise RuntimeError("a TP group was given but torch.distributed is not initialised")
        return 1, 0
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def _validate(in_features, out_features, dim, dropout, dropout_position, column_parallel, tp,
              a_init, b_init, activation) -> None:
    if not isinstance(dim, int) or dim <= 0:
        raise ValueError(f"LoRA dim must be a positive integer, got {dim!r}")
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    if dropout_position not in DROPOUT_POSITIONS:
        raise ValueError(f"dropout_position must be one of {DROPOUT_POSITIONS}, got {dropout_position!r}")
    for name, method in (("lora_A_init_method", a_init), ("lora_B_init_method", b_init)):
        if method not in INIT_METHODS:
            raise ValueError(f"{name} must be one of {INIT_METHODS}, got {method!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"adapter activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    if column_parallel and dim % tp:
        raise ValueError(f"LoRA dim {dim} is not divisible by the tensor-parallel size {tp} "
                         "(LoRA-A of a column-parallel base is sharded over the rank)")
    if not column_parallel and in_features % tp:
        raise ValueError(f"in_features {in_features} is not divisible by the tensor-parallel size {tp}")
    if out_features % tp:
        raise ValueError(f"out_features {out_features} is not divisible by the tensor-parallel size {tp}")
