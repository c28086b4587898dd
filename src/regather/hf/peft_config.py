"""``adapter_config.json``: what regather writes, what it reads, what it refuses.

No import of ``peft``: the fields below are those ``LoraConfig(...).save_pretrained`` writes
in peft 0.21.2 (``tests/distributed/hf/test_peft_hf.py`` compares them with the real library),
and the target matching follows ``peft.tuners.tuners_utils.check_target_module_exists``
(compared there too).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: The files of a PEFT adapter directory (``PeftModel.save_pretrained``'s names).
WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"

#: The PEFT release whose ``LoraConfig`` fields :data:`LORA_CONFIG_DEFAULTS` mirrors.
PEFT_FIELDS_VERSION = "0.21.2"

#: ``LoraConfig().to_dict()`` of peft 0.21.2 as ``save_pretrained`` writes it (defaults).
LORA_CONFIG_DEFAULTS: dict = {
    "alora_invocation_tokens": None,
    "alpha_pattern": {},
    "arrow_config": None,
    "auto_mapping": None,
    "base_model_name_or_path": None,
    "bias": "none",
    "corda_config": None,
    "ensure_weight_tying": False,
    "eva_config": None,
    "exclude_modules": None,
    "fan_in_fan_out": False,
    "inference_mode": True,
    "init_lora_weights": True,
    "kasa_config": None,
    "layer_replication": None,
    "layers_pattern": None,
    "layers_to_transform": None,
    "loftq_config": {},
    "lora_alpha": 8,
    "lora_bias": False,
    "lora_dropout": 0.0,
    "lora_ga_config": None,
    "megatron_config": None,
    "megatron_core": "megatron.core",
    "modules_to_save": None,
    "monteclora_config": None,
    "peft_type": "LORA",
    "peft_version": None,  # PEFT writes its own version; regather leaves it to the loading PEFT
    "qalora_group_size": 16,
    "r": 8,
    "rank_pattern": {},
    "revision": None,
    "target_modules": None,
    "target_parameters": None,
    "task_type": "CAUSAL_LM",
    "trainable_token_indices": None,
    "use_bdlora": None,
    "use_dora": False,
    "use_qalora": False,
    "use_rslora": False,
    "velora_config": None,
}

# Read and honoured by load_peft.
HONOURED = ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules",
            "exclude_modules", "layers_to_transform", "layers_pattern")
# Do not change the function a loaded adapter computes (metadata, training-only, init-only).
IGNORED = ("peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "peft_version",
           "auto_mapping", "lora_dropout", "megatron_core", "qalora_group_size", "ensure_weight_tying",
           "eva_config", "corda_config", "lora_ga_config", "init_lora_weights")
# init_lora_weights values that only initialise A and B (the saved weights are the adapter).
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")

_REFUSED_WHY = {
    "use_dora": "DoRA (use_dora=True) rescales each output row of the merged weight with a learned "
                "magnitude vector; this model's adapters compute a plain LoRA delta B(A(x)): build it with "
                "regather.DoRA to load a DoRA adapter",
    "lora_bias": "lora_bias=True gives LoRA-B a trained bias; regather's adapters have none",
    "fan_in_fan_out": "fan_in_fan_out=True stores weights transposed for GPT-2-style Conv1D layers; the "
                      "megatron linears are nn.Linear-layout (out, in)",
    "modules_to_save": "modules_to_save saves full trained copies of base modules (e.g. lm_head, a "
                       "classifier head); regather loads LoRA weights only",
    "trainable_token_indices": "trainable_token_indices trains rows of the embedding matrix; regather "
                               "loads LoRA weights on the four megatron linears only",
    "layer_replication": "layer_replication duplicates decoder layers; the megatron model has its own layers",
    "target_parameters": "target_parameters puts LoRA on bare parameters (e.g. MoE experts), not on the "
                         "four megatron linears",
    "megatron_config": "megatron_config is PEFT's own megatron integration (other module names and layouts)",
    "use_qalora": "QA-LoRA (use_qalora=True) pools the adapter input; regather's adapters do not",
    "use_bdlora": "BD-LoRA (use_bdlora) makes LoRA-A/B block-diagonal; regather's adapters are dense",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens) switches the adapter on only after "
                               "invocation tokens; regather's adapters act on every token",
}


class UnsupportedAdapter(ValueError):
    """An HF PEFT adapter regather cannot load into this model as it is (raised before any change)."""


def _empty(value) -> bool:
    return value is None or value is False or value == {} or value == [] or value == "" or value == "none"


def check_features(config: Mapping, where: str, dora: bool = False) -> None:
    """Refuse every PEFT feature that changes what the adapter computes beyond LoRA (``dora``: the model's
    adapters are DoRA's, so ``use_dora=True`` is what the file must say)."""
    if dora != bool(config.get("use_dora")):
        if dora:
            raise UnsupportedAdapter(f"{where}: use_dora={config.get('use_dora')!r}: a plain LoRA adapter; the model's "
                                     "adapters are DoRA's (regather.DoRA): build the model with regather.LoRA")
    elif dora:
        config = {k: v for k, v in config.items() if k != "use_dora"}
    if config.get("peft_type", "LORA") != "LORA":
        raise UnsupportedAdapter(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise UnsupportedAdapter(f"{where}: bias={bias!r} trains the base model's biases and saves them with the "
                                 "adapter; regather loads LoRA weights only (and the megatron Llama has no biases)")
    init = config.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        raise UnsupportedAdapter(
            f"{where}: init_lora_weights={init!r} changed the base weights at initialisation (PiSSA, OLoRA, "
            "CorDA, LoftQ, LoRA-GA) or selects a LoRA variant (MiCA): the adapter reproduces its function only on "
            "that modified base; convert it to a plain LoRA with PEFT (path_initial_model_for_weight_conversion)")
    for key, why in _REFUSED_WHY.items():
        if not _empty(config.get(key)):
            raise UnsupportedAdapter(f"{where}: {key}={config[key]!r} is not supported: {why}")
    loftq = config.get("loftq_config")
    if not _empty(loftq):
        raise UnsupportedAdapter(f"{where}: loftq_config={loftq!r}: LoftQ changes the base weights")
    known = set(HONOURED) | set(IGNORED) | set(_REFUSED_WHY) | {"bias", "loftq_config"}
    for key in sorted(set(config) - known):
        if not _empty(config[key]):
            raise UnsupportedAdapter(f"{where}: {key}={config[key]!r} is set; regather does not know what it "
                                     "changes, so it loads no adapter that uses it")


# -- target matching (PEFT's rules) -------------------------------------------------------


def _match_layer(key: str, layers, pattern) -> bool:
    if pattern is None or len(pattern) == 0:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        m = None
        for p in [pattern] if isinstance(pattern, str) else pattern:
            m = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
            if m is not None:
                break
    if m is None:
        return False
    idx = int(m.group("idx"))
    return idx == layers if isinstance(layers, int) else idx in layers


def targeted(config: Mapping, module_names: Iterable[str], linear: Iterable[str] = ()) -> set[str]:
    """The modules of ``module_names`` PEFT puts LoRA on for ``config`` (its
    ``check_target_module_exists``; ``"all-linear"`` is ``linear`` less ``lm_head``)."""
    targets = config.get("target_modules")
    exclude = config.get("exclude_modules")
    save = config.get("modules_to_save") or []
    layers = config.get("layers_to_transform")
    pattern = config.get("layers_pattern")
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = sorted(n for n in linear if n != "lm_head")
    out = set()
    for key in module_names:
        if exclude:
            if isinstance(exclude, str):
                if re.fullmatch(exclude, key):
                    continue
            elif key in exclude or any(key.endswith(f".{e}") for e in exclude):
                continue
        if save and any(re.match(rf"(^|.*\.){m}($|\..*)", key) for m in save):
            continue
        if targets is None:
            continue
        if isinstance(targets, str):
            found = re.fullmatch(targets, key) is not None
        elif key in targets:
            found = True
        else:
            found = any(key.endswith(f".{t}") for t in targets)
            use_layers = layers is not None and (len(layers) != 0 if isinstance(layers, list) else True)
            if use_layers and found:
                found = _match_layer(key, layers, pattern)
        if found:
            out.add(key)
    return out


def _pattern_value(patterns: Mapping, key: str):
    """PEFT's ``get_pattern_key``: the first pattern whose regex ends ``key`` at a dot boundary."""
    for p in patterns:
        if re.match(rf"(.*\.)?({p})$", key):
            return p, patterns[p]
    return None, None


@dataclass
class ModuleLoRA:
    """r, alpha and scale PEFT gives one HF module, and which config keys set them."""

    r: int
    alpha: float
    scale: float
    r_from: str = "r"
    alpha_from: str = "lora_alpha"


def module_lora(config: Mapping, name: str) -> ModuleLoRA:
    """PEFT's ``_create_and_replace``: ``rank_pattern`` / ``alpha_pattern`` then ``use_rslora``."""
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    r_from = alpha_from = None
    p, v = _pattern_value(config.get("rank_pattern") or {}, name)
    if p is not None:
        r, r_from = v, f"rank_pattern[{p!r}]"
    p, v = _pattern_value(config.get("alpha_pattern") or {}, name)
    if p is not None:
        alpha, alpha_from = v, f"alpha_pattern[{p!r}]"
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return ModuleLoRA(r, alpha, scale, r_from or "r", alpha_from or "lora_alpha")


# -- writing -------------------------------------------------------------------------------


def _number(x: float):
    return int(x) if float(x).is_integer() else float(x)


@dataclass
class ExportedModule:
    name: str     # model.layers.0.self_attn.q_proj
    layer: int
    module: str   # q_proj
    dim: int
    alpha: float
    scale: float


def _patterns(modules: list[ExportedModule], value: Mapping[str, float], default) -> dict:
    """``rank_pattern`` / ``alpha_pattern`` entries for the modules whose value is not ``default``:
    the bare module name (``q_proj``) where every such module has the same value, else the full
    names. The keys never overlap, so PEFT's first-match lookup finds the right one."""
    by_short: dict[str, set] = {}
    for m in modules:
        by_short.setdefault(m.module, set()).add(value[m.name])
    out = {}
    for m in sorted(modules, key=lambda m: m.name):
        v = value[m.name]
        if v == default:
            continue
        out[m.module if len(by_short[m.module]) == 1 else m.name] = _number(v)
    return dict(sorted(out.items()))


def lora_config(modules: list[ExportedModule], num_layers: int, base_model_name_or_path: str | None = None,
                dropout: float = 0.0, dora: bool = False) -> dict:
    """``adapter_config.json`` that makes PEFT build exactly ``modules`` with their scales (``dora``:
    ``use_dora=True``, each module with its ``lora_magnitude_vector``)."""
    if not modules:
        raise ValueError("no LoRA modules to export")
    by_module: dict[str, set[int]] = {}
    for m in modules:
        by_module.setdefault(m.module, set()).add(m.layer)
    layer_sets = {frozenset(s) for s in by_module.values()}
    layers_to_transform = layers_pattern = None
    if len(layer_sets) == 1:  # every module name on the same layers: names + layer indices
        (layers,) = layer_sets
        target_modules = sorted(by_module)
        if layers != frozenset(range(num_layers)):
            layers_to_transform, layers_pattern = sorted(layers), "layers"
    else:  # otherwise the exact module names (PEFT matches a listed name exactly or as a suffix)
        target_modules = sorted(m.name for m in modules)
    # scales: PEFT's lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    rslora = (all(math.isclose(m.scale, m.alpha / math.sqrt(m.dim), rel_tol=1e-12) for m in modules)
              and any(not math.isclose(m.scale, m.alpha / m.dim, rel_tol=1e-12) for m in modules))
    eff = {m.name: (m.scale * math.sqrt(m.dim) if rslora else m.scale * m.dim) for m in modules}
    eff = {k: (round(v) if math.isclose(v, round(v), rel_tol=1e-12) else v) for k, v in eff.items()}
    r = Counter(m.dim for m in modules).most_common(1)[0][0]
    # lora_alpha is the adapters' own alpha (LoRA(alpha=...)), so the file loads back into the same
    # LoRA config; modules whose scale says otherwise get alpha_pattern entries
    alpha = Counter(m.alpha for m in modules).most_common(1)[0][0]
    alpha = round(alpha) if float(alpha).is_integer() else alpha
    rank_pattern = _patterns(modules, {m.name: m.dim for m in modules}, r)
    alpha_pattern = _patterns(modules, eff, alpha)
    return dict(LORA_CONFIG_DEFAULTS, **{
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": _number(alpha),
        "lora_dropout": dropout,
        "use_rslora": rslora,
        "rank_pattern": dict(sorted(rank_pattern.items())),
        "alpha_pattern": alpha_pattern,
        "target_modules": target_modules,
        "layers_to_transform": layers_to_transform,
        "layers_pattern": layers_pattern,
        "use_dora": bool(dora),
    })


def write_adapter_dir(directory: str, tensors: Mapping, config: dict, source: str) -> None:
    """Write ``tensors`` (:data:`WEIGHTS_NAME`, safetensors with ``source`` in its metadata) and
    ``config`` (:data:`CONFIG_NAME`) to ``directory``. A collective when ``torch.distributed`` is
    initialised: rank 0 of the default group writes, every rank waits for it."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        meta = {"format": "pt", "regather.source": source}
        save_file({k: v.cpu() for k, v in tensors.items()}, os.path.join(directory, WEIGHTS_NAME), metadata=meta)
        with open(os.path.join(directory, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    if dist.is_initialized():
        dist.barrier()
