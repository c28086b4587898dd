"""The run-time patches megatron-core's training machinery needs on a machine without CUDA (docs/design.md §8).

:func:`enable_megatron_training_cpu` applies them on top of
:func:`regather.tools.cpu.megatron_cpu.enable_megatron_cpu` (§6). Each patch is idempotent,
scoped to the megatron modules that need it (:data:`TRAINING_MODULES`), and skipped when CUDA is there:

1. **``device="cuda"`` tensor factories** (``torch.zeros(..., device="cuda")``
   for token counters in the schedules, grad-norm / overflow buffers in
   ``clip_grads``, ``optimizer``, ``grad_scaler``, ``utils``, a warm-up tensor in
   ``param_and_grad_buffer``): the module-global ``torch`` of those megatron
   modules is replaced by a proxy whose factories put "cuda" tensors on the CPU.
2. **``torch.cuda.synchronize()``** after batched p2p (``p2p_communication``),
   in DDP's buffer offload: the same proxy's ``torch.cuda`` makes it a no-op
   (CPU work is synchronous; gloo's async ops are waited on explicitly); and
   **``torch.cuda.current_stream()``**, which megatron-core 0.19's
   ``start_grad_sync`` reads on every bucket (to wait on CUDA-graph wgrad events):
   the proxy returns torch's CPU stream stand-in, whose waits are no-ops.
3. **``Tensor.type()`` compared with ``"torch.cuda.FloatTensor"``** (the
   optimizers sort parameters into fp32 / fp16 groups this way and raise
   ``TypeError`` otherwise; ``clip_grads`` asserts it): ``Tensor.type()`` with
   no argument returns the ``torch.cuda.*`` name for a CPU tensor, but only when
   called from one of those megatron modules (checked on the caller's frame).
4. **``fused_weight_gradient_mlp_cuda``** (apex's fused wgrad extension):
   megatron's linears refuse ``gradient_accumulation_fusion=True`` without it.
   A torch stand-in (:data:`FUSED_WGRAD_STANDIN`) with apex's two entry points
   ``wgrad_gemm_accum_fp32(input, grad_output, main_grad)`` and
   ``wgrad_gemm_accum_fp16(...)`` (``main_grad += grad_output^T @ input``) is
   put into ``sys.modules`` and into megatron's ``tensor_parallel.layers``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import torch

#: megatron modules whose module-global ``torch`` becomes the CPU proxy (patches 1, 2)
#: and whose Tensor.type() calls see torch.cuda.* names (patch 3).
TRAINING_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.utils",
)
_ENABLED = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # a CUDA ordinal


def _on_cpu(factory: Callable) -> Callable:
    def make(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    make.__name__ = factory.__name__
    return make


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as megatron's training modules see it on CPU: no-op synchronize, and
    torch's CPU stream stand-in (``wait_event`` / ``wait_stream`` are no-ops) as the current
    / default stream."""

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    @staticmethod
    def current_stream(device=None):
        return torch.cpu.current_stream()

    @staticmethod
    def default_stream(device=None):
        return torch.cpu.current_stream()

    @staticmethod
    def current_device():
        return "cpu"


class _CpuTorch(types.ModuleType):
    """``torch`` for megatron's training modules on CPU: "cuda" factories land on the CPU."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
                  "zeros_like", "ones_like", "empty_like", "full_like")

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in self._FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))
        self._regather_cpu_proxy = True

    def __getattr__(self, name):
        return getattr(torch, name)


def _patch_training_modules() -> None:
    import importlib

    proxy = _CpuTorch()
    for name in TRAINING_MODULES:
        module = importlib.import_module(name)
        if getattr(getattr(module, "torch", None), "_regather_cpu_proxy", False):
            continue
        module.torch = proxy


def _patch_tensor_type() -> None:
    orig = torch.Tensor.type
    if getattr(orig, "_regather_cpu", False):
        return
    modules = frozenset(TRAINING_MODULES)

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            if sys._getframe(1).f_globals.get("__name__") in modules:
                return orig(self).replace("torch.", "torch.cuda.", 1)
        return orig(self, dtype, non_blocking, **kwargs)

    type_._regather_cpu = True
    type_.__doc__ = orig.__doc__
    torch.Tensor.type = type_


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _wgrad_gemm_accum_fp32(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """apex: ``main_grad (fp32) += grad_output^T @ input`` (one GEMM with beta = 1)."""
    main_grad.addmm_(_rows(grad_output).t().float(), _rows(input).float())


def _wgrad_gemm_accum_fp16(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """apex: ``main_grad (fp16/bf16) += grad_output^T @ input``, fp32 product, one rounding."""
    acc = main_grad.float().addmm_(_rows(grad_output).t().float(), _rows(input).float())
    main_grad.copy_(acc)


FUSED_WGRAD_STANDIN = types.ModuleType("fused_weight_gradient_mlp_cuda")
FUSED_WGRAD_STANDIN.__doc__ = "tests.harness stand-in for apex's fused wgrad CUDA extension (torch, CPU)."
FUSED_WGRAD_STANDIN.wgrad_gemm_accum_fp32 = _wgrad_gemm_accum_fp32
FUSED_WGRAD_STANDIN.wgrad_gemm_accum_fp16 = _wgrad_gemm_accum_fp16
FUSED_WGRAD_STANDIN.regather_standin = True


def _install_fused_wgrad_standin() -> None:
    from megatron.core.tensor_parallel import layers

    real = sys.modules.get("fused_weight_gradient_mlp_cuda")
    if real is not None and not getattr(real, "regather_standin", False):
        return  # the real extension is there: use it
    sys.modules["fused_weight_gradient_mlp_cuda"] = FUSED_WGRAD_STANDIN
    layers.fused_weight_gradient_mlp_cuda = FUSED_WGRAD_STANDIN
    layers._grad_accum_fusion_available = True


def enable_megatron_training_cpu() -> bool:
    """Apply §6's and §8's CPU patches once. Returns True when they are (or were) applied;
    False (and nothing patched) when CUDA is available."""
    global _ENABLED
    from regather.tools.cpu.megatron_cpu import enable_megatron_cpu

    if not enable_megatron_cpu():
        return False
    if not _ENABLED:
        _patch_training_modules()
        _patch_tensor_type()
        _install_fused_wgrad_standin()
        _ENABLED = True
    return True
