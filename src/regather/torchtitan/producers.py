"""``recompute_adapter_inputs`` for torchtitan: what each adapter input's producer already keeps.

================ =================================== ================================== ==========
adapter          its input                           saved instead, rebuilt in backward  new bytes
================ =================================== ================================== ==========
``wqkv``, ``w1``, the sequence shard: a norm's output  the norm's input, which the norm's   0
``w3`` (regather (``attention_norm`` / ``ffn_norm``; a autograd nodes save (``rms_norm`` is
/ lowrank)       ``SequenceParallel`` norm by hand)  decomposed on DTensors); the norm is
                                                     rerun on it
``w2``           ``silu(w1 x) * w3 x`` (``[b, s,     the multiply's two saved operands;   0
                 ffn/t]``)                           multiplied again
``wo``           the attention output                kept: the attention already saves    0
                                                     it (counted as shared)
================ =================================== ================================== ==========

Nothing is assumed from module names or classes: every forward checks that the adapter input is
*this forward's* output of the producer (identity), unmodified, computed from the tensor to be
saved alone, and that an autograd node already saves that tensor
(:mod:`regather.core.recompute.graph`). Each adapter's first rebuild is compared with its input bit
for bit (by the adapter); what fails keeps the input, with the reason.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from regather.core.recompute.graph import saved_tensors, storage_key
from regather.core.recompute.producers import NormProducer
from regather.core.recompute.sources import Captured, Kept, Recomputed
from regather.core.unwrap import plain
from regather.torchtitan import reasons

NORMS = (nn.RMSNorm, nn.LayerNorm)


def _local_param(p: torch.Tensor | None) -> torch.Tensor | None:
    return p.to_local() if isinstance(p, DTensor) else p


class ShardNorm(NormProducer):
    """A norm whose output may be the sequence shard an adapter reads (``ffn_norm``'s is read by
    ``w1`` and ``w3``: ``shared``), watched by core's forward hook."""

    shared = True
    not_output = reasons.NOT_NORM_OUTPUT

    def recompute(self, inp: torch.Tensor) -> torch.Tensor:
        """The norm's op on its local input with this rank's weights (DTensor runs the same
        decomposition on the local shard; checked bit for bit by each adapter's first rebuild)."""
        norm = self.module
        if isinstance(norm, nn.LayerNorm):
            return F.layer_norm(inp, norm.normalized_shape, _local_param(norm.weight), _local_param(norm.bias), norm.eps)
        return F.rms_norm(inp, norm.normalized_shape, _local_param(norm.weight), norm.eps)


def norms_near(modules: dict, path: str) -> list[ShardNorm]:
    """The norms among the children of ``path``'s ancestors, nearest first (the block's
    ``attention_norm`` and ``ffn_norm`` for ``wqkv``, ``w1``, ``w3``, after qwen3's ``q_norm`` /
    ``k_norm``; the block's norm by hand), each watched once. Which one produced the shard is
    checked by identity on every forward."""
    parts = path.split(".")
    found = []
    for i in range(len(parts) - 1, -1, -1):
        for name, child in modules[".".join(parts[:i])].named_children():
            if isinstance(child, NORMS):
                watch = getattr(child, "_regather_shard_norm", None)
                if watch is None:
                    watch = child._regather_shard_norm = ShardNorm(child, name)
                found.append(watch)
    return found


class SwiGLU:
    """``w2``'s input ``silu(w1 x) * w3 x``: the multiply saves both operands for its backward."""

    name = reasons.SWIGLU_PRODUCT

    def capture(self, x: torch.Tensor) -> Captured:
        """The multiply's two local operands (as its node keeps them), or ``Kept(why not)``."""
        node = x.grad_fn
        if node is None or type(node).__name__ != "MulBackward0":
            return Kept(reasons.NOT_SWIGLU)
        first = node.next_functions[0][0] if node.next_functions else None
        if first is None or type(first).__name__ != "SiluBackward0":
            return Kept(reasons.NOT_SWIGLU)
        try:
            a, b = node._saved_self, node._saved_other
        except RuntimeError as exc:  # modified in place since it was saved
            return Kept(f"{reasons.NOT_SWIGLU} ({exc})")
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return Kept(reasons.NOT_SWIGLU)
        return Recomputed(self, (plain(a).detach(), plain(b).detach()))

    def recompute(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mul(a, b)


SWIGLU = SwiGLU()


def already_saved_by(x: torch.Tensor, limit: int = 8) -> str | None:
    """The autograd node near ``x``'s producer that already saves ``x``'s storage (the attention
    output ``wo`` reads), or None."""
    want = storage_key(x)
    frontier, seen = [x.grad_fn], set()
    while frontier and len(seen) < limit:
        node = frontier.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        try:
            if any(storage_key(t) == want for t in saved_tensors(node)):
                return type(node).__name__
        except RuntimeError:
            return None
        frontier.extend(fn for fn, _ in node.next_functions)
    return None
