"""The PyTorch-native front end: regather for torchtitan's LoRA under tensor + sequence parallelism.

torchtitan's LoRA (``torchtitan.components.lora``) keeps, for each column-parallel adapter, the
input all-gathered over the sequence (``[b, s, h]``) for LoRA-A's gradient. regather keeps the
sequence shard instead and gathers it again in backward (or computes LoRA-A on the shard:
lowrank), bit-identical to torchtitan's LoRA for gather and regather; with
``recompute_adapter_inputs`` LoRA adds only its rank-r tensors over the frozen model.

- :class:`LoRAConverter` — drop-in for torchtitan's ``LoRAConverter`` in the ``converters=``
  list of a model registry (``model_registry("8B", converters=[LoRAConverter.Config(...)])``)
- :func:`apply_lora` — the same for a model parallelized by hand with
  ``torch.distributed.tensor.parallel``
- :func:`adapters`, :func:`decisions`, :func:`set_strategy` — the adapters of a model, what each
  decided and why (``regather.decisions`` reads every loaded front end), a strategy switch

Runs on every SPMD backend of torchtitan 0.3.0: ``spmd_types`` (its default: plain tensors, layouts
read from the sharding configs), ``partial_dtensor`` and ``full_dtensor`` (DTensor placements).

Modules: :mod:`.converter`, :mod:`.hand` (entry points); :mod:`.model` (attach, decisions);
:mod:`.adapter` (plan, then execute the LoRA-A paths); :mod:`.pairing` (where the gathered input
is recorded, the early-regather anchor), :mod:`.producers` (recompute), :mod:`.rebuilt`,
:mod:`.traced` (the forward under ``torch.compile``), :mod:`.frozen` (what the converter froze stays
frozen through ``parallelize``); :mod:`.layout` (the layout and the sequence gather, per
backend), :mod:`.runstate`; :mod:`.spmd` (what ``spmd_types`` declares), :mod:`.tp` (where a path's
local tensors meet the backend's); :mod:`.options`, :mod:`.reasons`, :mod:`.compat` (every private
torchtitan / torch name touched, with versions). Imports torch, torchtitan and
:mod:`regather.core` only (docs/torchtitan.md, docs/design.md §12).
"""

import importlib

from regather.core import frontends

# the entry points by module, imported on first use: regather.torchtitan.reasons (the sentences
# ``regather estimate`` shares) imports without torchtitan, as regather.megatron.reasons without megatron
_HOME = {"LoRAConverter": "converter", "apply_lora": "hand", "adapters": "model", "decisions": "model",
         "set_strategy": "model"}

__all__ = ["LoRAConverter", "adapters", "apply_lora", "decisions", "set_strategy"]


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def _model():
    from regather.torchtitan import model

    return model


# regather.adapters / decisions / set_strategy ask every front end registered (regather.core.frontends)
frontends.register("torchtitan", _model)


def __dir__():
    return sorted(set(globals()) | set(__all__))
