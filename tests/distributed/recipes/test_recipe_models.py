"""The models of Megatron Bridge 0.6.2's PEFT recipes for Qwen3-8B, Qwen3-30B-A3B and GPT-OSS-20B,
built by the recipes' own providers (shrunk: 2 layers, narrow; MoE 4 experts top-2; every
architecture switch kept), TP2 + SP (EP2 for MoE) on 2 gloo ranks, local spec, fp32, adapted through
Bridge's own ``_apply_peft_transformation``: ``regather.bridge.LoRA`` side by side with Bridge's
``LoRA(sequence_parallel_input_regather=True)`` from identical weights, on the recipe's own targets
and on all four. Loss and every adapter gradient bit-identical (``torch.equal``) with the classic output
(``lean_transients=False``, Bridge 0.6.2's); regather's default (lean, docs/design.md §3.7) and
``recompute_adapter_inputs=True`` too but for the row-parallel adapters' (linear_proj, linear_fc2)
LoRA-B weight gradient, summed per sequence shard (another order than Bridge's one GEMM): against the
same model in float64 within three times Bridge's own error (tests.harness.numerics); the bytes autograd
keeps, per side.

One spawn of two ranks runs all three recipes (workers_recipes.side_by_side): each spawn pays the
imports (Bridge and its model zoo: 20-60 s per rank on 2 shared cores)."""

import functools

import pytest
import torch
import workers_recipes as W
from tests.harness.numerics import check_rounding

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

RECIPES = ("qwen3_8b", "qwen3_30b_a3b", "gpt_oss_20b")
TARGET_SETS = ("recipe", "all")


@functools.lru_cache(maxsize=1)
def runs():
    return run_ranks(W.side_by_side, 2, list(RECIPES), timeout=200)


def test_recipes_own_lora_settings():
    """What the recipes set (docs/design.md §10): Qwen3 dim 8 / alpha 16 on linear_qkv + linear_proj;
    GPT-OSS keeps Bridge's default LoRA (all four targets, dim 32, alpha 32)."""
    for r in runs():
        for name in ("qwen3_8b", "qwen3_30b_a3b"):
            f = r[name]["fields"]
            assert (f["dim"], f["alpha"], f["dropout"], f["target_modules"]) == (8, 16, 0.0,
                                                                                ["linear_qkv", "linear_proj"])
        f = r["gpt_oss_20b"]["fields"]
        assert (f["dim"], f["alpha"], sorted(f["target_modules"])) == (32, 32, sorted(W.ALL_TARGETS))


def test_shrunk_models_keep_their_architecture():
    for r in runs():
        q8, q30, oss = (r[n]["features"] for n in RECIPES)
        for f in (q8, q30, oss):
            assert f["num_layers"] == 2 and f["gated"]
            assert f["query_groups"] == 2 and f["heads"] > f["query_groups"]  # GQA kept
        for f in (q8, q30):
            assert f["qk_layernorm"] and f["activation"] == "silu" and not f["add_bias_linear"]
            assert f["windows"] == [None, None] and not any(f["sinks"]) and not f["yarn"]
        assert q8["num_experts"] is None
        for f in (q30, oss):
            assert (f["num_experts"], f["topk"], f["expert_kinds"]) == (4, 2, ["SequentialMLP"])
        # GPT-OSS: attention sinks, sliding window on every other layer, YaRN, biased experts,
        # the clamped gated activation (through megatron's fused weighted quick-GeGLU)
        assert all(oss["sinks"])
        assert oss["windows"] == [(127, 0), None] and oss["seq_length"] > 128
        assert oss["yarn"] and oss["yarn_factor"] == 32.0
        assert oss["add_bias_linear"] and oss["expert_fc1_bias"]
        assert (oss["activation"], oss["clamp"], oss["glu_linear_offset"], oss["bias_activation_fusion"]) == (
            "quick_gelu", 7.0, 1.0, True)


@pytest.mark.parametrize("targets", TARGET_SETS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_bit_identical_to_bridge(recipe, targets):
    for r in runs():
        sides = r[recipe]["runs"][targets]
        ref = sides["bridge"]
        assert ref["names"] and len(ref["names"]) == len(ref["grads"])
        assert any(g.abs().sum() > 0 for g in ref["grads"].values())
        for n, g in ref["grads"].items():
            if ".experts." not in n:  # an expert may get no token; every other adapter has a gradient
                assert g.abs().sum() > 0, (recipe, targets, n)
        rounded = [n for n in ref["grads"] if lean_row_b(n)]
        assert rounded and len(rounded) % 2 == 0, rounded  # per layer: linear_proj's, and linear_fc2's on "all"
        for side in ("classic", "regather", "recompute"):
            got = sides[side]
            assert got["names"] == ref["names"], (recipe, targets, side)
            assert torch.equal(got["loss"], ref["loss"]), (recipe, targets, side, got["loss"], ref["loss"])
            for n, g in ref["grads"].items():
                if side != "classic" and n in rounded:
                    check_rounding(got["grads"][n], g, sides["fp64"]["grads"][n], f"{recipe} {targets} {side} {n}")
                else:
                    assert torch.equal(got["grads"][n], g), (recipe, targets, side, n)


def lean_row_b(name: str) -> bool:
    """A dense row-parallel adapter's LoRA-B weight, whose lean gradient sums in another order (module doc);
    not an expert's (its tokens are the dispatcher's rows, not a sequence shard)."""
    return ".experts." not in name and (".linear_proj.adapter.linear_out." in name
                                        or ".linear_fc2.adapter.linear_out." in name)


@pytest.mark.parametrize("targets", TARGET_SETS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_regather_adapts_what_bridge_adapts(recipe, targets):
    """Same parameter names and Bridge's ``params_to_save``; every targeted megatron linear is a
    regather wrapper on regather's sides and none on Bridge's."""
    for r in runs():
        sides = r[recipe]["runs"][targets]
        assert not sides["bridge"]["regather_wrappers"]
        assert sides["bridge"]["params_to_save"]
        for side in ("regather", "recompute"):
            assert sides[side]["params_to_save"] == sides["bridge"]["params_to_save"]
            wanted = r[recipe]["fields"]["target_modules"] if targets == "recipe" else W.ALL_TARGETS
            adapted = {p.rsplit(".", 1)[-1] for p in sides[side]["regather_wrappers"]}
            assert adapted == set(wanted), (recipe, targets, side, adapted)
            decisions = sides[side]["decisions"]
            assert len(decisions) == len(sides[side]["regather_wrappers"])
            qkv = [d for p, d in decisions.items() if p.endswith("linear_qkv")]
            assert qkv and all(d.startswith("regather") for d in qkv), qkv  # the re-gather is on
            if side == "recompute" and targets == "all" and r[recipe]["features"]["num_experts"]:
                # per-expert LoRA-A (SequentialMLP): inputs re-dispatched from the router's input
                fc1 = [d for p, d in decisions.items() if ".experts." in p and p.endswith("linear_fc1")]
                assert fc1 and all("recomputed from the router's input" in d for d in fc1), fc1


@pytest.mark.parametrize("recipe", RECIPES)
def test_recompute_keeps_fewer_bytes(recipe):
    """Bytes autograd keeps for backward (saved-tensor hooks; unique storages, parameters excluded),
    per side: recompute_adapter_inputs keeps less than regather on both target sets."""
    for r in runs():
        for targets in TARGET_SETS:
            saved = {side: run["saved"] for side, run in r[recipe]["runs"][targets].items()}
            assert saved["recompute"] < saved["regather"], (recipe, targets, saved)


def test_what_recompute_drops_on_the_dense_recipe():
    """Qwen3-8B (dense, fp32), per rank, with S the sequence, B the micro-batch, H hidden, F the FFN
    width, T = 2, L = 2 layers. On the recipe's targets (qkv + proj) recompute drops the sequence
    shard of linear_qkv's input in every layer but the first (layer 0's norm reads the frozen
    embedding output and keeps nothing: its shard stays) and nothing of linear_proj (its input,
    the attention output, has no producer to rebuild it from). On all four targets it also drops
    linear_fc1's shard (rebuilt from the MLP norm) and linear_fc2's [S, B, F/T] input (rebuilt from
    the activation) in every layer: what stays is then what the recipe's targets keep. Beside Bridge's
    re-gather: the classic output keeps the same bytes; lean (the default) keeps each row-parallel
    adapter's mid on its sequence shard, [S/T, B, r] for [S, B, r]."""
    for r in runs():
        f = r["qwen3_8b"]["features"]
        s, b, h, ffn, t, layers = f["seq_length"], W.MICRO_BATCH, f["hidden"], f["ffn"], W.TP, f["num_layers"]
        shard, fc2_input = s // t * b * h * 4, s * b * ffn // t * 4
        row_mid_cut = layers * (s * b * r["qwen3_8b"]["fields"]["dim"] * 4) * (t - 1) // t  # per row target
        recipe, every = (r["qwen3_8b"]["runs"][k] for k in ("recipe", "all"))
        assert recipe["regather"]["saved"] - recipe["recompute"]["saved"] == (layers - 1) * shard
        assert every["regather"]["saved"] - every["recompute"]["saved"] == (
            (layers - 1) * shard + layers * shard + layers * fc2_input)
        assert every["recompute"]["saved"] == recipe["regather"]["saved"] - row_mid_cut  # fc2's mid: lean too
        for runs_, rows in ((recipe, 1), (every, 2)):  # linear_proj; and linear_fc2 on all four
            assert runs_["classic"]["saved"] == runs_["bridge"]["saved"]  # the same bytes as Bridge's re-gather
            assert runs_["bridge"]["saved"] - runs_["regather"]["saved"] == rows * row_mid_cut


def test_report_bytes(capsys):
    """Not a check: the table of kept bytes per rank, printed for the record (pytest -s)."""
    rows = []
    for r in runs():
        for recipe in RECIPES:
            for targets in TARGET_SETS:
                s = {side: run["saved"] for side, run in r[recipe]["runs"][targets].items()}
                rows.append(f"rank {r['rank']} {recipe:14s} {targets:6s} bridge {s['bridge']:9d}  "
                            f"regather {s['regather']:9d}  recompute {s['recompute']:9d}")
        rows.append(f"rank {r['rank']} imports {r['import_seconds']:.0f} s; "
                    + ", ".join(f"{n} {r[n]['seconds']:.0f} s" for n in RECIPES))
    with capsys.disabled():
        print("\n" + "\n".join(rows))
