"""LoRA-A on an input that needs no sequence gather.

=================== ===================== ============================================
path                input                 LoRA-A
=================== ===================== ============================================
``row``             ``x_i [s, b, h/t]``   row-parallel ``A_i [r, h/t]`` (``linear_proj``,
                    (split over hidden)   ``linear_fc2``); the adapter reduces ``mid``
``replicated``      ``x [s, b, h]``       column-parallel ``A_i [r/t, h]`` without SP;
                    (same on every rank)  ``dX`` is all-reduced over TP (a copy to the group)
``dispatched``      ``x [n, h]`` (the     column-parallel ``A_i [r/t, h]`` of a base that
                    token dispatcher's    leaves TP communication to its caller (MoE
                    output, same on every experts: ``explicit_expert_comm``); ``dX`` stays
                    expert-TP rank)       partial, as the base's: the dispatcher's reverse
                                          reduce-scatters both over expert TP
=================== ===================== ============================================

``row`` and ``dispatched`` also run per-expert adapters (``splits``: the ``m_splits`` row
blocks of grouped experts, one LoRA-A per block, :class:`~regather.core.wgrad.
GroupedLinearWithWgrad`).

Saved for backward: the input, through the path's source — kept, or recomputed from what its
producer already keeps (:mod:`regather.core.recompute.sources`): for ``row`` (``linear_fc2``)
the MLP activation's input, for ``replicated`` (``linear_qkv`` / ``linear_fc1`` at TP = 1 or
with SP off) the norm's input, exactly as under SP (the input is the norm's whole output then,
not a shard of it). No collective of their own beyond the copy's
backward all-reduce.
"""

from __future__ import annotations

from regather.core import mappings
from regather.core.wgrad import linear


def local_linear_a(x, weight, args):
    """``row`` and ``dispatched``: ``x A^T`` on the input as it is (per-expert row blocks with
    ``args.splits``), saved through ``args.source``; with ``args.junction`` its input gradient is
    added into the base's in place (:mod:`regather.core.peak.junction`)."""
    return linear(x, weight, args.fuse, args.source, args.splits, into=args.junction)


def replicated_linear_a(x, weight, args):
    """``replicated``: ``x A_i^T``, saved through ``args.source``; backward all-reduces ``dX`` over
    TP (a copy to the group) — or, with ``args.junction``, all-reduces it chunk by chunk on its way
    into the base's input gradient."""
    if args.junction is not None:
        return linear(x, weight, args.fuse, args.source, into=args.junction)
    return linear(mappings.copy_to_group(x, args.group), weight, args.fuse, args.source)
