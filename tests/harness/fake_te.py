"""CPU stand-ins for megatron's Transformer Engine linears (TE cannot be installed on CPU).

They mimic what :mod:`regather.megatron.dense.te` relies on, and nothing else:

- the class names (``TELayerNormColumnParallelLinear``, ``TEColumnParallelLinear``),
  TE's per-rank ``in_features`` / ``out_features``, ``parallel_mode``,
  ``sequence_parallel``, ``tp_group``, ``te_return_bias``; no ``input_size``;
- the flags ``return_layernorm_output`` / ``return_layernorm_output_gathered``
  read on every forward, and megatron's return forms:
  ``(out, None)``, ``(out, bias)``, ``((out, ln_out), None)``, ``(out, bias, ln_out)``;
- TE's autograd for the LayerNorm output: the gathered one is the tensor fed to
  the GEMM, so its gradient is summed with the dgrad *before* the sequence
  reduce-scatter; the local one's gradient is added *after* it.

Shapes (SP on, ``t`` ranks): ``x [s/t, b, h]`` -> LayerNorm -> all-gather ->
``[s, b, h]`` -> ``@ W^T`` with ``W [o/t, h]`` -> ``out [s, b, o/t]``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn


class TELayerNormColumnParallelLinear(nn.Module):
    """Stand-in for ``megatron.core.extensions.transformer_engine.TELayerNormColumnParallelLinear``."""

    def __init__(self, input_size: int, output_size: int, *, tp_group, sequence_parallel: bool,
                 bias: bool = False, skip_bias_add: bool = False, dtype=torch.float32, eps: float = 1e-5,
                 config=None, normalization: str = "LayerNorm", zero_centered_gamma: bool = False):
        super().__init__()
        import torch.distributed as dist

        t = dist.get_world_size(tp_group) if dist.is_initialized() else 1
        self.tp_group, self.tp_size = tp_group, t
        self.sequence_parallel = bool(sequence_parallel and t > 1)
        self.parallel_mode = "column"
        self.in_features, self.out_features = input_size, output_size // t  # TE: per rank
        self.te_return_bias = skip_bias_add and bias
        self.return_layernorm_output = False
        self.return_layernorm_output_gathered = False
        self.eps = eps
        self.normalization, self.zero_centered_gamma = normalization, zero_centered_gamma
        self.config = config or SimpleNamespace(sequence_parallel=self.sequence_parallel,
                                                tensor_model_parallel_size=t)
        g = torch.Generator().manual_seed(1234 + (dist.get_rank(tp_group) if dist.is_initialized() else 0))
        self.weight = nn.Parameter((torch.randn(self.out_features, input_size, generator=g) * 0.1).to(dtype))
        self.layer_norm_weight = nn.Parameter((1 + 0.1 * torch.randn(input_size, generator=g)).to(dtype))
        self.layer_norm_bias = nn.Parameter((0.1 * torch.randn(input_size, generator=g)).to(dtype))
        self.bias = nn.Parameter(torch.randn(self.out_features, generator=g).to(dtype)) if bias else None

    def layer_norm(self, x: torch.Tensor) -> torch.Tensor:
        # TE's norm options: zero-centered gamma (weight + 1), RMSNorm (no bias)
        weight = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        if self.normalization == "RMSNorm":
            return nn.functional.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return nn.functional.layer_norm(x, (x.shape[-1],), weight, self.layer_norm_bias, self.eps)

    def forward(self, x: torch.Tensor):
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        ln_out = self.layer_norm(x)
        total = ln_out
        if self.sequence_parallel:  # backward: reduce-scatter of everything total's users sent back
            total = gather_from_sequence_parallel_region(ln_out, tensor_parallel_output_grad=True,
                                                         group=self.tp_group)
        out = torch.matmul(total, self.weight.t())
        if self.bias is not None and not self.te_return_bias:
            out = out + self.bias
        extra = ()
        if self.return_layernorm_output:
            extra = (total if self.return_layernorm_output_gathered else ln_out,)
        if self.te_return_bias:  # TE returns (out, bias[, ln_out]); megatron passes it through
            return (out, self.bias) + extra
        return ((out,) + extra if extra else out), None  # megatron: (out, None) / ((out, ln), None)


class TEColumnParallelLinear(nn.Module):
    """Stand-in for megatron's ``TEColumnParallelLinear``: input is the (local) LayerNorm output."""

    def __init__(self, input_size: int, output_size: int, *, tp_group, sequence_parallel: bool,
                 dtype=torch.float32):
        super().__init__()
        import torch.distributed as dist

        t = dist.get_world_size(tp_group) if dist.is_initialized() else 1
        self.tp_group = tp_group
        self.sequence_parallel = bool(sequence_parallel and t > 1)
        self.parallel_mode = "column"
        self.in_features, self.out_features = input_size, output_size // t
        self.config = SimpleNamespace(sequence_parallel=self.sequence_parallel, tensor_model_parallel_size=t)
        self.weight = nn.Parameter(torch.randn(self.out_features, input_size).to(dtype) * 0.1)

    def forward(self, x: torch.Tensor):
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=self.tp_group)
        return torch.matmul(x, self.weight.t()), None
