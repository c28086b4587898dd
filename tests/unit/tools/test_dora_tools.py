"""``--peft dora`` in ``regather estimate`` and ``regather doctor`` (regather.tools.estimate.dora,
regather.tools.doctor.dora): what DoRA's magnitude keeps per adapter, by formula, and doctor's DoRA findings
(Bridge's DoRA: TE's gathered LayerNorm output with no re-gather option, the per-slice row norm)."""

import json
from dataclasses import replace

import pytest

from regather.tools import cli
from regather.tools.doctor import Setup, diagnose
from regather.tools.estimate import PRESETS, Run, dora_output_bytes, estimate

GOOD_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
QWEN = PRESETS["qwen3-8b"]
RUN = Run(tp=2, seq=8192, micro_batch=1, dtype="bfloat16", peft="dora")


def test_what_dora_keeps_on_qwen3_8b_at_tp2():
    """Per layer, bf16, s = 8192, TP2 + SP: qkv's z [s, (32 + 2*8)*128/2], fc1's [s, 2*12288/2] (201 MB: gate
    and up), proj's and fc2's sequence shard [s/2, 4096]; each with its scale and norm (2 x the magnitude)."""
    per_layer = {"linear_qkv": 8192 * 3072 * 2 + 2 * 3072 * 2, "linear_fc1": 8192 * 12288 * 2 + 2 * 12288 * 2,
                 "linear_proj": 4096 * 4096 * 2 + 2 * 4096 * 2, "linear_fc2": 4096 * 4096 * 2 + 2 * 4096 * 2}
    assert per_layer["linear_fc1"] // 10**6 == 201
    assert dora_output_bytes(QWEN, RUN) == {k: 36 * v for k, v in per_layer.items()}
    rebuilt = dora_output_bytes(QWEN, replace(RUN, dora_output="rebuild"))
    assert rebuilt == {k: 36 * 2 * o * 2 for k, o in (("linear_qkv", 3072), ("linear_fc1", 12288),
                                                      ("linear_proj", 4096), ("linear_fc2", 4096))}
    no_sp = dora_output_bytes(QWEN, replace(RUN, sp=False))  # a row base's whole output on every rank
    assert no_sp["linear_proj"] == 36 * (8192 * 4096 * 2 + 2 * 4096 * 2)
    assert dora_output_bytes(QWEN, replace(RUN, peft="lora")) == {}
    rows = estimate(QWEN, RUN, ("gather", "regather-recompute"))
    assert rows["gather"]["dora_output_bytes"] == rows["regather-recompute"]["dora_output_bytes"] == sum(
        36 * v for v in per_layer.values())
    assert "dora_output_bytes" not in estimate(QWEN, replace(RUN, peft="lora"), ("gather",))["gather"]


def test_dora_refuses_expert_targets_and_bad_values():
    with pytest.raises(ValueError, match="DoRA adapts dense linears only; Qwen3-30B-A3B's linear_fc1, linear_fc2"):
        dora_output_bytes(PRESETS["qwen3-30b-a3b"], RUN)
    assert dora_output_bytes(PRESETS["qwen3-30b-a3b"], replace(RUN, targets=("linear_qkv",)))
    with pytest.raises(ValueError, match="peft 'ia3'"):
        dora_output_bytes(QWEN, replace(RUN, peft="ia3"))


def test_estimate_cli(capsys):
    assert cli.main(["estimate", "--peft", "dora", "--strategies", "gather,regather", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["strategies"]["gather"]["dora_output_bytes"] == sum(dora_output_bytes(QWEN, RUN).values())
    assert cli.main(["estimate", "--peft", "dora", "--dora-output", "rebuild", "--strategies", "regather"]) == 0
    text = capsys.readouterr().out
    assert "DoRA r=16" in text and "DoRA's magnitude keeps" in text and "z rebuilt in backward" in text


def _codes(setup, level=None):
    return [f.code for f in diagnose(GOOD_ENV, setup) if level is None or f.level == level]


def test_doctor_on_bridges_dora():
    """Bridge's DoRA has no re-gather option: TE's gathered output under SP whatever the strategy, and the
    per-slice norm on the row targets at TP > 1."""
    setup = Setup(peft="dora", bridge_lora=True, strategy="regather", te_version="2.18.0", spec="te")
    found = {f.code: f for f in diagnose(GOOD_ENV, setup)}
    assert found["te-ln-grad"].level == "error" and "regather.bridge.DoRA" in found["te-ln-grad"].fix
    assert found["dora-row-norm"].level == "warning" and "linear_proj, linear_fc2 at TP=2" in found["dora-row-norm"].message
    assert "recompute_dora_output=True" in found["dora-output"].fix
    assert "dora-row-norm" not in _codes(replace(setup, tp=1))
    assert "te-ln-grad" not in _codes(replace(setup, te_version="2.3.0"))


def test_doctor_on_regathers_dora():
    keep = {f.code: f for f in diagnose(GOOD_ENV, Setup(peft="dora"))}
    assert "dora-row-norm" not in keep and "te-ln-grad" not in keep and keep["dora-output"].level == "info"
    rebuilt = {f.code: f for f in diagnose(GOOD_ENV, Setup(peft="dora", recompute_dora_output=True))}
    assert "rebuilt in backward" in rebuilt["dora-output"].message and rebuilt["dora-output"].fix is None
    assert _codes(Setup(peft="dora", num_experts=4), "error") == ["dora-experts"]
    assert "dora-output" not in _codes(Setup())


def test_doctor_cli(capsys):
    assert cli.main(["doctor", "--peft", "dora", "--bridge-lora", "--te-version", "2.18"]) == 1  # an error finding
    out = capsys.readouterr().out
    assert "te-ln-grad" in out and "dora-row-norm" in out and "dora-output" in out
    assert cli.main(["doctor", "--peft", "dora", "--recompute-dora-output"]) == 0
    assert "rebuilt in backward" in capsys.readouterr().out
