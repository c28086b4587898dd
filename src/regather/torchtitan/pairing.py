"""Where an adapter's gathered input comes from: the sequence gather recorded in this forward.

Under sequence parallelism a column-parallel linear reads an input all-gathered over the
sequence (``Shard(1) -> Replicate``). regather needs the shard it came from — never guessed: the
gather is *recorded* where it happens, and an adapter pairs its input with a record by identity.

============================ ================================ =================================
site                         where the gather happens          recorded by
============================ ================================ =================================
torchtitan (``converter``)   the parent module's input         :func:`watch_redistribution`: wraps
                             redistribution (``attention``,    that module's ``_redistribute_inputs``
                             ``feed_forward``: one gather for  (``Module.parallelize`` looks it up on
                             ``wqkv``; one for ``w1`` + ``w3``) every call)
by hand (``apply_lora``)     the linear's ``ColwiseParallel``  :func:`watch_colwise_input`: a forward
                             input pre-hook (one gather per    pre-hook before the style's and one
                             linear)                           after it
============================ ================================ =================================

A record (:class:`Gathered`) holds the gathered tensor the base reads, its version, the shard,
the sequence dim and the group it was gathered on; it lives until the site's module returns.
What counts as a sequence gather is :func:`.layout.sequence_gather`'s: DTensor placements, or
under ``spmd_types`` (plain tensors) the site's declared input layouts. For early re-gather the site puts
one anchor on the gathered tensor for every member adapter that will regather
(:mod:`regather.core.strategies.shared_anchor`): its backward runs when every reader of the
gathered input — bases and adapters — produced its gradient, right before the site's
reduce-scatter, and computes the deferred ``dA``'s there; the members on one shard share one
backward gather. A wrapper that re-wraps the input (spmd_types' ``local_map`` under a dispatch
mode) is paired by the same local storage and view geometry (:func:`~.layout.same_view`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from regather.core.strategies.shared_anchor import AnchorMembers, anchor_shared
from regather.core.strategies.shared_gather import SharedGather
from regather.torchtitan import compat, reasons
from regather.torchtitan.layout import same_view, sequence_gather
from regather.torchtitan.runstate import in_checkpoint


@dataclass
class Gathered:
    """One sequence gather of this forward."""

    full: torch.Tensor            # the gathered tensor the base reads (anchored when early)
    version: int
    shard: torch.Tensor           # the tensor it was gathered from
    dim: int                      # the sequence dim
    group: object                 # the tensor-parallel process group it was gathered on
    anchored: list = field(default_factory=list)   # the adapters whose dA the anchor computes
    anchor: AnchorMembers | None = None
    share: SharedGather | None = None               # their shared backward gather (opened by the first)


class GatherSite:
    """A place where one sequence gather feeds adapters (``members``, set when attached)."""

    def __init__(self, module=None) -> None:
        self.module = module  # the torchtitan module whose input redistribution gathers (None: by hand)
        self.members: list = []
        self._records: list[Gathered] = []

    def clear(self, *_args) -> None:
        self._records = []

    def record(self, before, after, name: str | None = None):
        """Record ``after`` if it is ``before`` (the site's input ``name``) gathered over the
        sequence; return the tensor to hand on (``after``, or ``after`` through the early-regather
        anchor)."""
        found = sequence_gather(self.module, name, before, after)
        if found is None:
            return after
        dim, group = found
        early = [m for m in self.members if m.wants_anchor()]
        anchor = None
        if early and torch.is_grad_enabled() and after.requires_grad and not in_checkpoint():
            anchor = AnchorMembers(len(early))
            after = anchor_shared(after, [m.lora_a.weight for m in early], anchor)
        self._records.append(Gathered(after, after._version, before, dim, group, early if anchor else [], anchor))
        return after

    def find(self, x: torch.Tensor) -> tuple[Gathered | None, str | None]:
        """The record whose gathered tensor ``x`` is, or why there is none."""
        for rec in self._records:
            if rec.full is x or same_view(rec.full, x):
                if x._version != rec.version:
                    return None, reasons.GATHER_MODIFIED
                return rec, None
        return None, reasons.NOT_THIS_GATHER

    def find_traced(self, x: torch.Tensor) -> Gathered | None:
        """The record whose gathered tensor ``x`` is, in a traced forward (``torch.compile``):
        by identity, which Dynamo resolves while tracing (no version counter, no storage)."""
        for rec in self._records:
            if rec.full is x:
                return rec
        return None


def watch_redistribution(module) -> GatherSite:
    """The site of a torchtitan ``Module`` whose input redistribution gathers (once per module)."""
    site = getattr(module, "_regather_gather_site", None)
    if site is not None:
        return site
    site = GatherSite(module)

    def recording(redistribute):
        def redistribute_inputs(parallel_dims, args, kwargs):
            # torchtitan hands positional inputs back in their order and keyword inputs by name
            site.clear()
            new_args, new_kwargs = redistribute(parallel_dims, args, kwargs)
            names = compat.input_names(module, args, kwargs)
            new_args = tuple(site.record(old, new, name) for old, new, name in zip(args, new_args, names)) \
                + tuple(new_args[len(names):])
            new_kwargs = {name: site.record(kwargs.get(name), value, name) for name, value in new_kwargs.items()}
            return new_args, new_kwargs

        return redistribute_inputs

    compat.wrap_input_redistribution(module, recording)
    module.register_forward_hook(site.clear, always_call=True)
    module._regather_gather_site = site
    return site


def watch_colwise_input(linear: torch.nn.Module) -> GatherSite:
    """The site of a linear parallelized by hand with ``ColwiseParallel(input_layouts=Shard(d))``:
    a pre-hook before the style's records its input, one after it the gathered input."""
    site = GatherSite()
    seen: dict = {}

    def before(module, args):
        site.clear()
        seen["x"] = args[0] if args else None

    def after(module, args):
        x = seen.pop("x", None)
        if not args:
            return None
        y = site.record(x, args[0])
        return None if y is args[0] else (y, *args[1:])

    linear.register_forward_pre_hook(before, prepend=True)
    linear.register_forward_pre_hook(after)
    linear.register_forward_hook(site.clear, always_call=True)
    return site
