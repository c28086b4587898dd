"""What the moment decides, for every front end: mode, autograd, activation checkpointing.

A LoRA-A that keeps only a sequence shard (regather, lowrank) or rebuilds its input needs a
forward that saves for a backward and runs once: training mode, autograd on, outside activation
checkpointing — whose recompute must save exactly what the first forward saved. The sentences
saying why not are the same in every front end (logged at INFO: the moment decides them), except
the checkpointing one, which each front end words for its own checkpoint.

Everything here is a pure function of torch's state and its arguments (no module state, no
cache), so a front end can evaluate it once outside a traced region (``torch.compile``) and keep
the result as plain module state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from regather.core.decision import Reason, expected
from regather.core.saved_hooks import top_saved_tensors_hook

if TYPE_CHECKING:
    import torch

EVAL = expected("module is in eval mode")
NO_GRAD = expected("autograd is disabled (torch.no_grad / inference_mode)")
FROZEN_A = Reason("LoRA-A weight is frozen (requires_grad=False)")


def in_activation_checkpoint() -> bool:
    """Inside a backward pass (a reentrant ``torch.utils.checkpoint`` recompute), or under
    ``torch.utils.checkpoint``'s saved-tensor hooks (both passes of a non-reentrant checkpoint,
    whose recompute must save exactly what the first forward saved)."""
    import torch  # in the functions: the reasons above are the ``regather`` command's, which loads no torch to parse

    if torch._C._current_graph_task_id() != -1:
        return True
    top = top_saved_tensors_hook()
    return top is not None and getattr(top, "__module__", "") == "torch.utils.checkpoint"


@dataclass(frozen=True)
class RunState:
    """What may change between two forwards of the same adapter."""

    training: bool
    grad_enabled: bool
    in_recompute: bool
    lora_a_trainable: bool

    @classmethod
    def capture(cls, module: torch.nn.Module, lora_a: torch.Tensor, in_recompute: bool) -> RunState:
        """The state now; ``in_recompute``: the front end's checkpoint test (its own checkpoint
        added to :func:`in_activation_checkpoint`)."""
        import torch

        return cls(training=module.training, grad_enabled=torch.is_grad_enabled(), in_recompute=in_recompute,
                   lora_a_trainable=lora_a.requires_grad)

    @property
    def saves_for_backward(self) -> bool:
        """A forward now saves tensors for a backward (training, autograd on)."""
        return self.training and self.grad_enabled


def moment_reason(state: RunState, in_checkpoint: str) -> str | None:
    """Why only the gather path may run in ``state``, or None; ``in_checkpoint``: the front end's
    sentence for a forward inside activation checkpointing."""
    if not state.training:
        return EVAL
    if not state.grad_enabled:
        return NO_GRAD
    if state.in_recompute:
        return in_checkpoint
    if not state.lora_a_trainable:
        return FROZEN_A
    return None
