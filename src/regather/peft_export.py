"""Export LoRA adapters to Hugging Face PEFT's format, and load them back.

:func:`export_peft` writes ``adapter_model.safetensors`` and
``adapter_config.json`` to a directory; :func:`load_peft` loads such a
directory into a LoRA-wrapped, TP-sharded megatron-core model with any
strategy. Both are collectives over each adapter's TP group: call them on
every rank (rank 0 of the default group writes the files).

Module names (Llama/Qwen style, ``P = base_model.model.model.layers.{i}``)
and the layouts they are cut from:

=========================== ==================================== ===========================
megatron linear             HF modules                           LoRA-A / LoRA-B
=========================== ==================================== ===========================
``self_attention.           ``P.self_attn.q_proj``,              A shared (written to each);
linear_qkv``                ``k_proj``, ``v_proj``               B split by rows, see below
``self_attention.           ``P.self_attn.o_proj``               A gathered over ``h/t``
linear_proj``
``mlp.linear_fc1`` (gated)  ``P.mlp.gate_proj``, ``P.mlp.up_proj`` A shared; B split, see below
``mlp.linear_fc1`` (plain)  ``P.mlp.up_proj``                    A and B as they are
``mlp.linear_fc2``          ``P.mlp.down_proj``                  A gathered over ``h/t``
=========================== ==================================== ===========================

``linear_qkv``'s output rows are interleaved per query group (megatron's
``get_query_key_value_tensors``): for each of the ``ng`` groups, its
``np/ng`` query heads, then one key head, then one value head, each
``head_dim`` rows. A TP rank holds ``ng/t`` whole groups, so the TP shards
concatenate to the full interleaved matrix, which is then cut into
``q_proj`` (``np*hd`` rows, heads in order), ``k_proj`` and ``v_proj``
(``ng*hd`` rows each).

``linear_fc1`` with gated linear units holds ``[gate_i; up_i]`` on each TP
rank (``ffn/t`` rows each): the full ``gate_proj`` B is the concatenation of
the ``gate_i`` halves, ``up_proj`` of the ``up_i`` halves. A non-gated fc1
(the tiny test GPT, GELU) is exported as ``up_proj`` (and ``fc2`` as
``down_proj``), the names HF uses for the up/down projections of Llama-like
MLPs; pass ``names=`` to choose others (e.g. GPT-NeoX's ``dense_h_to_4h``).

HF PEFT's scale is ``lora_alpha / r``, the same as ``alpha / dim`` here, so
weights are written unscaled. The exported tensors are the same whichever
strategy trained the model (every strategy's state dict holds the sharded
Bridge layout). Pipeline parallelism is not supported (layer numbers are
taken from the local module path).
"""

from __future__ import annotations

import json
import os
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from regather import comm

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
PREFIX = "base_model.model.model.layers"

DEFAULT_NAMES = {
    "linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "linear_proj": ("self_attn", ("o_proj",)),
    "linear_fc1_gated": ("mlp", ("gate_proj", "up_proj")),
    "linear_fc1": ("mlp", ("up_proj",)),
    "linear_fc2": ("mlp", ("down_proj",)),
}


# -- pure layout conversions ------------------------------------------------------------


def split_qkv(b_full: torch.Tensor, heads: int, groups: int, head_dim: int):
    """Megatron's interleaved ``[ng*(np/ng+2)*hd, r]`` -> ``(q [np*hd, r], k [ng*hd, r], v [ng*hd, r])``."""
    if heads % groups:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_query_groups {groups}")
    per = heads // groups
    rows = groups * (per + 2) * head_dim
    if b_full.shape[0] != rows:
        raise ValueError(f"linear_qkv LoRA-B has {b_full.shape[0]} rows; {heads} heads, {groups} query "
                         f"groups and head_dim {head_dim} make {rows}")
    g = b_full.reshape(groups, per + 2, head_dim, -1)
    q = g[:, :per].reshape(heads * head_dim, -1)
    k = g[:, per].reshape(groups * head_dim, -1)
    v = g[:, per + 1].reshape(groups * head_dim, -1)
    return q.contiguous(), k.contiguous(), v.contiguous()


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int, head_dim: int):
    """Inverse of :func:`split_qkv`."""
    per = heads // groups
    r = q.shape[-1]
    expect = {"q_proj": heads * head_dim, "k_proj": groups * head_dim, "v_proj": groups * head_dim}
    for name, t in zip(expect, (q, k, v)):
        if t.shape[0] != expect[name]:
            raise ValueError(f"{name} LoRA-B has {t.shape[0]} rows, expected {expect[name]} "
                             f"({heads} heads, {groups} query groups, head_dim {head_dim})")
    g = torch.cat([q.reshape(groups, per, head_dim, r), k.reshape(groups, 1, head_dim, r),
                   v.reshape(groups, 1, head_dim, r)], dim=1)
    return g.reshape(-1, r).contiguous()


def split_gated_fc1(shards: list[torch.Tensor]):
    """TP shards ``[gate_i; up_i]`` -> full ``(gate, up)``."""
    gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
    return torch.cat(gates).contiguous(), torch.cat(ups).contiguous()


def gated_fc1_shard(gate: torch.Tensor, up: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Full ``(gate, up)`` -> this TP rank's ``[gate_i; up_i]``."""
    if gate.shape != up.shape or gate.shape[0] % tp:
        raise ValueError(f"gate_proj {tuple(gate.shape)} / up_proj {tuple(up.shape)} cannot be split "
                         f"over {tp} TP ranks")
    return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]).contiguous()


# -- model helpers ----------------------------------------------------------------------


def _layer_and_kind(path: str):
    parts = path.split(".")
    try:
        i = parts.index("layers")
        layer = int(parts[i + 1])
    except (ValueError, IndexError):
        raise ValueError(f"cannot find a layer number in module path {path!r}") from None
    return layer, parts[-1]


def _attention_layout(config):
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    head_dim = config.kv_channels or config.hidden_size // heads
    return heads, groups, head_dim


def _shards(adapter) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's LoRA-A and LoRA-B in the sharded (Bridge) layout, whatever the strategy."""
    sd = adapter.state_dict()
    return sd["linear_in.weight"].detach(), sd["linear_out.weight"].detach()


def _hf_modules(kind: str, gated: bool, names: Mapping) -> tuple[str, tuple[str, ...]]:
    key = "linear_fc1_gated" if kind == "linear_fc1" and gated else kind
    if key not in names:
        raise ValueError(f"no HF name for megatron linear {kind!r}; known: {sorted(names)}")
    return names[key]


def hf_state_dict(model: torch.nn.Module, names: Optional[Mapping] = None,
                  dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """The full (TP-gathered) LoRA weights under HF PEFT keys. A collective: call on every rank."""
    from regather.lora import adapters

    names = dict(DEFAULT_NAMES, **(names or {}))
    out: dict[str, torch.Tensor] = {}
    found = adapters(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters to export")
    for path in sorted(found):
        adapter = found[path]
        layer, kind = _layer_and_kind(path)
        config = adapter.config
        a, b = _shards(adapter)
        group = adapter.tp_group
        a_full = comm.all_gather_dim(a, group, dim=0 if adapter.column_parallel else 1)
        b_shards = list(comm.all_gather_dim(b, group, dim=0).chunk(_size_rank(group)[0], dim=0))
        gated = kind == "linear_fc1" and bool(getattr(config, "gated_linear_unit", False))
        block, modules = _hf_modules(kind, gated, names)
        if kind == "linear_qkv" and len(modules) == 3:
            bs = split_qkv(torch.cat(b_shards), *_attention_layout(config))
        elif gated and len(modules) == 2:
            bs = split_gated_fc1(b_shards)
        else:
            bs = (torch.cat(b_shards),)
        for module, b_part in zip(modules, bs):
            key = f"{PREFIX}.{layer}.{block}.{module}"
            out[f"{key}.lora_A.weight"] = a_full.clone().to(dtype or a_full.dtype).contiguous()
            out[f"{key}.lora_B.weight"] = b_part.clone().to(dtype or b_part.dtype).contiguous()
    return out


def _lora_settings(model) -> dict:
    from regather.lora import adapters

    found = list(adapters(model).values())
    dims = {a.dim for a in found}
    alphas = {a.alpha for a in found}
    drops = {a.dropout.p if a.dropout is not None else 0.0 for a in found}
    if len(dims) != 1 or len(alphas) != 1:
        raise ValueError(f"adapters differ in rank {sorted(dims)} or alpha {sorted(alphas)}; "
                         "HF PEFT's config has one r and one lora_alpha")
    alpha = alphas.pop()
    return {"r": dims.pop(), "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
            "lora_dropout": max(drops)}


def peft_config(model, tensors: Mapping[str, torch.Tensor], base_model_name_or_path: Optional[str] = None) -> dict:
    """``adapter_config.json`` for ``model``'s adapters (HF PEFT ``LoraConfig`` fields)."""
    targets = sorted({k.split(".")[-3] for k in tensors})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        **_lora_settings(model),
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "use_rslora": False,
        "use_dora": False,
        "revision": None,
    }


def export_peft(model: torch.nn.Module, directory: str, *, base_model_name_or_path: Optional[str] = None,
                names: Optional[Mapping] = None, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` to ``directory``.

    A collective (every rank must call it); rank 0 of the default group writes.
    Returns the exported tensors (on every rank).
    """
    from safetensors.torch import save_file

    _check_no_pipeline()
    tensors = hf_state_dict(model, names, dtype)
    config = peft_config(model, tensors, base_model_name_or_path)
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        meta = {"format": "pt", "regather.source": "megatron-core LoRA (regather)"}
        save_file({k: v.cpu() for k, v in tensors.items()}, os.path.join(directory, WEIGHTS_NAME), metadata=meta)
        with open(os.path.join(directory, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    if dist.is_initialized():
        dist.barrier()
    return tensors


def read_peft(directory: str) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    weights = os.path.join(directory, WEIGHTS_NAME)
    config_path = os.path.join(directory, CONFIG_NAME)
    for p in (weights, config_path):
        if not os.path.exists(p):
            raise FileNotFoundError(f"HF PEFT adapter file {p!r} is missing")
    with open(config_path) as f:
        config = json.load(f)
    return load_file(weights), config


def load_peft(model: torch.nn.Module, directory: str, names: Optional[Mapping] = None) -> list[str]:
    """Load an HF PEFT LoRA adapter into ``model`` (LoRA already applied, any strategy, TP-sharded).

    Every adapter of ``model`` must find its tensors; unused tensors are an error
    too. Returns the loaded module paths. A collective for low-rank adapters.
    """
    from regather.lora import adapters

    _check_no_pipeline()
    tensors, config = read_peft(directory)
    names = dict(DEFAULT_NAMES, **(names or {}))
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{directory}: peft_type {config.get('peft_type')!r} is not LORA")
    found = adapters(model)
    used: set[str] = set()
    staged = {}
    for path in sorted(found):  # validate everything before loading anything
        adapter = found[path]
        layer, kind = _layer_and_kind(path)
        gated = kind == "linear_fc1" and bool(getattr(adapter.config, "gated_linear_unit", False))
        block, modules = _hf_modules(kind, gated, names)
        keys = [f"{PREFIX}.{layer}.{block}.{m}" for m in modules]
        missing = [f"{k}.lora_{x}.weight" for k in keys for x in "AB" if f"{k}.lora_{x}.weight" not in tensors]
        if missing:
            raise KeyError(f"{directory}: no tensors {missing} for adapter {path!r}")
        a_list = [tensors[f"{k}.lora_A.weight"] for k in keys]
        b_list = [tensors[f"{k}.lora_B.weight"] for k in keys]
        used.update(f"{k}.lora_{x}.weight" for k in keys for x in "AB")
        if any(not torch.equal(a_list[0], a) for a in a_list[1:]):
            raise ValueError(f"{path!r} is one fused linear, so {', '.join(modules)} must share LoRA-A; "
                             f"the file has different lora_A weights for {keys}")
        a_full = a_list[0]
        if a_full.shape[0] != adapter.dim or config.get("r", adapter.dim) != adapter.dim:
            raise ValueError(f"{path!r}: the file has r={config.get('r')} (lora_A {tuple(a_full.shape)}), the "
                             f"adapter dim={adapter.dim}")
        if float(config.get("lora_alpha", adapter.alpha)) != adapter.alpha:
            raise ValueError(f"{path!r}: the file has lora_alpha={config.get('lora_alpha')}, the adapter "
                             f"alpha={adapter.alpha:g} (the scale alpha/r would change)")
        t, rank = _size_rank(adapter.tp_group)
        if kind == "linear_qkv" and len(b_list) == 3:
            b_shard = merge_qkv(*b_list, *_attention_layout(adapter.config)).chunk(t)[rank]
        elif gated and len(b_list) == 2:
            b_shard = gated_fc1_shard(b_list[0], b_list[1], rank, t)
        else:
            b_shard = b_list[0].chunk(t)[rank]
        a_shard = a_full.chunk(t, dim=0 if adapter.column_parallel else 1)[rank]
        cur_a, cur_b = _shards(adapter)
        for what, new, cur in (("lora_A", a_shard, cur_a), ("lora_B", b_shard, cur_b)):
            if tuple(new.shape) != tuple(cur.shape):
                raise ValueError(f"{path!r}: {what} shard from the file is {tuple(new.shape)}, the adapter "
                                 f"holds {tuple(cur.shape)} (TP={t})")
        staged[path] = (a_shard.to(cur_a.dtype).contiguous(), b_shard.to(cur_b.dtype).contiguous())
    unused = sorted(set(tensors) - used)
    if unused:
        raise KeyError(f"{directory}: tensors {unused[:6]}{'...' if len(unused) > 6 else ''} match no adapter "
                       f"of the model")
    for path, (a_shard, b_shard) in staged.items():
        found[path].load_state_dict({"linear_in.weight": a_shard, "linear_out.weight": b_shard}, strict=True)
    return sorted(staged)


def _size_rank(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _check_no_pipeline() -> None:
    try:
        from megatron.core import parallel_state

        pp = parallel_state.get_pipeline_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    except Exception:  # noqa: BLE001 - no megatron state: no pipeline
        pp = 1
    if pp > 1:
        raise NotImplementedError(f"HF PEFT export/import with pipeline parallelism ({pp} stages) is not supported")
