"""Hugging Face PEFT export of a torchtitan model (regather.hf.export_peft on a model with regather's
torchtitan LoRAConverter; torchtitan has no such export) against real peft 0.21.2 and transformers
5.24.0 on CPU: torchtitan's llama3 debugmodel (2 layers) at TP2 + SP, one spawn
(workers_titan_peft_hf.titan_hf_suite).

Tolerance, fp32 logits (magnitude ~3.8): 1e-5 absolute. The two sides compute the same function with
other kernels (TP partial sums, a fused wqkv GEMM, torchtitan's complex rope against HF's
rotate_half); measured 1.5e-6 for the base model and with the adapter, while a wrong convention is
far above it (q_proj's LoRA-B left in torchtitan's rope layout: 0.42).
"""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from regather.tools.cpu import torchtitan_models

if torchtitan_models.missing():
    pytest.skip(torchtitan_models.missing(), allow_module_level=True)
pytest.importorskip("peft")
pytest.importorskip("transformers")

import workers_titan_peft_hf as W

from regather.tools.cpu.dist import run_ranks

TOL = 1e-5
KEY_WARNING_WORDS = ("missing", "unexpected", "not found", "were not used", "newly initialized")
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return run_ranks(W.titan_hf_suite, 2, str(tmp_path_factory.mktemp("titan_peft")), timeout=240)


def _diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_base_weights_through_torchtitans_adapter_give_torchtitans_logits(suite):
    r0 = suite[0]
    assert r0["missing"] == ([], [])
    for res in suite:
        assert _diff(res["titan_base"], r0["hf_base"]) <= TOL


def test_export_loads_in_peft_with_torchtitans_logits(suite):
    r0 = suite[0]
    for res in suite:
        assert _diff(res["titan_lora"], r0["peft"]) <= TOL
    assert _diff(r0["peft"], r0["hf_base"]) > 0.5  # the adapter changes the model
    assert _diff(r0["peft_unpermuted"], r0["titan_lora"]) > 0.1  # the rope permutation is seen
    for w in r0["warnings"]:
        assert not any(word in w.lower() for word in KEY_WARNING_WORDS), w


def test_export_names_and_config(suite):
    r0 = suite[0]
    config = r0["config"]
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (8, 16, False)
    assert len(r0["keys"]) == 2 * 7 * 2  # 2 layers x 7 HF modules x (A, B)
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in r0["keys"]
