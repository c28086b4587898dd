"""Rank bodies for the tests against the real ``peft`` and ``transformers`` (test_peft_hf.py).

One TP=2 run does everything: the megatron Llama-style GPT and its HF twin
(:mod:`tests.harness.hf_llama`), regather exports read by ``PeftModel.from_pretrained``,
and adapters made by real PEFT (``get_peft_model`` + ``save_pretrained``, random non-zero A and
B) loaded with :func:`regather.hf.load_peft`. Rank 0 runs the HF side and writes the
adapters; both ranks run megatron.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist

from regather import CanonicalLoRA, DoRA, LoRA
from regather.tools.cpu.models import TinyGPT

SHAPE = TinyGPT(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=96, vocab_size=256, seq_length=16)
# Weights 5x megatron's default std (0.02): attention is far from uniform, so rope, eps and
# the q/k/v cut show in the logits (a rope base of 500 instead of 10000 moves them by ~1).
STD = 0.1
R, ALPHA = 8, 16
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KINDS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def tokens():
    return torch.randint(0, SHAPE.vocab_size, (2, SHAPE.seq_length), generator=torch.Generator().manual_seed(0))


_built = {"n": 0}


def base_model(t):
    from tests.harness.hf_llama import build_llama_gpt

    first = _built["n"] == 0
    _built["n"] += 1  # megatron's parallel state once per process (each init leaks ~17 groups)
    return build_llama_gpt(SHAPE, t, init_method_std=STD, init_parallel=first)


def lora_model(t, cls=LoRA, strategy="regather", seed=99, **kw):
    model = base_model(t)
    torch.manual_seed(seed)
    model = cls(dim=R, alpha=ALPHA, lora_B_init_method="normal", sequence_parallel_input_strategy=strategy,
                **kw)(model, training=False)
    from regather import adapters

    with torch.no_grad():  # Bridge's "normal" B (std 0.2) at a quarter: deltas of the base logits' size
        for a in adapters(model).values():
            a.linear_out.weight.mul_(0.25)
    return model


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(f"{record.name}: {record.getMessage()}")


@contextlib.contextmanager
def hf_warnings():
    """Every Python warning and every peft/transformers log record at WARNING or above."""
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("transformers", "peft")]
    for lg in loggers:
        lg.addHandler(handler)
    out: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield out
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    out.extend(f"{w.category.__name__}: {w.message}" for w in caught)
    out.extend(handler.messages)


def peft_logits(hf_base, directory):
    from peft import PeftModel

    with hf_warnings() as caught:
        model = PeftModel.from_pretrained(copy.deepcopy(hf_base), directory)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens()).logits, caught


def peft_saved_config(hf_base, directory, **kw):
    """What real PEFT writes for the same targets (``LoraConfig(...).save_pretrained``)."""
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(copy.deepcopy(hf_base), LoraConfig(r=R, lora_alpha=ALPHA, task_type="CAUSAL_LM", **kw))
    pm.save_pretrained(directory)
    from safetensors.torch import load_file

    with open(os.path.join(directory, "adapter_config.json")) as f:
        return json.load(f), sorted(load_file(os.path.join(directory, "adapter_model.safetensors")))


# -- export: regather -> PEFT ---------------------------------------------------------------

EXPORTS = {
    # name: (LoRA class, LoRA kwargs, the LoraConfig kwargs of the same targets)
    "full": (LoRA, {}, {"target_modules": ALL7}),
    "layer1": (LoRA, {"target_modules": [f"*.layers.1.*.{k}" for k in KINDS]},
               {"target_modules": ALL7, "layers_to_transform": [1], "layers_pattern": "layers"}),
    "qkv_fc2": (LoRA, {"target_modules": ["linear_qkv", "linear_fc2"]},
                {"target_modules": ["q_proj", "k_proj", "v_proj", "down_proj"]}),
    "irregular": (LoRA, {"target_modules": ["*.layers.0.*.linear_qkv", "*.layers.1.*.linear_fc2"]},
                  {"target_modules": ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                                      "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"]}),
    "canonical_qv": (CanonicalLoRA, {"target_modules": ["linear_q", "linear_v"]},
                     {"target_modules": ["q_proj", "v_proj"]}),
    # DoRA: lora_magnitude_vector per module (the magnitude drawn at wrap time, B scaled after: m != ||W||)
    "dora": (DoRA, {}, {"target_modules": ALL7, "use_dora": True}),
}


def _export_cases(rank, t, root, hf_base, res):
    from tests.harness.hf_llama import megatron_logits

    from regather.hf import export_peft

    out = {}
    for name, (cls, kw, peft_kw) in EXPORTS.items():
        model = lora_model(t, cls, **kw)
        d = os.path.join(root, "export", name)
        export_peft(model, d, base_model_name_or_path="tiny-llama")
        case = {"megatron": megatron_logits(model, tokens())}
        if rank == 0:
            case["peft"], case["warnings"] = peft_logits(hf_base, d)
            with open(os.path.join(d, "adapter_config.json")) as f:
                case["config"] = json.load(f)
            from safetensors.torch import load_file

            case["keys"] = sorted(load_file(os.path.join(d, "adapter_model.safetensors")))
            own = os.path.join(root, "peft_own", name)
            case["peft_config"], case["peft_keys"] = peft_saved_config(hf_base, own, **peft_kw)
            case["peft_own_warnings"] = peft_logits(hf_base, own)[1]  # what PEFT says about its own file
        out[name] = case
    res["export"] = out


# -- load: PEFT -> regather -----------------------------------------------------------------

# name: (LoraConfig kwargs, share A across q/k/v and gate/up)
ADAPTERS = {
    "separate_A": ({"target_modules": ALL7}, False),
    "shared_A": ({"target_modules": ALL7}, True),
    "rslora": ({"target_modules": ALL7, "use_rslora": True}, True),
    "alpha_pattern": ({"target_modules": ALL7, "alpha_pattern": {"q_proj": 32, "k_proj": 32, "v_proj": 32,
                                                                  "model.layers.1.mlp.down_proj": 4}}, True),
    "rslora_alpha_pattern": ({"target_modules": ALL7, "use_rslora": True,
                              "alpha_pattern": {"down_proj": 4}}, True),
    "alpha_pattern_split": ({"target_modules": ALL7, "alpha_pattern": {"q_proj": 32}}, True),
    "rank_pattern_same": ({"target_modules": ALL7, "rank_pattern": {"o_proj": R}}, True),
    "rank_pattern_other": ({"target_modules": ALL7, "rank_pattern": {"o_proj": 2 * R}}, True),
    "alpha_other": ({"target_modules": ALL7, "lora_alpha": 2 * ALPHA}, True),
    "dora": ({"target_modules": ALL7, "use_dora": True}, True),
    "lora_bias": ({"target_modules": ALL7, "lora_bias": True}, True),
    "lm_head": ({"target_modules": ALL7 + ["lm_head"]}, True),
    "embed_tokens": ({"target_modules": ALL7 + ["embed_tokens"]}, True),
    "modules_to_save": ({"target_modules": ALL7, "modules_to_save": ["lm_head"]}, True),
    "qv_shared": ({"target_modules": ["q_proj", "v_proj"]}, True),
    "qv_separate": ({"target_modules": ["q_proj", "v_proj"]}, False),
    "layer1_shared": ({"target_modules": ALL7, "layers_to_transform": [1], "layers_pattern": "layers"}, True),
}
# edited copies of a real PEFT adapter: name -> (source, edit)
EDITED = {
    "fan_in_fan_out": ("shared_A", "config"),
    "weights_missing_layer0_qkv": ("shared_A", "weights"),
}

# name: (adapter, model, expected: None = loads, else a string the refusal must contain)
LOADS = [
    ("separate_A", "lora", "CanonicalLoRA"),
    ("shared_A", "lora", None),
    ("shared_A", "lora_lowrank", None),
    ("rslora", "lora", None),
    ("alpha_pattern", "lora", None),
    ("rslora_alpha_pattern", "lora", None),
    ("alpha_pattern_split", "lora", "alpha_pattern['q_proj']"),
    ("rank_pattern_same", "lora", None),
    ("rank_pattern_other", "lora", "rank_pattern['o_proj']"),
    ("alpha_other", "lora", f"LoRA(alpha={2 * ALPHA})"),
    ("dora", "lora", "use_dora"),
    ("lora_bias", "lora", "lora_bias"),
    ("fan_in_fan_out", "lora", "fan_in_fan_out"),
    ("lm_head", "lora", "outside the four megatron linears"),
    ("embed_tokens", "lora", "outside the four megatron linears"),
    ("modules_to_save", "lora", "modules_to_save"),
    ("qv_shared", "lora_qkv", None),
    ("qv_separate", "lora_qkv", "CanonicalLoRA"),
    ("layer1_shared", "lora_layer1", None),
    ("layer1_shared", "lora", "no tensors for the adapter"),
    ("weights_missing_layer0_qkv", "lora", "disagree"),
    ("separate_A", "canonical", None),
    ("qv_separate", "canonical_qv", None),
    ("alpha_pattern_split", "canonical", None),  # one scale per projection adapter
    ("dora", "dora", None),
    ("dora", "dora_lowrank", None),
    ("shared_A", "dora", "a plain LoRA adapter"),
]
MODELS = {
    "lora": (LoRA, "regather", {}),
    "lora_lowrank": (LoRA, "lowrank", {}),
    "lora_qkv": (LoRA, "regather", {"target_modules": ["linear_qkv"]}),
    "lora_layer1": (LoRA, "regather", {"target_modules": [f"*.layers.1.*.{k}" for k in KINDS]}),
    "canonical": (CanonicalLoRA, "regather", {}),
    "canonical_qv": (CanonicalLoRA, "regather", {"target_modules": ["linear_q", "linear_v"]}),
    "dora": (DoRA, "regather", {}),
    "dora_lowrank": (DoRA, "lowrank", {}),
}
ROUND_TRIPS = ("rslora", "alpha_pattern")  # after loading these, export again and read with PEFT


def make_peft_adapter(hf_base, directory, kw, share_a, seed):
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(copy.deepcopy(hf_base), LoraConfig(**dict({"r": R, "lora_alpha": ALPHA,
                                                                    "task_type": "CAUSAL_LM"}, **kw)))
    g = torch.Generator().manual_seed(seed)
    params = dict(pm.named_parameters())
    with torch.no_grad():
        for n, p in params.items():
            if ".lora_A." in n or ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        if share_a:  # one LoRA-A per fused megatron linear, built so
            for n, p in params.items():
                for src, dsts in (("q_proj", ("k_proj", "v_proj")), ("gate_proj", ("up_proj",))):
                    if f".{src}.lora_A." in n:
                        for d in dsts:
                            other = n.replace(f".{src}.", f".{d}.")
                            if other in params:
                                params[other].copy_(p)
    pm.save_pretrained(directory)
    pm.eval()
    with torch.no_grad():
        return pm(input_ids=tokens()).logits


def _edit(src_dir, directory, how):
    shutil.copytree(src_dir, directory)
    if how == "config":
        path = os.path.join(directory, "adapter_config.json")
        with open(path) as f:
            config = json.load(f)
        config["fan_in_fan_out"] = True
        with open(path, "w") as f:
            json.dump(config, f)
    else:
        from safetensors.torch import load_file, save_file

        path = os.path.join(directory, "adapter_model.safetensors")
        tensors = {k: v for k, v in load_file(path).items() if ".layers.0.self_attn.o_proj" in k
                   or ".layers.0.self_attn." not in k}
        save_file(tensors, path)


def _snapshot(model):
    from regather import adapters

    sd = {k: v.detach().clone() for k, v in model.state_dict().items() if ".adapter" in k and "_extra_state" not in k}
    return sd, {p: a.scale for p, a in adapters(model).items()}


def _unchanged(model, snap) -> bool:
    sd, scales = _snapshot(model)
    return (sorted(sd) == sorted(snap[0]) and all(torch.equal(sd[k], snap[0][k]) for k in sd)
            and scales == snap[1])


def _load_cases(rank, t, root, hf_base, res):
    from tests.harness.hf_llama import megatron_logits

    from regather import adapters
    from regather.hf import UnsupportedAdapter, export_peft, hf_state_dict, load_peft, read_peft

    hf_out = {}
    if rank == 0:
        for i, (name, (kw, share)) in enumerate(ADAPTERS.items()):
            hf_out[name] = make_peft_adapter(hf_base, os.path.join(root, "peft", name), kw, share, seed=100 + i)
        for name, (src, how) in EDITED.items():
            _edit(os.path.join(root, "peft", src), os.path.join(root, "peft", name), how)
    dist.barrier()
    models = {key: lora_model(t, cls, strategy, **kw) for key, (cls, strategy, kw) in MODELS.items()}
    out = []
    for adapter_name, model_key, expect in LOADS:
        model = models[model_key]
        d = os.path.join(root, "peft", adapter_name)
        snap = _snapshot(model)
        case = {"adapter": adapter_name, "model": model_key, "expect": expect}
        try:
            case["loaded"] = load_peft(model, d)
            case["error"] = None
        except UnsupportedAdapter as exc:
            case["error"], case["error_type"] = str(exc), type(exc).__name__
            case["unchanged"] = _unchanged(model, snap)
        if case["error"] is None:
            case["megatron"] = megatron_logits(model, tokens())
            case["scales"] = {p: a.scale for p, a in adapters(model).items()}
            # the model's adapter, exported again, next to the file PEFT wrote
            file_tensors, _ = read_peft(d)
            mine = hf_state_dict(model)
            case["weights_equal"] = {k: torch.equal(v, file_tensors[k]) if k in file_tensors else
                                     bool((k.endswith("lora_A.weight")) or v.abs().max() == 0)
                                     for k, v in mine.items()}
            if rank == 0:
                case["hf"] = hf_out[adapter_name]
            if adapter_name in ROUND_TRIPS and model_key == "lora":
                rt = os.path.join(root, "roundtrip", adapter_name)
                export_peft(model, rt)
                if rank == 0:
                    case["roundtrip"], case["roundtrip_warnings"] = peft_logits(hf_base, rt)
                    with open(os.path.join(rt, "adapter_config.json")) as f:
                        case["roundtrip_config"] = json.load(f)
        out.append(case)
    res["load"] = out


def hf_suite(rank, t, root):
    from tests.harness import hf_llama

    res = {}
    base = base_model(t).eval()
    hf_base = hf_llama.to_hf_llama(base)
    res["base_megatron"] = hf_llama.megatron_logits(base, tokens())
    if rank == 0:
        res["base_hf"] = hf_llama.hf_logits(hf_base, tokens())
        # the comparison can fail: HF with another rope base, and with HF's default RMSNorm eps
        from transformers import LlamaForCausalLM

        for what, change in (("rope_theta_500", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
                             ("rms_norm_eps_1e-6", {"rms_norm_eps": 1e-6})):
            cfg = copy.deepcopy(hf_base.config)
            for k, v in change.items():
                setattr(cfg, k, v)
            other = LlamaForCausalLM(cfg)
            other.load_state_dict(hf_base.state_dict())
            res[f"base_hf_{what}"] = hf_llama.hf_logits(other.eval(), tokens())
    _export_cases(rank, t, root, hf_base, res)
    _load_cases(rank, t, root, hf_base, res)
    return res
