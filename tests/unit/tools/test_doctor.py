"""`regather doctor`: one test per finding (pure functions over an env dict and a Setup)."""

import json

import pytest

from regather.tools import doctor
from regather.tools.doctor import Setup, diagnose, env_findings

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
    per = 32 * 2 * 64 * 2 // 2  # s*b*h*e*(t-1)/t: the local spec keeps x_local beside nothing
    assert f"saved per GPU: {4 * per:,} bytes" in saving.message
    assert f"linear_qkv {2 * per:,} (2 adapter(s)), linear_fc1 {2 * per:,} (2 adapter(s))" in saving.message


def test_selective_mlp_recompute_falls_back_with_a_fix():
    s = Setup(recompute_granularity="selective", recompute_modules=("core_attn", "mlp"))
    found = [f for f in diagnose(GOOD_ENV, s) if f.code == "adapter" and "linear_fc1" in f.message]
    assert found and all(f.level == "warning" and "mlp" in f.message and f.fix for f in found)


def test_full_recompute_and_cuda_graphs_make_every_adapter_fall_back():
    for s in (Setup(recompute_granularity="full", recompute_method="uniform"), Setup(cuda_graphs=True)):
        found = diagnose(GOOD_ENV, s)
        assert not any(f.message.endswith(": regather") for f in found if f.code == "adapter")
        assert "saved per GPU: 0 bytes, of" in next(f for f in found if f.code == "saving").message


def test_gather_strategy_suggests_regather_and_tp1_says_no_effect():
    assert "regather-off" in codes(diagnose(GOOD_ENV, Setup(strategy="gather")), "warning")
    assert "regather-no-effect" in codes(diagnose(GOOD_ENV, Setup(tp=1)))
    assert "regather-no-effect" in codes(diagnose(GOOD_ENV, Setup(sp=False)))


@pytest.mark.parametrize("spec,freed", [("local", 8192 * 4096 * 2 // 2), ("te", 8192 * 4096 * 2)])
def test_each_adapter_reads_estimates_row(spec, freed):
    """A re-gathering qkv adapter frees x_full - x_local on the local spec and the whole gathered x_full on
    TE's (LayerNormLinear keeps the shard for LoRA-A anyway: regather.tools.estimate.spec)."""
    setup = Setup(seq=8192, micro_batch=1, hidden=4096, tp=2, dtype="bfloat16", spec=spec)
    per = doctor.dense_bytes(setup, doctor.analytic_decisions(setup))
    gather, kept = per["decoder.layers.1.self_attention.linear_qkv"]
    assert gather - kept == freed


def test_cli_json_and_exit_code(capsys, monkeypatch):
    from regather.tools.cli import main

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert main(["doctor", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["tp"] == 2 and any(f["code"] == "saving" for f in out["findings"])
    assert main(["doctor", "--cpu-offloading", "--pp", "2"]) == 1
    assert "cpu-offload-pp" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        main(["doctor", "--strategy", "bogus"])
    assert refused.value.code == 2 and "'bogus'" in capsys.readouterr().err


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
    assert f"saved per GPU: {total:,} bytes" in saving.message
    # layer 0's qkv re-gathers (x_local) but keeps its input; layer 1's frees x_full = 2 x_local
    assert f"linear_qkv {3 * x_local:,} (2 adapter(s)), linear_fc1 {4 * x_local:,} (2 adapter(s)), " \
           f"linear_fc2 {2 * fc2:,} (2 adapter(s))" in saving.message


def test_recompute_on_gather_only_fc2_and_the_reasons():
    d = doctor.analytic_decisions(Setup(recompute_adapter_inputs=True, strategy="gather"))
    assert d["decoder.layers.1.self_attention.linear_qkv"]["recompute_reason"].startswith(
        "the gather path keeps its input as it is")
    assert d["decoder.layers.1.mlp.linear_fc2"]["recompute"] == "the MLP activation (gelu)"
    nosp = doctor.analytic_decisions(Setup(recompute_adapter_inputs=True, sp=False))
    # TP = 1 / SP off: the replicated path rebuilds qkv / fc1 from the norm, whatever the strategy
    assert nosp["decoder.layers.1.mlp.linear_fc1"]["recompute"] == "pre_mlp_layernorm"
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


def test_moe_recompute_rules_expert_fc1_from_the_router_fc2_rebuilt():
    """Issue 16: an expert fc1 input comes from the router's input — a shared grouped LoRA-A runs
    before the dispatch, a per-expert one (SequentialMLP) needs the re-dispatch opt-in; an expert fc2
    rebuilds act x probs (SequentialMLP's expert MLP, or TEGroupedMLP's activation). The MoE runs in
    tests/distributed/megatron/moe/test_moe.py check these sentences against the adapters' own decisions."""
    from regather.megatron.dense.eligibility import IN_CHECKPOINT
    from regather.megatron.moe.inputs import PREDISPATCH, REDISPATCH_OPT_IN

    seq = doctor.analytic_decisions(Setup(num_experts=4, recompute_adapter_inputs=True))
    grouped = doctor.analytic_decisions(Setup(num_experts=4, experts="grouped", recompute_adapter_inputs=True,
                                              activation="swiglu"))
    for layer in (0, 1):
        assert seq[f"decoder.layers.{layer}.mlp.linear_fc1"]["recompute_reason"] == REDISPATCH_OPT_IN
        assert grouped[f"decoder.layers.{layer}.mlp.linear_fc1"]["recompute"] == PREDISPATCH
        assert seq[f"decoder.layers.{layer}.mlp.linear_fc2"]["recompute"] == "the MLP activation (gelu)"
        assert grouped[f"decoder.layers.{layer}.mlp.linear_fc2"]["recompute"] == \
            "the grouped experts' activation (silu, gated)"
    act = doctor.analytic_decisions(Setup(num_experts=4, experts="grouped", recompute_adapter_inputs=True,
                                          recompute_granularity="selective", recompute_modules=("moe_act",)))
    assert "'moe_act' in recompute_modules" in act["decoder.layers.0.mlp.linear_fc2"]["recompute_reason"]
    moe = doctor.analytic_decisions(Setup(num_experts=4, recompute_adapter_inputs=True,
                                          recompute_granularity="selective", recompute_modules=("moe",)))
    assert moe["decoder.layers.1.mlp.linear_fc2"]["recompute_reason"] == IN_CHECKPOINT
    # selective 'mlp' does not checkpoint MoE layers (megatron's TransformerLayer skips them): experts
    # still rebuild their inputs, as the adapters decide (eligibility.checkpointed_by_config(expert=True))
    mlp = doctor.analytic_decisions(Setup(num_experts=4, experts="grouped", recompute_adapter_inputs=True,
                                          recompute_granularity="selective", recompute_modules=("mlp",)))
    assert mlp["decoder.layers.1.mlp.linear_fc1"]["recompute"] == PREDISPATCH
    assert mlp["decoder.layers.1.mlp.linear_fc2"]["recompute"] == "the grouped experts' activation (gelu)"
    only_fc2 = doctor.analytic_decisions(Setup(num_experts=4, recompute_adapter_inputs=True, targets=("linear_fc2",)))
    assert "keeps nothing" in only_fc2["decoder.layers.0.mlp.linear_fc2"]["recompute_reason"]
    assert only_fc2["decoder.layers.1.mlp.linear_fc2"]["recompute"] == "the MLP activation (gelu)"
    line = str(doctor.saving_finding(Setup(num_experts=4, recompute_adapter_inputs=True), seq))
    assert "0 MoE layer(s) of expert fc1 inputs" in line and "+ 2 of expert fc2 inputs" in line


def _fc1(setup, layer=1):
    d = doctor.analytic_decisions(setup)[f"decoder.layers.{layer}.mlp.linear_fc1"]
    return d["recompute"], d["recompute_reason"]


MOE_RC = Setup(num_experts=4, recompute_adapter_inputs=True, ep=2)


def test_expert_fc1_rules_in_the_adapters_order():
    """Per-expert without the opt-in first (no producer is attached), then megatron's checkpoint, then the
    MoE layer's configuration (expert_inputs.static_reason), then the router's input needing grad."""
    from dataclasses import replace

    from regather.megatron.dense.eligibility import IN_CHECKPOINT
    from regather.megatron.moe.inputs import PREDISPATCH, REDISPATCH, REDISPATCH_OPT_IN
    from regather.tools.estimate import ROUTER_KEEPS_NOTHING

    grouped = replace(MOE_RC, experts="grouped")
    assert _fc1(grouped) == (PREDISPATCH, None)
    assert _fc1(replace(grouped, share_expert_adapters=False)) == (None, REDISPATCH_OPT_IN)
    assert _fc1(replace(grouped, share_expert_adapters=False, redispatch_expert_inputs=True)) == (REDISPATCH, None)
    assert _fc1(replace(MOE_RC, redispatch_expert_inputs=True)) == (REDISPATCH, None)  # SequentialMLP
    assert _fc1(replace(MOE_RC, share_expert_adapters=True)) == (None, REDISPATCH_OPT_IN)  # always per expert
    full = dict(recompute_granularity="full", recompute_method="uniform")
    assert _fc1(replace(MOE_RC, **full)) == (None, REDISPATCH_OPT_IN)  # the opt-in comes first
    assert _fc1(replace(grouped, **full)) == (None, IN_CHECKPOINT)
    assert _fc1(replace(grouped, recompute_granularity="selective", recompute_modules=("moe",))) == \
        (None, IN_CHECKPOINT)
    flex = _fc1(replace(grouped, dispatcher="flex"))[1]
    assert flex.startswith("the 'flex' token dispatcher") and "cannot be replayed" in flex
    assert _fc1(replace(grouped, cpu_offloading=True)) == \
        (None, "CPU activation offloading is on (cpu_offloading=True)")
    experts_only = replace(grouped, targets=("linear_fc1", "linear_fc2"))  # layer 0's router input: no grad
    assert _fc1(experts_only, 0) == (None, ROUTER_KEEPS_NOTHING) and _fc1(experts_only, 1) == (PREDISPATCH, None)
    assert _fc1(replace(experts_only, input_requires_grad=True), 0) == (PREDISPATCH, None)
    with pytest.raises(ValueError, match="'deepep'"):
        _fc1(replace(grouped, dispatcher="deepep"))


@pytest.mark.parametrize("kw", [dict(), dict(redispatch_expert_inputs=True), dict(experts="grouped"),
                                dict(experts="grouped", share_expert_adapters=False),
                                dict(experts="grouped", targets=("linear_fc1", "linear_fc2")),
                                dict(targets=("linear_fc1",), redispatch_expert_inputs=True, input_requires_grad=True)])
def test_expert_fc1_rules_agree_with_estimate(kw):
    from dataclasses import replace

    from regather.tools.estimate import expert_inputs

    setup = replace(MOE_RC, **kw)
    model, run = doctor.expert_estimate(setup)
    want = [next((a.recomputed_from, a.kept_because) for a in row if a.target == "experts.linear_fc1")
            for row in expert_inputs(model, run, "regather-recompute")]
    assert [_fc1(setup, layer) for layer in range(setup.layers)] == want


def test_redispatch_available_finding():
    """SequentialMLP experts without the opt-in: each MoE layer keeps R*h*e; re-dispatching costs one
    more all-to-all of the tokens per layer in backward. Here T = s*b/t = 32*2/2 = 32 tokens, top-2,
    ETP 1: R = 64 rows, h = 64, bf16: R*h*e = 8,192 bytes per layer, 2 layers; all-to-all over EP 2:
    T*k*h*e*(p-1)/p = 4,096 bytes per layer."""
    from dataclasses import replace

    (f,) = [f for f in diagnose(GOOD_ENV, MOE_RC) if f.code == "redispatch-available"]
    assert f.level == "info" and "redispatch_expert_inputs=True" in f.fix
    assert "2 per-expert linear_fc1 adapter(s) in 2 MoE layer(s)" in f.message
    assert f"free {2 * 8192:,} bytes per GPU" in f.message and f"all_to_all {2 * 4096:,}" in f.message
    for setup in (replace(MOE_RC, redispatch_expert_inputs=True), replace(MOE_RC, experts="grouped"),
                  replace(MOE_RC, dispatcher="flex"),  # re-dispatch would be refused too: nothing to gain
                  replace(MOE_RC, recompute_granularity="full", recompute_method="uniform"),
                  replace(MOE_RC, recompute_adapter_inputs=False)):
        assert "redispatch-available" not in codes(diagnose(GOOD_ENV, setup)), setup
    # only layer 1 would gain where layer 0's router input needs no grad
    (one,) = [f for f in diagnose(GOOD_ENV, replace(MOE_RC, targets=("linear_fc1", "linear_fc2")))
              if f.code == "redispatch-available"]
    assert "in 1 MoE layer(s)" in one.message and f"free {8192:,} bytes" in one.message


def test_saving_counts_expert_adapters_exactly():
    """Grouped experts with a shared LoRA-A: every expert fc1 and fc2 input is rebuilt. By hand (bf16,
    s=32, b=2, h=64, t=2, top-2, ETP 1, moe_ffn 64): re-gather saves x_full - x_local = 4,096 bytes on
    2 qkv adapters, layer 1's qkv recomputes its x_local (4,096), and each of the 2 MoE layers frees
    R*h*e + R*moe_ffn*e = 64*64*2 + 64*64*2 bytes (R = 32*2*1 routed rows); the same as estimate's."""
    from dataclasses import replace

    from regather.tools.estimate import adapter_input_bytes

    setup = replace(MOE_RC, experts="grouped")
    (saving,) = [f for f in diagnose(GOOD_ENV, setup) if f.code == "saving"]
    expert = 2 * (64 * 64 * 2 + 64 * 64 * 2)
    assert f"{2 * 4096 + 4096 + expert:,} bytes" in saving.message
    assert "2 MoE layer(s) of expert fc1 inputs x 8,192 bytes" in saving.message
    model, run = doctor.expert_estimate(setup)
    gather, rc = adapter_input_bytes(model, run, "gather"), adapter_input_bytes(model, run, "regather-recompute")
    assert sum(gather[k] - rc[k] for k in ("experts.linear_fc1", "experts.linear_fc2")) == expert
    bad = next(f for f in diagnose(GOOD_ENV, replace(setup, num_experts=3)) if f.code == "saving")
    assert bad.message == "LoRA-A input bytes not estimated: 3 experts do not split over EP 2"


def test_cli_moe_flags(capsys, monkeypatch):
    from regather.tools.cli import main

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert main(["doctor", "--moe", "--experts", "grouped", "--expert-lora", "per-expert", "--recompute-adapter-inputs",
                 "--ep", "2", "--etp", "2", "--num-experts", "8", "--topk", "4", "--moe-ffn", "32",
                 "--dispatcher", "allgather", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["share_expert_adapters"] is False and out["setup"]["dispatcher"] == "allgather"
    (f,) = [f for f in out["findings"] if f["code"] == "redispatch-available"]
    # allgather over EP x ETP = 4 ranks: T*g*h*e*(g-1)/g = 32*4*64*2*3/4 bytes per layer, 2 layers
    assert f"all_gather {2 * 32 * 4 * 64 * 2 * 3 // 4:,}" in f["message"]
    assert main(["doctor", "--moe", "--experts", "grouped", "--expert-lora", "per-expert", "--recompute-adapter-inputs",
                 "--redispatch-expert-inputs"]) == 0
    assert "input recomputed from the router's input, dispatched again in backward" in capsys.readouterr().out


# -- doctor on real models: the same bytes as estimate --------------------------------------------

RC = "--recompute-adapter-inputs"


def _parsed(command: str, argv: list[str]):
    from regather.tools.cli import build_parser

    return build_parser().parse_args([command, *argv])


@pytest.mark.parametrize("argv", [
    [], ["--model", "qwen3-8b", "--tp", "2", "--seq", "8192", RC], ["--spec", "local"],
    ["--spec", "local", RC, "--input-requires-grad"], ["--strategy", "lowrank", RC], ["--strategy", "gather", RC],
    ["--no-sp", RC], ["--pp", "2", "--in-flight", "2", RC], ["--recipe", RC],
    ["--recipe", "qwen3-8b-peft-1gpu", RC], ["--recipe", "llama3-70b-peft-8gpu", RC],
    ["--recipe", "qwen3-8b-reference", RC], ["--model", "qwen3-30b-a3b", "--tp", "4", "--ep", "4", RC],
    ["--model", "gpt-oss-120b", "--ep", "8", RC], ["--model", "llama3-8b", "--targets", "linear_qkv,linear_fc2", RC],
    ["--model", "tiny", RC], ["--hidden", "1024", "--heads", "8", "--layers", "4", RC],
    ["--model", "qwen3-30b-a3b", "--tp", "4", "--ep", "4", "--experts", "sequential", RC],
], ids=lambda a: " ".join(a) or "defaults")
def test_doctor_and_estimate_agree_to_the_byte(argv):
    """The same command line (doctor's own options left out) gives estimate's model and run, and the
    saving estimate reports for the strategy doctor is asked about is the one doctor sums adapter by adapter."""
    from regather.tools.doctor.cli import setup_from_args
    from regather.tools.doctor.summary import estimate_variant, summary
    from regather.tools.estimate.cli import apply_layout, model_from_args, run_from_args
    from regather.tools.estimate.summary import estimate

    setup = setup_from_args(_parsed("doctor", argv))
    shared = [a for a in argv if a != RC]
    if "--strategy" in shared:
        i = shared.index("--strategy")
        shared = shared[:i] + shared[i + 2:]
    args = _parsed("estimate", shared)
    apply_layout(args)
    variant = estimate_variant(setup)
    want = estimate(model_from_args(args), run_from_args(args), (variant,))[variant]["saved_vs_gather"]
    got = summary(setup, doctor.analytic_decisions(setup))
    assert got["saved"] == want == got["estimate"]["saved"], (got["saved"], want)
    assert got["saved"] == sum(g["saved"] for g in got["groups"])


def test_doctor_defaults_are_estimates():
    """No option: estimate's preset, spec, micro-batch, rank and layout; the tiny GPT under --build."""
    from regather.tools.doctor.cli import setup_from_args

    s = setup_from_args(_parsed("doctor", []))
    assert (s.model_name, s.hidden, s.layers, s.spec, s.micro_batch, s.seq, s.lora_rank, s.tp, s.sp) == \
        ("Qwen3-8B", 4096, 36, "te", 1, 8192, 16, 2, True)
    assert s.attention_keeps_output and s.activation == "swiglu" and not s.add_bias_linear
    built = setup_from_args(_parsed("doctor", ["--build"]))
    assert (built.hidden, built.spec, built.micro_batch, built.seq) == (Setup().hidden, "local", 2, 32)
    recipe = setup_from_args(_parsed("doctor", ["--recipe", "qwen3-8b-peft-1gpu"]))
    assert (recipe.tp, recipe.sp, recipe.seq, recipe.targets, recipe.lora_rank) == \
        (1, False, 2048, ("linear_qkv", "linear_proj"), 8)


def test_summary_groups_say_why_the_rest_saves_nothing():
    from regather.tools.doctor.cli import setup_from_args
    from regather.tools.doctor.summary import summary

    setup = setup_from_args(_parsed("doctor", [RC]))
    groups = {(g["kind"], g["layers"]): g for g in summary(setup, doctor.analytic_decisions(setup))["groups"]}
    qkv0 = groups[("linear_qkv", "0")]
    assert qkv0["adapters"] == 1 and "input kept" in qkv0["decision"] and "requires grad" in qkv0["fix"]
    assert groups[("linear_qkv", "1-35")]["adapters"] == 35
    proj = groups[("linear_proj", "")]
    assert proj["saved"] == 0 and "row-parallel" in proj["decision"] and proj["adapters"] == 36
    graphs = setup_from_args(_parsed("doctor", ["--cuda-graphs"]))
    s = summary(graphs, doctor.analytic_decisions(graphs))
    assert s["saved"] == 0 < s["estimate"]["saved"]  # estimate models no CUDA graphs: the summary says so
