"""``regather.bridge.LoRA`` / ``regather.bridge.DoRA``: regather's adapters behind Megatron Bridge's PEFT protocol.

A drop-in for ``megatron.bridge.peft.lora.LoRA`` in a Bridge recipe::

    from regather.bridge import LoRA

    cfg.peft = LoRA(dim=16, alpha=32, sequence_parallel_input_regather=True)
    cfg.peft = LoRA(dim=16, alpha=32, sequence_parallel_input_strategy="lowrank")

It *is* a Bridge ``LoRA`` (a dataclass subclass: every Bridge field, ``isinstance``
checks such as Bridge's LoRA-aware FLOP count, ``params_to_save`` /
``set_params_to_save``, ``adapter_key_filter``, ``freeze_model`` and
``PEFT.__call__(model, training)`` on a module or a list of model chunks all come
from Bridge), plus regather's fields ``sequence_parallel_input_strategy``
("gather" | "regather" | "lowrank"), ``early_regather``,
``lowrank_grad_allreduce``, ``share_sequence_gather``, ``recompute_adapter_inputs`` and
``redispatch_expert_inputs`` (see :class:`regather.LoRA`).

Only :meth:`LoRA.transform` differs: a megatron column- or row-parallel linear
that Bridge's matcher selects (``target_modules``, wildcards, or Bridge's
``exclude_modules`` mode) becomes a :class:`regather.LoRALinear` with a
:class:`regather.ParallelLinearAdapter`, built by :meth:`regather.megatron.lora.LoRA.make_adapter`.
Parameter and state-dict names follow Bridge's (``…linear_qkv.adapter.linear_in.weight``).
MoE expert linears are regather's too, with Bridge's layouts and options: SequentialMLP
experts get an adapter each; TE grouped experts one adapter shared by the local experts
(``share_expert_adapters=True``, Bridge's default) or one per expert (``False``);
``normalize_moe_lora`` gives expert adapters ``dim // moe_router_topk`` (:mod:`regather.megatron.moe.experts`).
Modules regather does not adapt — plain ``torch.nn.Linear``, MoE routers, grouped experts
under ``experts_shared_outer_loras=True`` (Bridge's serving layout) — go to Bridge's own
``transform`` and get Bridge's adapters. ``lora_dtype``, as in Bridge, applies only to those
plain ``nn.Linear`` adapters.

Bridge's ``ConfigContainer`` declares ``peft: Optional[PEFT]`` and, in
``validate()``, only asks for ``checkpoint.pretrained_checkpoint`` when it is set;
its training setup calls ``peft(model, training=True)`` then
``peft.set_params_to_save(model)``, and its checkpointing filters with
``peft.adapter_key_filter``. When a config is written to YAML, the class is
recorded as ``_target_: regather.bridge.LoRA`` with every field (:meth:`LoRA.to_cfg_dict`),
and ``ConfigContainer.from_yaml`` reads it back; Bridge instantiates only targets under its
allow-listed prefixes, so call
``megatron.bridge.utils.instantiate_utils.register_allowed_target_prefix("regather")``
before loading such a YAML. A string ``target_modules`` is an error naming it (at construction
and when ``validate()`` re-runs ``__post_init__``); ``lora_A_init_method="uniform"`` is accepted
as in Bridge and honoured on plain ``nn.Linear`` targets, and refused with the reason for the
megatron linears regather adapts (Bridge's own parallel-linear adapter has no such initialiser).

Importing this module needs Megatron Bridge; ``import regather`` never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

try:
    from megatron.bridge.peft.dora import DoRA as BridgeDoRA
    from megatron.bridge.peft.lora import LoRA as BridgeLoRA
except ImportError as exc:  # pragma: no cover - exercised in a subprocess without Bridge
    missing = getattr(exc, "name", None) or ""
    if missing.split(".")[0] == "transformer_engine":  # Bridge is there; what it imports is not
        raise ImportError(
            "regather.bridge imports Megatron Bridge, and Megatron Bridge (0.6.2) imports Transformer Engine at "
            "module level (megatron/bridge/peft/lora_layers.py: `import transformer_engine.pytorch`), which is "
            "not installed here: install the transformer-engine your Bridge pins (2.18 for 0.6.2), or use "
            f"regather.LoRA, which needs only megatron-core. The import failed with: {type(exc).__name__}: {exc}"
        ) from exc
    raise ImportError(
        "regather.bridge needs Megatron Bridge (the megatron.bridge.peft package): "
        "`pip install megatron-bridge` into this environment, or use regather.LoRA, which needs only "
        f"megatron-core. The import failed with: {type(exc).__name__}: {exc}"
    ) from exc

from torch import nn

from regather.core.peak.magnitude import WHOLE_ROW
from regather.megatron import dora, lora
from regather.megatron.dense.adapter import INIT_METHODS, ParallelLinearAdapter
from regather.megatron.dense.linears import is_parallel_linear
from regather.megatron.dense.model import finish_wrapping
from regather.megatron.dense.wrapper import LoRALinear
from regather.megatron.lora import attach_producers
from regather.megatron.moe import experts

__all__ = ["PLAIN_LINEAR_ONLY_INITS", "BridgeDoRA", "BridgeLoRA", "DoRA", "LoRA"]

_WRAPPER_CHILDREN = ("to_wrap", "adapter")
#: LoRA-A initialisers Bridge's plain ``nn.Linear`` adapters (``LinearAdapter``: Kaiming-uniform) take
#: and no parallel-linear adapter has — Bridge's own raises for them as regather's does. Accepted by
#: the config, honoured on plain linears (Bridge's adapters), refused on the megatron linears.
PLAIN_LINEAR_ONLY_INITS = ("uniform",)


def _plain_only_init_message(a_init: str, where: str) -> str:
    return (f"regather.bridge.LoRA(lora_A_init_method={a_init!r}): only plain torch.nn.Linear targets (Bridge's "
            f"LinearAdapter) have this initialiser; Bridge's and regather's parallel-linear adapters do not, and it "
            f"selects {where}. Use one of {INIT_METHODS} for megatron linears")


def _plain(value):
    """A config value as YAML-safe plain data (sets and tuples as lists, mappings as dicts)."""
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass
class LoRA(BridgeLoRA):
    """Megatron Bridge's ``LoRA`` whose dense parallel-linear adapters are regather's."""

    # "gather" | "regather" | "lowrank"; None follows sequence_parallel_input_regather.
    sequence_parallel_input_strategy: str | None = None
    # regather: start the backward gather when the output gradient arrives (bit-identical).
    early_regather: bool = True
    # lowrank: "backward" or "finalize_model_grads" (megatron-core's) sums the TP-partial dA.
    lowrank_grad_allreduce: str = "backward"
    # one forward gather / backward reduce-scatter for a frozen ColumnParallelLinear and its adapter.
    share_sequence_gather: bool = False
    # rebuild adapter inputs in backward from what their producers keep (regather.megatron.dense.producers; MoE
    # experts: regather.megatron.moe.inputs), and per-expert LoRA-A inputs by re-dispatching the router's input
    recompute_adapter_inputs: bool = False
    redispatch_expert_inputs: bool = False
    # LoRA's output added into the base's in place, in row chunks (regather.core.peak); None: for every
    # strategy but gather, whose classic output is Bridge's bit for bit
    lean_transients: bool | None = None

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        for name in ("target_modules", "exclude_modules"):  # Bridge's validate() re-runs this too
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"regather.bridge.LoRA({name}={value!r}): expected a list of module names, not a "
                                f"string (it would be read as its characters); write {name}=[{value!r}]")
        self._regather_lora(validating=True)  # a bad regather field fails at construction

    def regather_config(self) -> lora.LoRA:
        """The :class:`regather.LoRA` these fields describe (it builds the adapters of the megatron
        linears); an initialiser only plain ``nn.Linear`` adapters have is an error here."""
        return self._regather_lora(validating=False)

    def _regather_lora(self, validating: bool) -> lora.LoRA:
        a_init = self.lora_A_init_method
        if a_init in PLAIN_LINEAR_ONLY_INITS:
            if not validating:
                raise ValueError(_plain_only_init_message(a_init, "the megatron linears regather adapts"))
            # construction checks the other fields; the initialiser is refused where an adapter of a
            # megatron linear would use it (__call__ / transform), never silently replaced
            a_init = lora.LoRA.lora_A_init_method
        return lora.LoRA(
            target_modules=list(self.target_modules or []),
            dim=self.dim,
            alpha=self.alpha,
            dropout=self.dropout,
            dropout_position=self.dropout_position,
            lora_A_init_method=a_init,
            lora_B_init_method=self.lora_B_init_method,
            a2a_experts=self.a2a_experimental,
            sequence_parallel_input_regather=self.sequence_parallel_input_regather,
            sequence_parallel_input_strategy=self.sequence_parallel_input_strategy,
            early_regather=self.early_regather,
            lowrank_grad_allreduce=self.lowrank_grad_allreduce,
            share_sequence_gather=self.share_sequence_gather,
            recompute_adapter_inputs=self.recompute_adapter_inputs,
            redispatch_expert_inputs=self.redispatch_expert_inputs,
            share_expert_adapters=self.share_expert_adapters,
            normalize_moe_lora=self.normalize_moe_lora,
            lean_transients=self.lean_transients,
        )

    def to_cfg_dict(self) -> dict:
        """What Bridge's ``ConfigContainer.to_yaml`` writes for this PEFT config (megatron's config
        container serialises any value with a ``to_cfg_dict``): the public class path
        ``regather.bridge.LoRA`` and every constructor field as plain values — not the ``init=False``
        ``params_to_save`` set, which OmegaConf cannot read back — so ``ConfigContainer.from_yaml``
        round-trips it (after ``register_allowed_target_prefix("regather")``, as for any non-Bridge
        target)."""
        out = {"_target_": "regather.bridge.LoRA"}
        for f in fields(self):
            if f.init and not f.name.startswith("_"):
                out[f.name] = _plain(getattr(self, f.name))
        return out

    def __call__(self, model, training: bool = True):
        """Bridge's ``PEFT.__call__`` (validate matches, freeze, walk ``transform``, set the mode),
        after re-validating the fields (recipes set them after construction)."""
        self.__post_init__()
        if self.lora_A_init_method in PLAIN_LINEAR_ONLY_INITS:
            self._refuse_plain_only_init(model)  # before Bridge's walk changes anything
        model = super().__call__(model, training=training)
        for chunk in model if isinstance(model, list) else [model]:
            chunk = getattr(chunk, "module", chunk)
            if self.recompute_adapter_inputs:  # after every wrap: producers hook the final modules
                attach_producers(chunk)
            finish_wrapping(chunk)
        return model

    def _refuse_plain_only_init(self, model) -> None:
        """Name every megatron linear this config would hand to regather under an initialiser
        only plain ``nn.Linear`` adapters have (Bridge's own parallel-linear adapter has none)."""
        hits = []
        for chunk in model if isinstance(model, list) else [model]:
            for path, module in getattr(chunk, "module", chunk).named_modules():
                prefix, _, name = path.rpartition(".")
                if self._regather_adapts(module) and self.match(module, name, prefix or None) is not None:
                    hits.append(path)
        if hits:
            raise ValueError(_plain_only_init_message(self.lora_A_init_method, f"{hits[:4]}"
                                                      f"{' and more' if len(hits) > 4 else ''}"))

    def transform(self, module: nn.Module, name: str | None = None, prefix: str | None = None) -> nn.Module:
        """Wrap ``module`` in a regather ``LoRALinear`` when Bridge's matcher selects it."""
        full_name = f"{prefix}.{name}" if prefix else (name or "")
        if isinstance(module, (LoRALinear, ParallelLinearAdapter)) or any(
            part in _WRAPPER_CHILDREN for part in full_name.split(".")
        ):
            return module  # already adapted, or inside an adapted linear
        if not self._regather_adapts(module):
            return super().transform(module, name, prefix)  # Bridge's own adapter (see module doc)
        match = self.match(module, name, prefix)
        if match is None:
            return module
        _, path = match
        config = self.regather_config()  # raises for an initialiser only plain nn.Linear adapters have
        return config.wrap(module, config.make_adapter(path, module))

    def _regather_adapts(self, module: nn.Module) -> bool:
        if isinstance(module, nn.Linear) or not (is_parallel_linear(module) or experts.is_grouped_linear(module)):
            return False
        return not (self.experts_shared_outer_loras and experts.is_grouped_linear(module))


@dataclass
class DoRA(BridgeDoRA):
    """Megatron Bridge's ``DoRA`` whose adapters are regather's (:class:`regather.DoRA`): a drop-in for
    ``megatron.bridge.peft.dora.DoRA`` (``cfg.peft = DoRA(dim=16, alpha=32, ...)``; a recipe's
    ``peft_scheme=DoRA(...)``). Bridge's fields and defaults, and regather's: the LoRA strategy
    (``sequence_parallel_input_regather`` / ``sequence_parallel_input_strategy``, ``early_regather``,
    ``lowrank_grad_allreduce``), ``recompute_adapter_inputs``, ``lean_transients``, ``dora_norm``
    (``"whole_row"``; ``"per_rank_slice"`` is Bridge 0.6.2's TP-dependent norm of a row-parallel base, for
    checkpoints trained with it) and ``recompute_dora_output`` (see :class:`regather.DoRA`). Parameter and
    checkpoint names are Bridge's (``…adapter.weight_magnitude``). A module regather does not adapt goes to
    Bridge's own ``transform``."""

    sequence_parallel_input_regather: bool = False
    sequence_parallel_input_strategy: str | None = None
    early_regather: bool = True
    lowrank_grad_allreduce: str = "backward"
    recompute_adapter_inputs: bool = False
    lean_transients: bool | None = None
    dora_norm: str = WHOLE_ROW
    recompute_dora_output: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()  # Bridge's: dropout_position "pre"
        for name in ("target_modules", "exclude_modules"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"regather.bridge.DoRA({name}={value!r}): expected a list of module names, not a "
                                f"string (it would be read as its characters); write {name}=[{value!r}]")
        self.regather_config()  # a bad regather field fails at construction

    def regather_config(self) -> dora.DoRA:
        """The :class:`regather.DoRA` these fields describe (it builds the adapters)."""
        return dora.DoRA(
            target_modules=list(self.target_modules or []), dim=self.dim, alpha=self.alpha, dropout=self.dropout,
            dropout_position=self.dropout_position, lora_A_init_method=self.lora_A_init_method,
            lora_B_init_method=self.lora_B_init_method,
            sequence_parallel_input_regather=self.sequence_parallel_input_regather,
            sequence_parallel_input_strategy=self.sequence_parallel_input_strategy, early_regather=self.early_regather,
            lowrank_grad_allreduce=self.lowrank_grad_allreduce, recompute_adapter_inputs=self.recompute_adapter_inputs,
            lean_transients=self.lean_transients, dora_norm=self.dora_norm,
            recompute_dora_output=self.recompute_dora_output)

    def to_cfg_dict(self) -> dict:
        """As :meth:`LoRA.to_cfg_dict`: ``_target_: regather.bridge.DoRA`` and every constructor field."""
        out = {"_target_": "regather.bridge.DoRA"}
        for f in fields(self):
            if f.init and not f.name.startswith("_"):
                out[f.name] = _plain(getattr(self, f.name))
        return out

    def __call__(self, model, training: bool = True):
        """Bridge's ``PEFT.__call__`` after re-validating the fields (recipes set them after construction)."""
        self.__post_init__()
        model = super().__call__(model, training=training)
        for chunk in model if isinstance(model, list) else [model]:
            chunk = getattr(chunk, "module", chunk)
            if self.recompute_adapter_inputs:
                attach_producers(chunk)
            finish_wrapping(chunk)
        return model

    def transform(self, module: nn.Module, name: str | None = None, prefix: str | None = None) -> nn.Module:
        """Wrap ``module`` in a regather ``DoRALinear`` when Bridge's matcher selects it."""
        full_name = f"{prefix}.{name}" if prefix else (name or "")
        if isinstance(module, (LoRALinear, ParallelLinearAdapter)) or any(
            part in _WRAPPER_CHILDREN for part in full_name.split(".")
        ):
            return module
        if isinstance(module, nn.Linear) or not is_parallel_linear(module):
            return super().transform(module, name, prefix)  # Bridge's own (it refuses what it cannot adapt)
        match = self.match(module, name, prefix)
        if match is None:
            return module
        _, path = match
        config = self.regather_config()
        return config.wrap(module, config.make_adapter(path, module))


# Users, YAML configs and pickles name the class by its public path (``regather.bridge`` imports it
# from here): megatron's config container writes ``_target_`` from ``__module__`` for a dataclass
# without ``to_cfg_dict``, and pickle looks the class up by it.
LoRA.__module__ = "regather.bridge"
DoRA.__module__ = "regather.bridge"
