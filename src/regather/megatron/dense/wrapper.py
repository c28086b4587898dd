"""``LoRALinear``: a frozen megatron linear and its adapter, ``(base(x) + adapter(x), bias)``.

The wrapper a :class:`regather.LoRA` puts in place of each target linear. It plans the
adapter's forward *before* the base layer runs (early re-gather anchors ``x`` so LoRA-A's ``dA``
waits for the base's dgrad), feeds a Transformer Engine base's LayerNorm output to the adapter
(:mod:`regather.megatron.dense.te`), optionally gathers the input once for base and adapter
(``share_sequence_gather``), and keeps Megatron Bridge's checkpoint keys
(:mod:`regather.megatron.dense.checkpoint`).
"""

from __future__ import annotations

import torch
from torch import nn

from regather.core import mappings
from regather.megatron import compat
from regather.megatron.dense import checkpoint, te
from regather.megatron.dense.adapter import ParallelLinearAdapter


class LoRALinear(nn.Module):
    """A frozen megatron linear plus its adapter: ``(base(x) + adapter(x), bias)``.

    Checkpoints use Megatron Bridge's keys (:mod:`regather.megatron.dense.checkpoint`): the base layer's
    entries under the wrapper's own path (``linear_qkv.weight``, as in the frozen model's
    checkpoint), the adapter's under ``adapter.``; ``sharded_state_dict`` declares both for
    megatron's ``dist_checkpointing``.
    """

    is_lora_wrapper = True  # how regather.megatron.dense.checkpoint recognises a wrapper without importing this module

    def __init__(self, to_wrap: nn.Module, adapter: ParallelLinearAdapter):
        super().__init__()
        self.to_wrap = to_wrap
        self.adapter = adapter
        self._register_state_dict_hook(checkpoint.flatten_base_keys)
        self._register_load_state_dict_pre_hook(checkpoint.nest_base_keys)
        self.te_layernorm = te.fuses_layernorm(to_wrap)  # LoRA reads TE's LayerNorm output
        # One sequence all-gather (forward) and one reduce-scatter (backward) for base + adapter
        # on a frozen megatron ColumnParallelLinear; see _shared_gather_forward. Off by default:
        # it changes the summation order of the input gradient (dX_base + dX_adapter, then one
        # reduce-scatter) against the unshared path; gather and regather stay bit-identical
        # to each other when both share.
        self.share_sequence_gather = False
        self.adapter_enabled = True

    def delta_weight(self, delta_of) -> torch.Tensor:
        """The adapter's merged weight delta in the base's layout (:mod:`regather.megatron.merge`)."""
        return delta_of(self.adapter)

    def named_adapters(self, path: str) -> dict[str, ParallelLinearAdapter]:
        """This wrapper's adapters by the name :func:`adapters` lists them under."""
        return {path: self.adapter}

    def enable_adapter_layers(self) -> None:
        """Megatron Bridge's PEFT protocol (``PEFT.enable_adapter_layers`` / ``disable_adapter``)."""
        self.adapter_enabled = True

    def disable_adapter_layers(self) -> None:
        """Run the frozen base alone (e.g. reference outputs under Bridge's ``peft.disable_adapter``)."""
        self.adapter_enabled = False

    def forward(self, x: torch.Tensor, *args, **kwargs):
        if not self.adapter_enabled:
            return self.to_wrap(x, *args, **kwargs)
        # plan() first: with early re-gather it anchors x so LoRA-A's dA runs after the
        # base layer's dgrad too (regather.core.strategies.regather); otherwise x is unchanged.
        x, plan = self.adapter.plan(x, reads_base_input=not self.te_layernorm)
        if self.te_layernorm:  # x is pre-norm: the adapter gets TE's LayerNorm output (regather.megatron.dense.te)
            return te.lora_forward(self.to_wrap, self.adapter, x, plan, *args, **kwargs)
        if self.share_sequence_gather and self._can_share(plan):
            return self._shared_gather_forward(x, plan, *args, **kwargs)
        out, bias = self.to_wrap(x, *args, **kwargs)
        return self.adapter(x, plan=plan, base_out=out), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """megatron ``dist_checkpointing``: the base layer's shards, then the adapter's."""
        return checkpoint.lora_linear_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def _can_share(self, plan) -> bool:
        base = self.to_wrap
        return (type(base).__name__ == "ColumnParallelLinear" and self.adapter.shares_input_gather(plan)
                and base.weight is not None and not base.weight.requires_grad
                and getattr(base, "sequence_parallel", False) and not getattr(base, "gather_output", False)
                and not getattr(base, "explicit_expert_comm", False)
                and not getattr(base.config, "defer_embedding_wgrad_compute", False))

    def _shared_gather_forward(self, x, plan, *args, **kwargs):
        """Gather ``x`` once; the frozen base runs on it with its own SP communication off
        (megatron's frozen-weight path then keeps no input: it saves only the weight) and the
        adapter reads the same tensor. Backward: both partial input gradients meet at the
        gather, whose backward reduce-scatters their sum once.

        ========================= ============================ ===========================
        per eligible adapter      unshared                     shared
        ========================= ============================ ===========================
        forward all-gather of x   2 (base + adapter)           1
        backward reduce-scatter   2                            1
        saved for backward        unchanged (x_full on gather, x_local on regather)
        ========================= ============================ ===========================
        """
        base = self.to_wrap
        x_full = mappings.gather_seq(x, base.tp_group)
        with compat.local_input(base):  # input used as is, no dgrad reduction: the shared gather's backward does it
            out, bias = base(x_full, *args, **kwargs)
        return self.adapter(x, plan=plan, x_full=x_full, base_out=out), bias
