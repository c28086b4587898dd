"""A megatron-core GPT with Llama's conventions, and the same weights in a real ``transformers``
``LlamaForCausalLM`` (test helper; needs ``transformers``, loads nothing from a hub).

:func:`build_llama_gpt` builds :func:`regather.tools.cpu.models.build_gpt` with RMSNorm, a gated
SwiGLU ``linear_fc1``, no biases, rope and untied embeddings (GQA through
``TinyGPT.kv_heads``). :func:`to_hf_llama` gathers its TP-sharded base weights (also
from a LoRA-wrapped model: its state dict keeps the base keys) and loads them into an HF Llama
built from a config: embedding, RMSNorm weights, q/k/v cut from the fused ``linear_qkv`` by query
group and gate/up from ``linear_fc1`` with the same row rules :mod:`regather.hf.layout` uses for
LoRA-B, ``o_proj``, ``down_proj``, ``lm_head``.

Conventions checked (the conversion refuses a model that differs): megatron's non-interleaved
rotary (``rotary_interleaved=False``: ``cat(freqs, freqs)`` with ``[-x2, x1]``) is HF's
``rotate_half``; the rope base is read from the model's own ``inv_freq`` (``rotary_base``, default
10000) into ``rope_parameters["rope_theta"]``; full rotary (``rotary_percent=1``), no rope
scaling; RMSNorm eps is megatron's ``layernorm_epsilon`` (1e-5; HF's Llama default is 1e-6, so it
is set); softmax scale ``1/sqrt(head_dim)`` on both sides.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from regather.core import comm
from regather.hf import layout

#: ``build_gpt`` overrides that give a Llama-style block.
LLAMA_LIKE = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)

# megatron base weight -> how it is split over TP (dim), None for replicated
_SPLIT_DIM = {"linear_qkv": 0, "linear_proj": 1, "linear_fc1": 0, "linear_fc2": 1}


def build_llama_gpt(shape, tp: int, dtype: torch.dtype = torch.float32, seed: int = 1234, **overrides):
    """A megatron-core GPT (local spec, SP on for TP>1) with Llama's block (:data:`LLAMA_LIKE`)."""
    from regather.tools.cpu.models import build_gpt

    return build_gpt(shape, tp, True, dtype, seed=seed, **dict(LLAMA_LIKE, **overrides))


def _unwrap(model):
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def _refuse(what: str):
    raise ValueError(f"to_hf_llama: {what}; a LlamaForCausalLM computes something else")


def rope_theta(model) -> float:
    """The rope base of ``model``'s rotary embedding, checked against its own ``inv_freq``."""
    rope = model.rotary_pos_emb
    base = float(getattr(model, "rotary_base", 10000))
    inv = rope.inv_freq.float().cpu()
    dim = 2 * inv.numel()
    expect = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if not torch.equal(inv, expect):
        _refuse(f"the rotary inv_freq is not that of base {base:g} (rope scaling or another base)")
    return base


def llama_config(model):
    """``transformers.LlamaConfig`` of a megatron GPT with Llama's conventions (checked)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig

    model = _unwrap(model)
    c = model.config
    heads, groups, head_dim = layout.attention_layout(c)
    if c.normalization != "RMSNorm":
        _refuse(f"normalization is {c.normalization!r}, not RMSNorm")
    if not c.gated_linear_unit or c.activation_func is not F.silu:
        _refuse("linear_fc1 is not gated SiLU (SwiGLU)")
    if c.add_bias_linear or getattr(c, "add_qkv_bias", False):
        _refuse("the linears have biases")
    if getattr(model, "position_embedding_type", None) != "rope":
        _refuse(f"position embedding {getattr(model, 'position_embedding_type', None)!r}, not rope")
    if c.rotary_interleaved:
        _refuse("rotary_interleaved=True (HF Llama rotates halves)")
    if getattr(model, "rotary_percent", 1.0) != 1.0 or getattr(model, "rotary_scaling", False):
        _refuse("partial rotary or rope scaling")
    if getattr(model.rotary_pos_emb, "seq_len_interpolation_factor", None) is not None:
        _refuse("seq_len_interpolation_factor is set")
    if c.qk_layernorm or c.layernorm_zero_centered_gamma:
        _refuse("qk_layernorm / zero-centered gamma")
    if c.softmax_scale is not None and c.softmax_scale != head_dim ** -0.5:
        _refuse(f"softmax_scale {c.softmax_scale} is not 1/sqrt(head_dim)")
    if getattr(c, "apply_query_key_layer_scaling", False):
        _refuse("apply_query_key_layer_scaling")
    return LlamaConfig(
        vocab_size=model.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.ffn_hidden_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=head_dim,
        max_position_embeddings=model.max_position_embeddings,
        rms_norm_eps=c.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta(model)},
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        hidden_act="silu",
        tie_word_embeddings=bool(model.share_embeddings_and_output_weights),
    )


def hf_base_state_dict(model) -> dict[str, torch.Tensor]:
    """The full (TP-gathered) base weights under ``LlamaForCausalLM`` names. A collective over TP."""
    from megatron.core import parallel_state

    model = _unwrap(model)
    group = parallel_state.get_tensor_model_parallel_group()
    t = comm.world_size(group)
    attention = layout.attention_layout(model.config)
    sd = {k: v for k, v in model.state_dict().items()
          if not k.endswith("_extra_state") and ".adapter." not in k}
    biases = sorted(k for k in sd if k.endswith(".bias"))
    if biases:
        _refuse(f"bias tensors {biases[:3]}")

    def full(key, dim):
        return comm.all_gather_dim(sd.pop(key).detach().contiguous(), group, dim=dim)

    out = {"model.embed_tokens.weight": full("embedding.word_embeddings.weight", 0)}
    for i in range(model.config.num_layers):
        p, hf = f"decoder.layers.{i}.", f"{layout.HF_LAYERS}.{i}."
        out[hf + "input_layernorm.weight"] = sd.pop(p + "input_layernorm.weight").detach().clone()
        out[hf + "post_attention_layernorm.weight"] = sd.pop(p + "pre_mlp_layernorm.weight").detach().clone()
        for block, kind in (("self_attention", "linear_qkv"), ("self_attention", "linear_proj"),
                            ("mlp", "linear_fc1"), ("mlp", "linear_fc2")):
            w = full(f"{p}{block}.{kind}.weight", _SPLIT_DIM[kind])
            tgt = layout.target(kind, True)
            shards = w.chunk(t, dim=0) if _SPLIT_DIM[kind] == 0 else (w,)
            for name, part in zip(tgt.names(i), layout.split_rows(tgt, shards, attention)):
                out[f"{name}.weight"] = part
    out["model.norm.weight"] = sd.pop("decoder.final_layernorm.weight").detach().clone()
    if "output_layer.weight" in sd:
        out["lm_head.weight"] = full("output_layer.weight", 0)
    if sd:
        _refuse(f"unconverted weights {sorted(sd)[:4]}")
    return out


def to_hf_llama(model, dtype: torch.dtype = torch.float32):
    """A ``LlamaForCausalLM`` (eval mode, ``attn_implementation="eager"``) holding ``model``'s
    base weights. A collective over the TP group: call on every rank (each gets the model)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaForCausalLM

    config = llama_config(model)
    config._attn_implementation = "eager"
    weights = hf_base_state_dict(model)
    torch.manual_seed(0)  # the constructor initialises weights that are overwritten next
    hf = LlamaForCausalLM(config)
    missing, unexpected = hf.load_state_dict(weights, strict=not config.tie_word_embeddings)
    if unexpected or (missing and missing != ["lm_head.weight"]):
        _refuse(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    return hf.to(dtype).eval()


def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits ``[b, s, V]`` of a megatron GPT (TP-gathered), no grad."""
    from megatron.core import parallel_state

    s = tokens.shape[1]
    position_ids = torch.arange(s).unsqueeze(0).expand_as(tokens)
    mask = torch.tril(torch.ones(s, s, dtype=torch.bool)).logical_not().view(1, 1, s, s)
    with torch.no_grad():
        local = model(tokens, position_ids, mask)
    group = parallel_state.get_tensor_model_parallel_group()
    return comm.all_gather_dim(local.contiguous(), group, dim=-1)


def hf_logits(hf_model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(input_ids=tokens).logits
