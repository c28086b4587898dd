"""Fused kernels for regather.

``wgrad_accumulate_(main_grad, grad_output, input)`` -- ``main_grad += grad_output^T @ input``
into an fp32 ``main_grad`` (LoRA-A weight gradient); ``wgrad_backend(device)`` -- which
implementation runs on a device. See ``regather.ops.wgrad``.

Importing this package imports neither triton nor the compiled extension.
"""

from regather.ops.wgrad import BACKENDS, wgrad_accumulate_, wgrad_backend

__all__ = ["BACKENDS", "wgrad_accumulate_", "wgrad_backend"]
