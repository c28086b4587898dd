"""LoRA on mixture-of-experts layers: which linears are experts, and the per-expert adapter.

megatron-core builds experts three ways; regather adapts each with Megatron Bridge 0.6.2's
layout, names and checkpoint keys:

========================= ======================================== ==============================================
expert module             expert linears                           adapters (``share_expert_adapters``)
========================= ======================================== ==============================================
``SequentialMLP``         ``local_experts.N.linear_fc1/2``:        one :class:`~regather.adapter.ParallelLinear\
                          megatron ``Column/RowParallelLinear``    Adapter` per expert (the option does not apply)
                          with ``is_expert=True``
``TEGroupedMLP``          ``experts.linear_fc1/2``:                ``True`` (default): one adapter shared by the
                          ``TEColumn/RowParallelGroupedLinear``    local experts, the same on every EP rank
                          (``weight0..weight{n-1}``, ``m_splits``) (broadcast at init, gradients summed over EP);
                                                                   ``False``: :class:`GroupedExpertAdapter`, one
                                                                   LoRA pair per local expert (``[n, r, h]``)
``shared_experts``        dense megatron linears (dense TP group)  dense rules (``SharedExpertMLP`` is an MLP)
========================= ======================================== ==============================================

Every expert linear leaves its TP communication to the token dispatcher
(``explicit_expert_comm``; TE: ``parallel_mode=None``): its input ``[n, h]`` is the same on
every expert-TP rank and its input gradient stays partial, reduce-scattered by the dispatcher's
reverse; an expert ``linear_fc2`` returns a partial output the combine sums over expert TP.
The adapters do the same over the *expert-TP* group (the linears' own group, not the dense TP
group): the ``dispatched`` LoRA-A path for ``linear_fc1``
(:mod:`regather.strategies.local`), and for ``linear_fc2`` the reduced rank-``r`` middle with
the output placed as this rank's share of the sum (:func:`regather.adapter.partial_output`). That
is what keeps them right at expert TP > 1. An expert's input is never a sequence shard, so
expert adapters run the gather path's LoRA-A (no re-gather exists for them) and say so.

With EP > 1 their weights are expert parameters (``allreduce=False``: megatron DDP reduces
them over the expert data-parallel group), as megatron tags its own expert weights.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from regather.adapter import ParallelLinearAdapter, init_weight_

GROUPED_CLASSES = ("TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear", "TEGroupedLinear")
_EXPERT_NAME = re.compile(r".*mlp\..*experts.*\.linear_fc[1-2]$")  # Bridge's is_expert_linear


def is_grouped_linear(module: nn.Module) -> bool:
    """A TE grouped expert linear (megatron's wrapper, or a stand-in with its name)."""
    return bool({c.__name__ for c in type(module).__mro__} & set(GROUPED_CLASSES)) and hasattr(module, "num_gemms")


def is_expert_linear(path: str, module: nn.Module) -> bool:
    """An expert's linear: megatron tags its own (``is_expert``); grouped linears are always
    experts; Bridge's name rule (``…mlp.…experts….linear_fc1/2``, not ``shared_experts``) covers
    the rest."""
    if getattr(module, "is_expert", False) or is_grouped_linear(module):
        return True
    return _EXPERT_NAME.match(path) is not None and ".shared_experts." not in path


def explicit_comm(module: nn.Module) -> bool:
    """The linear does no TP communication of its own (its caller does)."""
    return bool(getattr(module, "explicit_expert_comm", False)) or (
        hasattr(module, "parallel_mode") and module.parallel_mode is None)


def tp_group_of(module: nn.Module):
    """The TP group the linear's weights are split over: megatron's TE wrappers keep it as
    ``_tp_group`` (TE's own ``tp_group`` is None once megatron hid expert TP from TE)."""
    group = getattr(module, "_tp_group", None)
    return group if group is not None else getattr(module, "tp_group", None)


def grouped_sizes(module: nn.Module, column: bool, t: int) -> tuple[int, int]:
    """``(in, out)`` of one expert of a grouped linear, unsharded: ``weight0`` is this rank's
    ``[out/t, in]`` (column) or ``[out, in/t]`` (row) over the expert-TP group."""
    out_local, in_local = module.weight0.shape
    return (int(in_local), int(out_local) * t) if column else (int(in_local) * t, int(out_local))


def ep_group_of(module: nn.Module):
    """The expert-parallel group of a grouped linear (its process-group collection)."""
    pgs = getattr(module, "_pg_collection", None)
    if pgs is not None and getattr(pgs, "ep", None) is not None:
        return pgs.ep
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_group()


def expert_slots(module: nn.Module) -> tuple[int, int, int]:
    """``(first global expert, local experts, global experts)`` of this EP rank's grouped linear."""
    group = ep_group_of(module)
    size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    n = module.num_gemms
    return rank * n, n, size * n


def expert_dim(config, dim: int, normalize: bool, column: bool, t: int) -> int:
    """Bridge's ``normalize_moe_lora``: an expert's rank is ``dim // moe_router_topk`` (so a token's
    top-k experts together hold ``dim``), rounded up to a multiple of expert TP for a
    column-parallel base (its LoRA-A is split over the rank)."""
    if not normalize:
        return dim
    topk = getattr(config, "moe_router_topk", None)
    if not topk or topk <= 0:
        raise ValueError(f"LoRA(normalize_moe_lora=True) needs the model's moe_router_topk > 0, got {topk!r}")
    if dim % topk:
        raise ValueError(f"LoRA(dim={dim}, normalize_moe_lora=True): dim must be divisible by "
                         f"moe_router_topk={topk}")
    r = dim // topk
    if column and t > 1 and r % t:
        r = -(-r // t) * t
    return r


class _ExpertWeights(nn.Module):
    """One 3-D weight ``[n_local, rows, cols]`` of a per-expert adapter, called to be read (megatron
    DDP's param-gather pre-hooks run on modules that own parameters, see ``_ShardedWeight``)."""

    def __init__(self, weight: torch.Tensor, partition_dim: int, t: int):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.weight.tensor_model_parallel = t > 1
        self.weight.partition_dim = partition_dim
        self.weight.partition_stride = 1
        self.weight.expert_axis = 0  # local expert i is global expert ep_rank * n_local + i

    def forward(self) -> nn.Parameter:
        return self.weight


class GroupedExpertAdapter(ParallelLinearAdapter):
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
    (:class:`~regather.strategies.wgrad.GroupedLinearWithWgrad`); the rank-``r`` middle of all
    experts is gathered (fc1) or reduced (fc2) over expert TP in one collective, where Bridge
    issues one per expert. Everything else — decisions, dropout, scale, the expert-TP
    communication — is :class:`~regather.adapter.ParallelLinearAdapter`'s.
    """

    def __init__(self, in_features: int, out_features: int, dim: int, *, num_local_experts: int, **kwargs):
        if not isinstance(num_local_experts, int) or num_local_experts <= 0:
            raise ValueError(f"GroupedExpertAdapter: num_local_experts must be a positive integer, "
                             f"got {num_local_experts!r}")
        self.num_local_experts = num_local_experts
        super().__init__(in_features, out_features, dim, is_expert=True, **kwargs)

    def _init_weights(self, dim, in_features, out_features, a_init, b_init, dtype, rank, tp) -> None:
        """Each expert from its own full master weights, then this rank's shard (TP-size independent)."""
        a_dim = 0 if self.column_parallel else 1
        a, b = [], []
        for _ in range(self.num_local_experts):
            a_i = init_weight_(torch.empty(dim, in_features, dtype=torch.float32), a_init)
            b_i = init_weight_(torch.empty(out_features, dim, dtype=torch.float32), b_init)
            a.append(a_i.chunk(tp, dim=a_dim)[rank])
            b.append(b_i.chunk(tp, dim=0)[rank])
        self.linear_in = _ExpertWeights(torch.stack(a).to(dtype).contiguous(), a_dim + 1, tp)
        self.linear_out = _ExpertWeights(torch.stack(b).to(dtype).contiguous(), 1, tp)

    def _tag_lora_a(self) -> None:
        """Tagged when made (:class:`_ExpertWeights`); experts never switch layout."""

    def _splits(self, x: torch.Tensor, m_splits):
        if m_splits is None:
            raise ValueError(f"per-expert LoRA on {getattr(self, 'qualified_name', self.facts.base_name)!r} needs "
                             "the grouped linear's m_splits (tokens per local expert)")
        splits = [int(m) for m in (m_splits.tolist() if torch.is_tensor(m_splits) else m_splits)]
        if len(splits) != self.num_local_experts or sum(splits) != x.shape[0] or min(splits, default=0) < 0:
            raise ValueError(f"per-expert LoRA on {getattr(self, 'qualified_name', self.facts.base_name)!r}: "
                             f"m_splits {splits} do not split {x.shape[0]} tokens over "
                             f"{self.num_local_experts} local experts")
        return splits

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Bridge's grouped per-expert keys: ``[E, ...]`` over EP on axis 0, expert TP on the
        weight's split axis, replicas along expert DP (:mod:`regather.checkpoint_experts`)."""
        from regather.checkpoint_experts import per_expert_sharded_state_dict

        return per_expert_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, experts={self.num_local_experts}"


def grouped_ep_group(module: nn.Module) -> Optional[object]:
    """The EP group a shared grouped adapter is replicated over (None at EP = 1)."""
    group = ep_group_of(module)
    return group if torch.distributed.get_world_size(group) > 1 else None
