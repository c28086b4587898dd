"""The CPU patches for megatron's training machinery (docs/design.md §8) are idempotent, scoped to
megatron's training modules, and the fused-wgrad stand-in does apex's arithmetic."""

import pytest
import torch
from tests.harness.megatron_train import (
    FUSED_WGRAD_STANDIN,
    TRAINING_MODULES,
    enable_megatron_training_cpu,
)


def _in_module(name: str, source: str, **values):
    """Evaluate ``source`` as code of module ``name`` (what Tensor.type() sees as its caller)."""
    scope = {"__name__": name, **values}
    exec(f"def f():\n    return {source}\n", scope)
    return scope["f"]()


def test_idempotent_and_cpu_only():
    assert not torch.cuda.is_available()
    assert enable_megatron_training_cpu() is True
    import importlib

    proxies = {id(importlib.import_module(m).torch) for m in TRAINING_MODULES}
    assert enable_megatron_training_cpu() is True
    assert {id(importlib.import_module(m).torch) for m in TRAINING_MODULES} == proxies
    assert len(proxies) == 1 and importlib.import_module(TRAINING_MODULES[0]).torch is not torch


def test_cuda_factories_land_on_cpu_only_inside_megatron_modules():
    enable_megatron_training_cpu()
    from megatron.core.optimizer import clip_grads
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    t = schedules.torch.zeros([], dtype=torch.int, device="cuda")
    assert t.device.type == "cpu" and t.dtype == torch.int
    assert clip_grads.torch.tensor([1.0], device="cuda").device.type == "cpu"
    assert clip_grads.torch.nn is torch.nn and clip_grads.torch.Tensor is torch.Tensor
    p2p_communication.torch.cuda.synchronize()  # a no-op, not "Torch not compiled with CUDA"
    p2p_communication.torch.cuda.current_stream().wait_stream(torch.cpu.current_stream())
    with pytest.raises((AssertionError, RuntimeError)):  # torch itself is untouched
        torch.zeros(1, device="cuda")


def test_tensor_type_names_cuda_only_for_megatron_callers():
    enable_megatron_training_cpu()
    x = torch.zeros(2)
    assert x.type() == "torch.FloatTensor"
    assert _in_module("megatron.core.optimizer.distrib_optimizer", "x.type()", x=x) == "torch.cuda.FloatTensor"
    assert _in_module("megatron.core.optimizer.optimizer", "x.type()", x=x.bfloat16()) == "torch.cuda.BFloat16Tensor"
    assert _in_module("megatron.core.transformer.module", "x.type()", x=x) == "torch.FloatTensor"
    assert x.type(torch.float64).dtype == torch.float64  # conversions unchanged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_wgrad_standin_accumulates_like_apex(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 16, generator=g).to(dtype)
    dy = torch.randn(4, 3, 8, generator=g).to(dtype)
    start = torch.randn(8, 16, generator=g)
    expected = start + dy.reshape(-1, 8).float().t() @ x.reshape(-1, 16).float()
    if dtype == torch.float32:
        main_grad = start.clone()
        FUSED_WGRAD_STANDIN.wgrad_gemm_accum_fp32(x, dy, main_grad)
        torch.testing.assert_close(main_grad, expected, rtol=1e-6, atol=1e-5)
    else:
        main_grad = start.to(dtype)
        FUSED_WGRAD_STANDIN.wgrad_gemm_accum_fp16(x, dy, main_grad)
        # fp32 product added to the low-precision main_grad, rounded once
        want = (start.to(dtype).float() + dy.reshape(-1, 8).float().t() @ x.reshape(-1, 16).float()).to(dtype)
        torch.testing.assert_close(main_grad, want, rtol=0, atol=0)


def test_megatron_linear_fuses_into_main_grad_through_the_standin(single_rank_group):
    """megatron's own ColumnParallelLinear accepts gradient_accumulation_fusion on CPU, adds
    its wgrad to main_grad and returns megatron's dummy gradient, as with apex."""
    enable_megatron_training_cpu()
    import sys

    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from regather.tools.cpu.models import init_model_parallel

    assert sys.modules["fused_weight_gradient_mlp_cuda"] is FUSED_WGRAD_STANDIN
    init_model_parallel(1)
    try:
        config = ModelParallelConfig(gradient_accumulation_fusion=True, use_cpu_initialization=True)
        layer = ColumnParallelLinear(16, 8, config=config, init_method=torch.nn.init.normal_, bias=False)
        layer.weight.main_grad = torch.zeros(8, 16)
        layer.weight.grad_added_to_main_grad = False
        x = torch.randn(6, 2, 16)
        out, _ = layer(x)
        dy = torch.randn_like(out)
        out.backward(dy)
        expected = dy.reshape(-1, 8).t() @ x.reshape(-1, 16)
        torch.testing.assert_close(layer.weight.main_grad, expected, rtol=1e-6, atol=1e-5)
        assert layer.weight.grad_added_to_main_grad
        assert layer.weight.grad is not None and layer.weight.grad.shape == (8, 16)  # the dummy
    finally:
        parallel_state.destroy_model_parallel()
