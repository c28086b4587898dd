"""What the moment decides, checked on every forward: mode, autograd, activation checkpointing.

torchtitan's activation checkpointing (full or selective, ``torch.utils.checkpoint`` under
``checkpoint_wrapper``) re-runs the block in backward and must save exactly what the first forward
saved; the checkpointed block keeps no adapter input in the first place, so adapters there take
torchtitan's own path in both passes. The test and the sentences are core's
(:mod:`regather.core.moment`); torchtitan words only its checkpoint sentence.
"""

from __future__ import annotations

import torch

from regather.core.moment import RunState, in_activation_checkpoint
from regather.core.moment import moment_reason as core_moment_reason
from regather.torchtitan import reasons

in_checkpoint = in_activation_checkpoint  # torchtitan has no checkpoint of its own beside torch's


def moment_reason(module: torch.nn.Module, lora_a: torch.Tensor) -> str | None:
    """Why nothing but torchtitan's own LoRA-A may run now, or None."""
    return core_moment_reason(RunState.capture(module, lora_a, in_activation_checkpoint()), reasons.IN_CHECKPOINT)


def saves_for_backward(module: torch.nn.Module) -> bool:
    """A forward now saves tensors for a backward (training, autograd on)."""
    return module.training and torch.is_grad_enabled()
