"""Distributed-checkpoint entries of expert adapters (Megatron Bridge 0.6.2's keys and shards).

=========================== ===================================== ============================================
adapter                     local weight                          declared as (``L`` layers, ``E`` experts)
=========================== ===================================== ============================================
SequentialMLP expert        ``[r/t, h]`` (fc1 A), ``[o/t, r]``     ``…experts.linear_fc1.adapter.linear_in.weight``
(``local_experts.N``)                                             ``(L, E, r, h)``: megatron's ``SequentialMLP``
                                                                  adds the expert axis and expert-DP replicas
                                                                  (:mod:`regather.megatron.dense.checkpoint`, unchanged)
grouped, shared             ``[r/t, h]``, one for the ``n`` local ``(L, E, r, h)``: the same tensor declared in
(``share_expert_adapters``) experts                               each of this EP rank's ``n`` expert slots;
                                                                  loading averages the slots it reads (equal
                                                                  copies: the copy itself)
grouped, per expert         ``[n, r/t, h]``                       ``(L, E, r, h)``: axis 0 split over EP, the
                                                                  split axis over expert TP, replicas along
                                                                  expert DP
=========================== ===================================== ============================================

Gated ``linear_fc1``'s LoRA-B keeps megatron's gate/up halves apart in every row (the SwiGLU
factory), so a checkpoint reshards across expert TP. The same global tensors in every layout is
what lets a checkpoint saved at EP=2 load at EP=1 or at EP=2 x ETP=2, and Bridge's expert
adapters load it (and it theirs).
"""

from __future__ import annotations

import dataclasses

import torch


def _with_axis(st, axis: int, index: int, size: int):
    """A ``ShardedTensor`` with one more leading axis (``size`` long) holding it at ``index``."""
    return dataclasses.replace(
        st,
        global_shape=st.global_shape[:axis] + (size,) + st.global_shape[axis:],
        global_offset=st.global_offset[:axis] + (index,) + st.global_offset[axis:],
        axis_fragmentations=st.axis_fragmentations[:axis] + (size,) + st.axis_fragmentations[axis:],
        prepend_axis_num=st.prepend_axis_num + 1,
    )


def over_expert_slots(value, axis: int, first: int, n_local: int, n_global: int):
    """``value`` (a ``ShardedTensor`` or ``ShardedTensorFactory``) declared once per local expert
    slot ``first .. first + n_local - 1`` of an expert axis ``n_global`` long at ``axis``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    inner_merge = value.merge_fn if isinstance(value, ShardedTensorFactory) else (lambda parts: parts[0])

    # ``key`` is the factory's key when megatron builds it: a parent (TEGroupedMLP) renames its
    # children's keys after they declared them, so the inner entry's own key is stale by then
    def inner(key, data, replica_id, flattened_range):
        if isinstance(value, ShardedTensor):
            return [dataclasses.replace(value, key=key, data=data, replica_id=replica_id)]
        built = value.build_fn(key, data, replica_id, flattened_range)
        return built if isinstance(built, list) else [built]

    @torch.no_grad()
    def build(key, data, replica_id, flattened_range):
        parts = inner(key, data, replica_id, flattened_range)
        return [_with_axis(st, axis, first + slot, n_global) for slot in range(n_local) for st in parts]

    def merge(loaded):
        loaded = loaded if isinstance(loaded, list) else [loaded]
        k = len(loaded) // n_local
        copies = [inner_merge(loaded[i * k:(i + 1) * k]) for i in range(n_local)]
        if all(torch.equal(c, copies[0]) for c in copies[1:]):
            return copies[0]
        return torch.stack([c.float() for c in copies]).mean(dim=0).to(copies[0].dtype)

    return ShardedTensorFactory(value.key, value.data, build, merge, value.replica_id,
                                flattened_range=getattr(value, "flattened_range", None))


def shared_over_experts(adapter, entries: dict, sharded_offsets) -> dict:
    """A shared grouped adapter's entries over its EP rank's expert slots; its holders'
    ``_extra_state`` only from expert-TP rank 0 of EP rank 0 (one object, not one per rank)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    first, n_local, n_global = adapter.expert_slots
    keep_objects = adapter.tp_rank == 0 and first == 0
    edp_rank = parallel_state.get_expert_data_parallel_rank()
    out = {}
    for key, value in entries.items():
        if isinstance(value, ShardedObject):
            if keep_objects:
                out[key] = value
            continue
        value.replica_id = (*value.replica_id[:2], edp_rank)  # copies differ by expert-DP rank only
        out[key] = over_expert_slots(value, len(sharded_offsets), first, n_local, n_global)
    return out


def _swiglu_halves(st, local_axis: int):
    """A factory saving ``st``'s gate and up halves (along ``local_axis``) as megatron shards a
    gated fc1: rank ``k`` of ``f`` holds rows ``k`` of each half, ``2f`` fragments in all."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    g = local_axis + st.prepend_axis_num
    half = st.local_shape[local_axis] // 2
    rank, frag = st.global_offset[g] // st.local_shape[local_axis], st.axis_fragmentations[g]

    def part(key, data, index):
        return dataclasses.replace(
            st, key=key, data=data, local_shape=data.shape,
            global_offset=st.global_offset[:g] + (index * half,) + st.global_offset[g + 1:],
            axis_fragmentations=st.axis_fragmentations[:g] + (2 * frag,) + st.axis_fragmentations[g + 1:])

    @torch.no_grad()
    def build(key, data, replica_id, flattened_range):
        w, v = torch.chunk(data, 2, dim=local_axis)
        return [dataclasses.replace(part(key, w, rank), replica_id=replica_id),
                dataclasses.replace(part(key, v, rank + frag), replica_id=replica_id)]

    def merge(loaded):
        return torch.cat(loaded, dim=local_axis)

    return ShardedTensorFactory(st.key, st.data, build, merge, st.replica_id)


def per_expert_sharded_state_dict(adapter, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
    """:class:`regather.megatron.moe.experts.GroupedExpertAdapter`'s ``[n, ...]`` weights (table above)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    ep = parallel_state.get_expert_model_parallel_group()
    ep_size, ep_rank = torch.distributed.get_world_size(ep), torch.distributed.get_rank(ep)
    edp_rank = parallel_state.get_expert_data_parallel_rank()
    p = len(sharded_offsets)
    out = {}
    for name, holder in (("linear_in", adapter.linear_in), ("linear_out", adapter.linear_out)):
        w = holder.weight
        offsets = [*sharded_offsets, (p, ep_rank, ep_size)]
        if adapter.tp_size > 1:
            offsets.append((p + w.partition_dim, adapter.tp_rank, adapter.tp_size))
        key = f"{prefix}{name}.weight"
        st = ShardedTensor.from_rank_offsets(key, w, *offsets, replica_id=(0, 0, edp_rank), prepend_axis_num=p)
        if name == "linear_out" and adapter.facts.base_name == "linear_fc1" and getattr(
                adapter.config, "gated_linear_unit", False):
            st = _swiglu_halves(st, 1)
        out[key] = st
    return out
