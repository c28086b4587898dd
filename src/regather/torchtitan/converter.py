"""``regather.torchtitan.LoRAConverter``: torchtitan's LoRA converter with regather's fields.

Drop-in: it *is* a ``torchtitan.components.lora.LoRAConverter`` (``validate_converter_order``
sees a LoRA converter; recipes, logging and checkpoints stay as they are), its ``Config`` has
torchtitan's fields and defaults (``rank=8``, ``alpha=16.0``, ``target_modules=None``) plus
regather's (:mod:`regather.torchtitan.options`), checked when the config is made::

    from regather.torchtitan import LoRAConverter

    model_spec = model_registry("8B", converters=[LoRAConverter.Config(
        rank=8, alpha=16.0, target_modules=["wqkv", "wo", "w1", "w2", "w3"],
        sequence_parallel_input_strategy="regather", recompute_adapter_inputs=True)])

``convert`` is torchtitan's walk of the config tree; each target becomes the config of a regather
LoRA class — a subclass of torchtitan's own LoRA class for that base
(:func:`regather.torchtitan.adapter.regather_class`: same ``__init__``, children, init, placements
and names) carrying the fields — and the root config is wrapped so that ``build()`` attaches the
adapters (:func:`regather.torchtitan.model.attach`) after torchtitan's build (a "replacement
root config", which torchtitan's converter protocol allows) and keeps what the converter froze
frozen through ``parallelize`` on every backend (:mod:`regather.torchtitan.frozen`: torchtitan
0.3.0's ``spmd_types`` makes it trainable again). Nothing else changes: ``update_from_config``,
``parallelize``, activation checkpointing, FSDP2 and DCP run as with torchtitan's converter.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torchtitan.components import lora as titan_lora

from regather.core.strategies import Strategy
from regather.torchtitan import compat
from regather.torchtitan.adapter import regather_class
from regather.torchtitan.frozen import keep_frozen
from regather.torchtitan.model import attach
from regather.torchtitan.options import Options, check_lora, options

_lora_classes: dict = {}
_root_classes: dict = {}


def lora_class(base_cls: type) -> type:
    """The regather LoRA class for a torchtitan base linear class (``Linear``, ``Float8Linear``)."""
    if base_cls in _lora_classes:
        return _lora_classes[base_cls]
    titan_cls = compat.titan_lora_class(base_cls)

    @dataclass(kw_only=True, slots=True)
    class Config(titan_cls.Config):
        strategy: str = Strategy.GATHER.value
        early_regather: bool = True
        recompute_adapter_inputs: bool = False

    def __init__(self, config: Config) -> None:
        titan_cls.__init__(self, config)
        self.init_regather(Options(Strategy.parse(config.strategy), config.early_regather,
                                   config.recompute_adapter_inputs))

    cls = regather_class(titan_cls, base_cls.forward, {"Config": Config, "__init__": __init__})
    Config.__qualname__ = f"{cls.__name__}.Config"
    _lora_classes[base_cls] = cls
    return cls


def _attaching_root(config):
    """``config`` as an instance of a subclass whose ``build()`` attaches the adapters."""
    base = type(config)
    if base not in _root_classes:
        def build(self, **kwargs):
            return attach(keep_frozen(base.build(self, **kwargs)))

        name = f"Regather{base.__name__}"
        _root_classes[base] = type(name, (base,), {"build": build, "__qualname__": name, "__module__": __name__})
    return _root_classes[base](**{f.name: getattr(config, f.name) for f in fields(config) if f.init})


class LoRAConverter(titan_lora.LoRAConverter):
    """torchtitan's ``LoRAConverter`` whose adapters run regather's LoRA-A paths."""

    @dataclass(kw_only=True, slots=True)
    class Config(titan_lora.LoRAConverter.Config):
        sequence_parallel_input_regather: bool = False
        """``True``: the regather strategy (as ``regather.LoRA``)."""

        sequence_parallel_input_strategy: str | None = None
        """``"gather"`` | ``"regather"`` | ``"lowrank"``; ``None`` follows the flag above."""

        early_regather: bool = True
        """regather: start the backward gather early and compute ``dA`` after the module's dgrad."""

        recompute_adapter_inputs: bool = False
        """Save what each adapter input's producer keeps and rebuild the input in backward."""

        def __post_init__(self) -> None:
            check_lora("LoRAConverter.Config", self.rank, self.alpha, self.target_modules)
            self.options()

        def options(self) -> Options:
            return options("LoRAConverter.Config",
                           sequence_parallel_input_regather=self.sequence_parallel_input_regather,
                           sequence_parallel_input_strategy=self.sequence_parallel_input_strategy,
                           early_regather=self.early_regather,
                           recompute_adapter_inputs=self.recompute_adapter_inputs)

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.options = config.options()

    def lora_config(self, cfg):
        """torchtitan's LoRA config for the linear config ``cfg``, of the regather class (torchtitan's
        converter calls it for each target: :func:`.compat.override_make_lora_config`)."""
        cls = lora_class(compat.config_owner(cfg))
        opts = self.options
        return cls.Config(**{f.name: getattr(cfg, f.name) for f in fields(cfg) if f.init},
                          rank=self.rank, alpha=self.alpha, strategy=opts.strategy.value,
                          early_regather=opts.early_regather, recompute_adapter_inputs=opts.recompute_adapter_inputs)

    def convert(self, model_config):
        return _attaching_root(super().convert(model_config))


compat.override_make_lora_config(LoRAConverter, LoRAConverter.lora_config)
