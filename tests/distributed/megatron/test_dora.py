"""``regather.DoRA`` on one linear against a float64 DoRA from the full tensors (issue 47).

Every strategy variant (Bridge's classic expression, the lean output keeping ``z``, ``z`` rebuilt in
backward; gather, regather, lowrank), with and without ``recompute_adapter_inputs`` where the base has a
producer (the TE model's fused LayerNorm), on column and row bases of the local spec and of the TE model
under both TE behaviours, at TP1, TP2 SP off and TP2 + SP: output, input gradient, LoRA-A / LoRA-B and
magnitude gradients within the fp64 rule (tests.harness.numerics: 3x the float32 reference's own error +
4 ulps). The row norm is the whole row's at every TP (a row-parallel base's squares summed over TP), so one
float64 reference serves every layout. Where the maths is the same GEMMs, bit for bit: regather and lowrank's
fallback-free paths against the gather path made lean, recompute against keep, and ``z`` rebuilt against ``z``
kept (everything but the magnitude's gradient, whose token sum the rebuild makes in its own chunks).

One spawn of two gloo ranks (workers_dora.run: TP2 then TP1 in the same processes)."""

import pytest
import torch
from tests.harness.numerics import check_rounding
from workers_dora import GRADS, LAYOUTS, ROW_VARIANTS, SPECS, VARIANTS, run

from regather.tools.cpu.dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(run, 2, timeout=300)


def _cases():
    for layout in LAYOUTS:
        for spec in SPECS:
            for kind in ("column", "row"):
                for variant in (VARIANTS if kind == "column" else ROW_VARIANTS):
                    for recompute in ((False, True) if spec != "local" and kind == "column" else (False,)):
                        yield layout, spec, kind, variant, recompute


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_variant_against_float64(ranks, layout):
    n = 0
    for rank, res in enumerate(ranks):
        for key in _cases():
            if key[0] != layout:
                continue
            case = res[key]
            for what in GRADS:
                got, fp32, fp64 = case[what]
                check_rounding(got, fp32, fp64, f"rank {rank} {key} {what} ({case['decision']})")
                n += 1
    assert n == 2 * 5 * sum(1 for k in _cases() if k[0] == layout)


def _equal(a, b, what):
    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=what)


def test_the_same_gemms_give_the_same_bits(ranks):
    for rank, res in enumerate(ranks):
        for layout in LAYOUTS:
            for spec in SPECS:
                for recompute in ((False, True) if spec != "local" else (False,)):
                    lean = res[(layout, spec, "column", "gather-lean", recompute)]
                    for variant in ("regather", "lowrank"):
                        case = res[(layout, spec, "column", variant, recompute)]
                        if variant == "lowrank" and layout == "tp2sp":
                            continue  # lowrank: LoRA-A on the shard, another summation order
                        for what in GRADS:
                            got, want = case[what][0], lean[what][0]
                            if got.shape != want.shape:  # lowrank's replicated LoRA-A [r, h]: this rank's rows
                                got = got.chunk(2)[rank]
                            _equal(got, want, f"{layout} {spec} {variant} {what}")
                for kind in ("column", "row"):
                    keep_names = ("gather-lean", "regather", "lowrank") if kind == "column" else ("gather-lean",)
                    for keep in keep_names:
                        rebuild = res[(layout, spec, kind, keep.split("-")[0] + "-rebuild", False)]
                        for what in ("y", "dx", "dA", "dB"):
                            _equal(rebuild[what][0], res[(layout, spec, kind, keep, False)][what][0],
                                   f"{layout} {spec} {kind} {keep} rebuild {what}")
            for spec in ("te<=2.3", "te2.8-2.20"):
                for variant in VARIANTS:
                    for what in GRADS:
                        _equal(res[(layout, spec, "column", variant, True)][what][0],
                               res[(layout, spec, "column", variant, False)][what][0],
                               f"{layout} {spec} {variant} recompute {what}")


def test_decisions(ranks):
    for res in ranks:
        assert res[("tp2sp", "local", "column", "regather", False)]["decision"] == "regather"
        assert res[("tp2sp", "local", "column", "lowrank", False)]["decision"] == "lowrank"
        for variant in ("regather", "regather-rebuild", "lowrank", "lowrank-rebuild"):
            decision = res[("tp2sp", "te2.8-2.20", "column", variant, True)]["decision"]
            assert "recomputed" in decision or "recompute" in decision, decision
