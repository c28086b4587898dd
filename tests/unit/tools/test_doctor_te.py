"""`regather doctor`'s Transformer Engine rule (te-ln-grad): Bridge's own LoRA asking TE >= 2.4 for its
gathered LayerNorm output under SP (regather.tools.doctor.te_gradient)."""

import json
from types import SimpleNamespace

import pytest

from regather.tools.doctor import Setup, diagnose
from regather.tools.doctor.te_gradient import te_gradient_finding

GOOD_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@pytest.mark.parametrize("version", ["2.4.0", "2.18.0+e7c550c5", "2.20.2"])
def test_bridge_lora_on_te_from_2_4_under_sp_is_an_error(version):
    f = te_gradient_finding(Setup(bridge_lora=True, strategy="gather", te_version=version))
    assert f.code == "te-ln-grad" and f.level == "error"
    assert f"Transformer Engine {version} drops that output's gradient" in f.message
    assert "regather.bridge.LoRA" in f.fix and "sequence_parallel_input_regather=True" in f.fix


@pytest.mark.parametrize("setup", [
    Setup(bridge_lora=True, strategy="gather", te_version="2.3.0"),    # TE <= 2.3 adds it
    Setup(bridge_lora=True, strategy="regather", te_version="2.18.0"),  # Bridge's re-gather: the local output
    Setup(bridge_lora=True, strategy="gather", te_version="2.18.0", sp=False),
    Setup(bridge_lora=True, strategy="gather", te_version="2.18.0", tp=1),
    Setup(bridge_lora=False, strategy="gather", te_version="2.18.0"),  # regather's LoRA never asks
])
def test_no_finding_where_the_gradient_arrives(setup):
    assert te_gradient_finding(setup) is None


def test_unknown_te_version_is_a_warning():
    f = te_gradient_finding(Setup(bridge_lora=True, strategy="gather", te_version=None))
    assert f.level == "warning" and "--te-version" in f.message


def test_diagnose_and_cli(capsys, monkeypatch):
    found = diagnose(GOOD_ENV, Setup(bridge_lora=True, strategy="gather", te_version="2.18.0"))
    assert [f.code for f in found if f.level == "error"] == ["te-ln-grad"]
    from regather.tools.cli import main

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    rc = main(["doctor", "--bridge-lora", "--strategy", "gather", "--te-version", "2.18.0", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["setup"]["te_version"] == "2.18.0"
    assert [f["code"] for f in out["findings"] if f["level"] == "error"] == ["te-ln-grad"]
    assert main(["doctor", "--bridge-lora", "--strategy", "regather", "--te-version", "2.18.0"]) == 0


# -- the release of TE's ln_out under recompute_adapter_inputs: the run's own rule --------------------------


TE_RC = dict(spec="te", recompute_adapter_inputs=True, tp=2, seq=64, hidden=64, ffn=128, layers=2,
             attention_keeps_output=True)


def _qkv_fc1(decisions: dict) -> list[dict]:
    return [d for p, d in decisions.items() if p.endswith(("linear_qkv", "linear_fc1")) and ".layers.1." in p]


def test_doctor_and_estimate_decide_the_release_by_the_runs_rule(monkeypatch):
    """One function: doctor's decisions, estimate's rows and the run's TE producer all answer with
    ``te_rule.release_reason`` — replaced here, all three say what it says."""
    from regather.megatron.dense import te_rule
    from regather.tools.doctor.rules import analytic_decisions
    from regather.tools.estimate import PRESETS, Run, adapter_inputs

    read = analytic_decisions(Setup(**TE_RC, te_version="2.20.2"))
    assert all(d["recompute"] == "the fused LayerNorm of the TE base" for d in _qkv_fc1(read))
    monkeypatch.setattr(te_rule, "release_reason", lambda facts: f"refused for {facts.version}")
    refused = analytic_decisions(Setup(**TE_RC, te_version="2.20.2"))
    assert all(d["recompute"] is None and d["recompute_reason"] == "refused for 2.20.2" for d in _qkv_fc1(refused))
    rows = adapter_inputs(PRESETS["qwen3-8b"], Run(tp=2, seq=8192, spec="te"), "regather-recompute")
    assert {a.kept_because for a in rows[1] if a.target in ("linear_qkv", "linear_fc1")} == {"refused for 2.20.2"}
    base = SimpleNamespace(weight=None, config=None)
    assert te_rule.unsupported_reason(base, "2.20.2") == "refused for 2.20.2"  # what TELayerNormProducer asks


@pytest.mark.parametrize("version,kept", [("2.20.2", False), ("2.19.0", False), ("2.3.0", False), ("2.21.0", True),
                                          ("2.2.1", True)])
def test_doctor_keeps_te_ln_out_outside_the_versions_read(version, kept):
    """Outside the versions read qkv / fc1 keep their input — TE's ln_out — with the rule's reason, and the
    saving is estimate's for that version, smaller than where the release applies."""
    from regather.megatron.dense.te_rule import ReleaseFacts, release_reason
    from regather.tools.doctor.rules import analytic_decisions
    from regather.tools.doctor.summary import summary

    setup = Setup(**TE_RC, te_version=version)
    decisions = analytic_decisions(setup)
    summ = summary(setup, decisions)
    assert summ["saved"] == summ["estimate"]["saved"]
    why = release_reason(ReleaseFacts(version=version))
    assert summ["te_release"] == {"version": version, "assumed": False, "refused": why}
    if kept:
        assert why.startswith("TE's ln_out is kept: Transformer Engine") and "outside the versions read (2.3 to 2.20)" in why
        assert all(d["recompute_reason"] == why for d in _qkv_fc1(decisions))
        read = Setup(**TE_RC, te_version="2.20.2")
        assert summ["saved"] < summary(read, analytic_decisions(read))["saved"]
    else:
        assert why is None and all(d["recompute"] for d in _qkv_fc1(decisions))


def test_doctor_assumes_the_newest_version_read_when_none_is_known():
    from regather.tools.doctor.rules import analytic_decisions
    from regather.tools.doctor.summary import lines, summary

    setup = Setup(**TE_RC)
    summ = summary(setup, analytic_decisions(setup))
    assert summ["te_release"] == {"version": "2.20.2", "assumed": True, "refused": None}
    assert any("Transformer Engine 2.20.2 (none given or installed: the newest read, assumed" in line
               for line in lines(setup, summ))
    offload = Setup(**TE_RC, cpu_offloading=True)  # megatron's CPU offload: the run's rule refuses it too
    assert "CPU offload (cpu_offloading=True)" in summary(offload, analytic_decisions(offload))["te_release"]["refused"]
