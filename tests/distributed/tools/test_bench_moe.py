"""``regather bench --moe`` end to end on two gloo ranks (TP2+SP x EP2, megatron's MoE layers), and its
command line.

Two runs through the CLI (each spawns its ranks), checked against formulas from the routing the run
itself recorded (the tokens each rank's local experts received, per MoE layer and forward):

- SequentialMLP, alltoall, 3 steps: gather / regather / regather-recompute / regather-recompute-redispatch;
- grouped experts with one LoRA-A shared by the local experts, alltoall, 2 steps: gather / regather /
  regather-recompute (the shared A runs before the dispatch).
"""

import dataclasses
import json

import pytest

from regather.tools import cli
from regather.tools.bench import moe_report
from regather.tools.bench.cli import spec_from_args
from regather.tools.bench.moe import MoEBenchSpec

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

ELT = 4  # float32
LAYERS, HIDDEN, SEQ, BATCH, TOPK, EXPERTS, MOE_FFN, RANK, EP = 2, 64, 32, 2, 2, 4, 64, 8, 2
COMMON = ["bench", "--moe", "--hidden", str(HIDDEN), "--layers", str(LAYERS), "--heads", "4", "--ffn", "128",
          "--vocab", "256", "--seq", str(SEQ), "--micro-batch", str(BATCH), "--tp", "2", "--ep", str(EP),
          "--etp", "1", "--num-experts", str(EXPERTS), "--topk", str(TOPK), "--moe-ffn", str(MOE_FFN),
          "--lora-rank", str(RANK), "--quiet"]
SEQUENTIAL = ("gather", "gather-lean", "regather", "regather-recompute", "regather-recompute-redispatch")
GROUPED = ("gather", "gather-lean", "regather", "regather-recompute")
#: the variants on the lean output path: bit-identical to gather-lean, not to the classic gather (docs/design.md §3.7)
LEAN = ("regather", "regather-recompute", "regather-recompute-redispatch")


def _bench(tmp_path_factory, name, extra):
    out = tmp_path_factory.mktemp(name)
    assert cli.main(COMMON + ["--out", str(out)] + extra) == 0
    with open(out / "bench.json") as f:
        return json.load(f), out


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    return _bench(tmp_path_factory, "moe-seq", ["--experts", "sequential", "--steps", "3", "--warmup", "1",
                                                "--strategies", ",".join(SEQUENTIAL)])


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    return _bench(tmp_path_factory, "moe-grouped", ["--experts", "grouped", "--steps", "2", "--warmup", "1",
                                                    "--strategies", ",".join(GROUPED)])


def _routed(row, rank, step):
    """Rows routed to ``rank``'s local experts in ``step``'s forward, per MoE layer."""
    return [sum(forwards[step]) for forwards in row["tokens_per_local_expert_per_rank"][rank].values()]


def _one_dispatch(rows, width):
    """One all-to-all over EP per MoE layer whose output is ``rows`` rows of ``width`` (the accounting:
    output bytes x (g-1)/g)."""
    return sum(n * width * ELT * (EP - 1) // EP for n in rows)


def _extra(a, b):
    return {k: v for k in set(a) | set(b) if (v := a.get(k, 0) - b.get(k, 0))}


# -- SequentialMLP: keeping, recomputing from the activation, re-dispatching -----------------------


def test_sequential_expert_bytes_are_routed_rows_times_width(sequential):
    summary, _ = sequential
    rows = summary["strategies"]
    for v in SEQUENTIAL:
        row = rows[v]
        for rank in range(2):
            got = row["adapter_input_by_kind_per_rank"][rank]
            routed = sum(_routed(row, rank, 0))
            assert routed == sum(row["routed_rows_first_forward_per_rank"][rank].values()) > 0
            fc1 = 0 if v.endswith("-redispatch") else routed * HIDDEN * ELT
            fc2 = 0 if "-recompute" in v else routed * MOE_FFN * ELT  # ETP1: each expert's fc2 input
            assert (got["experts.linear_fc1"], got["experts.linear_fc2"]) == (fc1, fc2), (v, rank, got)
            assert sum(got.values()) == row["adapter_input_bytes_per_rank"][rank]
        # the mean over the EP group: every token's k rows, s*b tokens over the two ranks
        mean = row["adapter_input_by_kind_mean"]
        want = 0 if v.endswith("-redispatch") else LAYERS * SEQ * BATCH * TOPK // EP * HIDDEN * ELT
        assert mean["experts.linear_fc1"] == want, v
        # dense adapters: gather keeps x_full = s*b*h per layer
        if v == "gather":
            assert mean["linear_qkv"] == LAYERS * SEQ * BATCH * HIDDEN * ELT
    # the retained total moves by exactly what estimate says LoRA keeps (LoRA-A inputs, LoRA-B's rank-r mid: on its
    # sequence shard for the lean linear_proj adapters)
    g, est = rows["gather"], _estimate(summary)
    for v in est:
        assert g["saved_bytes_mean"] - rows[v]["saved_bytes_mean"] == \
            est["gather"]["lora_kept_bytes"] - est[v]["lora_kept_bytes"], v


def test_sequential_every_variant_is_bit_exact_against_gather(sequential):
    summary, _ = sequential
    rows = summary["strategies"]
    lean = rows["gather-lean"]  # the lean row adapters' LoRA-B weight gradient: another order, an fp32 rounding
    assert lean["first_loss_equal_to_gather"] and lean["max_rel_grad_diff"] < 1e-5
    for v in SEQUENTIAL:
        if v == "gather-lean":
            continue
        row = rows[v]
        ref, what = ("gather-lean", "_vs_same_output_path") if v in LEAN else ("gather", "")
        assert row["first_loss_equal_to_gather"], v  # same weights, batches: the first forward is the same
        assert row["loss"] == rows[ref]["loss"], v
        assert row[f"max_abs_grad_diff{what}"] == 0.0 and row[f"max_rel_grad_diff{what}"] == 0.0, v
        assert row["tokens_per_local_expert_per_rank"] == rows["gather"]["tokens_per_local_expert_per_rank"], v
        assert row["first_step_routing_differs_from_gather"] is None, v
    rd = rows["regather-recompute-redispatch"]
    assert rd["variant_of"] == "regather" and rd["max_abs_loss_diff_vs_base"] == 0.0
    assert rd["max_abs_grad_diff_vs_base"] == 0.0


def test_peak_over_frozen_obeys_the_lean_goal(sequential):
    """LoRA's peak over the frozen MoE GPT (the allocator's, on every rank; each model routes as the frozen one):
    a lean variant adds at most what it keeps + its LoRA weights' gradients + W/4 (+ regather's re-gathered x_full;
    W: the largest full-width tensor a base makes per rank, here linear_qkv's output [s, b, 3h/t]); the classic
    gather path adds more than its lean twin. Bytes only: no time is asserted."""
    summary, _ = sequential
    rows = summary["strategies"]
    W, x_full = SEQ * BATCH * 3 * HIDDEN // 2 * ELT, SEQ * BATCH * HIDDEN * ELT
    for v in LEAN + ("gather-lean",):
        for a in rows[v]["allocated_per_rank"]:
            bound = a["kept_over_frozen"] + a["lora_grad_bytes"] + W // 4 + (x_full if v.startswith("regather") else 0)
            assert a["peak_over_frozen"] <= bound, (v, a)
    for classic, lean in zip(rows["gather"]["allocated_per_rank"], rows["gather-lean"]["allocated_per_rank"]):
        assert classic["peak_over_frozen"] > lean["peak_over_frozen"], (classic, lean)


def test_redispatch_sends_one_more_h_wide_dispatch(sequential):
    summary, _ = sequential
    rows = summary["strategies"]
    rd, rc = rows["regather-recompute-redispatch"], rows["regather-recompute"]
    steps = summary["spec"]["steps"]
    per_step = []
    for rank in range(2):
        for step in range(1, steps):  # the first step also checks each layer's route once
            want = {"all_to_all": _one_dispatch(_routed(rd, rank, step), HIDDEN)}
            got = _extra(rd["comm_bytes_per_rank_and_step"][rank][step], rc["comm_bytes_per_rank_and_step"][rank][step])
            assert got == want, (rank, step, got, want)
            per_step.append(want["all_to_all"])
        # every layer re-dispatched once per forward, started when the experts' output gradient arrived
        per_layer = rd["redispatches_per_rank"][rank]
        counts = {layer: {k: v for k, v in c.items() if not k.endswith("_s")} for layer, c in per_layer.items()}
        assert counts == {f"decoder.layers.{i}.mlp": {"early": steps} for i in range(LAYERS)}
        assert all(0 <= c["wait_s"] <= c["flight_s"] for c in per_layer.values()), per_layer
    mean = sum(per_step) / len(per_step)
    assert {k: v for k, v in rd["comm_bytes_extra_vs_base"].items() if v} == {"all_to_all": mean}
    assert summary["dispatch_bytes_per_step_mean"]["h_wide"] == mean
    assert not any(rc["comm_bytes_extra_vs_base"].values())  # recomputing from the activation sends nothing
    counts = rd["adapter_inputs"]
    assert counts["recomputed from the router's input, dispatched again in backward"] == LAYERS * EXPERTS // EP
    assert "step_time_ratio_vs_base" in rd and "paired_step_time_ratio_vs_gather" in rd  # no timed assertion


def test_reports_and_render(sequential, capsys):
    summary, out = sequential
    md = (out / "bench.md").read_text()
    assert summary["command"] in md and "--moe --ep 2 --etp 1 --experts sequential" in summary["command"]
    assert "regather-recompute-redispatch" in md and "torch" in md
    capsys.readouterr()
    assert cli.main(["bench", "--render", str(out / "bench.json")]) == 0
    text = capsys.readouterr().out
    assert "expert linear_fc1" in text and "regather-recompute-redispatch" in text
    # the recorded command parses back to the same spec (--quiet and --timeout are not part of it)
    again = dataclasses.asdict(spec_from_args(cli.build_parser().parse_args(summary["command"].split()[1:])))
    recorded = {k: tuple(v) if isinstance(v, list) else v for k, v in summary["spec"].items()}
    for key in ("quiet", "timeout", "out"):
        again.pop(key, None), recorded.pop(key, None)
    assert again == recorded


# -- grouped experts, one LoRA-A before the dispatch -------------------------------------------------


def test_grouped_shared_a_runs_before_the_dispatch(grouped):
    summary, _ = grouped
    rows = summary["strategies"]
    rc, base, g = rows["regather-recompute"], rows["regather"], rows["gather"]
    for rank in range(2):
        routed = sum(_routed(g, rank, 0))
        assert g["adapter_input_by_kind_per_rank"][rank]["experts.linear_fc1"] == routed * HIDDEN * ELT
        assert g["adapter_input_by_kind_per_rank"][rank]["experts.linear_fc2"] == routed * MOE_FFN * ELT
        assert rc["adapter_input_by_kind_per_rank"][rank]["experts.linear_fc1"] == 0
        assert rc["adapter_input_by_kind_per_rank"][rank]["experts.linear_fc2"] == 0
        # step 2: the rank-r output along the route (the rows routed here) and back (k rows per local token)
        assert _routed(rc, rank, 1) == _routed(base, rank, 1)  # the same routing (else the dispatch differs too)
        tokens = SEQ * BATCH // 2
        want = {"all_to_all": _one_dispatch(_routed(rc, rank, 1), RANK)
                + _one_dispatch([tokens * TOPK] * LAYERS, RANK)}
        got = _extra(rc["comm_bytes_per_rank_and_step"][rank][1], base["comm_bytes_per_rank_and_step"][rank][1])
        assert got == want, (rank, got, want)
    # fp32 rounding only: dA summed over tokens instead of routed rows
    for a, b in zip(rc["loss"], g["loss"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert rc["max_rel_grad_diff"] <= 1e-5
    assert rc["adapter_inputs"]["recomputed from the router's input: LoRA-A runs before the dispatch (one LoRA-A "
                                "for the local experts)"] == LAYERS
    assert base["losses_equal_to_same_output_path"] and base["max_abs_grad_diff_vs_same_output_path"] == 0.0


# -- the command line ------------------------------------------------------------------------------


def _spec(argv):
    return spec_from_args(cli.build_parser().parse_args(["bench", "--moe"] + argv))


def test_cli_parses_the_moe_flags():
    spec = _spec(["--experts", "grouped", "--expert-lora", "per-expert", "--tp", "4", "--ep", "2", "--etp", "2",
                  "--dispatcher", "allgather", "--num-experts", "8", "--topk", "1", "--moe-ffn", "32",
                  "--shared-expert-ffn", "16", "--moe-layer-freq", "2",
                  "--strategies", "gather,lowrank-recompute-redispatch"])
    assert isinstance(spec, MoEBenchSpec) and spec.world == 4
    assert (spec.experts, not spec.share_expert_adapters, spec.ep, spec.etp, spec.dispatcher, spec.num_experts, spec.topk,
            spec.moe_ffn, spec.shared_expert_ffn, spec.moe_layer_freq) == \
        ("grouped", True, 2, 2, "allgather", 8, 1, 32, 16, 2)
    run = spec.run_config()
    assert not run.share_expert_adapters and run.world == 4 and run.shape.layer_pattern == [1, 0]
    assert _spec(["--tp", "1", "--ep", "2"]).world == 2  # DP2 for the dense layers
    assert "--expert-lora per-expert" in moe_report.command_line(spec.__dict__)


@pytest.mark.parametrize("argv, message", [
    (["--expert-lora", "per-expert"], "--expert-lora per-expert needs --experts grouped"),
    (["--tp", "2", "--ep", "3"], "must divide one another"),
    (["--tp", "4", "--ep", "2", "--etp", "3"], "must divide one another"),
    (["--num-experts", "3"], "is not a multiple of --ep"),
    (["--topk", "5"], "--topk 5 must be between 1"),
    (["--moe-ffn", "63", "--ep", "1", "--etp", "2"], "--moe-ffn 63 is not divisible by --etp 2"),
    (["--steps", "1", "--warmup", "0"], "must be at least 2"),
    (["--canonical"], "--canonical is not measured"),
])
def test_cli_refuses_bad_combinations(argv, message):
    with pytest.raises(SystemExit, match=message):
        _spec(argv)


def test_moe_options_need_moe(capsys):
    with pytest.raises(SystemExit, match="regather-recompute-redispatch: MoE models only"):
        spec_from_args(cli.build_parser().parse_args(["bench", "--strategies", "regather-recompute-redispatch"]))
    with pytest.raises(SystemExit, match="--ep, --experts: MoE models only"):
        spec_from_args(cli.build_parser().parse_args(["bench", "--ep", "4", "--experts", "grouped"]))
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--moe", "--strategies", "regather-nonsense"])
    assert "unknown strategies" in capsys.readouterr().err


# -- regather estimate agrees with the measurement -----------------------------------------------------


def _estimate(summary):
    """``regather estimate`` for the benchmarked model and run, every measured variant: the bench's
    ``<strategy>-recompute-redispatch`` is estimate's ``<strategy>-recompute`` with ``redispatch``."""
    from regather.tools.estimate import Model, Run, estimate

    s = summary["spec"]
    model = Model(name="tiny MoE", hidden=s["hidden"], layers=s["layers"], heads=s["heads"], ffn=0,
                  num_experts=s["num_experts"], moe_ffn=s["moe_ffn"], topk=s["topk"], experts=s["experts"],
                  dispatcher=s["dispatcher"])
    out = {}
    for name in summary["strategies"]:
        if name == "gather-lean":  # a bench variant; estimate's gather is Bridge's classic output path
            continue
        redispatch = name.endswith("-redispatch")
        base = name[: -len("-redispatch")] if redispatch else name
        run = Run(tp=s["tp"], seq=s["seq"], micro_batch=s["micro_batch"], dtype=s["dtype"], lora_rank=s["lora_rank"],
                  targets=tuple(s["targets"]), ep=s["ep"], etp=s["etp"],
                  share_expert_adapters=not moe_report.per_expert(s),
                  redispatch_expert_inputs=redispatch, input_requires_grad=bool(s.get("input_requires_grad")))
        out[name] = (estimate(model, run, (base,))[base])
    return out


@pytest.mark.parametrize("which", ["sequential", "grouped"])
def test_estimate_agrees_byte_for_byte(which, request):
    """The adapter-input bytes by target (expert rows: the mean over the EP ranks, which estimate models
    exactly for dropless routing) and the collective bytes each variant adds to gather per step, by kind."""
    summary, _ = request.getfixturevalue(which)
    for name, e in _estimate(summary).items():
        row = summary["strategies"][name]
        measured = {k: v for k, v in row["adapter_input_by_kind_mean"].items() if v}
        assert measured == {k: v for k, v in e["adapter_input_by_target"].items() if v}, name
        assert row["adapter_input_bytes_mean"] == e["adapter_input_bytes"], name
        counted = {k: v for k, v in row["comm_bytes_extra_vs_gather"].items() if v}
        assert counted == {k: v for k, v in e["extra_comm_bytes"].items() if v}, name
