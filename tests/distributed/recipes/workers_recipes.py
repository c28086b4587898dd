"""Rank workers of tests/distributed/recipes (spawned by ``regather.testing.dist.run_ranks``).

For each recipe: the recipe's ``ConfigContainer`` (offline HF cache, regather.testing.recipes),
its model provider shrunk and set to TP2 + SP (EP2 for MoE) on 2 gloo ranks, local spec, fp32;
the model built by the provider once per side, from the same seed (the base weights are checked
equal across sides); PEFT applied through Bridge's own ``_apply_peft_transformation``; every
adapter weight then set from its parameter name (and rank), so that every side starts from the
same full set of weights; one forward and backward of the next-token loss.

Sides, with the recipe's own LoRA fields (dim, alpha, dropout, init, ...):

- ``bridge``: Bridge's ``LoRA(sequence_parallel_input_regather=True)``, the reference;
- ``regather``: ``regather.bridge.LoRA(sequence_parallel_input_regather=True)``;
- ``recompute``: the same with ``recompute_adapter_inputs=True`` (and ``redispatch_expert_inputs=True``
  where expert linears are adapted: megatron's SequentialMLP gives each expert its own adapter).

Target sets: the recipe's own (``recipe``) and all four (``all``); where they are the same set
(GPT-OSS keeps Bridge's default LoRA) the run is made once.
"""

from __future__ import annotations

import time
import zlib

import torch

TP = 2
EP_MOE = 2
MICRO_BATCH = 2
SEED = 1234
ALL_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
SIDES = ("bridge", "regather", "recompute")


def lora_fields(peft) -> dict:
    """The constructor fields of a Bridge ``LoRA`` (what the recipe configured)."""
    import dataclasses

    from megatron.bridge.peft.lora import LoRA as BridgeLoRA

    return {f.name: getattr(peft, f.name) for f in dataclasses.fields(BridgeLoRA) if f.init}


def make_peft(side: str, fields: dict, targets: list[str], experts_adapted: bool):
    from megatron.bridge.peft.lora import LoRA as BridgeLoRA

    import regather.bridge

    kw = {**fields, "target_modules": list(targets), "sequence_parallel_input_regather": True}
    if side == "bridge":
        return BridgeLoRA(**kw)
    if side == "recompute":
        kw.update(recompute_adapter_inputs=True, redispatch_expert_inputs=experts_adapted)
    return regather.bridge.LoRA(**kw)


def fill_adapters(model, rank: int) -> list[str]:
    """Every trainable (adapter) parameter set from its name and the rank; returns the names."""
    names = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 16 + rank)
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.05)
            names.append(name)
    return sorted(names)


def saved_bytes_class():
    """``SavedBytes`` (regather.core.accounting: where bytes are counted)."""
    from regather.core.accounting import SavedBytes

    return SavedBytes


def features(model, provider) -> dict:
    """What of the architecture the built (shrunk) model has, read from its modules."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    layers = model.decoder.layers
    attn = [layer.self_attention.core_attention for layer in layers]
    experts = [m for n, m in model.named_modules() if n.endswith(".mlp.experts")]
    expert_fc1 = [m for n, m in model.named_modules() if ".local_experts." in n and n.endswith("linear_fc1")]
    return {
        "num_layers": len(layers), "hidden": provider.hidden_size, "ffn": provider.ffn_hidden_size,
        "heads": provider.num_attention_heads, "query_groups": provider.num_query_groups,
        "qk_layernorm": all(getattr(layer.self_attention, "q_layernorm", None) is not None for layer in layers),
        "gated": provider.gated_linear_unit, "activation": provider.activation_func.__name__,
        "clamp": provider.activation_func_clamp_value, "glu_linear_offset": provider.glu_linear_offset,
        "bias_activation_fusion": provider.bias_activation_fusion,
        "add_bias_linear": provider.add_bias_linear,
        "sinks": [getattr(a, "softmax_offset", None) is not None and isinstance(a.softmax_offset, torch.nn.Parameter)
                  for a in attn],
        "windows": [a.scale_mask_softmax.window_size for a in attn],
        "yarn": isinstance(getattr(model, "rotary_pos_emb", None), YarnRotaryEmbedding),
        "yarn_factor": provider.yarn_rotary_scaling_factor,
        "num_experts": provider.num_moe_experts, "topk": provider.moe_router_topk,
        "expert_kinds": sorted({type(m).__name__ for m in experts}),
        "expert_fc1_bias": bool(expert_fc1) and all(getattr(m, "bias", None) is not None for m in expert_fc1),
        "seq_length": provider.seq_length,
    }


def run_side(provider, peft, rank: int, base_state: dict | None) -> tuple[dict, dict]:
    """Build, adapt (Bridge's _apply_peft_transformation), fill, one forward + backward."""
    from megatron.core import tensor_parallel

    import regather
    from regather.testing import recipes as R

    model = R.build_model(provider, seed=SEED)
    state = {n: t.detach().clone() for n, t in model.state_dict().items() if torch.is_tensor(t)}
    if base_state is not None:  # identical base weights on every side
        assert state.keys() == base_state.keys()
        for n, t in base_state.items():
            assert torch.equal(state[n], t), f"base weight {n} differs between sides"
    chunks = R.apply_peft(peft, model)
    assert isinstance(chunks, list) and len(chunks) == 1
    model = chunks[0]
    names = fill_adapters(model, rank)
    inputs, labels, position_ids, mask = R.token_batch(provider.vocab_size, MICRO_BATCH, provider.seq_length)
    SavedBytes = saved_bytes_class()
    with SavedBytes.for_model(model) as saved:
        logits = model(inputs, position_ids, mask)
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels).mean()
    loss.backward()
    wrapped = {n: f"{type(m).__module__}.{type(m).__name__}" for n, m in model.named_modules()
               if n.rsplit(".", 1)[-1] in ALL_TARGETS}
    out = {
        "loss": loss.detach().clone(),
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
        "names": names,
        "saved": saved.total,
        "params_to_save": sorted(peft.params_to_save),
        "wrapped": wrapped,
        "regather_wrappers": sorted(n for n, m in model.named_modules() if isinstance(m, regather.LoRALinear)),
    }
    if hasattr(peft, "regather_config"):  # regather.bridge.LoRA
        out["decisions"] = {p: str(d) for p, d in regather.decisions(model).items()}
    return out, state


def recipe_runs(rank: int, name: str) -> dict:
    from regather.testing import recipes as R

    recipe = R.RECIPES[name]
    start = time.monotonic()
    cfg = recipe.config()
    ep = EP_MOE if recipe.moe else 1
    R.init_parallel(TP, ep, seed=SEED)
    provider = R.shrink_provider(cfg.model, TP, ep)
    fields = lora_fields(cfg.peft)
    target_sets = {"recipe": list(fields["target_modules"])}
    if sorted(target_sets["recipe"]) != sorted(ALL_TARGETS):
        target_sets["all"] = list(ALL_TARGETS)
    out = {"fields": {k: v for k, v in fields.items() if k != "canonical_mapping"}, "runs": {}}
    base_state = None
    for label, targets in target_sets.items():
        experts_adapted = recipe.moe and any(t in targets for t in ("linear_fc1", "linear_fc2"))
        runs = {}
        for side in SIDES:
            peft = make_peft(side, fields, targets, experts_adapted)
            runs[side], state = run_side(provider, peft, rank, base_state)
            base_state = base_state or state
        out["runs"][label] = runs
    if "all" not in out["runs"]:
        out["runs"]["all"] = out["runs"]["recipe"]
    model = R.build_model(provider, seed=SEED)
    out["features"] = features(model, provider)
    out["seconds"] = time.monotonic() - start
    return out


def side_by_side(rank: int, world_size: int, names: list[str]) -> dict:
    """Every recipe in ``names`` in this one spawn (imports are the expensive part)."""
    from regather.testing import recipes as R

    start = time.monotonic()
    R.import_bridge()
    R.enable_recipe_cpu()
    out = {"import_seconds": time.monotonic() - start, "rank": rank}
    for name in names:
        out[name] = recipe_runs(rank, name)
    out["shims"] = R.installed_shims()
    return out
