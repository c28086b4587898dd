"""Rank bodies for the Transformer Engine routing test (CPU stand-in for TE, gloo ranks)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from tests.harness.fake_te import TELayerNormColumnParallelLinear
from torch import nn

from regather import LoRA, ParallelLinearAdapter
from regather.core.accounting import CollectiveBytes
from regather.tools.cpu.megatron_cpu import enable_megatron_cpu


def run_te_route(rank, t, strategy, *, bias=False, skip_bias_add=False, s=8, b=2, h=16, o=24, r=4,
                 dtype=torch.float32):
    """LoRA on a TE-style LayerNorm-fused base vs the reference ``base(x) + adapter(LN(x))``.

    The reference adapter is a gather-path ``ParallelLinearAdapter`` fed the *local*
    LayerNorm output (it gathers by itself), with the same initial weights.
    """
    enable_megatron_cpu()
    group = dist.group.WORLD
    base = TELayerNormColumnParallelLinear(h, o, tp_group=group, sequence_parallel=True, bias=bias,
                                           skip_bias_add=skip_bias_add, dtype=dtype)
    ref_base = copy.deepcopy(base, memo={id(group): group})  # process groups do not copy
    model = nn.Module()
    model.linear_qkv = base
    torch.manual_seed(5)
    LoRA(target_modules=["linear_qkv"], dim=r, alpha=2 * r, lora_B_init_method="normal",
         sequence_parallel_input_strategy=strategy)(model)
    lora = model.linear_qkv
    torch.manual_seed(5)
    ref = ParallelLinearAdapter(h, o, r, column_parallel=True, base_name="linear_qkv", tp_group=group,
                                sequence_parallel=True, alpha=2 * r, strategy="gather",
                                lora_B_init_method="normal", params_dtype=dtype)
    for p in ref_base.parameters():
        p.requires_grad_(False)

    g = torch.Generator().manual_seed(11)
    x_full = torch.randn(s, b, h, generator=g).to(dtype)
    dy_full = torch.randn(s, b, o, generator=g).to(dtype)
    x = x_full.chunk(t, 0)[rank].clone().requires_grad_()
    dy = dy_full.chunk(t, 2)[rank].clone()
    x_ref = x.detach().clone().requires_grad_()

    with CollectiveBytes() as fwd:
        y, y_bias = lora(x)
    y.backward(dy)
    with CollectiveBytes() as ref_fwd:
        out, ref_bias = ref_base(x_ref)
        y_ref = out + ref(ref_base.layer_norm(x_ref))
    y_ref.backward(dy)

    a = lora.adapter.linear_in.weight
    rows = lora.adapter.lora_a_rows() if lora.adapter.replicated_a else slice(None)
    return {
        "decision": lora.adapter.last_decision,
        "flags_after": (base.return_layernorm_output, base.return_layernorm_output_gathered),
        "same_init": bool(torch.equal(a.detach()[rows], ref.linear_in.weight.detach())),
        "out": y.detach(), "out_ref": y_ref.detach(),
        "bias": y_bias, "bias_ref": ref_bias,
        "dx": x.grad, "dx_ref": x_ref.grad,
        "dA": a.grad[rows], "dA_ref": ref.linear_in.weight.grad,
        "dB": lora.adapter.linear_out.weight.grad, "dB_ref": ref.linear_out.weight.grad,
        "fwd_bytes": fwd.snapshot(), "ref_fwd_bytes": ref_fwd.snapshot(),
    }
