"""Public names stay where users find them (README, docs/), whatever the layout behind them."""

import importlib
import subprocess
import sys

import pytest

NAMES = {
    "regather": ["LoRA", "CanonicalLoRA", "LoRALinear", "ParallelLinearAdapter", "Decision", "Strategy", "adapters",
                 "decisions", "set_strategy"],
    "regather.hf": ["export_peft", "load_peft", "read_peft", "peft_config", "hf_state_dict", "UnsupportedAdapter"],
    "regather.peft_export": ["export_peft", "load_peft", "read_peft", "peft_config", "hf_state_dict",
                             "UnsupportedAdapter", "split_qkv", "merge_qkv"],
    "regather.merge": ["merge", "unmerge", "merged", "delta_weight"],
    "regather.ops": ["wgrad_accumulate_", "wgrad_backend", "BACKENDS"],
    "regather.estimate": ["estimate", "adapter_input_bytes", "Model", "Run", "PRESETS"],
    "regather.testing": ["enable_megatron_cpu"],
    "regather.testing.megatron_train": ["enable_megatron_training_cpu", "train", "TrainSpec"],
    "regather.testing.megatron_cpu": ["enable_megatron_cpu", "allreduce_sequence_parallel_grads"],
    "regather.testing.megatron_ckpt": ["enable_dist_checkpointing_cpu"],
    "regather.testing.hf_llama": ["build_llama_gpt", "to_hf_llama"],
    "regather.testing.dist": ["run_ranks", "RankFailed"],
    "regather.testing.bridge_env": ["import_bridge_peft", "bridge_available"],
}


@pytest.mark.parametrize("module", sorted(NAMES))
def test_names_are_importable(module):
    mod = importlib.import_module(module)
    missing = [n for n in NAMES[module] if not hasattr(mod, n)]
    assert missing == [], f"{module} lost {missing}"


def test_package_all_is_the_documented_api():
    import regather

    assert sorted(regather.__all__) == sorted(NAMES["regather"])


def test_front_end_entry_points_where_their_framework_is_installed():
    from regather.testing.bridge_env import bridge_available

    if bridge_available():
        from regather.testing.bridge_env import import_bridge_peft

        import_bridge_peft()
        assert importlib.import_module("regather.bridge").LoRA.__name__ == "LoRA"
    if importlib.util.find_spec("torchtitan") is not None:
        titan = importlib.import_module("regather.torchtitan")
        assert {"LoRAConverter", "apply_lora", "adapters", "decisions", "set_strategy"} <= set(dir(titan))


def test_cli_verbs():
    out = subprocess.run([sys.executable, "-m", "regather", "--help"], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert "{demo,bench,estimate,doctor}" in out
