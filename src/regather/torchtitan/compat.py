"""Every private upstream name the torchtitan front end touches, in one place, with the version it
was read from. tests/unit/torchtitan/test_titan_compat.py checks each against the pinned versions, so an
upgrade fails there, naming the attribute, instead of somewhere in a forward.

Read from torchtitan 0.3.0 (:data:`TORCHTITAN_VERSION`) and torch 2.13.0 and 2.14.1
(:data:`TORCH_VERSIONS`; 0.3.0's release checks pinned torch 2.14):

============================================ ===================================================
private name                                 what regather does with it
============================================ ===================================================
``torchtitan.components.lora._get_lora_cls`` the LoRA class torchtitan makes for a base linear
                                             class; regather's adapter class subclasses it
``LoRAConverter._make_lora_config``          the converter method that turns a linear's config
                                             into its LoRA config; regather's converter
                                             overrides it (:func:`override_make_lora_config`)
``Linear.Config._owner``                     the class a linear config builds (set by
                                             torchtitan's ``Configurable``)
``LoRALinear._lora_scaling``                 ``alpha / rank``, set by torchtitan's ``__init__``
                                             (and by :func:`regather.torchtitan.apply_lora`)
``Module._redistribute_inputs``              a torchtitan module's input redistribution, looked
                                             up on every call by ``Module.parallelize``'s
                                             forward; regather wraps it per instance to record
                                             the sequence gather (:mod:`.pairing`)
``Module._sharding_config``                  the sharding config ``set_*_sharding_config``
                                             attaches (its ``in_dst_shardings``; under
                                             ``spmd_types`` its ``state_shardings`` and
                                             ``in_src_shardings`` too: :mod:`.spmd`)
``Module._cache_pos_arg_names``              the names ``_redistribute_inputs`` gives a
                                             module's positional inputs (the keys of its
                                             sharding config's input layouts)
``Module._spmd_distribute_state``            re-registers a sharded state under
                                             ``spmd_types`` as ``nn.Parameter(tensor)``:
                                             trainable again in 0.3.0 (torchtitan #4267 fixes
                                             it after 0.3.0); :mod:`.frozen` undoes it
``torch.utils._python_dispatch``             the innermost ``TorchDispatchMode`` and popping it
``._get_current_dispatch_mode`` /            for a moment: how the LoRA branch stays out of
``._pop_mode_temporarily``                   selective checkpointing's op policy
                                             (:func:`unseen_by_selective_checkpoint`)
``torch.utils.checkpoint``'s                 the two modes selective checkpointing runs a block
``_CachingTorchDispatchMode`` /              under (first forward / recompute)
``_CachedTorchDispatchMode``
``torch.distributed.algorithms._checkpoint`` the module torchtitan's SelectiveAC / FullAC wrap a
``.checkpoint_wrapper.CheckpointWrapper``    block in (``ptd_checkpoint_wrapper``): what a
                                             compiled adapter inside one is told
                                             (:func:`checkpoint_wrapper_class`)
============================================ ===================================================
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils._python_dispatch as python_dispatch
import torch.utils.checkpoint as checkpoint

TORCHTITAN_VERSION = "0.3.0"
TORCH_VERSIONS = ("2.13.0", "2.14.1")

#: the torchtitan ``LoRAConverter`` method regather's converter overrides
MAKE_LORA_CONFIG = "_make_lora_config"
#: the per-instance attribute of a torchtitan ``Module`` that redistributes its inputs
REDISTRIBUTE_INPUTS = "_redistribute_inputs"
#: selective checkpointing's dispatch modes, first forward and recompute
SAC_MODES = (checkpoint._CachingTorchDispatchMode, checkpoint._CachedTorchDispatchMode)


def titan_lora_class(base_cls: type) -> type:
    """torchtitan's LoRA class for the base linear class ``base_cls`` (``Linear``, ``Float8Linear``)."""
    from torchtitan.components import lora

    return lora._get_lora_cls(base_cls)


def config_owner(config) -> type:
    """The class a torchtitan ``Linear.Config`` builds."""
    return config._owner


def override_make_lora_config(converter_cls: type, method) -> None:
    """Make ``method(self, linear_config)`` the LoRA config maker of ``converter_cls`` (a subclass
    of torchtitan's ``LoRAConverter``)."""
    setattr(converter_cls, MAKE_LORA_CONFIG, method)


def lora_scaling(module) -> float:
    """``alpha / rank`` of a torchtitan LoRA linear."""
    return module._lora_scaling


def set_lora_scaling(module, scaling: float) -> None:
    module._lora_scaling = scaling


def wrap_input_redistribution(module, wrap) -> None:
    """Replace ``module``'s input redistribution ``f(parallel_dims, args, kwargs)`` by ``wrap(f)``
    (on this instance: ``Module.parallelize`` looks it up on every call)."""
    setattr(module, REDISTRIBUTE_INPUTS, wrap(getattr(module, REDISTRIBUTE_INPUTS)))


def sharding_config(module):
    """The sharding config torchtitan attached to ``module``, or None."""
    return getattr(module, "_sharding_config", None)


def input_names(module, args: tuple, kwargs: dict) -> list[str]:
    """The names torchtitan's ``_redistribute_inputs`` gives ``args`` (the positional inputs of
    ``module``'s forward not passed by keyword, in order)."""
    names = [name for name in module._cache_pos_arg_names() if name not in kwargs]
    return names[:len(args)]


def checkpoint_wrapper_class() -> type:
    """The module class torchtitan's activation checkpointing wraps each block in."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return CheckpointWrapper


def _selective_checkpoint_mode():
    mode = python_dispatch._get_current_dispatch_mode()
    return mode if isinstance(mode, SAC_MODES) else None


@contextlib.contextmanager
def unseen_by_selective_checkpoint():
    """Run the body with selective checkpointing's dispatch mode popped when it is the innermost
    mode (eager only; nothing otherwise). The body's ops are then neither counted by the op
    policy nor cached: they run again, unseen, in the recompute, which pops the recompute's mode
    the same way — the two passes stay aligned op for op."""
    if torch.compiler.is_compiling() or _selective_checkpoint_mode() is None:
        yield
        return
    with python_dispatch._pop_mode_temporarily():
        yield
