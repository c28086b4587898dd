"""What the moment decides, checked on every forward: mode, autograd, activation checkpointing.

torchtitan's activation checkpointing (full or selective, ``torch.utils.checkpoint`` under
``checkpoint_wrapper``) re-runs the block in backward and must save exactly what the first forward
saved; the checkpointed block keeps no adapter input in the first place, so adapters there take
torchtitan's own path in both passes.
"""

from __future__ import annotations

import torch

from regather.torchtitan import reasons


def in_checkpoint() -> bool:
    """Inside a backward pass (a reentrant recompute), or under ``torch.utils.checkpoint``'s
    saved-tensor hooks (both passes of a non-reentrant checkpoint)."""
    if torch._C._current_graph_task_id() != -1:
        return True
    getter = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        hooks = getter(False) if getter is not None else None
    except (TypeError, RuntimeError):
        return False
    return bool(hooks) and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint"


def moment_reason(module: torch.nn.Module, lora_a: torch.Tensor) -> str | None:
    """Why nothing but torchtitan's own LoRA-A may run now, or None."""
    if not module.training:
        return reasons.EVAL
    if not torch.is_grad_enabled():
        return reasons.NO_GRAD
    if in_checkpoint():
        return reasons.IN_CHECKPOINT
    if not lora_a.requires_grad:
        return reasons.FROZEN_A
    return None


def saves_for_backward(module: torch.nn.Module) -> bool:
    """A forward now saves tensors for a backward (training, autograd on)."""
    return module.training and torch.is_grad_enabled()
