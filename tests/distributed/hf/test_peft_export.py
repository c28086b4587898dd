"""HF PEFT export/import on TP=2 with GQA attention (4 heads, 2 query groups) and a gated MLP."""

import pytest
import torch
from workers_peft import peft_roundtrip

from regather import Strategy
from regather.tools.cpu.dist import run_ranks

T = 2
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
P = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    return run_ranks(peft_roundtrip, T, str(tmp_path_factory.mktemp("peft")), timeout=240)


def test_files_have_hf_names_shapes_and_config(rt):
    res = rt[0]
    shapes, config = res["file_shapes"], res["config"]
    h, r, hd = 64, 8, 16
    expect = {
        "self_attn.q_proj": (4 * hd, h), "self_attn.k_proj": (2 * hd, h), "self_attn.v_proj": (2 * hd, h),
        "self_attn.o_proj": (h, 4 * hd), "mlp.gate_proj": (96, h), "mlp.up_proj": (96, h),
        "mlp.down_proj": (h, 96),
    }
    for layer in range(2):
        for module, (o, i) in expect.items():
            assert shapes[f"{P}.{layer}.{module}.lora_A.weight"] == (r, i)
            assert shapes[f"{P}.{layer}.{module}.lora_B.weight"] == (o, r)
    assert len(shapes) == 2 * len(expect) * 2
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16
    assert config["target_modules"] == sorted(m.split(".")[1] for m in expect)
    assert config["base_model_name_or_path"] == "tiny-gpt"


def test_qkv_split_matches_megatrons_own_query_key_value(rt):
    for rank in range(T):
        for name, (got, want) in rt[rank]["qkv_check"].items():
            assert got.abs().max() > 0
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("strategy", [s.value for s in Strategy if s != Strategy.GATHER])
def test_export_is_the_same_whichever_strategy_trained(rt, strategy):
    for rank in range(T):
        ref, got = rt[rank]["exported"]["gather"], rt[rank]["exported"][strategy]
        assert sorted(ref) == sorted(got)
        for k in ref:
            if strategy == "regather":
                assert torch.equal(ref[k], got[k]), k
            else:  # same maths, other summation order: a 2-step SGD run, fp32
                torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert torch.equal(rt[0]["exported"]["gather"][f"{P}.0.self_attn.q_proj.lora_A.weight"],
                       rt[1]["exported"]["gather"][f"{P}.0.self_attn.q_proj.lora_A.weight"])


@pytest.mark.parametrize("strategy", [s.value for s in Strategy])
def test_load_into_tp_sharded_model_with_any_strategy(rt, strategy):
    for rank in range(T):
        res = rt[rank]
        assert len(res["loaded"][strategy]["paths"]) == 8
        # eval mode: every strategy runs the gather path's forward, so loading is exact
        torch.testing.assert_close(res["loaded"][strategy]["logits"], res["trained_logits"]["gather"],
                                   rtol=0, atol=0)
