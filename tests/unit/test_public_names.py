"""Public names stay where users find them (README, docs/), whatever the layout behind them."""

import importlib
import subprocess
import sys

import pytest

NAMES = {
    "regather": ["LoRA", "CanonicalLoRA", "DoRA", "LoRALinear", "ParallelLinearAdapter", "Decision", "Strategy", "adapters",
                 "decisions", "set_strategy", "merge", "unmerge", "merged", "delta_weight"],
    # the former regather.peft_export's names, at their home
    "regather.hf": ["export_peft", "load_peft", "read_peft", "peft_config", "hf_state_dict", "UnsupportedAdapter",
                    "split_qkv", "merge_qkv"],
    "regather.megatron.merge": ["merge", "unmerge", "merged", "delta_weight"],
    "regather.ops": ["wgrad_accumulate_", "wgrad_backend", "BACKENDS"],
    "regather.tools.estimate": ["estimate", "adapter_input_bytes", "Model", "Run", "PRESETS"],
    "regather.tools.cpu.megatron_cpu": ["enable_megatron_cpu", "allreduce_sequence_parallel_grads"],
    "regather.tools.cpu.dist": ["run_ranks", "RankFailed"],
}
# the modules a top-level module used to be: gone, their names at the homes above (docs/design.md §11)
GONE = ("regather.peft_export", "regather.merge", "regather.estimate", "regather.testing")


@pytest.mark.parametrize("module", sorted(NAMES))
def test_names_are_importable(module):
    mod = importlib.import_module(module)
    missing = [n for n in NAMES[module] if not hasattr(mod, n)]
    assert missing == [], f"{module} lost {missing}"


@pytest.mark.parametrize("module", GONE)
def test_removed_modules_fail_loudly(module):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(module)


def test_top_level_modules_are_documented_entry_points():
    import pkgutil

    import regather

    top = sorted(m.name for m in pkgutil.iter_modules(regather.__path__) if not m.ispkg)
    assert top == ["__main__", "bridge"]
    assert all(m in regather.__doc__ for m in (":mod:`regather.bridge`", ":mod:`regather.__main__`"))


def test_package_all_is_the_documented_api():
    import regather

    assert sorted(regather.__all__) == sorted(NAMES["regather"])


def test_front_end_entry_points_where_their_framework_is_installed():
    from tests.harness.bridge_env import bridge_available

    if bridge_available():
        from tests.harness.bridge_env import import_bridge_peft

        import_bridge_peft()
        assert importlib.import_module("regather.bridge").LoRA.__name__ == "LoRA"
    if importlib.util.find_spec("torchtitan") is not None:
        titan = importlib.import_module("regather.torchtitan")
        assert {"LoRAConverter", "apply_lora", "adapters", "decisions", "set_strategy"} <= set(dir(titan))


def test_cli_verbs():
    out = subprocess.run([sys.executable, "-m", "regather", "--help"], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert "{demo,bench,estimate,doctor}" in out


def test_front_ends_register_on_import():
    """regather.adapters / decisions / set_strategy ask the front ends imported in the process,
    each registered by its package (regather.core.frontends), in import order."""
    code = ("import torch, regather\n"
            "from regather.core import frontends\n"
            "print(list(frontends.registered()))\n"
            "import regather.torchtitan\n"
            "print(list(frontends.registered()))\n"
            "import regather.megatron\n"
            "print(list(frontends.registered()))\n"
            "print(regather.adapters(torch.nn.Linear(2, 2)), regather.decisions(torch.nn.Linear(2, 2)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True).stdout.splitlines()
    assert out == ["[]", "['torchtitan']", "['torchtitan', 'megatron']", "{} {}"]


def test_front_end_registration_refuses_bad_input():
    from regather.core import frontends

    with pytest.raises(ValueError, match=r"register\(name=''\)"):
        frontends.register("", lambda: None)
    with pytest.raises(TypeError, match=r"register\('x', load=3\)"):
        frontends.register("x", 3)
    assert "x" not in frontends.registered() and "" not in frontends.registered()
