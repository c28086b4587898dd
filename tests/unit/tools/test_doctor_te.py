"""`regather doctor`'s Transformer Engine rule (te-ln-grad): Bridge's own LoRA asking TE >= 2.4 for its
gathered LayerNorm output under SP (regather.tools.doctor.te_gradient)."""

import json

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
