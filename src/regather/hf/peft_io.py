"""Export regather's LoRA adapters to Hugging Face PEFT's format, and load PEFT adapters.

:func:`export_peft` writes ``adapter_model.safetensors`` and ``adapter_config.json``;
:func:`load_peft` loads such a directory (written by regather or by PEFT's
``save_pretrained``) into a LoRA-wrapped, TP-sharded megatron-core model with any strategy.
Both are collectives over each adapter's TP group: call them on every rank (rank 0 of the
default group writes the files). Names and row layouts: :mod:`regather.hf.layout`.

Which adapters load into which config (checked before any weight or scale changes; a
refusal raises :class:`~regather.hf.peft_config.UnsupportedAdapter`, a ``ValueError``):

* ``LoRA`` (one adapter on the fused ``linear_qkv`` / ``linear_fc1``): the HF modules of one
  fused linear (q/k/v, gate/up) must have the *same* ``lora_A`` (and r and scale) — a standard
  PEFT adapter with its own A per projection needs ``CanonicalLoRA``. Projections the file
  leaves out of a fused linear (e.g. ``k_proj`` of ``["q_proj", "v_proj"]``) load as zero rows
  of LoRA-B.
* ``CanonicalLoRA``: one adapter per HF module.
* Either: every adapter of the model must find its tensors and every tensor an adapter; the
  HF modules the config targets (PEFT's own matching of ``target_modules``,
  ``exclude_modules``, ``layers_to_transform``, ``layers_pattern``) must be the ones the
  weights file holds and lie on the four megatron linears (not ``embed_tokens``,
  ``lm_head``, ...); each module's ``r`` (``rank_pattern``) must be the adapter's ``dim``.
* Scale: PEFT's ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), per module with
  ``alpha_pattern``. The file's ``lora_alpha`` must be the model's ``LoRA(alpha=...)`` (or
  give the same scale); ``use_rslora`` and ``alpha_pattern`` then set each adapter's
  ``scale`` (one per megatron adapter: the modules of a fused linear must agree).
* DoRA (``regather.DoRA``, PEFT's ``use_dora=True``): each module's ``lora_magnitude_vector`` is the
  magnitude's rows (cut as LoRA-B's); the file's ``use_dora`` must match the model's adapters. A model with
  Bridge's per-slice norm at TP > 1 is not exported (PEFT's norm is the whole row's).
* Refused: ``use_dora`` into a LoRA model (and a plain LoRA into a DoRA model), ``lora_bias``, ``bias != "none"``, ``fan_in_fan_out``,
  ``modules_to_save``, trainable tokens, PiSSA/OLoRA/CorDA/LoftQ/LoRA-GA/MiCA inits, and any
  other set field regather does not know (:func:`~regather.hf.peft_config.check_features`).

Weights are written unscaled (``alpha / dim`` is PEFT's ``lora_alpha / r``). The exported
tensors are the same whichever strategy trained the model. A torchtitan model (torchtitan's or
regather's ``LoRAConverter``) is exported by :mod:`regather.hf.torchtitan_peft`: ``export_peft``,
``hf_state_dict`` and ``peft_config`` hand it over; ``load_peft`` is megatron's only. Pipeline parallelism is not
supported (layer numbers are taken from the local module path).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from regather.core import comm
from regather.hf import layout, torchtitan_peft
from regather.hf.layout import PEFT_PREFIX, Target
from regather.hf.peft_config import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    ExportedModule,
    UnsupportedAdapter,
    check_features,
    lora_config,
    module_lora,
    targeted,
    write_adapter_dir,
)

WEIGHTS_NAME_BIN = "adapter_model.bin"
#: PEFT key prefix of decoder layers (``base_model.model.model.layers``).
PREFIX = f"{PEFT_PREFIX}{layout.HF_LAYERS}"


# -- the model's adapters, each with its HF modules ---------------------------------------


@dataclass
class Slot:
    """One regather adapter and the HF modules it stands for."""

    path: str      # as regather.adapters lists it (CanonicalLoRA: ...self_attention.linear_q)
    layer: int
    adapter: object
    target: Target

    @property
    def names(self) -> tuple[str, ...]:
        return self.target.names(self.layer)


def _layer_and_kind(path: str):
    parts = path.split(".")
    try:
        i = parts.index("layers")
        layer = int(parts[i + 1])
    except (ValueError, IndexError):
        raise ValueError(f"cannot find a layer number in module path {path!r}") from None
    return layer, parts[-1]


def _gated(config) -> bool:
    return bool(getattr(config, "gated_linear_unit", False))


def slots(model: torch.nn.Module, names: Mapping | None = None) -> list[Slot]:
    """Every adapter of ``model`` (``LoRA`` or ``CanonicalLoRA``) with its :class:`Target`."""
    from regather.megatron.dense.model import adapters

    found = adapters(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters")
    out = []
    for path in sorted(found):
        adapter = found[path]
        layer, kind = _layer_and_kind(path)
        out.append(Slot(path, layer, adapter, layout.target(kind, _gated(adapter.config), names)))
    return out


def _model_facts(found: list[Slot]) -> tuple[int, bool]:
    config = found[0].adapter.config
    return int(config.num_layers), _gated(config)


def _shards(adapter) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's LoRA-A and LoRA-B in the sharded (Bridge) layout, whatever the strategy."""
    sd = adapter.state_dict()
    return sd["linear_in.weight"].detach(), sd["linear_out.weight"].detach()


def _size_rank(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _a_dim(adapter) -> int:
    return 0 if adapter.column_parallel else 1


def _is_dora(adapter) -> bool:
    """A DoRA adapter (:class:`regather.DoRA`): its ``weight_magnitude`` is PEFT's ``lora_magnitude_vector``."""
    return getattr(adapter, "weight_magnitude", None) is not None


def _dora_model(found: list[Slot], where: str) -> bool:
    kinds = {_is_dora(s.adapter) for s in found}
    if len(kinds) > 1:
        raise ValueError(f"{where}: the model mixes DoRA and LoRA adapters; one PEFT config holds one kind")
    return kinds.pop()


def _magnitude_parts(slot: Slot) -> tuple[torch.Tensor, ...]:
    """A DoRA adapter's magnitude cut into its HF modules' ``lora_magnitude_vector`` (rows as LoRA-B's). PEFT's
    norm is the whole row's: a model with Bridge's per-slice norm at TP > 1 computes another function."""
    adapter = slot.adapter
    group = adapter.tp_group
    t = _size_rank(group)[0]
    if adapter.norm_group is None and not adapter.column_parallel and t > 1:
        raise ValueError(f"{slot.path!r}: DoRA(dora_norm={adapter.norm!r}) at TP={t} takes each rank's slice norm; "
                         "PEFT's DoRA takes the whole row's, so the exported adapter would compute another function")
    m = adapter.weight_magnitude.detach()
    shards = (list(comm.all_gather_dim(m, group, dim=0).chunk(t, dim=0)) if adapter.column_parallel else [m])
    parts = layout.split_rows(slot.target, [p.unsqueeze(1) for p in shards], layout.attention_layout(adapter.config))
    return tuple(p.squeeze(1) for p in parts)


# -- export ------------------------------------------------------------------------------


def _exported(model, names, dtype):
    tensors: dict[str, torch.Tensor] = {}
    modules: list[ExportedModule] = []
    for slot in slots(model, names):
        adapter = slot.adapter
        a, b = _shards(adapter)
        group = adapter.tp_group
        t = _size_rank(group)[0]
        a_full = comm.all_gather_dim(a, group, dim=_a_dim(adapter))
        b_shards = list(comm.all_gather_dim(b, group, dim=0).chunk(t, dim=0))
        bs = layout.split_rows(slot.target, b_shards, layout.attention_layout(adapter.config))
        ms = _magnitude_parts(slot) if _is_dora(adapter) else (None,) * len(bs)
        for name, module, b_part, m_part in zip(slot.names, slot.target.modules, bs, ms):
            key = f"{PEFT_PREFIX}{name}"
            tensors[f"{key}.lora_A.weight"] = a_full.clone().to(dtype or a_full.dtype).contiguous()
            tensors[f"{key}.lora_B.weight"] = b_part.clone().to(dtype or b_part.dtype).contiguous()
            if m_part is not None:
                tensors[f"{key}.lora_magnitude_vector"] = m_part.clone().to(dtype or m_part.dtype).contiguous()
            modules.append(ExportedModule(name, slot.layer, module, adapter.dim, adapter.alpha, adapter.scale))
    return tensors, modules


def _torchtitan(model, names) -> bool:
    """``model`` is a torchtitan model with LoRA (:mod:`regather.hf.torchtitan_peft` exports it)."""
    if not torchtitan_peft.is_torchtitan_lora(model):
        return False
    if names is not None:
        raise ValueError("names= renames megatron linears; a torchtitan model's names are fixed "
                         "(regather.hf.torchtitan_peft.NAMES)")
    return True


def hf_state_dict(model: torch.nn.Module, names: Mapping | None = None,
                  dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full (TP-gathered) LoRA weights under HF PEFT keys. A collective: call on every rank."""
    if _torchtitan(model, names):
        return torchtitan_peft.hf_state_dict(model, dtype)
    return _exported(model, names, dtype)[0]


def _dropout(model) -> float:
    from regather.megatron.dense.model import adapters

    return max((a.dropout.p if a.dropout is not None else 0.0) for a in adapters(model).values())


def peft_config(model, tensors: Mapping[str, torch.Tensor] | None = None,
                base_model_name_or_path: str | None = None, names: Mapping | None = None) -> dict:
    """``adapter_config.json`` for ``model``'s adapters: the fields peft 0.21.2's ``LoraConfig``
    writes; targets as module names (+ ``layers_to_transform`` when not every layer has them, or
    exact module names when the layers differ per module); ``rank_pattern`` / ``alpha_pattern``
    / ``use_rslora`` from each adapter's ``dim`` and ``scale``. Collective-free."""
    if _torchtitan(model, names):
        return torchtitan_peft.peft_config(model, base_model_name_or_path)
    modules = []
    found = slots(model, names)
    for slot in found:
        a = slot.adapter
        modules += [ExportedModule(n, slot.layer, m, a.dim, a.alpha, a.scale)
                    for n, m in zip(slot.names, slot.target.modules)]
    num_layers = _model_facts(found)[0]
    return lora_config(modules, num_layers, base_model_name_or_path, _dropout(model),
                       dora=_dora_model(found, type(model).__name__))


def export_peft(model: torch.nn.Module, directory: str, *, base_model_name_or_path: str | None = None,
                names: Mapping | None = None, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` to ``directory``.

    A collective (every rank must call it); rank 0 of the default group writes.
    Returns the exported tensors (on every rank).
    """
    if _torchtitan(model, names):
        return torchtitan_peft.export_peft(model, directory, base_model_name_or_path=base_model_name_or_path,
                                          dtype=dtype)
    _check_no_pipeline()
    tensors, _ = _exported(model, names, dtype)
    config = peft_config(model, tensors, base_model_name_or_path, names)
    write_adapter_dir(directory, tensors, config, "megatron-core LoRA (regather)")
    return tensors


# -- load --------------------------------------------------------------------------------


def read_peft(directory: str) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, config)`` of a PEFT adapter directory (safetensors, or PEFT's ``.bin``)."""
    config_path = os.path.join(directory, CONFIG_NAME)
    weights = os.path.join(directory, WEIGHTS_NAME)
    legacy = os.path.join(directory, WEIGHTS_NAME_BIN)
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"HF PEFT adapter file {config_path!r} is missing")
    with open(config_path) as f:
        config = json.load(f)
    if os.path.exists(weights):
        from safetensors.torch import load_file

        return load_file(weights), config
    if os.path.exists(legacy):
        return torch.load(legacy, map_location="cpu", weights_only=True), config
    raise FileNotFoundError(f"HF PEFT adapter file {weights!r} is missing")


def _module_of(key: str) -> str:
    """The HF module a PEFT tensor key belongs to (``...q_proj.lora_A.weight`` -> ``...q_proj``)."""
    name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
    for marker in (".lora_", ".base_layer.", ".modules_to_save.", ".original_module.", ".trainable_tokens_"):
        if marker in name:
            return name.split(marker)[0]
    return name.rsplit(".", 1)[0]


def _outside_message(names: list[str]) -> str:
    return (f"target modules {names[:6]}{'...' if len(names) > 6 else ''} lie outside the four megatron linears "
            "regather adapts (linear_qkv = q/k/v_proj, linear_proj = o_proj, linear_fc1 = gate/up_proj, "
            "linear_fc2 = down_proj)")


def _check_targets(config: Mapping, tensors: Mapping, found: list[Slot], names, where: str,
                   dora: bool = False) -> set[str]:
    """The HF modules with LoRA: what the config targets (PEFT's matching) must be what the
    weights hold, on the four megatron linears, as LoRA-A/B weights only (and DoRA's magnitude vectors,
    ``dora``). Returns them."""
    suffixes = ("lora_A.weight", "lora_B.weight") + (("lora_magnitude_vector",) if dora else ())
    num_layers, gated = _model_facts(found)
    projections = layout.projection_names(num_layers, gated, names)
    every = layout.hf_module_names(num_layers, gated, names)
    if config.get("target_modules") is None:
        raise UnsupportedAdapter(f"{where}: target_modules is null (PEFT would pick the model type's defaults); "
                                 "name the modules")
    want = targeted(config, every, sorted(projections) + ["lm_head"])
    outside = sorted(want - projections)
    if outside:
        raise UnsupportedAdapter(f"{where}: {_outside_message(outside)}")
    have, other = set(), []
    for key in tensors:
        module = _module_of(key)
        if module not in projections:
            outside.append(module)
        elif key in {f"{PEFT_PREFIX}{module}.{suffix}" for suffix in suffixes}:
            have.add(module)
        else:
            other.append(key)
    if outside:
        raise UnsupportedAdapter(f"{where}: the weights hold tensors of modules {sorted(set(outside))[:6]}: "
                                 f"{_outside_message(sorted(set(outside)))}")
    if other:
        raise UnsupportedAdapter(f"{where}: tensors {sorted(other)[:6]} are not LoRA-A/B weights "
                                 "(<module>.lora_A.weight / lora_B.weight); regather loads LoRA weights only")
    for module in sorted(have):
        for suffix in suffixes:
            if f"{PEFT_PREFIX}{module}.{suffix}" not in tensors:
                raise UnsupportedAdapter(f"{where}: {module} has no {suffix}")
    if want != have:
        missing, extra = sorted(want - have), sorted(have - want)
        raise UnsupportedAdapter(
            f"{where}: adapter_config.json and the weights disagree (PEFT would warn and compute something "
            f"else): targeted without tensors {missing[:6]}, tensors not targeted {extra[:6]}")
    return have


def _why_canonical(slot: Slot, present: list[str]) -> str:
    return (f"{slot.path!r} is one fused megatron linear with one LoRA-A (regather.LoRA), but the adapter "
            f"has a different lora_A for each of {present}: it needs regather.CanonicalLoRA (one adapter per "
            "projection, Bridge's linear_q/linear_k/linear_v, linear_fc1_gate/linear_fc1_up)")


def _stage(slot: Slot, tensors, config, present: list[int], where: str):
    """This rank's (A, B) shards and the scale for one adapter, or an UnsupportedAdapter."""
    adapter, tgt = slot.adapter, slot.target
    names = slot.names
    a_list = [tensors[f"{PEFT_PREFIX}{names[i]}.lora_A.weight"] for i in present]
    b_list = {i: tensors[f"{PEFT_PREFIX}{names[i]}.lora_B.weight"] for i in present}
    per = [module_lora(config, names[i]) for i in present]
    shown = [tgt.modules[i] for i in present]
    for m, info in zip((names[i] for i in present), per):
        if info.r != adapter.dim:
            fix = (f"build LoRA(dim={info.r})" if info.r_from == "r" else
                   "one LoRA(dim=...) builds every adapter with the same rank, so a rank_pattern can load only "
                   "where it gives the model's dim")
            raise UnsupportedAdapter(f"{where}: {m} has r={info.r} (from {info.r_from}); the adapter on "
                                     f"{slot.path!r} has dim={adapter.dim}: {fix}")
        if info.alpha_from == "lora_alpha" and float(info.alpha) != adapter.alpha and not math.isclose(
                info.scale, adapter.alpha / adapter.dim, rel_tol=1e-12):
            rs = ", use_rslora" if config.get("use_rslora") else ""
            raise UnsupportedAdapter(
                f"{where}: lora_alpha={info.alpha} (r={info.r}{rs}: scale {info.scale:g}); the adapter on "
                f"{slot.path!r} has alpha={adapter.alpha:g}, dim={adapter.dim} (scale {adapter.alpha / adapter.dim:g}): "
                f"build LoRA(alpha={info.alpha})")
    if len({info.scale for info in per}) > 1:
        keys = sorted({info.alpha_from for info in per} - {"lora_alpha"})
        raise UnsupportedAdapter(
            f"{where}: {', '.join(shown)} of layer {slot.layer} get different scales "
            f"({', '.join(f'{s}: {i.scale:g}' for s, i in zip(shown, per))}; from {', '.join(keys)}); "
            f"{slot.path!r} is one fused adapter with one scale (regather.CanonicalLoRA has one per projection)")
    if any(not torch.equal(a_list[0], a) for a in a_list[1:]):
        raise UnsupportedAdapter(f"{where}: {_why_canonical(slot, shown)}")
    a_full = a_list[0]
    t, rank = _size_rank(adapter.tp_group)
    attention = layout.attention_layout(adapter.config)
    cur_a, cur_b = _shards(adapter)
    in_full = cur_a.shape[1] * (t if not adapter.column_parallel else 1)
    if tuple(a_full.shape) != (adapter.dim, in_full):
        raise UnsupportedAdapter(f"{where}: {names[present[0]]}.lora_A is {tuple(a_full.shape)}; the adapter on "
                                 f"{slot.path!r} needs ({adapter.dim}, {in_full})")
    rows = layout.module_rows(tgt, cur_b.shape[0] * t, attention)
    parts = []
    for i, n in enumerate(rows):
        b = b_list.get(i)
        if b is None:  # a projection of a fused linear the adapter leaves out: zero rows of B
            b = torch.zeros(n, adapter.dim, dtype=a_full.dtype)
        if tuple(b.shape) != (n, adapter.dim):
            raise UnsupportedAdapter(f"{where}: {names[i]}.lora_B is {tuple(b.shape)}; the adapter on "
                                     f"{slot.path!r} needs ({n}, {adapter.dim})")
        parts.append(b)
    try:
        b_shard = layout.rank_rows(tgt, parts, rank, t, attention)
        a_shard = a_full.chunk(t, dim=_a_dim(adapter))[rank]
    except ValueError as exc:
        raise UnsupportedAdapter(f"{where}: {slot.path!r}: {exc}") from None
    for what, new, cur in (("lora_A", a_shard, cur_a), ("lora_B", b_shard, cur_b)):
        if tuple(new.shape) != tuple(cur.shape):
            raise UnsupportedAdapter(f"{where}: {slot.path!r}: {what} shard from the file is {tuple(new.shape)}, "
                                     f"the adapter holds {tuple(cur.shape)} (TP={t})")
    m_shard = _magnitude_shard(slot, tensors, present, rows, rank, t, attention, where) if _is_dora(adapter) else None
    return a_shard.to(cur_a.dtype).contiguous(), b_shard.to(cur_b.dtype).contiguous(), per[0].scale, m_shard


def _magnitude_shard(slot: Slot, tensors, present: list[int], rows, rank: int, t: int, attention, where: str):
    """This rank's ``weight_magnitude`` from the modules' ``lora_magnitude_vector``: every module of the fused
    linear must have one (a DoRA magnitude has no neutral value to stand for a missing projection)."""
    adapter, names = slot.adapter, slot.names
    if len(present) != len(names):
        missing = [names[i] for i in range(len(names)) if i not in present]
        raise UnsupportedAdapter(f"{where}: {slot.path!r} is one DoRA adapter with one magnitude over "
                                 f"{', '.join(slot.target.modules)}; the file has none for {missing[:3]}")
    parts = []
    for i, n in enumerate(rows):
        m = tensors[f"{PEFT_PREFIX}{names[i]}.lora_magnitude_vector"]
        if tuple(m.shape) != (n,):
            raise UnsupportedAdapter(f"{where}: {names[i]}.lora_magnitude_vector is {tuple(m.shape)}; the adapter on "
                                     f"{slot.path!r} needs ({n},)")
        parts.append(m.unsqueeze(1))
    if adapter.column_parallel:
        shard = layout.rank_rows(slot.target, parts, rank, t, attention).squeeze(1)
    else:
        shard = parts[0].squeeze(1)
    return shard.to(adapter.weight_magnitude.dtype).contiguous()


def load_peft(model: torch.nn.Module, directory: str, names: Mapping | None = None) -> list[str]:
    """Load an HF PEFT LoRA adapter into ``model`` (``LoRA`` or ``CanonicalLoRA`` applied, any
    strategy, TP-sharded). Everything is checked first (module docstring); then each adapter's
    A/B shards are loaded and its ``scale`` set to PEFT's. Returns the loaded adapter paths.
    A collective for low-rank adapters."""
    _check_no_pipeline()
    tensors, config = read_peft(directory)
    where = directory
    found = slots(model, names)
    dora = _dora_model(found, where)
    check_features(config, where, dora)
    file_modules = _check_targets(config, tensors, found, names, where, dora)
    claimed: set[str] = set()
    staged = {}
    for slot in found:  # validate everything before loading anything
        present = [i for i, n in enumerate(slot.names) if n in file_modules]
        if not present:
            raise UnsupportedAdapter(
                f"{where}: no tensors for the adapter on {slot.path!r} ({', '.join(slot.names)}): build the model's "
                "LoRA with the adapter's targets (target_modules / exclude_modules, e.g. '*.layers.1.*.linear_qkv')")
        claimed.update(slot.names[i] for i in present)
        staged[slot.path] = (slot.adapter, *_stage(slot, tensors, config, present, where))
    unclaimed = sorted(file_modules - claimed)
    if unclaimed:
        raise UnsupportedAdapter(f"{where}: the model has no adapter for {unclaimed[:6]}"
                                 f"{'...' if len(unclaimed) > 6 else ''}: build its LoRA with these targets too")
    for adapter, a_shard, b_shard, scale, m_shard in staged.values():
        state = {"linear_in.weight": a_shard, "linear_out.weight": b_shard}
        if m_shard is not None:
            state["weight_magnitude"] = m_shard
        adapter.load_state_dict(state, strict=True)
        adapter.scale = scale
    return sorted(staged)


def _check_no_pipeline() -> None:
    try:
        from megatron.core import parallel_state

        pp = parallel_state.get_pipeline_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    except Exception:
        pp = 1
    if pp > 1:
        raise NotImplementedError(f"HF PEFT export/import with pipeline parallelism ({pp} stages) is not supported")
