"""``regather.bridge`` and Megatron Bridge's PEFT config protocol; regather without Bridge.

The subprocess tests run everywhere (with or without Bridge on the path); the in-process
ones need Bridge (``make test-bridge``)."""

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
from tests.harness.bridge_env import INSTALL_HINT, bridge_available

pytestmark = pytest.mark.timeout(180)
needs_bridge = pytest.mark.skipif(not bridge_available(), reason=INSTALL_HINT)


def _bridge_roots() -> set[str]:
    if not bridge_available():
        return set()
    spec = importlib.util.find_spec("megatron.bridge")
    return {os.path.dirname(os.path.dirname(p)) for p in spec.submodule_search_locations}


def _run(code: str, without_bridge: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if without_bridge:
        roots = {os.path.realpath(r) for r in _bridge_roots()}
        paths = [p for p in paths if os.path.realpath(p) not in roots]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=150)


# every regather module but regather.bridge; a module that needs an optional package which is
# missing here may fail to import: what matters is that none of them imports megatron.bridge
_IMPORT_ALL = """
    import importlib, pkgutil, sys, warnings
    warnings.filterwarnings("ignore")
    import regather
    assert "megatron.bridge" not in sys.modules, "import regather imported megatron.bridge"
    for info in pkgutil.walk_packages(regather.__path__, "regather."):
        # the two modules that are Bridge's front end: importing them needs Bridge (regather.bridge
        # is the public alias of regather.megatron.bridge)
        if info.name in ("regather.bridge", "regather.megatron.bridge") or info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except Exception:
            pass
    print(sorted(m for m in sys.modules if m.startswith("megatron.bridge")))
"""


def test_import_regather_without_bridge_never_touches_it():
    code = textwrap.dedent("""
        import importlib.util, sys
        assert importlib.util.find_spec("megatron.bridge") is None, "Bridge is still on the path"
    """) + textwrap.dedent(_IMPORT_ALL) + textwrap.dedent("""
        try:
            import regather.bridge
        except ImportError as exc:
            print("ImportError:", exc)
        else:
            raise AssertionError("import regather.bridge worked without Bridge")
    """)
    proc = _run(code, without_bridge=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-2] == "[]", proc.stdout
    assert lines[-1].startswith("ImportError: regather.bridge needs Megatron Bridge"), lines[-1]
    assert "pip install megatron-bridge" in lines[-1] and "regather.LoRA" in lines[-1]


@needs_bridge
def test_import_regather_with_bridge_on_the_path_does_not_import_it():
    proc = _run(_IMPORT_ALL, without_bridge=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


# -- the config object, in this process -------------------------------------------------------


@pytest.fixture(scope="module")
def bridge():
    from tests.harness.bridge_env import import_bridge_peft

    lora = import_bridge_peft()
    import regather.megatron.bridge as rb

    return lora, rb


@needs_bridge
def test_is_a_bridge_lora_with_bridge_fields_and_defaults(bridge):
    lora, rb = bridge
    from megatron.bridge.peft.base import PEFT

    assert issubclass(rb.LoRA, lora.LoRA) and issubclass(rb.LoRA, PEFT) and dataclasses.is_dataclass(rb.LoRA)
    ours = {f.name: f for f in dataclasses.fields(rb.LoRA)}
    theirs = {f.name: f for f in dataclasses.fields(lora.LoRA)}
    assert set(theirs) <= set(ours)
    mine, ref = rb.LoRA(), lora.LoRA()
    for name, f in theirs.items():
        assert getattr(mine, name) == getattr(ref, name), name
        assert ours[name].init == f.init, name
    assert set(ours) - set(theirs) == {"sequence_parallel_input_strategy", "early_regather",
                                       "lowrank_grad_allreduce", "share_sequence_gather",
                                       "recompute_adapter_inputs", "redispatch_expert_inputs",
                                       "lean_transients"}
    # Bridge's protocol, inherited, not re-implemented
    for method in ("freeze_model", "set_params_to_save", "adapter_key_filter", "match", "_walk_model"):
        assert getattr(rb.LoRA, method) is getattr(lora.LoRA, method), method
    assert rb.LoRA.__call__ is not PEFT.__call__ and rb.LoRA.transform is not lora.LoRA.transform


@needs_bridge
def test_config_errors_at_construction(bridge):
    _, rb = bridge
    with pytest.raises(ValueError, match="disagree"):
        rb.LoRA(sequence_parallel_input_regather=True, sequence_parallel_input_strategy="lowrank")
    with pytest.raises(ValueError, match="unknown strategy"):
        rb.LoRA(sequence_parallel_input_strategy="sideways")
    with pytest.raises(ValueError, match="lowrank_grad_allreduce"):
        rb.LoRA(lowrank_grad_allreduce="never")
    assert rb.LoRA(sequence_parallel_input_strategy="lowrank").regather_config().strategy.value == "lowrank"
    assert rb.LoRA(sequence_parallel_input_regather=True).regather_config().strategy.value == "regather"
    assert rb.LoRA().regather_config().strategy.value == "gather"


@needs_bridge
def test_round_trips_like_a_config_container_field(bridge):
    """Bridge's ConfigContainer serialises a dataclass ``peft`` field by its ``_target_`` and
    its public fields (megatron.training's ``_convert_value_to_dict``) and builds it back from them."""
    _, rb = bridge
    peft = rb.LoRA(dim=16, alpha=32, target_modules=["linear_qkv", "*.layers.1.*.linear_fc1"],
                   sequence_parallel_input_strategy="lowrank", lowrank_grad_allreduce="finalize_model_grads")
    as_dict = {"_target_": f"{type(peft).__module__}.{type(peft).__qualname__}"}
    as_dict.update({f.name: getattr(peft, f.name) for f in dataclasses.fields(peft)
                    if not f.name.startswith("_")})
    assert as_dict["_target_"] == "regather.bridge.LoRA"
    module, _, cls = as_dict.pop("_target_").rpartition(".")
    init = {f.name for f in dataclasses.fields(peft) if f.init}
    rebuilt = getattr(importlib.import_module(module), cls)(**{k: v for k, v in as_dict.items() if k in init})
    assert rebuilt == peft
    assert dataclasses.replace(peft, dim=8).dim == 8
