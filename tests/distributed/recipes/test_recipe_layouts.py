"""Megatron Bridge 0.6.2's PEFT recipes at the layouts they ship (issue 33): Qwen3-8B at its own
TP = 1 (``qwen3_8b_peft_1gpu``, SP off) and Llama 3 70B's TP 8 without sequence parallelism
(``llama3_70b_peft_8gpu``), shrunk to TP 2 on 2 gloo ranks as the other recipe runs are; local spec,
fp32, adapted through Bridge's own ``_apply_peft_transformation`` with the recipe's own LoRA fields.

Bridge's ``LoRA`` against ``regather.bridge.LoRA`` and the same with ``recompute_adapter_inputs=True``:
loss and every adapter gradient bit-identical (``torch.equal``), on the recipe's targets and on all
four. Bytes autograd keeps (saved-tensor hooks, unique storages), per adapter kind beside the frozen
model's (``workers_recipes.AdapterKinds``): with recompute, every qkv (but layer 0's: its norm
reads the frozen embedding output and keeps nothing), fc1 and fc2 adapter keeps only its rank-r
tensor; ``linear_proj`` keeps its input too (the local spec's attention keeps no output).

Then the Llama layout once more with TorchDynamo on (megatron-core 0.19.2's ``jit_fuser`` is
``torch.compile``; the recipe tier disables it elsewhere): fc2's input, rebuilt in backward by the
compiled fused SwiGLU, is bit-identical to the compiled forward's (the first-rebuild check passes,
gradients equal Bridge's).

One spawn of two ranks runs everything (the imports of Bridge cost 20-60 s per rank)."""

import functools

import pytest
import torch
import workers_recipes as W

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

LAYOUTS = tuple(W.LAYOUTS)
TARGET_SETS = ("recipe", "all")
FROZEN_INPUT = "input_layernorm: it keeps nothing for its backward (neither its input nor its weights need a gradient)"
NO_PRODUCER = "linear_proj has no recomputable producer (only linear_qkv, linear_fc1 and linear_fc2 do)"


@functools.lru_cache(maxsize=1)
def runs():
    return run_ranks(W.shipped_layouts, 2, list(LAYOUTS), timeout=800)


def test_layouts_are_the_recipes_own():
    """What the recipes ship (read from their ConfigContainer), and what ran: SP off in both."""
    for r in runs():
        q, llama = r["qwen3_8b_tp1"], r["llama3_70b_tp2"]
        assert q["shipped"] == {"tp": 1, "sp": False, "seq_length": 2048}
        assert llama["shipped"] == {"tp": 8, "sp": False, "seq_length": 4096}
        assert q["layout"] == {"tp": 1, "sp": False} and llama["layout"] == {"tp": 2, "sp": False}
        assert (q["fields"]["dim"], q["fields"]["alpha"], q["fields"]["target_modules"]) == (
            8, 16, ["linear_qkv", "linear_proj"])
        assert (llama["fields"]["dim"], llama["fields"]["alpha"]) == (16, 32)
        assert sorted(llama["fields"]["target_modules"]) == sorted(W.ALL_TARGETS)
        f = llama["features"]
        assert f["gated"] and f["activation"] == "silu" and f["bias_activation_fusion"] and not f["add_bias_linear"]
        assert f["query_groups"] == 2 and f["heads"] > f["query_groups"]


def _sides(layout, targets, r):
    return r[layout]["runs"][targets]


@pytest.mark.parametrize("targets", TARGET_SETS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bit_identical_to_bridge(layout, targets):
    for r in runs():
        sides = _sides(layout, targets, r)
        ref = sides["bridge"]
        assert ref["names"] and len(ref["names"]) == len(ref["grads"])
        for n, g in ref["grads"].items():
            assert g.abs().sum() > 0, (layout, targets, n)
        for side in ("regather", "recompute"):
            got = sides[side]
            assert got["names"] == ref["names"] and got["params_to_save"] == ref["params_to_save"]
            assert torch.equal(got["loss"], ref["loss"]), (layout, targets, side, got["loss"], ref["loss"])
            for n, g in ref["grads"].items():
                assert torch.equal(got["grads"][n], g), (layout, targets, side, n)


def _expected_recompute(path: str, fused: bool) -> str:
    """The recompute part of an adapter's decision; ``fused``: megatron's fused SwiGLU
    (``bias_activation_fusion``, Llama's provider sets it; Qwen3's does not)."""
    name, layer = path.rsplit(".", 1)[-1], int(path.split(".")[2])
    if name == "linear_proj":
        return f", input kept (recompute asked: {NO_PRODUCER})"
    if name == "linear_fc2":
        return f", input recomputed from the MLP activation (silu, gated{', fused' if fused else ''})"
    if name == "linear_qkv" and layer == 0:  # regather.decisions after the forward says what it found
        return f", input kept (recompute asked: {FROZEN_INPUT} (in the last forward))"
    return ", input recomputed from " + ("input_layernorm" if name == "linear_qkv" else "pre_mlp_layernorm")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decisions_on_the_replicated_path(layout):
    """SP off: every adapter takes the replicated path (the recipes leave
    ``sequence_parallel_input_regather`` off, so gather is asked); with recompute the qkv / fc1 inputs
    are rebuilt from their norms, fc2's from the activation."""
    for r in runs():
        for targets in TARGET_SETS:
            sides = _sides(layout, targets, r)
            assert all(d == "gather" for d in sides["regather"]["decisions"].values())
            rc = sides["recompute"]["decisions"]
            fused = r[layout]["features"]["bias_activation_fusion"]
            assert rc and all(d == "gather" + _expected_recompute(p, fused) for p, d in rc.items()), rc


def _kinds(run):
    """Bytes per adapter kind (the frozen model's own, ``"model"``, apart)."""
    return {k: v for k, v in run["saved_by_kind"].items() if v and k != "model"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bytes_per_adapter_kind(layout):
    """Per rank, ``S`` the sequence, ``B`` the micro-batch, ``H`` hidden, ``F`` the FFN width,
    ``A`` the attention width, ``r`` the LoRA dim, ``t`` the TP size, ``L`` layers, 4-byte floats.
    Without recompute each adapter keeps its input and LoRA-B's input ``[S, B, r]`` (regather's
    exactly Bridge's); with recompute qkv (but layer 0's), fc1 and fc2 keep the rank-r tensor
    only; the frozen model's own bytes are the same on every side."""
    for r in runs():
        f, fields = r[layout]["features"], r[layout]["fields"]
        s, b, h, ffn, t, n = f["seq_length"], W.MICRO_BATCH, f["hidden"], f["ffn"], r[layout]["layout"]["tp"], \
            f["num_layers"]
        attn = f["heads"] * f["kv_channels"]
        mid = s * b * fields["dim"] * 4
        inputs = {"linear_qkv": s * b * h * 4, "linear_fc1": s * b * h * 4, "linear_proj": s * b * attn // t * 4,
                  "linear_fc2": s * b * ffn // t * 4}
        for targets in TARGET_SETS:
            sides = _sides(layout, targets, r)
            wanted = sorted(fields["target_modules"] if targets == "recipe" else W.ALL_TARGETS)
            model = {side: run["saved_by_kind"]["model"] for side, run in sides.items()}
            assert len(set(model.values())) == 1 and model["bridge"] > 0, model
            kept = {k: n * (inputs[k] + mid) for k in wanted}
            assert _kinds(sides["bridge"]) == kept, (layout, targets)
            assert _kinds(sides["regather"]) == kept, (layout, targets)
            rebuilt = dict.fromkeys(wanted, n * mid)
            rebuilt["linear_proj"] = kept["linear_proj"]
            rebuilt["linear_qkv"] += inputs["linear_qkv"]  # layer 0's
            assert _kinds(sides["recompute"]) == rebuilt, (layout, targets)


def test_dynamo_rebuilds_fc2_bit_identical_to_the_compiled_forward():
    """TorchDynamo on (Inductor on CPU): the fused SwiGLU and the bias-dropout-add compile; every
    fc2 adapter's input is rebuilt from the compiled activation (its first rebuild compared bit for
    bit with the forward's: no fallback), and loss and gradients equal Bridge's, compiled alike."""
    for r in runs():
        d = r["dynamo"]
        assert "error" not in d, d.get("error")
        assert d["frames"]["stats"].get("unique_graphs", 0) > 0, d["frames"]  # Dynamo compiled something
        sides = d["runs"]["all"]
        ref, got = sides["bridge"], sides["recompute"]
        fc2 = {p: v for p, v in got["decisions"].items() if p.endswith("linear_fc2")}
        assert fc2 and all(v == "gather" + _expected_recompute(p, True) for p, v in fc2.items()), fc2
        assert torch.equal(got["loss"], ref["loss"])
        for n, g in ref["grads"].items():
            assert torch.equal(got["grads"][n], g), n
        assert _kinds(got)["linear_fc2"] == d["features"]["num_layers"] * d["features"]["seq_length"] * \
            W.MICRO_BATCH * d["fields"]["dim"] * 4


def test_report(capsys):
    """Not a check: bytes per side and kind, and where the time went (pytest -s)."""
    rows = []
    for r in runs():
        for layout in LAYOUTS:
            for targets in TARGET_SETS:
                for side, run in _sides(layout, targets, r).items():
                    rows.append(f"rank {r['rank']} {layout:15s} {targets:6s} {side:9s} {run['saved']:9d}  "
                                f"{run['saved_by_kind']}")
        rows.append(f"rank {r['rank']} imports {r['import_seconds']:.0f} s; "
                    + ", ".join(f"{n} {r[n]['seconds']:.0f} s" for n in LAYOUTS)
                    + f", dynamo {r['dynamo_seconds']:.0f} s")
    with capsys.disabled():
        print("\n" + "\n".join(rows))
