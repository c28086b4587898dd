"""Frozen stays frozen: the parameters a LoRA converter froze are frozen again after
``parallelize``, whatever the backend did to them.

torchtitan 0.3.0's ``spmd_types`` backend (its default) re-registers every sharded state in
``Module._spmd_distribute_state`` as ``nn.Parameter(tensor)``, whose ``requires_grad`` defaults
to True: after ``parallelize`` every frozen base weight of a LoRA model needs a gradient again —
weight gradients, optimizer state (torchtitan's optimizers take every parameter that requires
grad) and the inputs saved for them, for the whole model; torchtitan's own LoRA as well.
torchtitan fixed it after 0.3.0 (#4267: the re-registered parameter keeps the tensor's
``requires_grad``). :func:`keep_frozen` does what that fix does, from outside: it records which
parameters are frozen when the model is built and wraps the model's ``parallelize`` (the
``Module.parallelize`` torchtitan's ``parallelize_*`` functions call before FSDP and the
optimizer see the parameters) to freeze those again afterwards. The ``partial_dtensor`` path
already keeps ``requires_grad``; there it changes nothing.
"""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger("regather")

REFROZEN = ("{n} parameters frozen by the LoRA converter came back trainable from torchtitan's parallelize "
            "(spmd_types re-registers sharded states as trainable parameters; torchtitan #4267): frozen again")


def frozen_names(model: nn.Module) -> set[str]:
    """The names of ``model``'s parameters that need no gradient."""
    return {name for name, p in model.named_parameters() if not p.requires_grad}


def refreeze(model: nn.Module, names: set[str]) -> int:
    """Freeze again every parameter of ``model`` named in ``names`` that requires grad now;
    returns how many."""
    again = 0
    for name, p in model.named_parameters():
        if name in names and p.requires_grad:
            p.requires_grad_(False)
            again += 1
    return again


def keep_frozen(model: nn.Module) -> nn.Module:
    """Make ``model.parallelize(...)`` leave every parameter frozen now frozen (idempotent)."""
    if getattr(model, "_regather_frozen", None) is not None:
        return model
    model._regather_frozen = names = frozen_names(model)
    parallelize = model.parallelize

    def parallelize_keeping_frozen(*args, **kwargs):
        out = parallelize(*args, **kwargs)
        again = refreeze(model, names)
        if again:
            logger.info(REFROZEN.format(n=again))
        return out

    model.parallelize = parallelize_keeping_frozen
    return model
