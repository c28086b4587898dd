"""HF PEFT interop, in process: the adapter_config.json regather writes against the real
``peft`` 0.21.2 (fields, targets, ranks and scales, Llama module names, refusals naming the key).
The two-rank megatron <-> HF comparisons are in test_peft_hf.py."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("peft")
pytest.importorskip("transformers")



def _tiny_llama(layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=16))


@pytest.mark.timeout(120)
def test_module_names_are_those_of_llama():
    from regather.hf.layout import hf_module_names

    assert hf_module_names(3, True) == [n for n, _ in _tiny_llama(3).named_modules()]


MATCH_CONFIGS = [
    {"target_modules": ["q_proj", "v_proj"]},
    {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": [1]},
    {"target_modules": ["o_proj"], "layers_to_transform": 2, "layers_pattern": "layers"},
    {"target_modules": ["gate_proj", "up_proj"], "layers_to_transform": [0, 2], "layers_pattern": ["layers"]},
    {"target_modules": r".*\.layers\.[01]\.self_attn\.(q|k)_proj"},
    {"target_modules": ["model.layers.0.self_attn.q_proj", "model.layers.2.mlp.down_proj"]},
    {"target_modules": ["q_proj", "k_proj", "v_proj"], "exclude_modules": ["model.layers.1.self_attn.k_proj"]},
    {"target_modules": ["q_proj", "k_proj"], "exclude_modules": r".*\.layers\.0\..*"},
    {"target_modules": "all-linear"},
    {"target_modules": ["q_proj", "lm_head", "embed_tokens"]},
    {"target_modules": ["q_proj", "o_proj"], "rank_pattern": {"q_proj": 4, "model.layers.1.self_attn.o_proj": 2},
     "alpha_pattern": {"o_proj": 3, "model.layers.2.self_attn.q_proj": 7}},
    {"target_modules": ["q_proj", "o_proj"], "use_rslora": True, "alpha_pattern": {"o_proj": 3}},
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kw", MATCH_CONFIGS, ids=[str(i) for i in range(len(MATCH_CONFIGS))])
def test_targets_ranks_and_scales_follow_peft(kw):
    """regather's reading of target_modules / exclude_modules / layers_to_transform / patterns /
    use_rslora against the modules real PEFT wraps, with their r and scaling."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    from regather.hf.layout import hf_module_names, projection_names
    from regather.hf.peft_config import module_lora, targeted

    config = dict({"r": 8, "lora_alpha": 16}, **kw)
    pm = get_peft_model(_tiny_llama(3), LoraConfig(**config))
    wrapped = {n[len("base_model.model."):]: m for n, m in pm.named_modules() if isinstance(m, LoraLayer)}
    linear = sorted(projection_names(3, True)) + ["lm_head"]
    assert targeted(config, hf_module_names(3, True), linear) == set(wrapped)
    for name, module in wrapped.items():
        if name in ("lm_head", "model.embed_tokens"):
            continue
        mine = module_lora(config, name)
        assert (mine.r, mine.scale) == (module.r["default"], module.scaling["default"]), name


@pytest.mark.timeout(120)
def test_default_fields_are_peft_0212s(tmp_path):
    import json

    import peft
    from peft import LoraConfig

    from regather.hf.peft_config import LORA_CONFIG_DEFAULTS, PEFT_FIELDS_VERSION

    assert peft.__version__ == PEFT_FIELDS_VERSION  # bump the table with the pin
    LoraConfig(task_type="CAUSAL_LM").save_pretrained(str(tmp_path))
    with open(tmp_path / "adapter_config.json") as f:
        saved = json.load(f)
    assert sorted(saved) == sorted(LORA_CONFIG_DEFAULTS)
    # inference_mode: False in the bare config, True as PeftModel.save_pretrained writes it (the
    # export tests compare that); peft_version: PEFT's own stamp
    skip = ("peft_version", "inference_mode")
    assert {k: v for k, v in saved.items() if k not in skip} == {
        k: v for k, v in LORA_CONFIG_DEFAULTS.items() if k not in skip}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change, words", [
    ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
    ({"init_lora_weights": "loftq", "loftq_config": {"loftq_bits": 4}}, "init_lora_weights='loftq'"),
    ({"bias": "all"}, "bias='all'"),
    ({"kasa_config": {"x": 1}}, "kasa_config"),
    ({"some_future_field": True}, "some_future_field"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
])
def test_config_refusals_name_the_key(change, words):
    from regather.hf.peft_config import LORA_CONFIG_DEFAULTS, UnsupportedAdapter, check_features

    config = dict(LORA_CONFIG_DEFAULTS, target_modules=["q_proj"], **change)
    with pytest.raises(UnsupportedAdapter) as info:
        check_features(config, "dir")
    assert words in str(info.value)
    check_features(dict(LORA_CONFIG_DEFAULTS, target_modules=["q_proj"], init_lora_weights="gaussian"), "dir")
