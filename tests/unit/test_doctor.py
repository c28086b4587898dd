"""`regather doctor`: one test per finding (pure functions over an env dict and a Setup)."""

import json

import pytest

from regather import doctor
from regather.doctor import Setup, diagnose, env_findings

GOOD_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def codes(findings, level=None):
    return [f.code for f in findings if level is None or f.level == level]


def test_clean_setup_has_no_env_findings():
    assert env_findings(GOOD_ENV, Setup()) == []


@pytest.mark.parametrize("env", [{}, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"},
                                 {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}])
def test_alloc_conf_without_expandable_segments(env):
    (f,) = env_findings(env, Setup())
    assert f.code == "alloc-conf" and f.level == "warning"
    assert "expandable_segments:True" in f.fix and repr(env.get("PYTORCH_CUDA_ALLOC_CONF")) in f.message


def test_newer_alloc_conf_spelling_and_other_keys():
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"}
    assert env_findings(env, Setup()) == []


@pytest.mark.parametrize("how", ["flag", "env"])
def test_expandable_segments_with_nccl_ub(how):
    env = dict(GOOD_ENV, **({"NCCL_UB": "1"} if how == "env" else {}))
    (f,) = env_findings(env, Setup(use_nccl_ub=how == "flag"))
    assert f.code == "nccl-ub" and f.level == "error" and "--use-nccl-ub" in f.fix


def test_nccl_ub_without_expandable_segments_is_fine():
    assert env_findings({}, Setup(use_nccl_ub=True)) == []


@pytest.mark.parametrize("value,bad", [(None, True), ("1", True), ("0", False)])
def test_cuda_graphs_with_expandable_segments_need_graph_register_off(value, bad):
    env = dict(GOOD_ENV, **({"NCCL_GRAPH_REGISTER": value} if value is not None else {}))
    found = env_findings(env, Setup(cuda_graphs=True))
    assert codes(found) == (["cuda-graph-register"] if bad else [])
    if bad:
        assert found[0].fix == "export NCCL_GRAPH_REGISTER=0" and repr(value) in found[0].message


def test_cpu_offloading_with_pipeline_parallelism():
    (f,) = env_findings(GOOD_ENV, Setup(cpu_offloading=True, pp=4))
    assert f.code == "cpu-offload-pp" and f.level == "error" and "pipeline_model_parallel_size=4" in f.message
    assert env_findings(GOOD_ENV, Setup(cpu_offloading=True, pp=1)) == []


def test_adapter_decisions_and_saving():
    s = Setup(layers=2, hidden=64, seq=32, micro_batch=2, tp=2, dtype="bfloat16")
    found = diagnose(GOOD_ENV, s)
    adapters = [f for f in found if f.code == "adapter"]
    assert len(adapters) == 8
    local = [f for f in adapters if f.message.endswith(": regather")]
    assert sorted(f.message.split(":")[0].rsplit(".", 1)[-1] for f in local) == ["linear_fc1", "linear_fc1",
                                                                                 "linear_qkv", "linear_qkv"]
    row = [f for f in adapters if "row-parallel" in f.message]
    assert len(row) == 4 and all(f.level == "info" for f in row)  # by design: not a warning
    (saving,) = [f for f in found if f.code == "saving"]
    per = 32 * 2 * 64 * 2 // 2  # s*b*h*e*(t-1)/t
    assert f"{4 * per:,} bytes" in saving.message and f"4 re-gathering adapter(s) x {per:,}" in saving.message


def test_selective_mlp_recompute_falls_back_with_a_fix():
    s = Setup(recompute_granularity="selective", recompute_modules=("core_attn", "mlp"))
    found = [f for f in diagnose(GOOD_ENV, s) if f.code == "adapter" and "linear_fc1" in f.message]
    assert found and all(f.level == "warning" and "mlp" in f.message and f.fix for f in found)


def test_full_recompute_and_cuda_graphs_make_every_adapter_fall_back():
    for s in (Setup(recompute_granularity="full", recompute_method="uniform"), Setup(cuda_graphs=True)):
        found = diagnose(GOOD_ENV, s)
        assert not any(f.message.endswith(": regather") for f in found if f.code == "adapter")
        assert "0 re-gathering" in [f for f in found if f.code == "saving"][0].message


def test_gather_strategy_suggests_regather_and_tp1_says_no_effect():
    assert "regather-off" in codes(diagnose(GOOD_ENV, Setup(strategy="gather")), "warning")
    assert "regather-no-effect" in codes(diagnose(GOOD_ENV, Setup(tp=1)))
    assert "regather-no-effect" in codes(diagnose(GOOD_ENV, Setup(sp=False)))


def test_estimate_api_is_used_when_present():
    per, how = doctor.per_adapter_saving(Setup(seq=8192, micro_batch=1, hidden=4096, tp=2, dtype="bfloat16"))
    assert per == 8192 * 4096 * 2 // 2 and "regather.estimate" in how


def test_cli_json_and_exit_code(capsys, monkeypatch):
    from regather.cli import main

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert main(["doctor", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["tp"] == 2 and any(f["code"] == "saving" for f in out["findings"])
    assert main(["doctor", "--cpu-offloading", "--pp", "2"]) == 1
    assert "cpu-offload-pp" in capsys.readouterr().out
    with pytest.raises(ValueError, match="'bogus'"):
        main(["doctor", "--strategy", "bogus"])


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_built_model_decisions_agree_with_the_rules():
    s = Setup(layers=1, recompute_granularity="selective", recompute_modules=("mlp",))
    built = doctor.built_decisions(s, timeout=150)
    assert built == doctor.analytic_decisions(s)


# -- recompute_adapter_inputs ------------------------------------------------------------------

NOTHING_KEPT = "it keeps nothing for its backward (neither its input nor its weights need a gradient)"


def _adapter_lines(setup):
    return {f.message.split(":", 1)[0]: f for f in diagnose(GOOD_ENV, setup) if f.code == "adapter"}


def test_recompute_rules_layer0_qkv_keeps_its_input_with_frozen_embeddings():
    d = doctor.analytic_decisions(Setup(recompute_adapter_inputs=True))
    assert d["decoder.layers.0.self_attention.linear_qkv"]["recompute"] is None
    assert d["decoder.layers.0.self_attention.linear_qkv"]["recompute_reason"] == f"input_layernorm: {NOTHING_KEPT}"
    assert d["decoder.layers.1.self_attention.linear_qkv"]["recompute"] == "input_layernorm"
    assert d["decoder.layers.0.mlp.linear_fc1"]["recompute"] == "pre_mlp_layernorm"
    assert all(d[f"decoder.layers.{i}.mlp.linear_fc2"]["recompute"] == "the MLP activation (gelu)" for i in (0, 1))
    assert "no recomputable producer" in d["decoder.layers.0.self_attention.linear_proj"]["recompute_reason"]
    lines = _adapter_lines(Setup(recompute_adapter_inputs=True))
    qkv0 = lines["decoder.layers.0.self_attention.linear_qkv"]
    assert qkv0.level == "info" and "input kept (recompute asked: input_layernorm" in qkv0.message
    assert "requires grad" in qkv0.fix
    assert lines["decoder.layers.1.self_attention.linear_qkv"].message.endswith(
        ": regather, input recomputed from input_layernorm")
    grad = doctor.analytic_decisions(Setup(recompute_adapter_inputs=True, input_requires_grad=True))
    assert grad["decoder.layers.0.self_attention.linear_qkv"]["recompute"] == "input_layernorm"


def test_recompute_saving_line_counts_x_local_and_fc2_inputs():
    s = Setup(recompute_adapter_inputs=True, layers=2, hidden=64, ffn=128, seq=32, micro_batch=2, tp=2,
              dtype="bfloat16")
    (saving,) = [f for f in diagnose(GOOD_ENV, s) if f.code == "saving"]
    x_local, fc2 = 32 * 2 * 64 // 2 * 2, 32 * 2 * 128 // 2 * 2
    total = 4 * x_local + 3 * x_local + 2 * fc2  # re-gather 4, recompute 3 qkv/fc1 (not layer 0's qkv), 2 fc2
    assert f"{total:,} bytes" in saving.message
    assert f"3 recomputed qkv/fc1 input(s) x {x_local:,}" in saving.message
    assert f"2 recomputed fc2 input(s) x {fc2:,}" in saving.message


def test_recompute_on_gather_only_fc2_and_the_reasons():
    d = doctor.analytic_decisions(Setup(recompute_adapter_inputs=True, strategy="gather"))
    assert d["decoder.layers.1.self_attention.linear_qkv"]["recompute_reason"].startswith(
        "the gather path keeps its input as it is")
    assert d["decoder.layers.1.mlp.linear_fc2"]["recompute"] == "the MLP activation (gelu)"
    nosp = doctor.analytic_decisions(Setup(recompute_adapter_inputs=True, sp=False))
    assert nosp["decoder.layers.1.mlp.linear_fc1"]["recompute_reason"].startswith("the replicated path")
    assert nosp["decoder.layers.1.mlp.linear_fc2"]["recompute"] == "the MLP activation (gelu)"


def test_recompute_fallbacks_from_checkpointing_and_activations():
    full = doctor.analytic_decisions(Setup(recompute_adapter_inputs=True, recompute_granularity="full"))
    assert full["decoder.layers.1.mlp.linear_fc2"]["recompute_reason"].startswith("running inside activation")
    assert "full-recompute-frozen-input" in codes(diagnose(GOOD_ENV, Setup(recompute_granularity="full")), "warning")
    ln = doctor.analytic_decisions(Setup(recompute_adapter_inputs=True, recompute_granularity="selective",
                                         recompute_modules=("layernorm",)))
    assert ln["decoder.layers.1.self_attention.linear_qkv"]["recompute_reason"] == \
        "selective recompute covers 'layernorm' (recompute_modules=['layernorm'])"
    assert _adapter_lines(Setup(recompute_adapter_inputs=True, recompute_granularity="selective",
                                recompute_modules=("layernorm",)))[
        "decoder.layers.1.self_attention.linear_qkv"].level == "warning"
    gated = doctor.analytic_decisions(Setup(recompute_adapter_inputs=True, activation="swiglu"))
    assert gated["decoder.layers.1.mlp.linear_fc2"]["recompute"] == "the MLP activation (silu, gated)"
    nobias = doctor.analytic_decisions(Setup(recompute_adapter_inputs=True, activation="swiglu", add_bias_linear=False))
    assert nobias["decoder.layers.1.mlp.linear_fc2"]["recompute"] == "the MLP activation (silu, gated)"


def test_decisions_without_recompute_have_no_recompute_part():
    d = doctor.analytic_decisions(Setup())
    assert all(v["recompute"] is None and v["recompute_reason"] is None for v in d.values())
    assert all("input kept" not in f.message and "input recomputed" not in f.message
               for f in diagnose(GOOD_ENV, Setup()) if f.code == "adapter")


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
    for path, d in built.items():
        d.pop("recompute_reason_from_rules", None)
    assert built == doctor.analytic_decisions(s)


def test_moe_recompute_rules_expert_fc1_kept_fc2_rebuilt():
    """Issue 16: an expert fc1 keeps the dispatched tokens, an expert fc2 rebuilds act x probs
    (SequentialMLP's expert MLP, or TEGroupedMLP's activation); the MoE runs in tests/distributed/
    test_moe.py check these sentences against the adapters' own decisions."""
    from regather.eligibility import IN_CHECKPOINT
    from regather.producers import EXPERT_INPUT_KEPT

    seq = doctor.analytic_decisions(Setup(moe=True, recompute_adapter_inputs=True))
    grouped = doctor.analytic_decisions(Setup(moe=True, experts="grouped", recompute_adapter_inputs=True,
                                              activation="swiglu"))
    for layer in (0, 1):
        for d in (seq, grouped):
            assert d[f"decoder.layers.{layer}.mlp.linear_fc1"]["recompute_reason"] == EXPERT_INPUT_KEPT
        assert seq[f"decoder.layers.{layer}.mlp.linear_fc2"]["recompute"] == "the MLP activation (gelu)"
        assert grouped[f"decoder.layers.{layer}.mlp.linear_fc2"]["recompute"] == \
            "the grouped experts' activation (silu, gated)"
    act = doctor.analytic_decisions(Setup(moe=True, experts="grouped", recompute_adapter_inputs=True,
                                          recompute_granularity="selective", recompute_modules=("moe_act",)))
    assert "'moe_act' in recompute_modules" in act["decoder.layers.0.mlp.linear_fc2"]["recompute_reason"]
    moe = doctor.analytic_decisions(Setup(moe=True, recompute_adapter_inputs=True,
                                          recompute_granularity="selective", recompute_modules=("moe",)))
    assert moe["decoder.layers.1.mlp.linear_fc2"]["recompute_reason"] == IN_CHECKPOINT
    only_fc2 = doctor.analytic_decisions(Setup(moe=True, recompute_adapter_inputs=True, targets=("linear_fc2",)))
    assert "keeps nothing" in only_fc2["decoder.layers.0.mlp.linear_fc2"]["recompute_reason"]
    assert only_fc2["decoder.layers.1.mlp.linear_fc2"]["recompute"] == "the MLP activation (gelu)"
    line = str(doctor.saving_finding(Setup(moe=True, recompute_adapter_inputs=True), seq))
    assert "2 expert fc2 adapter(s) also recompute their input" in line
