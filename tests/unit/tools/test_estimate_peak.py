"""regather estimate / doctor at long context (issue 45): --cp, megatron's activation recompute, what LoRA keeps, its
peak over the frozen model and the per-GPU total, by hand-computed values."""

import json
from dataclasses import replace

import pytest

from regather.tools import cli
from regather.tools.estimate import PRESETS, Model, Run, adapter_input_bytes, estimate
from regather.tools.estimate.memory import frozen_weights, lora_parameters
from regather.tools.estimate.peak import chunk, peak, transients

QWEN3_8B, LLAMA3_70B = PRESETS["qwen3-8b"], PRESETS["llama3-70b"]
TINY = Model(name="m", hidden=64, layers=2, heads=4, ffn=512)


def test_context_parallelism_divides_the_sequence_each_linear_sees():
    """CP2 at 32k keeps per GPU what CP1 at 16k keeps, byte for byte, on every strategy."""
    for name in ("gather", "regather", "lowrank-recompute"):
        cp = estimate(QWEN3_8B, Run(tp=4, seq=32768, cp=2, spec="te", attention_keeps_output=True), [name])[name]
        one = estimate(QWEN3_8B, Run(tp=4, seq=16384, spec="te", attention_keeps_output=True), [name])[name]
        for key in ("adapter_input_bytes", "lora_kept_bytes", "extra_comm_bytes"):
            assert cp[key] == one[key], (name, key)
        assert cp["peak"] == one["peak"], name


@pytest.mark.parametrize("run, message", [
    (Run(tp=2, seq=8190, cp=2), "does not split into 2 x CP = 4 chunks"),
    (Run(tp=4, seq=8196, cp=2, spec="te"), r"sequence 4098 \(per CP rank: 8196/2\) is not divisible by TP 4"),
    (Run(tp=2, seq=8192, cp=2, spec="local"), "local DotProductAttention asserts context_parallel_size == 1"),
    (Run(recompute_granularity="full"), "recompute_method=None"),
    (Run(recompute_granularity="full", recompute_method="uniform"), "recompute_num_layers=None"),
    (Run(recompute_method="block", recompute_num_layers=2), "only with full recompute"),
])
def test_layouts_megatron_refuses_are_refused(run, message):
    with pytest.raises(ValueError, match=message):
        estimate(TINY, replace(run, seq=run.seq if run.seq != 8192 or run.cp > 1 else 32))


def test_mid_is_kept_on_its_shard_by_a_lean_row_adapter():
    """LoRA-B's rank-r input: [s, b, r] for every column adapter and a classic row one, [s/t, b, r] for a lean row
    adapter under SP (regather.core.peak.row); the kept total is that plus the adapter inputs."""
    run = Run(tp=2, seq=32, micro_batch=2, dtype="float32", lora_rank=8)
    res = estimate(TINY, run, ["gather", "regather"])
    mid = 32 * 2 * 8 * 4
    for name, row_mid in (("gather", mid), ("regather", mid // 2)):
        r = res[name]
        assert r["lora_kept_bytes"] == r["adapter_input_bytes"] + 2 * (2 * mid + 2 * row_mid), name


def test_full_recompute_keeps_nothing_after_the_forward():
    """Every layer checkpointed (uniform, 1): no strategy keeps anything after the forward, so no strategy saves
    anything; in the recomputed layer's backward the adapters keep what the gather path keeps (they take it
    inside a checkpoint), and the peak is that layer plus the transient."""
    full = Run(tp=8, seq=32768, spec="te", attention_keeps_output=True, recompute_granularity="full",
               recompute_method="uniform", recompute_num_layers=1)
    plain = replace(full, recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    res = estimate(LLAMA3_70B, full, ["gather", "regather", "regather-recompute"])
    gather = estimate(LLAMA3_70B, plain, ["gather"])["gather"]
    per_layer = gather["lora_kept_bytes"] // 80  # every Llama layer keeps the same on the gather path
    for name, r in res.items():
        assert r["adapter_input_bytes"] == r["lora_kept_bytes"] == r["saved_vs_gather"] == 0, name
        p = r["peak"]
        lean_rows = 0 if name == "gather" else 2 * (32768 * 16 * 2 - 32768 * 16 * 2 // 8)  # proj, fc2: mid shard
        assert p["checkpoint_alive"] == per_layer - lean_rows, name
        assert p["peak_over_frozen"] == p["checkpoint_alive"] + p["transient"]["bytes"], name
    # block: the first 40 layers checkpointed, the other 40 keep what they keep without recompute
    block = estimate(LLAMA3_70B, replace(full, recompute_method="block", recompute_num_layers=40), ["gather"])
    assert block["gather"]["lora_kept_bytes"] == 40 * per_layer


def test_selective_mlp_recompute_keeps_the_mlp_adapters_nothing():
    run = Run(tp=2, seq=8192, spec="te", attention_keeps_output=True, recompute_granularity="selective",
              recompute_modules=("core_attn", "mlp"))
    kept = adapter_input_bytes(QWEN3_8B, run, "gather")
    assert kept["linear_fc1"] == kept["linear_fc2"] == 0 and kept["linear_qkv"] > 0


def test_peak_is_kept_plus_the_largest_transient_by_hand():
    """The tiny model (T = s*b = 64 rows, fp32, TP2 + SP): fc1's output W = T * ffn/t * e; fc2's input gradient
    the same size. The classic gather path: fc1's output, its scaled copy and the sum, 2 W; fc2's LoRA-A input
    gradient and autograd's sum, 2 W, with dmid [T, r] beside: the largest. Lean: one chunk (one piece under
    16 MiB) of fc1's output and mid, or of fc2's input gradient beside dmid and LoRA-B gathered [h, r]: the
    largest."""
    run = Run(tp=2, seq=32, micro_batch=2, dtype="float32", lora_rank=8)
    W, rr = 64 * 256 * 4, 64 * 8 * 4
    g = peak(TINY, run, "gather")
    assert g["transient"] == {"target": "linear_fc2", "bytes": 2 * W + rr,
                              "what": "backward: LoRA-A's input gradient and autograd's sum + dmid"}
    assert g["peak_over_frozen"] == g["kept"] + 2 * W + rr
    lean = peak(TINY, run, "gather", lean=True)
    assert lean["transient"] == {"target": "linear_fc2", "bytes": 64 * 8 * 4 + rr + W,
                                 "what": "backward: LoRA-B gathered + dmid + one chunk of LoRA-A's input gradient"}
    # regather's backward re-gathers x_full [s, b, h] (32 KiB) beside dmid: less than fc1's chunk and mid
    assert peak(TINY, run, "regather")["transient"] == lean["transient"]
    assert [t.nbytes for t in transients(TINY, run, "regather") if t.target == "linear_fc1"] == [W + rr] * 2


def test_chunks_follow_the_library_rule():
    assert chunk(10 << 20, 1000) == 10 << 20  # under two minimum chunks: one piece
    assert chunk(8 * 25 << 20, 8000) == 25 << 20 and chunk(1000, 7) == 1000  # rows that do not divide: ceil
    assert chunk(200 << 20, 8192) == 25 << 20  # eight chunks of 25 MiB
    assert chunk(40 << 20, 4096) == 20 << 20  # two chunks of at least 16 MiB


def test_frozen_weights_are_the_published_parameter_counts():
    """Llama 3 70B has 70,553,706,496 parameters and Qwen3-8B 8,190,735,360 (untied embeddings, Qwen3's q / k
    norms), in bf16; over TP8 everything but the norms is split."""
    assert frozen_weights(LLAMA3_70B, Run(tp=1)) == 2 * 70_553_706_496
    assert frozen_weights(QWEN3_8B, Run(tp=1)) == 2 * 8_190_735_360
    norms = (2 * 80 + 1) * 8192
    assert frozen_weights(LLAMA3_70B, Run(tp=8)) == 2 * ((70_553_706_496 - norms) // 8 + norms)


def test_lora_parameters_by_hand():
    """qkv: A [r/t, h], B [(heads + 2 kv) d / t, r]; proj: A [r, heads d / t], B [h/t, r]; fc1: A [r/t, h],
    B [ffn/t, r]; fc2: A [r, ffn/t], B [h/t, r] (docs/design.md §2); lowrank's column A is [r, h]."""
    run = Run(tp=2, lora_rank=8)
    h, r, t = 64, 8, 2
    per = (r // t * h + 3 * h // t * r) + (r * h // t + h // t * r) + (r // t * h + 512 // t * r) + (
        r * 512 // t + h // t * r)
    assert lora_parameters(TINY, run, "gather") == 2 * per
    assert lora_parameters(TINY, run, "lowrank") == 2 * (per + 2 * (r * h - r // t * h))


def test_cli_reports_kept_peak_and_total(capsys):
    argv = ["estimate", "--model", "llama3-70b", "--tp", "8", "--cp", "2", "--seq", "32768", "--strategies",
            "gather,regather", "--gpu-memory", "80"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "context parallel: CP=2, each CP rank's linears see 16384 tokens per sample" in out
    assert "LoRA peak over frozen       : 58.351 GB" in out and "(classic output path;" in out
    assert "per-GPU total               : 100.32 GiB of 80.00 GiB: does NOT fit" in out
    assert "per-GPU total               : 60.09 GiB of 80.00 GiB: fits" in out
    assert "LoRA kept, peak and the per-GPU total: modelled" in out
    assert cli.main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["run"]["cp"] == 2 and doc["how_obtained_peak"]["peak"].startswith("modelled")
    assert doc["strategies"]["regather"]["gpu"]["fits"] is True


@pytest.mark.parametrize("argv, message", [
    (["estimate", "--recompute-method", "block"], "--recompute-method needs --recompute-granularity full"),
    (["estimate", "--recompute-granularity", "selective", "--recompute-num-layers", "2"],
     "megatron refuses a method or layer count with selective recompute"),
    (["estimate", "--recompute-modules", "mlp"], "--recompute-modules mlp needs --recompute-granularity selective"),
    (["estimate", "--spec", "local", "--cp", "2"], "--cp 2 with --spec local's unfused attention"),
    (["estimate", "--recipe", "llama3-70b-peft-8gpu", "--cp", "2"], r"--cp 2 \(it runs 1\)"),
    (["estimate", "--front-end", "torchtitan", "--cp", "2"], "--cp: Megatron's options"),
    (["doctor", "--build", "--cp", "2"], "--build: --cp 2"),
    (["doctor", "--spec", "local", "--cp", "2"], "--cp 2 with --spec local's unfused attention"),
])
def test_refusals(argv, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(argv)


def test_doctor_under_full_recompute_keeps_nothing_after_the_forward(capsys):
    """The command issue 45 names: it used to print that the gather path keeps 115.427 GB, which no run with every
    layer checkpointed keeps."""
    assert cli.main(["doctor", "--model", "llama3-70b", "--tp", "8", "--seq", "32768",
                     "--recompute-granularity", "full"]) == 0
    out = capsys.readouterr().out
    assert "115.427" not in out
    assert "the gather path keeps 0 bytes (0.00 KiB) after the forward" in out
    assert "nothing inside a checkpointed layer is kept after the forward (LoRA's inputs included)" in out
    assert "gather (classic, Bridge 0.6.2's output path): kept 0.000 GB (0.000 GiB), 1.447 GB (1.348 GiB) in a" in out
    assert cli.main(["doctor", "--model", "llama3-70b", "--tp", "8", "--seq", "32768", "--recompute-granularity",
                     "full", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    peaks = doc["summary"]["peak"]
    assert set(peaks) == {"gather", "regather", "lowrank"} and all(p["kept"] == 0 for p in peaks.values())
    assert doc["setup"]["recompute_method"] == "uniform" and doc["setup"]["recompute_num_layers"] == 1
