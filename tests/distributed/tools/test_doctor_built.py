"""`regather doctor --build`: the decisions of a megatron model built on 2 gloo ranks agree with
the doctor's rules (the in-process rule tests are in test_doctor.py)."""


import pytest

from regather.tools import doctor
from regather.tools.doctor import Setup


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_built_model_decisions_agree_with_the_rules():
    s = Setup(layers=1, recompute_granularity="selective", recompute_modules=("mlp",))
    built = doctor.built_decisions(s, timeout=150)
    assert built == doctor.analytic_decisions(s)


# -- recompute_adapter_inputs ------------------------------------------------------------------

NOTHING_KEPT = "it keeps nothing for its backward (neither its input nor its weights need a gradient)"


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("setup", [
    Setup(recompute_adapter_inputs=True),  # layer 0's qkv: its norm keeps nothing
    Setup(recompute_adapter_inputs=True, input_requires_grad=True, strategy="lowrank"),
    Setup(recompute_adapter_inputs=True, strategy="gather", targets=("linear_fc1", "linear_fc2")),
    Setup(recompute_adapter_inputs=True, activation="swiglu"),  # gated + unfused bias: from views of fc1_out + bias
    Setup(recompute_adapter_inputs=True, recompute_granularity="full", recompute_method="uniform",
          input_requires_grad=True),
], ids=["frozen", "input-grad-lowrank", "gather-fc1-fc2", "swiglu-bias", "full"])
def test_built_recompute_decisions_agree_with_the_rules(setup):
    """--build asks the adapters (decisions, then one training step's per-forward checks)."""
    built = doctor.built_decisions(setup, timeout=150)
    assert built == doctor.analytic_decisions(setup)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_built_selective_mlp_recompute_marks_what_came_from_the_rules():
    s = Setup(recompute_adapter_inputs=True, recompute_granularity="selective", recompute_modules=("mlp",))
    built = doctor.built_decisions(s, timeout=150)
    fc2 = built["decoder.layers.1.mlp.linear_fc2"]
    assert fc2.pop("recompute_reason_from_rules").startswith("megatron's selective 'mlp' checkpoint")
    assert fc2["recompute_reason"].startswith("running inside activation checkpointing")
    assert built["decoder.layers.0.self_attention.linear_qkv"]["recompute_reason"] == f"input_layernorm: {NOTHING_KEPT}"
    for _path, d in built.items():
        d.pop("recompute_reason_from_rules", None)
    assert built == doctor.analytic_decisions(s)


