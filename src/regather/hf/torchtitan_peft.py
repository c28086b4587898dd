"""Hugging Face PEFT export of a torchtitan model's LoRA (torchtitan's ``LoRAConverter`` or
regather's: the same modules, names and layouts), which torchtitan itself does not offer (its HF
state-dict adapter drops ``lora_*`` keys).

======================================== ===================================== ===================
torchtitan module (``layers.i.``)        HF module (``model.layers.i.``)       LoRA-B rows
======================================== ===================================== ===================
``attention.qkv_linear.wqkv`` (fused)    ``self_attn.q_proj``, ``k_proj``,      torchtitan's fused
                                         ``v_proj``, one shared ``lora_A``      rows interleave per
                                                                               KV group (the
                                                                               ``(n_kv, heads/kv +
                                                                               2, head_dim)`` of
                                                                               ``FusedQKVLinear``)
``attention.qkv_linear.wq`` / ``wk`` /   ``self_attn.q_proj`` / ``k_proj`` /    as they are
``wv``                                   ``v_proj``
``attention.wo``                         ``self_attn.o_proj``                   as they are
``feed_forward.w1`` / ``w3`` / ``w2``    ``mlp.gate_proj`` / ``up_proj`` /      as they are
                                         ``down_proj``
======================================== ===================================== ===================

q and k rows are permuted as torchtitan's own state-dict adapter permutes the base weights when the
attention's rope rotates adjacent pairs (``ComplexRoPE``: llama3) and HF's rotates halves; a
``CosSinRoPE`` (qwen3) rotates halves already. Scale: torchtitan's ``alpha / rank`` is PEFT's
``lora_alpha / r``. Weights are written unscaled, TP-gathered (``full_tensor``: a collective, call on
every rank; rank 0 writes). Dense decoders only (no MoE experts: torchtitan's LoRA does not adapt
``GroupedExperts``).
"""

from __future__ import annotations

import torch

from regather.hf.layout import HF_LAYERS, PEFT_PREFIX, split_qkv
from regather.hf.peft_config import ExportedModule, lora_config, write_adapter_dir

#: torchtitan linear -> (HF block, HF module)
NAMES = {"wq": ("self_attn", "q_proj"), "wk": ("self_attn", "k_proj"), "wv": ("self_attn", "v_proj"),
         "wo": ("self_attn", "o_proj"), "w1": ("mlp", "gate_proj"), "w3": ("mlp", "up_proj"),
         "w2": ("mlp", "down_proj")}
FUSED_QKV = "wqkv"


def lora_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """torchtitan LoRA linears of ``model`` (children ``lora_a`` / ``lora_b``, ``_lora_scaling``) by path."""
    return {path: m for path, m in model.named_modules()
            if hasattr(m, "lora_a") and hasattr(m, "lora_b") and hasattr(m, "_lora_scaling")}


def is_torchtitan_lora(model: torch.nn.Module) -> bool:
    """``model`` holds LoRA linears built by torchtitan's converter or regather's torchtitan front end."""
    return any(type(m).__module__.startswith(("torchtitan.", "regather.torchtitan."))
               for m in lora_modules(model).values())


def _layer(path: str) -> int:
    parts = path.split(".")
    try:
        return int(parts[parts.index("layers") + 1])
    except (ValueError, IndexError):
        raise ValueError(f"cannot find a layer number in module path {path!r}") from None


def _attention(model, path: str):
    parts = path.split(".")
    i = parts.index("qkv_linear") if "qkv_linear" in parts else len(parts) - 1
    return model.get_submodule(".".join(parts[:i]))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def _rotates_pairs(attention) -> bool:
    """torchtitan's complex rope rotates adjacent pairs (HF's ``rotate_half`` rotates halves)."""
    return type(getattr(attention, "rope", None)).__name__ == "ComplexRoPE"


def _hf_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of q or k in HF's rope layout: the permutation of HF's conversion script, which
    torchtitan's ``Llama3StateDictAdapter.to_hf`` applies to the base weights."""
    n = rows.shape[0]
    return rows.view(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(n, -1).contiguous()


def _targets(path: str, kind: str) -> list[str]:
    """The torchtitan names whose HF modules one LoRA linear stands for (``wqkv``: q, k, v)."""
    if kind == FUSED_QKV:
        return ["wq", "wk", "wv"]
    if kind in NAMES:
        return [kind]
    raise ValueError(f"{path!r}: no Hugging Face module for torchtitan linear {kind!r} (known: "
                     f"{FUSED_QKV}, {', '.join(NAMES)})")


def _parts(model, path: str, kind: str, b_full: torch.Tensor) -> list[tuple[str, str, torch.Tensor]]:
    """(HF block, HF module, LoRA-B) of one torchtitan LoRA linear."""
    targets = _targets(path, kind)
    attention = _attention(model, path) if set(targets) & {"wq", "wk"} else None
    if kind == FUSED_QKV:
        rows = split_qkv(b_full, attention.n_heads, attention.n_kv_heads, attention.head_dim)
    else:
        rows = (b_full,)
    out = []
    for name, b in zip(targets, rows):
        if name in ("wq", "wk") and _rotates_pairs(attention):
            b = _hf_rows(b, attention.n_heads if name == "wq" else attention.n_kv_heads)
        out.append((*NAMES[name], b))
    return out


def exported(model: torch.nn.Module, dtype: torch.dtype | None = None):
    """``(tensors under PEFT keys, [ExportedModule])`` of every LoRA linear of ``model``. A collective."""
    tensors: dict[str, torch.Tensor] = {}
    modules: list[ExportedModule] = []
    found = lora_modules(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no LoRA linears")
    for path in sorted(found):
        m = found[path]
        layer, kind = _layer(path), path.rsplit(".", 1)[-1]
        a = _full(m.lora_a.weight)
        rank = a.shape[0]
        alpha = float(m._lora_scaling) * rank
        for block, hf_module, b in _parts(model, path, kind, _full(m.lora_b.weight)):
            name = f"{HF_LAYERS}.{layer}.{block}.{hf_module}"
            key = f"{PEFT_PREFIX}{name}"
            tensors[f"{key}.lora_A.weight"] = a.clone().to(dtype or a.dtype).contiguous()
            tensors[f"{key}.lora_B.weight"] = b.clone().to(dtype or b.dtype).contiguous()
            modules.append(ExportedModule(name, layer, hf_module, rank, alpha, float(m._lora_scaling)))
    return tensors, modules


def _num_layers(model) -> int:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no 'layers' (a torchtitan decoder is expected)")
    return len(layers)


def hf_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full LoRA weights under HF PEFT keys. A collective: call on every rank."""
    return exported(model, dtype)[0]


def peft_config(model: torch.nn.Module, base_model_name_or_path: str | None = None) -> dict:
    """``adapter_config.json`` for ``model``'s LoRA (collective-free: shapes only)."""
    modules = []
    for path, m in sorted(lora_modules(model).items()):
        layer, kind = _layer(path), path.rsplit(".", 1)[-1]
        rank, scale = m.lora_a.weight.shape[0], float(m._lora_scaling)
        for block, hf_module in (NAMES[t] for t in _targets(path, kind)):
            modules.append(ExportedModule(f"{HF_LAYERS}.{layer}.{block}.{hf_module}", layer, hf_module, rank,
                                          scale * rank, scale))
    return lora_config(modules, _num_layers(model), base_model_name_or_path)


def export_peft(model: torch.nn.Module, directory: str, *, base_model_name_or_path: str | None = None,
                dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json``. A collective (every rank
    calls it); rank 0 of the default group writes. Returns the exported tensors."""
    tensors, _ = exported(model, dtype)
    config = peft_config(model, base_model_name_or_path)
    write_adapter_dir(directory, tensors, config, "torchtitan LoRA (regather)")
    return tensors
