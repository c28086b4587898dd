"""Rank workers of tests/distributed/recipes (spawned by ``regather.tools.cpu.dist.run_ranks``).

For each recipe: the recipe's ``ConfigContainer`` (offline HF cache, tests.harness.recipes),
its model provider shrunk and set to TP2 + SP (EP2 for MoE) on 2 gloo ranks, local spec, fp32;
the model built by the provider once per side, from the same seed (the base weights are checked
equal across sides); PEFT applied through Bridge's own ``_apply_peft_transformation``; every
adapter weight then set from its parameter name (and rank), so that every side starts from the
same full set of weights; one forward and backward of the next-token loss.

Sides, with the recipe's own LoRA fields (dim, alpha, dropout, init, ...):

- ``bridge``: Bridge's ``LoRA(sequence_parallel_input_regather=True)``, the reference;
- ``regather``: ``regather.bridge.LoRA(sequence_parallel_input_regather=True)``;
- ``recompute``: the same with ``recompute_adapter_inputs=True`` (and ``redispatch_expert_inputs=True``
  where expert linears are adapted: megatron's SequentialMLP gives each expert its own adapter);
- ``classic`` (the TP2 + SP recipe runs): ``regather`` with ``lean_transients=False``, the classic
  output Bridge 0.6.2 has (regather's regather path is lean by default: docs/design.md §3.7);
- ``fp64`` (the same): the ``classic`` side's function in float64 from the same weights (the fp32
  sides' base weights loaded, the adapters filled alike), the reference of the lean row adapters' other
  summation order (tests.harness.numerics).

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
RECIPE_SIDES = SIDES + ("classic",)


def lora_fields(peft) -> dict:
    """The constructor fields of a Bridge ``LoRA`` (what the recipe configured)."""
    import dataclasses

    from megatron.bridge.peft.lora import LoRA as BridgeLoRA

    return {f.name: getattr(peft, f.name) for f in dataclasses.fields(BridgeLoRA) if f.init}


def make_peft(side: str, fields: dict, targets: list[str], experts_adapted: bool, sp_regather: bool = True):
    """The side's LoRA with the recipe's ``fields``; ``sp_regather``: Bridge's
    ``sequence_parallel_input_regather=True`` (the TP2 + SP runs), else the recipe's own value."""
    from megatron.bridge.peft.lora import LoRA as BridgeLoRA

    import regather.bridge

    kw = {**fields, "target_modules": list(targets)}
    if sp_regather:
        kw["sequence_parallel_input_regather"] = True
    if side == "bridge":
        return BridgeLoRA(**kw)
    if side == "recompute":
        kw.update(recompute_adapter_inputs=True, redispatch_expert_inputs=experts_adapted)
    if side in ("classic", "fp64"):
        kw["lean_transients"] = False
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
        "kv_channels": provider.kv_channels,
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


class AdapterKinds:
    """Labels what every adapter module saves during its forward ``adapter:<target>`` (``expert
    <target>`` inside MoE experts) for ``SavedBytes``, on Bridge's adapters and regather's alike
    (both wrap their adapter as ``<linear>.adapter``); regather's own ``adapter_input:<target>``
    label inside counts for the same kind. What no adapter saves is the frozen model's."""

    def __init__(self, model):
        from regather.core import accounting

        self._label, self._open = accounting.label, []
        for name, m in model.named_modules():
            parts = name.split(".")
            if len(parts) >= 2 and parts[-1] == "adapter" and parts[-2] in ALL_TARGETS:
                kind = ("expert " if ".experts." in name else "") + parts[-2]
                m.register_forward_pre_hook(lambda mod, args, _k=kind: self._enter(_k))
                m.register_forward_hook(self._exit)

    def _enter(self, kind) -> None:
        cm = self._label(f"adapter:{kind}")
        cm.__enter__()
        self._open.append(cm)

    def _exit(self, module, args, output) -> None:  # None: the output stays the module's
        self._open.pop().__exit__(None, None, None)

    @staticmethod
    def split(by_label: dict) -> dict:
        """``{target kind: bytes, "model": bytes}`` from ``SavedBytes.by_label()``."""
        out = {"model": by_label.get("other", 0)}
        for key, n in by_label.items():
            if key.startswith(("adapter:", "adapter_input:")):
                kind = key.split(":", 1)[1]
                out[kind] = out.get(kind, 0) + n
        return out


def run_side(provider, peft, rank: int, base_state: dict | None, load: bool = False) -> tuple[dict, dict]:
    """Build, adapt (Bridge's _apply_peft_transformation), fill, one forward + backward. ``load``: load
    ``base_state`` (another dtype's model: the fp64 side) instead of checking the build made it."""
    from megatron.core import tensor_parallel
    from tests.harness import recipes as R

    import regather

    model = R.build_model(provider, seed=SEED)
    state = {n: t.detach().clone() for n, t in model.state_dict().items() if torch.is_tensor(t)}
    if load:
        report = model.load_state_dict(base_state, strict=False)
        assert not report.unexpected_keys and state.keys() == base_state.keys(), report
    elif base_state is not None:  # identical base weights on every side
        assert state.keys() == base_state.keys()
        for n, t in base_state.items():
            assert torch.equal(state[n], t), f"base weight {n} differs between sides"
    chunks = R.apply_peft(peft, model)
    assert isinstance(chunks, list) and len(chunks) == 1
    model = chunks[0]
    names = fill_adapters(model, rank)
    AdapterKinds(model)
    inputs, labels, position_ids, mask = R.token_batch(provider.vocab_size, MICRO_BATCH, provider.seq_length)
    SavedBytes = saved_bytes_class()
    with SavedBytes.for_model(model) as saved:
        logits = model(inputs, position_ids, mask)
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                                                            labels).mean()
    loss.backward()
    wrapped = {n: f"{type(m).__module__}.{type(m).__name__}" for n, m in model.named_modules()
               if n.rsplit(".", 1)[-1] in ALL_TARGETS}
    out = {
        "loss": loss.detach().clone(),
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
        "names": names,
        "saved": saved.total,
        "saved_by_kind": AdapterKinds.split(saved.by_label()),
        "params_to_save": sorted(peft.params_to_save),
        "wrapped": wrapped,
        "regather_wrappers": sorted(n for n, m in model.named_modules() if isinstance(m, regather.LoRALinear)),
    }
    if hasattr(peft, "regather_config"):  # regather.bridge.LoRA
        out["decisions"] = {p: str(d) for p, d in regather.decisions(model).items()}
    return out, state


def recipe_runs(rank: int, name: str) -> dict:
    from tests.harness import recipes as R

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
        for side in RECIPE_SIDES:
            peft = make_peft(side, fields, targets, experts_adapted)
            runs[side], state = run_side(provider, peft, rank, base_state)
            base_state = base_state or state
        runs["fp64"] = fp64_side(provider, make_peft("fp64", fields, targets, experts_adapted), rank, base_state)
        out["runs"][label] = runs
    if "all" not in out["runs"]:
        out["runs"]["all"] = out["runs"]["recipe"]
    model = R.build_model(provider, seed=SEED)
    out["features"] = features(model, provider)
    out["seconds"] = time.monotonic() - start
    return out


def fp64_side(provider, peft, rank: int, base_state: dict) -> dict:
    """:func:`run_side` of ``provider`` made float64 (a copy), from ``base_state`` (module doc)."""
    import copy

    from regather.tools.cpu.models import keep_fp64_cross_entropy

    keep_fp64_cross_entropy()  # megatron's cross entropy would round fp64 logits to fp32
    p64 = copy.copy(provider)
    p64.params_dtype = torch.float64
    return run_side(p64, peft, rank, base_state, load=True)[0]


def bridge_ready(rank: int) -> dict:
    """Bridge imported with the recipe tier's shims (the expensive part of a spawn); the rank's
    record so far."""
    from tests.harness import recipes as R

    start = time.monotonic()
    R.import_bridge()
    R.enable_recipe_cpu()
    return {"import_seconds": time.monotonic() - start, "rank": rank}


def side_by_side(rank: int, world_size: int, names: list[str]) -> dict:
    """Every recipe in ``names`` in this one spawn (imports are the expensive part)."""
    from tests.harness import recipes as R

    out = bridge_ready(rank)
    for name in names:
        out[name] = recipe_runs(rank, name)
    out["shims"] = R.installed_shims()
    return out


# -- issue 33: the layouts Bridge ships (TP = 1; TP > 1 with SP off) and TorchDynamo on once -------

#: name -> (recipe, TP on the 2 ranks); SP off in both, as the recipes set it
LAYOUTS = {"qwen3_8b_tp1": ("qwen3_8b", 1), "llama3_70b_tp2": ("llama3_70b", 2)}
#: the dense recipe whose MLP runs megatron's fused SwiGLU (``bias_activation_fusion``, a ``jit_fuser``)
DYNAMO_LAYOUT = "llama3_70b_tp2"


def layout_runs(rank: int, layout: str, sides=SIDES, target_sets=("recipe", "all")) -> dict:
    """One shipped layout: the recipe's own LoRA fields and SP setting, shrunk, every side."""
    from tests.harness import recipes as R

    name, tp = LAYOUTS[layout]
    start = time.monotonic()
    cfg = R.RECIPES[name].config()
    shipped = {"tp": cfg.model.tensor_model_parallel_size, "sp": cfg.model.sequence_parallel,
               "seq_length": cfg.model.seq_length}
    R.init_parallel(tp, seed=SEED)
    provider = R.shrink_provider(cfg.model, tp, sequence_parallel=shipped["sp"])
    fields = lora_fields(cfg.peft)
    sets = {"recipe": list(fields["target_modules"]), "all": list(ALL_TARGETS)}
    out = {"fields": {k: v for k, v in fields.items() if k != "canonical_mapping"}, "shipped": shipped,
           "layout": {"tp": provider.tensor_model_parallel_size, "sp": provider.sequence_parallel},
           "features": None, "runs": {}}
    base_state = None
    for label in target_sets:
        if label == "all" and sorted(sets["recipe"]) == sorted(ALL_TARGETS) and "recipe" in out["runs"]:
            out["runs"]["all"] = out["runs"]["recipe"]
            continue
        runs = {}
        for side in sides:
            peft = make_peft(side, fields, sets[label], False, sp_regather=False)
            runs[side], state = run_side(provider, peft, rank, base_state)
            base_state = base_state or state
        out["runs"][label] = runs
    out["features"] = features(R.build_model(provider, seed=SEED), provider)
    out["seconds"] = time.monotonic() - start
    return out


def dynamo_run(rank: int) -> dict:
    """The dense SwiGLU recipe's layout once more with TorchDynamo on (megatron-core 0.19.2's
    ``jit_fuser`` is ``torch.compile``: the fused SwiGLU and bias-dropout-add compile with Inductor,
    as on a GPU), Bridge's LoRA against regather's with ``recompute_adapter_inputs``: fc2's input is
    then rebuilt in backward by calling the compiled activation again, under ``no_grad``."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    dynamo.config.disable = False  # what the recipe tier's shim 5 turned off, back on for this run
    dynamo.reset()
    counters.clear()
    try:
        out = layout_runs(rank, DYNAMO_LAYOUT, sides=("bridge", "recompute"), target_sets=("all",))
    finally:
        dynamo.config.disable = True
    out["frames"] = {k: dict(v) for k, v in counters.items() if k in ("frames", "stats")}
    return out


def shipped_layouts(rank: int, world_size: int, names: list[str], dynamo: bool = True) -> dict:
    """Every layout in ``names``, then (``dynamo``) :func:`dynamo_run`, in this one spawn."""
    import traceback

    out = bridge_ready(rank)
    for name in names:
        out[name] = layout_runs(rank, name)
    if dynamo:
        t0 = time.monotonic()
        try:
            out["dynamo"] = dynamo_run(rank)
        except Exception as exc:  # reported by its own test; the layouts' results stand
            out["dynamo"] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        out["dynamo_seconds"] = time.monotonic() - t0
    return out
