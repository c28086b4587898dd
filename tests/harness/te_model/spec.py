"""megatron's Transformer Engine GPT layer spec on the model's linears, and one linear alone.

:func:`te_layer_spec` is ``get_gpt_layer_with_transformer_engine_spec()``'s dense layout
(megatron-core 0.16.1 / 0.19.2 ``gpt_layer_specs.py``): no ``input_layernorm`` /
``pre_mlp_layernorm`` (``IdentityOp``: the norms are fused into ``linear_qkv`` / ``linear_fc1``,
``TELayerNormColumnParallelLinear``), ``linear_proj`` / ``linear_fc2`` ``TERowParallelLinear``.
The core attention stays megatron's local ``DotProductAttention`` by default: ``linear_proj``'s
LoRA-A input is new bytes there, as on the local spec. ``te_attention=True`` puts in the model of
TE's attention (:mod:`.attention`: context parallelism, THD), which saves its output as TE's does.
:func:`build_te_gpt` builds the tiny GPT (:func:`regather.tools.cpu.models.build_gpt`) on it;
:func:`te_linear` one ``TELayerNormColumnParallelLinear`` for the routing tests.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch

from tests.harness.te_model.behaviour import Behaviour
from tests.harness.te_model.modules import TELayerNormColumnParallelLinear, TERowParallelLinear


def te_layer_spec(te_attention: bool = False):
    """megatron's TE layer spec (dense, no qk-norm) with the model's linears (module doc); with
    ``te_attention``, its core attention too (:class:`~.attention.TEDotProductAttention`: context
    parallelism, packed sequences)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp

    spec = copy.deepcopy(get_gpt_layer_local_spec())
    layer = spec.submodules
    layer.input_layernorm = IdentityOp
    layer.pre_mlp_layernorm = IdentityOp
    layer.sharded_state_dict_keys_map = {}
    attention = layer.self_attention.submodules
    attention.linear_qkv, attention.linear_proj = TELayerNormColumnParallelLinear, TERowParallelLinear
    if te_attention:
        from tests.harness.te_model.attention import TEDotProductAttention

        attention.core_attention = TEDotProductAttention
    if isinstance(layer.mlp, functools.partial):  # 0.19: MLP.as_mlp_submodule with submodules=
        mlp = dataclasses.replace(layer.mlp.keywords["submodules"], linear_fc1=TELayerNormColumnParallelLinear,
                                  linear_fc2=TERowParallelLinear)
        layer.mlp = functools.partial(layer.mlp.func, *layer.mlp.args, **{**layer.mlp.keywords, "submodules": mlp})
    else:  # 0.16: a ModuleSpec
        layer.mlp.submodules.linear_fc1 = TELayerNormColumnParallelLinear
        layer.mlp.submodules.linear_fc2 = TERowParallelLinear
    return spec


def build_te_gpt(shape, tp: int, sequence_parallel: bool = True, dtype: torch.dtype = torch.float32,
                 seed: int = 1234, te_attention: bool = False, **kwargs):
    """The tiny megatron ``GPTModel`` on :func:`te_layer_spec` (what the behaviour active now runs)."""
    from regather.tools.cpu.models import build_gpt

    return build_gpt(shape, tp, sequence_parallel, dtype, seed, transformer_layer_spec=te_layer_spec(te_attention),
                     **kwargs)


def te_config(hidden: int, tp: int, sequence_parallel: bool, dtype=torch.float32, **overrides):
    """A megatron ``TransformerConfig`` for one TE linear (CPU initialisation)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=max(tp, 1), tensor_model_parallel_size=tp,
                             sequence_parallel=sequence_parallel and tp > 1, use_cpu_initialization=True,
                             params_dtype=dtype, bf16=dtype == torch.bfloat16, **overrides)


def te_linear(hidden: int, out: int, *, tp_group, sequence_parallel: bool, bias: bool = False,
              skip_bias_add: bool = False, dtype=torch.float32, eps: float = 1e-5, normalization: str = "LayerNorm",
              zero_centered_gamma: bool = False, behaviour: Behaviour | None = None, seed: int = 1234):
    """One ``TELayerNormColumnParallelLinear`` (``out`` full output features) on ``tp_group``, with
    seeded weights the same for every TP size and a random norm affine and bias (same on every rank:
    a norm of ones and zeros would hide a wrong gamma / beta)."""
    import torch.distributed as dist

    tp = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    config = te_config(hidden, tp, sequence_parallel, dtype, layernorm_epsilon=eps, normalization=normalization,
                       layernorm_zero_centered_gamma=zero_centered_gamma)
    torch.manual_seed(seed)
    base = TELayerNormColumnParallelLinear(
        hidden, out, config=config, init_method=lambda w: torch.nn.init.normal_(w, std=0.1), gather_output=False,
        bias=bias, skip_bias_add=skip_bias_add, is_expert=False, tp_comm_buffer_name="qkv", tp_group=tp_group,
        behaviour=behaviour)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        base.layer_norm_weight.copy_(0.1 * torch.randn(hidden, generator=g) + (0 if zero_centered_gamma else 1))
        if base.layer_norm_bias is not None:
            base.layer_norm_bias.copy_(0.1 * torch.randn(hidden, generator=g))
        if base.bias is not None:
            full = torch.randn(out, generator=g).to(dtype)
            base.bias.copy_(full.chunk(tp)[base.tp_rank])
    return base


class Holder(torch.nn.Module):
    """A model around one TE base named ``linear_qkv`` (LoRA's fallback log flushes after a model's
    forward, and the target name picks the column-parallel rules)."""

    def __init__(self, base):
        super().__init__()
        self.linear_qkv = base

    def forward(self, x):
        return self.linear_qkv(x)
