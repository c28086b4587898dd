"""Hugging Face module names <-> megatron's fused layouts: the one place both directions use.

A megatron linear (by the name :func:`regather.adapters` lists its adapter under) corresponds
to one or more Hugging Face modules of a Llama/Qwen-style model, in the order megatron stacks
their output rows. The same row rules cut a LoRA-B ``[o, r]`` and a base weight ``[o, h]``
(:mod:`tests.harness.hf_llama` converts base weights with them):

====================== =============================== ====================================
megatron (adapter)     HF modules (``model.layers.i.``) output rows (per TP rank ``i``)
====================== =============================== ====================================
``linear_qkv``         ``self_attn.q_proj, k_proj,     ``QKV``: interleaved per query group:
                       v_proj``                        the group's query heads, one key head,
                                                       one value head; a rank holds whole groups
``linear_proj``        ``self_attn.o_proj``            ``PLAIN`` (row-parallel: A split on h)
``linear_fc1`` (gated) ``mlp.gate_proj, up_proj``      ``GATED``: ``[gate_i; up_i]``
``linear_fc1`` (plain) ``mlp.up_proj``                 ``PLAIN``
``linear_fc2``         ``mlp.down_proj``               ``PLAIN`` (row-parallel)
``linear_q`` / ``_k``  ``self_attn.q_proj`` / ...      ``PLAIN``: ``CanonicalLoRA``'s own
/ ``_v``                                               adapter holds the rank's groups' rows
``linear_fc1_gate`` /  ``mlp.gate_proj`` / ``up_proj`` ``PLAIN`` (its half, split over TP)
``linear_fc1_up``
====================== =============================== ====================================

``PLAIN`` rows: the TP shards concatenate to the full tensor. A fused adapter
(``linear_qkv``, gated ``linear_fc1`` under ``LoRA``) has one LoRA-A for all its modules;
a ``CanonicalLoRA`` adapter is one module with its own LoRA-A.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

QKV, GATED, PLAIN = "qkv", "gated", "plain"

#: PEFT's key prefix of a causal LM's decoder layers (``PeftModel`` -> ``LlamaForCausalLM`` -> ``model``).
PEFT_PREFIX = "base_model.model."
#: Module path of decoder layer ``i`` inside the HF model (``LlamaForCausalLM``).
HF_LAYERS = "model.layers"

#: megatron linear -> (HF block, HF modules in megatron's row order). ``names=`` overrides
#: entries (e.g. GPT-NeoX's ``dense_h_to_4h``); "linear_fc1_gated" is fc1 with gated linear units.
DEFAULT_NAMES: dict[str, tuple[str, tuple[str, ...]]] = {
    "linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "linear_proj": ("self_attn", ("o_proj",)),
    "linear_fc1_gated": ("mlp", ("gate_proj", "up_proj")),
    "linear_fc1": ("mlp", ("up_proj",)),
    "linear_fc2": ("mlp", ("down_proj",)),
    # CanonicalLoRA (regather.megatron.canonical): one adapter per projection
    "linear_q": ("self_attn", ("q_proj",)),
    "linear_k": ("self_attn", ("k_proj",)),
    "linear_v": ("self_attn", ("v_proj",)),
    "linear_fc1_gate": ("mlp", ("gate_proj",)),
    "linear_fc1_up": ("mlp", ("up_proj",)),
}
#: The megatron linears the HF modules of the table live in (for messages).
MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class Target:
    """Where one megatron adapter's rows go in the HF model."""

    kind: str                  # the megatron name (``linear_qkv``, ``linear_q``, ...)
    block: str                 # ``self_attn`` | ``mlp``
    modules: tuple[str, ...]   # HF modules, in megatron's row order
    rows: str                  # QKV | GATED | PLAIN

    def names(self, layer: int) -> tuple[str, ...]:
        """Full HF module names (``model.layers.0.self_attn.q_proj``)."""
        return tuple(f"{HF_LAYERS}.{layer}.{self.block}.{m}" for m in self.modules)


def names_table(names: Mapping | None = None) -> dict[str, tuple[str, tuple[str, ...]]]:
    return dict(DEFAULT_NAMES, **(names or {}))


def target(kind: str, gated: bool, names: Mapping | None = None) -> Target:
    """The :class:`Target` of the megatron linear ``kind`` (``gated``: fc1 with GLU)."""
    table = names_table(names)
    key = "linear_fc1_gated" if kind == "linear_fc1" and gated else kind
    if key not in table:
        raise ValueError(f"no HF name for megatron linear {kind!r}; known: {sorted(table)}")
    block, modules = table[key]
    modules = tuple(modules)
    if kind == "linear_qkv" and len(modules) == 3:
        rows = QKV
    elif key == "linear_fc1_gated" and len(modules) == 2:
        rows = GATED
    elif len(modules) == 1:
        rows = PLAIN
    else:
        raise ValueError(f"names[{key!r}] = {modules}: {kind} splits into 3 (qkv), 2 (gated fc1) or 1 module")
    return Target(kind, block, modules, rows)


def attention_layout(config) -> tuple[int, int, int]:
    """(attention heads, query groups, head dim) of a megatron TransformerConfig."""
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    head_dim = config.kv_channels or config.hidden_size // heads
    return heads, groups, head_dim


# -- row rules ---------------------------------------------------------------------------


def split_qkv(b_full: torch.Tensor, heads: int, groups: int, head_dim: int):
    """Megatron's interleaved ``[ng*(np/ng+2)*hd, c]`` -> ``(q [np*hd, c], k [ng*hd, c], v [ng*hd, c])``."""
    if heads % groups:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_query_groups {groups}")
    per = heads // groups
    rows = groups * (per + 2) * head_dim
    if b_full.shape[0] != rows:
        raise ValueError(f"linear_qkv has {b_full.shape[0]} rows; {heads} heads, {groups} query "
                         f"groups and head_dim {head_dim} make {rows}")
    g = b_full.reshape(groups, per + 2, head_dim, -1)
    q = g[:, :per].reshape(heads * head_dim, -1)
    k = g[:, per].reshape(groups * head_dim, -1)
    v = g[:, per + 1].reshape(groups * head_dim, -1)
    return q.contiguous(), k.contiguous(), v.contiguous()


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int, head_dim: int):
    """Inverse of :func:`split_qkv`."""
    per = heads // groups
    c = q.shape[-1]
    expect = {"q_proj": heads * head_dim, "k_proj": groups * head_dim, "v_proj": groups * head_dim}
    for name, t in zip(expect, (q, k, v)):
        if t.shape[0] != expect[name]:
            raise ValueError(f"{name} has {t.shape[0]} rows, expected {expect[name]} "
                             f"({heads} heads, {groups} query groups, head_dim {head_dim})")
    g = torch.cat([q.reshape(groups, per, head_dim, c), k.reshape(groups, 1, head_dim, c),
                   v.reshape(groups, 1, head_dim, c)], dim=1)
    return g.reshape(-1, c).contiguous()


def split_gated_fc1(shards: Sequence[torch.Tensor]):
    """TP shards ``[gate_i; up_i]`` -> full ``(gate, up)``."""
    gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
    return torch.cat(gates).contiguous(), torch.cat(ups).contiguous()


def gated_fc1_shard(gate: torch.Tensor, up: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Full ``(gate, up)`` -> this TP rank's ``[gate_i; up_i]``."""
    if gate.shape != up.shape or gate.shape[0] % tp:
        raise ValueError(f"gate_proj {tuple(gate.shape)} / up_proj {tuple(up.shape)} cannot be split "
                         f"over {tp} TP ranks")
    return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]).contiguous()


def split_rows(tgt: Target, shards: Sequence[torch.Tensor], attention=None) -> tuple[torch.Tensor, ...]:
    """This linear's per-TP-rank row shards (rank order) -> the full tensor of each HF module."""
    if tgt.rows == QKV:
        return split_qkv(torch.cat(list(shards)), *attention)
    if tgt.rows == GATED:
        return split_gated_fc1(shards)
    return (torch.cat(list(shards)).contiguous(),)


def rank_rows(tgt: Target, parts: Sequence[torch.Tensor], rank: int, tp: int, attention=None) -> torch.Tensor:
    """Inverse of :func:`split_rows` for one rank: full HF tensors -> this rank's row shard."""
    if tgt.rows == QKV:
        return merge_qkv(*parts, *attention).chunk(tp)[rank].contiguous()
    if tgt.rows == GATED:
        return gated_fc1_shard(parts[0], parts[1], rank, tp)
    (full,) = parts
    if full.shape[0] % tp:
        raise ValueError(f"{tgt.modules[0]} has {full.shape[0]} rows: not divisible by TP={tp}")
    return full.chunk(tp)[rank].contiguous()


def module_rows(tgt: Target, total: int, attention=None) -> tuple[int, ...]:
    """Rows of each HF module of a linear with ``total`` output rows (all ranks)."""
    if tgt.rows == QKV:
        heads, groups, hd = attention
        return heads * hd, groups * hd, groups * hd
    if tgt.rows == GATED:
        return total // 2, total // 2
    return (total,)


# -- the HF model's module names -----------------------------------------------------------


def hf_module_names(num_layers: int, gated: bool, names: Mapping | None = None) -> list[str]:
    """``named_modules()`` names of the equivalent ``LlamaForCausalLM`` (what PEFT matches
    ``target_modules`` against): projections from the table, plus embeddings, norms, lm_head."""
    out = ["", "model", "model.embed_tokens", HF_LAYERS]
    kinds = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    for i in range(num_layers):
        layer = f"{HF_LAYERS}.{i}"
        out.append(layer)
        blocks: dict[str, list[str]] = {}
        for kind in kinds:
            t = target(kind, gated, names)
            blocks.setdefault(t.block, []).extend(t.names(i))
        for block, mods in blocks.items():
            out.append(f"{layer}.{block}")
            out.extend(mods)
        out += [f"{layer}.mlp.act_fn", f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"]
    out += ["model.norm", "model.rotary_emb", "lm_head"]
    return out


def projection_names(num_layers: int, gated: bool, names: Mapping | None = None) -> set[str]:
    """The HF modules that sit on one of the four megatron linears."""
    kinds = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    return {n for i in range(num_layers) for k in kinds for n in target(k, gated, names).names(i)}
