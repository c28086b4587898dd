"""Rank bodies for tests/distributed/megatron/test_checkpoint_keys.py: a real TP=2 GPT, LoRA-wrapped."""

from __future__ import annotations

import torch

from regather import LoRA
from regather.megatron.dense import checkpoint
from regather.tools.cpu.models import TinyGPT, build_gpt, gpt_batch

SHAPE = TinyGPT()
QKV = "decoder.layers.0.self_attention.linear_qkv"


def _lora_model(strategy, seed=1234, adapter_seed=7, targets=None):
    model = build_gpt(SHAPE, tp=2, seed=seed)
    torch.manual_seed(adapter_seed)
    kw = {"target_modules": list(targets)} if targets else {}
    return LoRA(sequence_parallel_input_strategy=strategy, lora_B_init_method="normal", dim=8, **kw)(model)


def _logits(model):
    inputs, _, position_ids, mask = gpt_batch(SHAPE, 2, seed=3)
    model.eval()
    with torch.no_grad():
        return model(inputs, position_ids, mask)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _error(fn):
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def key_cases(rank, world):
    out = {}
    for strategy in ("gather", "regather", "lowrank"):
        model = _lora_model(strategy)
        sd = model.state_dict()
        res = {"keys": [k for k in sd if k.startswith(QKV + ".")], "logits": _logits(model)}
        # own layout, strict
        other = _lora_model(strategy, adapter_seed=99)
        other.load_state_dict(sd, strict=True)
        res["own_logits"] = _logits(other)
        # regather 0.1's layout: base under to_wrap., holders without _extra_state
        old = {}
        for k, v in sd.items():
            if k.endswith("adapter.linear_in._extra_state") or k.endswith("adapter.linear_out._extra_state"):
                continue
            path, _, leaf = k.rpartition(".")
            wrapper = next((p for p in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
                            if path.endswith(p) and ".adapter" not in k), None)
            old[f"{path}.to_wrap.{leaf}" if wrapper else k] = v
        res["old_has_to_wrap"] = any(".to_wrap." in k for k in old)
        older = _lora_model(strategy, adapter_seed=98)
        older.load_state_dict(old, strict=True)
        res["old_logits"] = _logits(older)
        # the same base weight given twice is refused
        twice = dict(sd)
        twice[f"{QKV}.to_wrap.weight"] = sd[f"{QKV}.weight"]
        res["twice_error"] = _error(lambda: _lora_model(strategy).load_state_dict(twice))
        out[strategy] = res
    return out


def partial_cases(rank, world):
    out = {}
    plain = build_gpt(SHAPE, tp=2, seed=4321)  # a "pretrained" frozen model: other base weights
    plain_sd = plain.state_dict()
    out["plain_logits"] = _logits(plain)
    for strategy in ("regather", "lowrank"):
        model = _lora_model(strategy)
        adapters_before = {n: p for n, p in _params(model).items() if ".adapter." in n}
        checkpoint.load_base_state_dict(model, plain_sd)
        after = _params(model)
        res = {"adapters_kept": all(torch.equal(after[n], p) for n, p in adapters_before.items())}
        base_named = {n.replace(".to_wrap.", "."): p for n, p in after.items() if ".adapter." not in n}
        res["base_from_plain"] = all(torch.equal(base_named[n], p.detach()) for n, p in plain.named_parameters())
        # LoRA-B zeroed: the wrapped model computes the frozen model's function exactly
        for n, p in model.named_parameters():
            if n.endswith("adapter.linear_out.weight"):
                p.data.zero_()
        res["zero_b_logits"] = _logits(model)
        # a missing base key: refused before anything changes
        model2 = _lora_model(strategy)
        before2 = _params(model2)
        broken = {k: v for k, v in plain_sd.items() if not k.endswith("decoder.final_layernorm.weight")}
        res["missing_error"] = _error(lambda: checkpoint.load_base_state_dict(model2, broken))
        res["unchanged_after_error"] = all(torch.equal(before2[n], p) for n, p in _params(model2).items())
        # adapter-only checkpoint from another adapter init; like Bridge's, it holds no _extra_state
        src = _lora_model(strategy, adapter_seed=55)
        only = checkpoint.adapter_only(src.state_dict())
        res["adapter_only_keys_ok"] = bool(only) and all(checkpoint.is_adapter_key(k) and "_extra_state" not in k
                                                         for k in only)
        dst = _lora_model(strategy, adapter_seed=56)
        base_before = {n: p for n, p in _params(dst).items() if ".adapter." not in n}
        checkpoint.load_adapter_state_dict(dst, only)
        res["adapter_logits"], res["src_logits"] = _logits(dst), _logits(src)
        res["base_kept"] = all(torch.equal(_params(dst)[n], p) for n, p in base_before.items())
        extra = dict(only, **{"decoder.final_layernorm.weight": plain_sd["decoder.final_layernorm.weight"]})
        res["extra_error"] = _error(lambda: checkpoint.load_adapter_state_dict(dst, extra))
        res["base_only_has_no_adapter"] = not any(checkpoint.is_adapter_key(k)
                                                  for k in checkpoint.base_only(model.state_dict()))
        out[strategy] = res
    return out
