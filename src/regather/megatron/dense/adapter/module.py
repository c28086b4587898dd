"""``ParallelLinearAdapter``: a LoRA adapter beside a megatron tensor-parallel linear.

The class is assembled from its halves: the decisions (:mod:`.decisions`), the forward
(:mod:`.forward`, with the data flow of each layout) and the weights (:mod:`.weights`); this
module holds the constructor and the LoRA-A layout (sharded, or replicated for lowrank) with the
strategy switch.

Layouts (docs/design.md §2; parameter names follow Megatron Bridge checkpoints):

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

``scale = alpha / rank`` (the LoRA rank ``r``: Megatron Bridge's ``dim``); dropout on the adapter input ("pre") or output
("post"). Every forward evaluates :func:`regather.megatron.dense.eligibility.unsupported_reason`;
when the requested strategy cannot run, the gather path runs instead with
unchanged numerics and the first reason is logged once (a replicated LoRA-A
then runs as its rank's rows, see :mod:`regather.core.strategies.lowrank`).

Checkpoints always hold the sharded (Bridge) layout: a low-rank adapter
writes its rank's rows ``A[rank*r/t:(rank+1)*r/t]`` and, on load, all-gathers
the shards over the TP group (so ``load_state_dict`` is a collective for a
low-rank adapter with ``t > 1``: call it on every TP rank, as megatron does). A
full ``[r, h]`` tensor is also accepted by every layout. Any strategy therefore
loads any other's checkpoint and computes the same function.
"""

from __future__ import annotations

import torch
from torch import nn

from regather.core import comm
from regather.core.buffers import ScratchPool
from regather.core.strategies import Strategy
from regather.core.strategies.lowrank import (
    GRAD_ALLREDUCE_BACKWARD,
    GRAD_ALLREDUCE_FINALIZE,
    GRAD_ALLREDUCE_MODES,
    shard_rows,
)
from regather.megatron.dense import checkpoint
from regather.megatron.dense.adapter.decisions import AdapterDecisions
from regather.megatron.dense.adapter.forward import ACTIVATIONS, AdapterForward
from regather.megatron.dense.adapter.weights import (
    ShardedWeight,
    group_size_rank,
    init_weight_,
    load_lora_a,
    save_sharded_lora_a,
    validate,
)
from regather.megatron.dense.eligibility import AdapterFacts


class ParallelLinearAdapter(AdapterDecisions, AdapterForward, nn.Module):
    """LoRA ``B(A(x)) * alpha/r`` matched to a megatron column- or row-parallel linear. Its LoRA
    rank ``r`` is the constructor's ``dim`` (Megatron Bridge's name) and :attr:`rank` here."""

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
        alpha: float | None = None,
        dropout: float = 0.0,
        dropout_position: str = "pre",
        lora_A_init_method: str = "xavier",
        lora_B_init_method: str = "zero",
        activation: str = "identity",
        a2a_experts: bool = False,
        strategy: Strategy | str = Strategy.GATHER,
        early_regather: bool = True,
        lowrank_grad_allreduce: str = GRAD_ALLREDUCE_BACKWARD,
        gradient_accumulation_fusion: bool | None = None,
        recompute_inputs: bool = False,
        lean_transients: bool | None = None,
        params_dtype: torch.dtype | None = None,
        device=None,
        pool: ScratchPool | None = None,
    ):
        super().__init__()
        tp, tp_rank = group_size_rank(tp_group)
        validate(in_features, out_features, dim, dropout, dropout_position, column_parallel, tp,
                 lora_A_init_method, lora_B_init_method, activation, ACTIVATIONS)
        self.rank = dim  # the LoRA rank r
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
        self.tp_size, self.tp_rank = tp, tp_rank
        self.config = config
        self.tp_group = tp_group
        self.column_parallel = column_parallel
        # explicit_comm: the base's caller (MoE token dispatcher) does every TP collective
        self.sequence_parallel = bool(sequence_parallel and tp > 1 and not explicit_comm)
        if gradient_accumulation_fusion is None:
            gradient_accumulation_fusion = bool(getattr(config, "gradient_accumulation_fusion", False))
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.pool = pool
        # LoRA's output added into the base's in place, in chunks (regather.core.peak): None = every
        # strategy but gather; True / False as set
        if lean_transients not in (None, True, False):
            raise ValueError(f"lean_transients must be None, True or False, got {lean_transients!r}")
        self.lean_transients = lean_transients
        self.init_decisions(recompute_inputs)
        self.activation_fn = ACTIVATIONS[activation]  # between LoRA-A and LoRA-B (None: identity)
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
        self.init_master_weights(dim, in_features, out_features, lora_A_init_method, lora_B_init_method,
                                 params_dtype, tp_rank, tp)
        self.tag_lora_a()
        if device is not None:
            self.to(device)
        self._register_state_dict_hook(save_sharded_lora_a)
        self._register_load_state_dict_pre_hook(load_lora_a, with_module=True)

    def init_master_weights(self, rank, in_features, out_features, a_init, b_init, dtype, tp_rank, tp) -> None:
        """Full master weights (LoRA rank ``rank``) from the default generator, then this TP rank's
        shard: every TP size starts from the same adapter."""
        a = init_weight_(torch.empty(rank, in_features, dtype=torch.float32), a_init)
        b = init_weight_(torch.empty(out_features, rank, dtype=torch.float32), b_init)
        a, b = a.to(dtype), b.to(dtype)
        self.linear_in = ShardedWeight(a, 0 if self.column_parallel else 1, tp_rank, tp)
        self.linear_out = ShardedWeight(b, 0, tp_rank, tp)
        if self._wants_replicated(self._strategy):
            # the full master weight the sharded layouts slice: every strategy starts identical
            self.linear_in.weight = nn.Parameter(a.contiguous())

    @property
    def dim(self) -> int:
        """The LoRA rank under Megatron Bridge's name (its ``ParallelLinearAdapter.dim``)."""
        return self.rank

    @property
    def dispatched(self) -> bool:
        """The base's caller does its TP communication (MoE experts at any EP x ETP, shared experts
        with overlap): no collective on the input, a partial output for a row-parallel base."""
        return self.facts.explicit_comm or self.facts.is_expert

    # -- LoRA-A layout -------------------------------------------------------------
    def _wants_replicated(self, strategy: Strategy) -> bool:
        """lowrank's replicated LoRA-A; experts never run lowrank, so they keep the shards."""
        return (strategy == Strategy.LOWRANK and self.column_parallel and self.tp_size > 1
                and not self.facts.is_expert and not self.facts.explicit_comm)

    @property
    def replicated_a(self) -> bool:
        """LoRA-A holds the full ``[r, h]`` on every rank (low-rank strategy)."""
        w = self.linear_in.weight
        return (w.dim() == 2 and w.shape[0] == self.rank and self.column_parallel and self.tp_size > 1
                and not self.dispatched)

    @property
    def lowrank_reduce_in_backward(self) -> bool:
        return self.lowrank_grad_allreduce == GRAD_ALLREDUCE_BACKWARD

    def tag_lora_a(self) -> None:
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
                w.data = self.full_lora_a(w.detach()) if want else w.detach()[self.lora_a_rows()].clone()
        self._strategy = value
        self.tag_lora_a()

    def lora_a_rows(self) -> slice:
        """This rank's rows of a full ``[r, h]`` LoRA-A (the sharded layout)."""
        return shard_rows(self.rank, self.tp_rank, self.tp_size)

    def full_lora_a(self, shard: torch.Tensor) -> torch.Tensor:
        """All-gather the rank shards ``[r/t, h]`` into ``[r, h]`` (a collective)."""
        return comm.all_gather_seq(shard.contiguous(), self.tp_group)


    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """megatron ``dist_checkpointing``: Bridge's keys, global shapes and TP axes
        (:mod:`regather.megatron.dense.checkpoint`); a replicated LoRA-A is declared as this rank's rows."""
        return checkpoint.adapter_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def extra_repr(self) -> str:
        kind = "column" if self.column_parallel else "row"
        return (f"base={self.facts.base_name}, {kind}-parallel, dim={self.rank}, alpha={self.alpha:g}, "
                f"strategy={self.strategy.value}")
