"""regather estimate: the analytic model, by hand-computed values (agreement with bench: tests/distributed)."""

import json

import pytest

from regather import cli
from regather.estimate import PRESETS, Model, Run, adapter_input_bytes, comm_changes, estimate

QWEN3_8B = PRESETS["qwen3-8b"]
S, B, H = 8192, 1, 4096


def test_qwen3_8b_tp2_saving_is_half_the_gathered_inputs():
    res = estimate(QWEN3_8B, Run(tp=2, seq=S, micro_batch=B, dtype="bfloat16"))
    per_adapter = S * B * H * 2  # bytes of x_full
    assert res["gather"]["saved_vs_gather"] == 0
    for name in ("regather", "lowrank"):
        assert res[name]["saved_vs_gather"] == 72 * per_adapter // 2  # 36 layers x (qkv, fc1), shard kept
    assert res["regather"]["extra_comm_bytes"] == {"all_gather": 72 * per_adapter // 2}


def test_lowrank_adds_under_one_percent_of_regathers_communication():
    run = Run(tp=2, seq=S, lora_rank=16)
    res = estimate(QWEN3_8B, run)
    r, f = 16, 1 / 2
    added = 72 * (S * r * 2 * f + 2 * r * H * 2 * f)  # reduce-scatter dmid + all-reduce dA
    assert res["lowrank"]["added_comm_bytes"] == added
    assert res["lowrank"]["added_comm_bytes"] <= 0.01 * res["regather"]["added_comm_bytes"]
    assert res["lowrank"]["extra_comm_total"] < 0  # it removes the two s*b*h collectives


def test_lowrank_changes_by_kind():
    m = Model("m", hidden=64, layers=1, heads=4, ffn=128)
    run = Run(tp=4, seq=32, micro_batch=2, dtype="float32", grad_dtype="float32", lora_rank=8,
              targets=("linear_qkv",), first_stage=False)
    changes = {(k, what): n for k, n, what in comm_changes(m, run, "lowrank")}
    x, mid = 32 * 2 * 64 * 4 * 3 // 4, 32 * 2 * 8 * 4 * 3 // 4
    assert sorted(changes.values()) == sorted([-x, -x, -2 * mid, mid, 2 * (8 * 64 * 4 * 3 // 4)])


def test_no_saving_without_sequence_parallelism_or_at_tp1():
    for run in (Run(tp=2, sp=False), Run(tp=1)):
        res = estimate(QWEN3_8B, run)
        assert res["regather"]["saved_vs_gather"] == 0 and res["regather"]["extra_comm_bytes"] == {}


def test_moe_experts_never_regather():
    m = PRESETS["qwen3-30b-a3b"]
    res = estimate(m, Run(tp=4, seq=S))
    assert res["regather"]["saved_vs_gather"] == 48 * S * 2048 * 2 * 3 // 4  # qkv only
    assert res["regather"]["adapter_input_bytes_experts_approx"] == res["gather"]["adapter_input_bytes_experts_approx"] > 0
    assert m.attn_width == 4096  # head_dim 128 x 32 heads: proj input wider than h


def test_in_flight_and_pipeline_scale_the_bytes():
    one = adapter_input_bytes(QWEN3_8B, Run(), "regather")
    more = adapter_input_bytes(QWEN3_8B, Run(in_flight=3, pp=4), "regather")
    assert {k: v * 3 // 4 for k, v in one.items()} == more


def test_cli_json_and_custom_sizes(capsys):
    assert cli.main(["estimate", "--model", "llama3-70b", "--layers", "4", "--seq", "1024", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["layers"] == 4 and out["model"]["hidden"] == 8192
    assert out["strategies"]["regather"]["saved_vs_gather"] == 4 * 2 * 1024 * 8192 * 2 // 2
    assert cli.main(["estimate", "--model", "qwen3-8b"]) == 0
    assert "saved vs gather" in capsys.readouterr().out


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="not divisible"):
        adapter_input_bytes(QWEN3_8B, Run(tp=3, seq=8192), "gather")
    with pytest.raises(ValueError, match="pipeline"):
        adapter_input_bytes(QWEN3_8B, Run(pp=5), "gather")
