"""The adapters of expert linears: one per expert, shared by a grouped linear's experts, or per expert in one.

==================================== ================================================================
adapter                              what it adds to :class:`~regather.megatron.dense.adapter.ParallelLinearAdapter`
==================================== ================================================================
:class:`ExpertAdapter`               expert parameters (``allreduce=False`` at EP > 1, as megatron
                                     tags its own expert weights: DDP reduces them over expert DP);
                                     shared by a grouped linear's local experts (``expert_slots``):
                                     the same weights on every EP rank (broadcast at init) whose
                                     gradients are summed over EP, declared in each local expert's
                                     checkpoint slot (Megatron Bridge's ``share_expert_adapters``)
:class:`GroupedExpertAdapter`        one LoRA pair per local expert of a grouped linear (``[n, r, h]``),
                                     applied to the ``m_splits`` row blocks
==================================== ================================================================
"""

from __future__ import annotations

import torch
from torch import nn

from regather.core.strategies.lowrank import replicated_copy
from regather.megatron.dense import checkpoint as dense_checkpoint
from regather.megatron.dense.adapter import ParallelLinearAdapter, init_weight_
from regather.megatron.dense.adapter.weights import group_size_rank
from regather.megatron.moe import checkpoint


class ExpertAdapter(ParallelLinearAdapter):
    """The adapter of an expert linear (``is_expert``); ``ep_group`` and ``expert_slots`` for one
    adapter shared by a grouped linear's local experts."""

    def __init__(self, in_features: int, out_features: int, dim: int, *, ep_group=None, expert_slots=None,
                 **kwargs):
        super().__init__(in_features, out_features, dim, is_expert=True, **kwargs)
        # shared over EP: the same weights on every EP rank, gradients summed over EP (None at EP = 1)
        self.ep_group = ep_group if ep_group is not None and group_size_rank(ep_group)[0] > 1 else None
        # (first global expert, local experts, global experts) of a shared grouped adapter, or None
        self.expert_slots = expert_slots
        self._tag_expert()
        if self.ep_group is not None:
            self._broadcast_over_ep()

    def _tag_expert(self) -> None:
        """megatron's expert parameters carry ``allreduce=False`` when EP > 1: DDP reduces them
        over the expert data-parallel group, not the dense one (their gradients differ per EP
        rank). An expert adapter's weights are expert parameters too."""
        expert_parallel = getattr(self.config, "expert_model_parallel_size", 1) > 1
        for holder in (self.linear_in, self.linear_out):
            holder.weight.allreduce = not expert_parallel

    def _broadcast_over_ep(self) -> None:
        """Start a shared expert adapter from EP rank 0's weights (as Bridge does): every EP rank
        holds the same adapter, and its gradients, summed over EP, keep it so."""
        src = torch.distributed.get_global_rank(self.ep_group, 0)
        with torch.no_grad():
            for holder in (self.linear_in, self.linear_out):
                torch.distributed.broadcast(holder.weight.data, src=src, group=self.ep_group)

    def weights_for_forward(self, fuse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = super().weights_for_forward(fuse)
        if self.ep_group is not None:  # shared over EP: each rank's gradient is a partial sum
            a, b = replicated_copy(a, self.ep_group, fuse), replicated_copy(b, self.ep_group, fuse)
        return a, b

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """The dense adapter's entries; a shared grouped adapter's declared in each of its EP rank's
        expert slots (:func:`regather.megatron.moe.checkpoint.shared_over_experts`)."""
        out = dense_checkpoint.adapter_sharded_state_dict(self, prefix, sharded_offsets, metadata)
        if self.expert_slots is not None:
            out = checkpoint.shared_over_experts(self, out, sharded_offsets)
        return out


class ExpertWeights(nn.Module):
    """One 3-D weight ``[n_local, rows, cols]`` of a per-expert adapter, called to be read (megatron
    DDP's param-gather pre-hooks run on modules that own parameters, see :class:`~regather.megatron.dense.adapter.weights.ShardedWeight`)."""

    def __init__(self, weight: torch.Tensor, partition_dim: int, t: int):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.weight.tensor_model_parallel = t > 1
        self.weight.partition_dim = partition_dim
        self.weight.partition_stride = 1
        self.weight.expert_axis = 0  # local expert i is global expert ep_rank * n_local + i

    def forward(self) -> nn.Parameter:
        return self.weight


class GroupedExpertAdapter(ExpertAdapter):
    """One LoRA pair per local expert of a grouped linear (``share_expert_adapters=False``).

    ================= =============================== ========================================
    weight            shape (per rank)                Bridge name
    ================= =============================== ========================================
    LoRA-A, fc1       ``[n, r/t, h]``                 ``adapter.linear_in.weight``
    LoRA-A, fc2       ``[n, r, f/t]``                 ``adapter.linear_in.weight``
    LoRA-B            ``[n, o/t, r]``                 ``adapter.linear_out.weight``
    ================= =============================== ========================================

    (``n`` local experts, ``t`` expert TP.) Forward takes the grouped linear's ``m_splits``:
    rows ``[sum(m_splits[:i]), sum(m_splits[:i+1]))`` go through expert ``i``'s pair
    (:class:`~regather.core.wgrad.GroupedLinearWithWgrad`); the rank-``r`` middle of all
    experts is gathered (fc1) or reduced (fc2) over expert TP in one collective, where Bridge
    issues one per expert. Everything else — decisions, dropout, scale, the expert-TP
    communication — is :class:`~regather.megatron.dense.adapter.ParallelLinearAdapter`'s.
    """

    def __init__(self, in_features: int, out_features: int, dim: int, *, num_local_experts: int, **kwargs):
        if not isinstance(num_local_experts, int) or num_local_experts <= 0:
            raise ValueError(f"GroupedExpertAdapter: num_local_experts must be a positive integer, "
                             f"got {num_local_experts!r}")
        self.num_local_experts = num_local_experts
        super().__init__(in_features, out_features, dim, **kwargs)

    def init_master_weights(self, rank, in_features, out_features, a_init, b_init, dtype, tp_rank, tp) -> None:
        """Each expert from its own full master weights (LoRA rank ``rank``), then this TP rank's shard
        (TP-size independent)."""
        a_dim = 0 if self.column_parallel else 1
        a, b = [], []
        for _ in range(self.num_local_experts):
            a_i = init_weight_(torch.empty(rank, in_features, dtype=torch.float32), a_init)
            b_i = init_weight_(torch.empty(out_features, rank, dtype=torch.float32), b_init)
            a.append(a_i.chunk(tp, dim=a_dim)[tp_rank])
            b.append(b_i.chunk(tp, dim=0)[tp_rank])
        self.linear_in = ExpertWeights(torch.stack(a).to(dtype).contiguous(), a_dim + 1, tp)
        self.linear_out = ExpertWeights(torch.stack(b).to(dtype).contiguous(), 1, tp)

    def tag_lora_a(self) -> None:
        """Tagged when made (:class:`ExpertWeights`); experts never switch layout."""

    def row_blocks(self, x: torch.Tensor, m_splits):
        if m_splits is None:
            raise ValueError(f"per-expert LoRA on {self.log_name!r} needs "
                             "the grouped linear's m_splits (tokens per local expert)")
        splits = [int(m) for m in (m_splits.tolist() if torch.is_tensor(m_splits) else m_splits)]
        if len(splits) != self.num_local_experts or sum(splits) != x.shape[0] or min(splits, default=0) < 0:
            raise ValueError(f"per-expert LoRA on {self.log_name!r}: "
                             f"m_splits {splits} do not split {x.shape[0]} tokens over "
                             f"{self.num_local_experts} local experts")
        return splits

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Bridge's grouped per-expert keys: ``[E, ...]`` over EP on axis 0, expert TP on the
        weight's split axis, replicas along expert DP (:mod:`regather.megatron.moe.checkpoint`)."""
        return checkpoint.per_expert_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, experts={self.num_local_experts}"
