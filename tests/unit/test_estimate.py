"""regather estimate: the analytic model, by hand-computed values (agreement with bench: tests/distributed)."""

import json

import pytest

from regather import cli
from dataclasses import replace

from regather.estimate import PRESETS, Model, Run, adapter_input_bytes, adapter_inputs, comm_changes, estimate

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


def test_moe_recompute_rebuilds_every_expert_fc2_input():
    """Issue 16, expert fc2: its input (act x probs) is rebuilt from what the activation and the probs
    multiply keep; fc1 keeps the dispatched tokens. Qwen3-30B-A3B TP4, seq 8192, bf16, top-8:
    s*b*k/t = 16384 routed rows per GPU and layer, fc2 input 768 wide, fc1 input 2048 wide."""
    m = PRESETS["qwen3-30b-a3b"]
    res = estimate(m, Run(tp=4, seq=S), ["gather", "regather", "regather-recompute"])
    rows = S * 8 // 4
    assert res["gather"]["adapter_input_bytes_experts_approx"] == 48 * rows * (2048 + 768) * 2
    rc = res["regather-recompute"]
    assert rc["adapter_input_bytes_experts_approx"] == 48 * rows * 2048 * 2  # fc1 only
    assert rc["recomputed_by_target"]["experts.linear_fc2"] == 48
    assert rc["kept_by_reason"]["experts.linear_fc1: expert linear_fc1: its input is the dispatched tokens, "
                                "which no op of the MoE layer keeps"] == 48
    expert_saving = 48 * rows * 768 * 2
    dense_saving = res["regather"]["saved_vs_gather"] + 47 * S * 2048 * 2 // 4  # qkv x_local, layer 0 keeps it
    assert rc["saved_vs_gather"] == dense_saving + expert_saving == 2_810_183_680
    # without fc1 and everything before it trainable, layer 0's fc1 output needs no grad: kept there
    only = estimate(m, Run(tp=4, seq=S, targets=("linear_fc2",)), ["regather-recompute"])["regather-recompute"]
    assert only["recomputed_by_target"] == {"experts.linear_fc2": 47}
    assert only["adapter_input_bytes_experts_approx"] == rows * 768 * 2


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


# -- recompute_adapter_inputs (the "-recompute" variants) ------------------------------------

X_FULL, FC2_IN = S * B * H * 2, S * B * 12288 // 2 * 2  # bf16 bytes per adapter: qkv/fc1 input, fc2 input


def test_qwen3_8b_recompute_saves_every_qkv_fc1_input_and_every_fc2_input():
    """The issue's 8.456 GB (x_full of 72 adapters + 36 fc2 inputs) when the decoder input requires
    grad; with frozen embeddings layer 0's input_layernorm keeps nothing, so its qkv keeps x_local."""
    for name in ("regather-recompute", "lowrank-recompute"):
        grad = estimate(QWEN3_8B, Run(tp=2, seq=S, input_requires_grad=True), [name])[name]
        assert grad["saved_vs_gather"] == 72 * X_FULL + 36 * FC2_IN == 8_455_716_864
        frozen = estimate(QWEN3_8B, Run(tp=2, seq=S), [name])[name]
        assert frozen["saved_vs_gather"] == 71 * X_FULL + X_FULL // 2 + 36 * FC2_IN == 8_422_162_432
        assert frozen["saved_vs_gather_frozen_input"] == frozen["saved_vs_gather"]
        assert frozen["saved_vs_gather_input_requires_grad"] == grad["saved_vs_gather"]
        assert frozen["recomputed_by_target"] == {"linear_qkv": 35, "linear_fc1": 36, "linear_fc2": 36}
        (why,) = [k for k in frozen["kept_by_reason"] if k.startswith("linear_qkv")]
        assert "input_layernorm: it keeps nothing for its backward" in why and frozen["kept_by_reason"][why] == 1
        # only linear_proj's inputs and layer 0's x_local remain
        assert frozen["adapter_input_bytes"] == 36 * S * B * 4096 // 2 * 2 + X_FULL // 2


def test_recompute_sends_what_its_strategy_sends():
    res = estimate(QWEN3_8B, Run(tp=2, seq=S))
    for name in ("gather", "regather", "lowrank"):
        assert res[name + "-recompute"]["extra_comm_bytes"] == res[name]["extra_comm_bytes"]


def test_gather_recompute_rebuilds_only_fc2():
    res = estimate(QWEN3_8B, Run(tp=2, seq=S), ["gather-recompute"])["gather-recompute"]
    assert res["saved_vs_gather"] == 36 * FC2_IN == 3_623_878_656
    assert res["recomputed_by_target"] == {"linear_fc2": 36}
    assert any("the gather path keeps its input as it is" in k for k in res["kept_by_reason"])


def test_first_layer_rule_follows_the_trainable_adapters():
    """Layer 0's producers keep a tensor only once something upstream needs a gradient."""
    m = Model("m", hidden=64, layers=2, heads=4, ffn=128)

    def recomputed(targets, **kw):
        layers = adapter_inputs(m, Run(tp=2, seq=32, micro_batch=2, dtype="float32", targets=targets, **kw),
                                "regather-recompute")
        return [{a.target: a.recomputed_from is not None for a in row} for row in layers]

    assert recomputed(("linear_fc2",)) == [{"linear_fc2": False}, {"linear_fc2": True}]
    assert recomputed(("linear_fc1", "linear_fc2")) == [{"linear_fc1": False, "linear_fc2": True},
                                                        {"linear_fc1": True, "linear_fc2": True}]
    assert recomputed(("linear_qkv",))[0] == {"linear_qkv": False}
    assert recomputed(("linear_qkv",), input_requires_grad=True)[0] == {"linear_qkv": True}
    assert recomputed(("linear_qkv",), first_stage=False)[0] == {"linear_qkv": True}  # p2p input needs grad


def test_lowrank_removes_a_dx_reduce_scatter_only_where_dx_exists():
    m = Model("m", hidden=64, layers=2, heads=4, ffn=128)
    run = Run(tp=2, seq=32, micro_batch=2, dtype="float32", targets=("linear_fc1", "linear_fc2"))
    x, mid = 32 * 2 * 64 * 4 // 2, 32 * 2 * 16 * 4 // 2
    assert estimate(m, run, ["lowrank"])["lowrank"]["extra_comm_bytes"]["reduce_scatter"] == -1 * x + 2 * mid
    grad = estimate(m, replace(run, input_requires_grad=True), ["lowrank"])["lowrank"]
    assert grad["extra_comm_bytes"]["reduce_scatter"] == -2 * x + 2 * mid


def test_no_sp_keeps_qkv_fc1_but_fc2_recomputes():
    res = estimate(QWEN3_8B, Run(tp=2, sp=False, seq=S), ["regather-recompute"])["regather-recompute"]
    assert res["recomputed_by_target"] == {"linear_fc2": 36}
    assert any("the replicated path keeps its input" in k for k in res["kept_by_reason"])


def test_unknown_variant_and_cli_report(capsys):
    with pytest.raises(ValueError, match="unknown strategy"):
        estimate(QWEN3_8B, Run(), ["bogus-recompute"])
    assert cli.main(["estimate", "--model", "qwen3-8b", "--tp", "2", "--seq", "8192"]) == 0
    out = capsys.readouterr().out
    assert "reference measured" in out and "4.731 GB" in out
    assert "[regather-recompute]" in out and "8.422 GB" in out and "8.456 GB" in out
    assert "kept: 1 x linear_qkv: input_layernorm: it keeps nothing for its backward" in out
    assert cli.main(["estimate", "--model", "qwen3-8b", "--input-requires-grad", "--json",
                     "--strategies", "regather-recompute"]) == 0
    row = json.loads(capsys.readouterr().out)["strategies"]["regather-recompute"]
    assert row["saved_vs_gather"] == 8_455_716_864
