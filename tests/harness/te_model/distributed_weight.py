"""A distributed weight (Megatron's GTP) as Transformer Engine 2.19+ meets it, on one rank.

TE 2.19 added an extension point for custom weight parallelism (``transformer_engine/pytorch/
distributed_weight.py``, 2.20.2:26-54): a weight that is a ``torch.Tensor`` subclass with
``is_distributed_weight = True`` is swapped, in ``_LayerNormLinear.forward``, for the tensor its
``materialize_group_for_forward()`` returns (an all-gather of its shards, 2.20.2 LL:326-330), and
every later ``weight.requires_grad`` test of that forward reads the *copy* (LL:427, 474, 539); the
forward saves the original (LL:526-536), the backward re-materializes it (LL:651-653) and passes the
weight gradient through ``finalize_group_grads`` (LL:1084-1086). TE ships no implementation: the
caller owns it, so what the copy's ``requires_grad`` says is the caller's choice, which regather
cannot see (regather refuses to release TE's ``ln_out`` beside one: ``regather.megatron.dense.te_rule``).

:class:`DistributedWeight` is that weight on one rank (its group holds one shard: gathering it is a
copy), the copy carrying the weight's own ``requires_grad``.
"""

from __future__ import annotations

import torch
from torch import nn


def is_distributed_weight(weight) -> bool:
    """TE's ``is_distributed_weight`` (2.20.2:56-68): the marker, on a tensor subclass."""
    flag = bool(getattr(weight, "is_distributed_weight", False))
    if flag and not isinstance(weight, torch.Tensor):
        raise TypeError(f"DistributedWeight implementers must be torch.Tensor subclasses; got {type(weight).__name__}.")
    return flag


class DistributedWeight(nn.Parameter):
    """A weight with TE's ``DistributedWeight`` protocol, its group one rank (the module doc)."""

    is_distributed_weight = True

    def _gathered(self) -> torch.Tensor:
        return self.detach().clone().requires_grad_(self.requires_grad)

    def materialize_group_for_forward(self) -> list[torch.Tensor]:
        return [self._gathered()]

    def materialize_group_for_backward(self) -> list[torch.Tensor]:
        return [self._gathered()]

    def finalize_group_grads(self, wgrads: list) -> list:
        return wgrads  # one shard: the gathered gradient is this rank's

    def grad_buffer(self) -> torch.Tensor:
        return self.main_grad
