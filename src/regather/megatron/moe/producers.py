"""The producer of a grouped expert ``linear_fc2``'s input: ``TEGroupedMLP``'s activation.

An expert's ``linear_fc2`` reads ``act(fc1 output) x probs`` — the routing probability of each
(token, expert) row scales the activation. Nothing saves that product (frozen expert linears keep
no input), but the two ops making it keep their inputs for their own backward:

============================ ============================================ ================================
op (megatron-core 0.16–0.19) keeps                                        regather saves instead of x
============================ ============================================ ================================
activation (gelu, SwiGLU…)   ``linear_fc1``'s output ``[n, f/t]`` (+ bias)  that output (or the biased sum)
``* permuted_probs[:, None]`` the activation's output and the probs view   the probs view ``[n, 1]``
weighted SwiGLU (fused)      fc1's output, bias, the probs view            fc1's output, the probs view
============================ ============================================ ================================

so the adapter saves fc1's output and the probs — storages autograd already holds, zero new bytes
— and reruns the activation block in backward (:func:`grouped_activation`: ``TEGroupedMLP``'s
``bias_act_func`` on the functions its module imported, bit-identical; the first rerun is compared
with the forward's input, as for every producer). ``SequentialMLP``'s experts are megatron ``MLP``
modules called with ``per_token_scale``: :class:`regather.megatron.dense.producers.ActivationProducer` covers them.

The pairing and the per-forward checks are :class:`~regather.megatron.dense.producers.ActivationProducer`'s (the
adapter input is the tensor ``TEGroupedMLP`` handed ``linear_fc2``, unmodified; it comes from fc1's
output and the probs alone). Refused, with the reason: activation recompute (``moe_act``) or its
offload, fp8 / fp4 padding, TE's fused grouped MLP (0.19's op fuser: no separate ``linear_fc2``
call), and probs applied on the input (``moe_apply_probs_on_input``: the probs become ``ones_like``,
which only the multiply keeps — found then, or refused).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from regather.megatron import compat
from regather.megatron.dense.producers import ActivationProducer, own_forward, scaled_activation
from regather.megatron.moe.inputs import expert_producer
from regather.megatron.reasons import MOE_ACT_RECOMPUTED


def grouped_name(mlp_name: str) -> str:
    """The producer name of the grouped experts' activation, from the MLP activation's."""
    return mlp_name.replace("the MLP activation", "the grouped experts' activation", 1)


class GroupedActivationProducer(ActivationProducer):
    """``TEGroupedMLP``'s ``bias_act_func`` between the grouped ``linear_fc1`` and ``linear_fc2``."""

    def __init__(self, experts: nn.Module):
        super().__init__(experts)
        self.name = grouped_name(self.name)

    def scale_argument(self, args, kwargs) -> torch.Tensor | None:
        """``TEGroupedMLP.forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)``."""
        return kwargs.get("permuted_probs", args[2] if len(args) > 2 else None)

    def static_reason(self) -> str | None:
        experts, cfg = self.mlp, self.config
        if getattr(experts, "activation_recompute", False):
            return MOE_ACT_RECOMPUTED
        if getattr(experts, "offload_moe_act", False):
            return "the experts' activation is offloaded (fine-grained activation offloading of 'moe_act')"
        if compat.private(experts, compat.FUSED_GROUPED_MLP, False):
            return "TE's fused grouped MLP runs linear_fc1, the activation and linear_fc2 as one op"
        if getattr(cfg, "fp8", None) or getattr(cfg, "fp4", None):
            return "fp8 / fp4 pad each expert's tokens before linear_fc1"
        if getattr(cfg, "moe_mlp_glu_interleave_size", None) is not None:
            return "the gated fc1 output is interleaved (moe_mlp_glu_interleave_size)"
        if getattr(cfg, "activation_func_fp8_input_store", False):
            return "the activation stores its input in fp8 (activation_func_fp8_input_store=True)"
        return None

    def recompute(self, out: torch.Tensor, bias: torch.Tensor | None,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
        return grouped_activation(self.mlp, out, bias, scale)


def grouped_activation(experts: nn.Module, intermediate: torch.Tensor, bias: torch.Tensor | None,
                       probs: torch.Tensor) -> torch.Tensor:
    """``TEGroupedMLP.forward``'s ``bias_act_func`` (megatron-core 0.16.1 – 0.19.x, no GLU
    interleaving): ``probs`` is ``permuted_probs.unsqueeze(-1)``."""
    cfg, fn = experts.config, experts.activation_func
    mod = sys.modules[type(experts).forward.__module__]
    if not (cfg.use_te_activation_func or cfg.bias_activation_fusion):
        if fn is getattr(mod, "squared_relu", None) and getattr(cfg, "use_fused_weighted_squared_relu", False):
            return mod.weighted_squared_relu_impl(intermediate, probs)
        bias = None  # megatron's unfused branch adds no bias before the activation
    return scaled_activation(cfg, fn, mod, intermediate, bias, probs)


def is_grouped_experts(module: nn.Module) -> bool:
    """``module`` is megatron's ``TEGroupedMLP`` running its own forward."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    return own_forward(module, TEGroupedMLP)


def expert_producer_for(model: nn.Module, path: str, adapter):
    """The producer of an expert adapter's input at ``path`` — an expert ``linear_fc1``'s from the
    router's input (:mod:`regather.megatron.moe.inputs`), a grouped ``linear_fc2``'s from the
    experts' activation — or why there is none; ``None`` where the dense rules apply
    (``SequentialMLP``'s experts are megatron ``MLP`` modules, shared experts are dense)."""
    if adapter.facts.is_expert and adapter.column_parallel:  # an expert fc1: the router's input
        return expert_producer(model, path, adapter)
    parent_path = path.rpartition(".")[0]
    parent = model.get_submodule(parent_path) if parent_path else model
    if path.rsplit(".", 1)[-1] == "linear_fc2" and is_grouped_experts(parent):
        producer = GroupedActivationProducer(parent)
        return producer.static_reason() or producer
    return None
