"""Producers watched by forward hooks: the generic part every front end shares.

A producer is the op whose output is an adapter's input (a norm before ``linear_qkv`` /
``wqkv``, an MLP activation before ``linear_fc2`` / ``w2``). :class:`HookedProducer` records,
in the producer module's own forward hook (registered first, ``prepend=True``), its output and
where its input lives; the adapter's ``capture`` then checks, every forward, that its input is
that output, unmodified, computed from the producer's input alone, and that the producer's
autograd node saved that input (:mod:`regather.core.recompute.graph`). Front ends decide which
module is whose producer; :class:`NormProducer` is the norm every front end has (a megatron
``input_layernorm``, torchtitan's ``attention_norm`` read by ``wqkv``, and by ``w1`` and ``w3``
at once).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from regather.core.recompute.graph import Meta, kept_between, modified_in_place, reason_now, same_tensor
from regather.core.recompute.sources import Captured, Kept, Recomputed


class HookedProducer:
    """A producer module watched by a forward hook: its last forward's output (weakly, for
    identity), its input's place (:class:`~regather.core.recompute.graph.Meta`) and autograd node.

    ``capture(x)`` (called by the adapter in the same forward, before it saves anything) returns
    a :class:`~regather.core.recompute.sources.Recomputed` source saving the producer's input, as
    its own node keeps it, in place of ``x`` — or ``Kept(why not)``. Subclasses give ``name`` and
    ``recompute(*saved)``, and may read another output (:meth:`output_of`) or refuse by
    configuration (:meth:`static_reason`). A producer read by one adapter forgets its forward once
    captured; one read by several (``shared``: torchtitan's ``ffn_norm`` before ``w1`` and
    ``w3``) keeps it until its next forward."""

    name = "the producer"
    shared = False
    #: why ``capture`` refuses an input that is not this forward's output (``{name}``: the producer)
    not_output = "the adapter input is not {name}'s output of this forward"

    def __init__(self, module: nn.Module):
        self.module = module
        self._clear()
        # first of the module's forward hooks: a later one that modifies the output in place
        # bumps its version, one that replaces it breaks the identity (both seen by capture)
        self._handle = module.register_forward_hook(self._seen, prepend=True)

    def static_reason(self) -> str | None:
        """A reason known from the configuration alone (before a forward), or None."""
        return None

    def remove(self) -> None:
        """Stop watching the module (its hook is removed)."""
        self._handle.remove()

    def _clear(self):
        self._out, self._meta, self._stop, self._version = None, None, None, None

    def output_of(self, result):
        """The tensor of the module's forward result the adapter reads (the result itself)."""
        return result

    def _seen(self, module, args, result):
        out = self.output_of(result)
        if torch.compiler.is_compiling():  # a traced forward rebuilds nothing (its partitioner decides)
            self._clear()
            return
        if not (torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor)
                and isinstance(out, torch.Tensor)):
            self._clear()
            return
        self._out, self._version = weakref.ref(out), out._version
        self._meta, self._stop = Meta(args[0]), args[0].grad_fn

    def produced(self, x: torch.Tensor) -> bool:
        """``x`` is this producer's output of its last forward."""
        out = self._out() if self._out is not None else None
        return out is not None and same_tensor(x, out)

    def capture(self, x: torch.Tensor) -> Captured:
        out = self._out() if self._out is not None else None
        meta, stop, version = self._meta, self._stop, self._version
        if not self.shared:
            self._clear()  # one adapter forward per producer forward
        why = reason_now(self)
        if why is not None:
            return Kept(why)
        if out is None or not same_tensor(x, out):
            return Kept(self.not_output.format(name=self.name))
        changed = modified_in_place(out, version, self.name)
        if changed:
            return Kept(changed)
        found = kept_between(out, meta, stop)
        return Kept(f"{self.name}: {found.reason}") if isinstance(found, Kept) else Recomputed(self, found)


class NormProducer(HookedProducer):
    """A norm module feeding the adapter (a LayerNorm / RMSNorm before a column-parallel linear):
    the adapter saves the norm's input, which the norm keeps, and reruns the module's own forward
    in backward (its eps, its weights: bit-identical)."""

    def __init__(self, norm: nn.Module, name: str):
        self.name = name
        super().__init__(norm)

    def recompute(self, inp: torch.Tensor) -> torch.Tensor:
        return self.module.forward(inp)  # the module's own op, its eps / zero-centered gamma
