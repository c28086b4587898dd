"""``GroupedLoRALinear``: a frozen TE grouped expert linear and its adapter."""

from __future__ import annotations

import torch

from regather.megatron.dense.wrapper import LoRALinear


class GroupedLoRALinear(LoRALinear):
    """A frozen TE grouped expert linear plus its adapter: ``base(x, m_splits) + adapter(x)``.

    The adapter is shared by the local experts (an :class:`~regather.megatron.moe.adapters.ExpertAdapter`
    on every row) or holds one pair per expert (:class:`~regather.megatron.moe.adapters.GroupedExpertAdapter`,
    which reads ``m_splits``). Checkpoint keys are Bridge's (``…experts.linear_fc1.adapter.…``).
    """

    def forward(self, x: torch.Tensor, m_splits, *args, **kwargs):
        if not self.adapter_enabled:
            return self.to_wrap(x, m_splits, *args, **kwargs)
        x, plan = self.adapter.plan(x)
        out, bias = self.to_wrap(x, m_splits, *args, **kwargs)
        return self.adapter(x, plan=plan, m_splits=m_splits, base_out=out), bias
