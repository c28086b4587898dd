"""Megatron Bridge 0.6.2's own LoRA against ``regather.bridge.LoRA`` on the Transformer Engine model.

The tiny GPT on megatron's TE spec over tests.harness.te_model (TP=2 + SP, fp32, LoRA on qkv, proj,
fc1, fc2; every model holds Bridge's adapter weights), Bridge seeing the model's classes as TE's and
the modelled TE version as installed (tests.harness.bridge_env, shim 7). Bridge's default SP LoRA
asks TE for its *gathered* LayerNorm output (``return_layernorm_output_gathered = not
sequence_parallel_input_regather``); TE >= 2.4 drops that output's gradient, so the decoder input's
gradient misses LoRA's qkv / fc1 share: far from float64 on the TE >= 2.4 model, right on TE <= 2.3.
Bridge's re-gather option and every ``regather.bridge.LoRA`` strategy take the local output: right on
both (within 3x the fp32 rounding of Bridge's re-gather path + 4 ulps, tests.harness.numerics).

One spawn of two gloo ranks (workers_bridge_te.te_worker)."""

import pytest
from tests.harness.bridge_env import INSTALL_HINT, bridge_available
from tests.harness.numerics import check_rounding, max_rel_err
from workers_bridge_te import VARIANTS, te_worker

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not bridge_available(), reason=INSTALL_HINT),
              pytest.mark.timeout(600)]
BEHAVIOURS = ("te<=2.3", "te2.8-2.20")


@pytest.fixture(scope="module")
def runs():
    return run_ranks(te_worker, 2, timeout=360)


def test_what_each_lora_asks_te_for(runs):
    """The flags every fused TE linear ran with: Bridge's default asks for the gathered output,
    its re-gather option and every regather strategy for the local one."""
    for res in runs:
        for behaviour in BEHAVIOURS:
            flags = res[behaviour]["flags"]
            assert flags["bridge/gather"] == [(True, True)], flags
            assert all(flags[v] == [(True, False)] for v in VARIANTS if v != "bridge/gather"), flags


@pytest.mark.parametrize("behaviour", BEHAVIOURS)
def test_decoder_input_gradient_against_float64(runs, behaviour):
    for res in runs:
        r = res[behaviour]
        fp64, same = r["fp64"], r["input_grad"]["bridge/regather"]
        errs = {v: max_rel_err(g, fp64) for v, g in r["input_grad"].items()}
        print(f"rank {res['rank']} {behaviour}: decoder input gradient, max-abs relative error vs fp64: "
              + ", ".join(f"{v} {e:.3g}" for v, e in errs.items()))
        for variant in VARIANTS:
            if variant == "bridge/gather" and behaviour == "te2.8-2.20":
                # LoRA's qkv / fc1 share of the input gradient never reaches the norm
                assert errs[variant] > 1e3 * max(errs["bridge/regather"], 1e-7), errs
                continue
            check_rounding(r["input_grad"][variant], same, fp64, f"rank {res['rank']} {behaviour} {variant}")


def test_regather_bridge_lora_decisions(runs):
    for res in runs:
        for behaviour in BEHAVIOURS:
            decisions = res[behaviour]["decisions"]
            for variant, strategy in (("rb/gather", "gather"), ("rb/regather", "regather"), ("rb/lowrank", "lowrank")):
                qkv = {p: d for p, d in decisions[variant].items() if p.endswith(("linear_qkv", "linear_fc1"))}
                assert len(qkv) == 4 and all(d == strategy for d in qkv.values()), decisions[variant]
