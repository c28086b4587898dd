"""LoRA on mixture-of-experts layers: which linears are experts, and their sizes and groups.

megatron-core builds experts three ways; regather adapts each with Megatron Bridge 0.6.2's
layout, names and checkpoint keys:

========================= ======================================== ==============================================
expert module             expert linears                           adapters (``share_expert_adapters``)
========================= ======================================== ==============================================
``SequentialMLP``         ``local_experts.N.linear_fc1/2``:        one :class:`~regather.megatron.moe.adapters.ExpertAdapter`
                          megatron ``Column/RowParallelLinear``    per expert (the option does not apply)
                          with ``is_expert=True``
``TEGroupedMLP``          ``experts.linear_fc1/2``:                ``True`` (default): one adapter shared by the
                          ``TEColumn/RowParallelGroupedLinear``    local experts, the same on every EP rank
                          (``weight0..weight{n-1}``, ``m_splits``) (broadcast at init, gradients summed over EP);
                                                                   ``False``: :class:`~.adapters.GroupedExpertAdapter`, one
                                                                   LoRA pair per local expert (``[n, r, h]``)
``shared_experts``        dense megatron linears (dense TP group)  dense rules (``SharedExpertMLP`` is an MLP)
========================= ======================================== ==============================================

Every expert linear leaves its TP communication to the token dispatcher
(``explicit_expert_comm``; TE: ``parallel_mode=None``): its input ``[n, h]`` is the same on
every expert-TP rank and its input gradient stays partial, reduce-scattered by the dispatcher's
reverse; an expert ``linear_fc2`` returns a partial output the combine sums over expert TP.
The adapters do the same over the *expert-TP* group (the linears' own group, not the dense TP
group): the ``dispatched`` LoRA-A path for ``linear_fc1``
(:mod:`regather.core.strategies.local`), and for ``linear_fc2`` the reduced rank-``r`` middle with
the output placed as this rank's share of the sum (:func:`regather.megatron.dense.adapter.partial_output`). That
is what keeps them right at expert TP > 1. An expert's input is never a sequence shard, so
expert adapters run the gather path's LoRA-A (no re-gather exists for them) and say so.

With EP > 1 their weights are expert parameters (``allreduce=False``: megatron DDP reduces
them over the expert data-parallel group), as megatron tags its own expert weights.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from regather.megatron import compat

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


def grouped_sizes(module: nn.Module, column: bool, t: int) -> tuple[int, int]:
    """``(in, out)`` of one expert of a grouped linear, unsharded: ``weight0`` is this rank's
    ``[out/t, in]`` (column) or ``[out, in/t]`` (row) over the expert-TP group."""
    out_local, in_local = module.weight0.shape
    return (int(in_local), int(out_local) * t) if column else (int(in_local) * t, int(out_local))


def ep_group_of(module: nn.Module):
    """The expert-parallel group of a grouped linear (its process-group collection)."""
    pgs = compat.private(module, compat.PG_COLLECTION)
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


def grouped_ep_group(module: nn.Module) -> object | None:
    """The EP group a shared grouped adapter is replicated over (None at EP = 1)."""
    group = ep_group_of(module)
    return group if torch.distributed.get_world_size(group) > 1 else None
