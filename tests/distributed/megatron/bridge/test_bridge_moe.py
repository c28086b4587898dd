"""Megatron Bridge 0.6.2's LoRA and ``regather.bridge.LoRA`` on megatron's MoE layers (issue 15):
the tiny MoE GPT of tests/distributed/megatron/moe/test_moe.py (SequentialMLP experts, alltoall dispatcher,
top-2, fp32), two SGD steps from the same full weights on 2 gloo ranks, and the same model at
TP = EP = ETP = 1 on one rank.

- TP2+SP x EP2 (ETP1): Bridge's LoRA (with and without its regather) and regather.bridge's gather
  path and regather path with the classic output (``lean_transients=False``) are bit-identical: losses,
  every LoRA gradient, weights after the steps. regather's regather path is lean by default
  (docs/design.md §3.7): the dense linear_proj adapter sums its LoRA-B weight gradient per sequence
  shard, another order, whose update carries the difference everywhere: against the gather path's
  float64 run within three times Bridge's own error (tests.harness.numerics). regather.bridge with
  ``recompute_adapter_inputs`` and ``redispatch_expert_inputs``, whose expert adapters keep no input
  (issue 16), is bit-identical to the same lean regather path without them.
- TP2 x ETP2 (EP1, the experts split over the TP ranks): regather.bridge matches the one-rank
  reference (the tolerance of test_moe.py); Bridge's expert adapters compute other deltas — its
  loss and expert gradients are far from the reference (measured: loss 5.6117 against 5.6205,
  expert LoRA gradients off by more than their own size) — so the test asserts that difference,
  and the README says so (Bridge's upstream tracker has the issue open).
- Expert adapter checkpoints cross both ways, strict (``dist_checkpointing``; SwiGLU experts).

Grouped experts are not compared here: Bridge picks its adapter by ``isinstance`` against
Transformer Engine's classes, which it cannot import on CPU, so it cannot wrap the TE grouped
stand-ins (regather's own grouped tests are in tests/distributed/megatron/moe/test_moe*.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
from tests.harness.bridge_env import INSTALL_HINT, bridge_available
from tests.harness.numerics import check_rounding

from regather.tools.cpu.dist import run_ranks
from regather.tools.cpu.moe_models import assemble

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(not bridge_available(), reason=INSTALL_HINT),
              pytest.mark.timeout(600)]

if bridge_available():
    import workers_bridge_moe as W
    from workers_moe import Case

    CASES = {
        "tp2_ep2": Case(ep=2, etp=1, variants=("bridge", "bridge-regather", "rb-gather", "rb-regather",
                                               "rb-regather-classic", "rb-regather-rc-rd"), fp64=("rb-gather",)),
        "tp2_etp2": Case(ep=1, etp=2, variants=("bridge", "rb-gather", "rb-regather")),
    }
else:  # collected, then skipped
    CASES = {"tp2_ep2": None, "tp2_etp2": None}
# regather's layouts against the one-rank run: other summation orders (measured 1.1e-6 apart), so
# held against the one-rank run in float64, within three times the one-rank fp32 run's own error plus
# 4 ulps (tests.harness.numerics), as tests/distributed/megatron/moe/test_moe.py does


@functools.lru_cache(maxsize=1)
def runs():
    return run_ranks(W.side_by_side, 2, CASES, timeout=300)


@functools.lru_cache(maxsize=1)
def reference():
    return run_ranks(W.reference, 1, CASES, timeout=200)[0]


def rel_err(got, ref):
    got, ref = got.double(), ref.double()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def losses(run):
    return torch.tensor(run["loss"], dtype=torch.float64)  # fp32 values, or the fp64 run's


def full_first_grads(name, variant):
    return assemble([r[name][variant]["first_grads"] for r in runs()])


def _identical(run, ref, what):
    assert run["loss"] == ref["loss"], what
    assert run["param_names"] == ref["param_names"], what
    for key in ("grads", "final"):
        assert run[key].keys() == ref[key].keys()
        for n, t in ref[key].items():
            torch.testing.assert_close(run[key][n], t, rtol=0, atol=0, msg=lambda m: f"{what} {key} {n}: {m}")


def test_bit_identical_to_bridge_at_etp1():
    for rank, r in enumerate(runs()):
        ref = r["tp2_ep2"]["bridge"]
        assert any(".experts." in n for n in ref["grads"])
        for v in ("bridge-regather", "rb-gather", "rb-regather-classic"):
            _identical(r["tp2_ep2"][v], ref, f"{rank} {v}")
        # recompute and re-dispatch: the same lean regather path, bit for bit
        _identical(r["tp2_ep2"]["rb-regather-rc-rd"], r["tp2_ep2"]["rb-regather"], f"{rank} rb-regather-rc-rd")


def test_lean_regather_within_rounding_of_bridge_at_etp1():
    """regather.bridge's regather path as a user gets it (lean): losses of both steps, the last step's
    gradients and the weights after the steps against the float64 gather run, within three times
    Bridge's own error (module doc)."""
    for rank, r in enumerate(runs()):
        res = r["tp2_ep2"]
        run, ref, fp64, what = res["rb-regather"], res["bridge"], res["fp64"]["rb-gather"], f"rank {rank} rb-regather"
        check_rounding(losses(run), losses(ref), losses(fp64), f"{what} losses", dtype=torch.float32)
        for key in ("grads", "final"):
            assert run[key].keys() == ref[key].keys() == fp64[key].keys(), what
            for n, t in ref[key].items():
                check_rounding(run[key][n], t, fp64[key][n], f"{what} {key} {n}")


def test_recompute_through_bridge_keeps_no_expert_input():
    """regather.bridge.LoRA(recompute_adapter_inputs=True, redispatch_expert_inputs=True) in a Bridge
    recipe: every expert adapter input rebuilt from what the MoE layer keeps (0 bytes counted), the
    dense qkv ones from their norm, bit-identical to the same regather path without them (test above)."""
    from regather.megatron.moe.inputs import REDISPATCH

    for r in runs():
        run = r["tp2_ep2"]["rb-regather-rc-rd"]
        experts = {p: n for p, n in run["saved_by_adapter"].items() if ".experts." in p}
        assert experts and not any(experts.values()), experts
        fc1 = [d for p, d in run["decisions"].items() if ".experts." in p and p.endswith("linear_fc1")]
        assert fc1 and all(d.endswith(f", input recomputed from {REDISPATCH}") for d in fc1), fc1
        assert run["saved_adapter_input"] < r["tp2_ep2"]["rb-regather"]["saved_adapter_input"]


@pytest.mark.parametrize("name", ["tp2_ep2", "tp2_etp2"])
def test_regather_matches_the_one_rank_reference(name):
    ref = reference()[name]
    ref64 = ref["fp64"]
    want, want64 = assemble([ref["first_grads"]]), assemble([ref64["first_grads"]])
    assert want.keys() == want64.keys()
    for v in ("rb-gather", "rb-regather"):
        check_rounding(losses(runs()[0][name][v]), losses(ref), losses(ref64), f"{name} {v} losses",
                       dtype=torch.float32)
        got = full_first_grads(name, v)
        assert got.keys() == want.keys()
        assert any(".experts." in n for n in want), "no expert adapter gradient compared"
        for n in want:
            check_rounding(got[n], want[n], want64[n], f"{name} {v} {n}")


def test_bridge_differs_from_the_reference_at_etp2():
    """What Bridge 0.6.2 computes at expert-TP 2, against the same model at EP = ETP = 1: the loss
    of the first step (same weights) already differs, and every expert adapter's gradient."""
    ref = reference()["tp2_etp2"]
    bridge = runs()[0]["tp2_etp2"]["bridge"]
    loss_err = abs(bridge["loss"][0] - ref["loss"][0]) / ref["loss"][0]
    assert loss_err > 1e-3, loss_err  # measured 1.6e-3; regather's is < 1e-7
    want, got = assemble([ref["first_grads"]]), full_first_grads("tp2_etp2", "bridge")
    expert = {n: rel_err(got[n], want[n]) for n in want if ".experts." in n}
    assert expert and min(expert.values()) > 0.1, expert  # measured: all > 0.5


@pytest.fixture(scope="module")
def crossed(tmp_path_factory):
    return run_ranks(W.cross_load, 2, str(tmp_path_factory.mktemp("bridge_moe_ckpt")), timeout=300)


@pytest.mark.parametrize("direction", [("bridge", "regather.bridge"), ("regather.bridge", "bridge")],
                         ids=["bridge-saves", "regather-saves"])
def test_expert_checkpoints_cross_both_ways(crossed, direction):
    for r in crossed:
        assert r[direction]["unexpected"] == [] and r[direction]["missing"] == [], r[direction]
    saved = assemble([r[direction]["saved"] for r in crossed])
    loaded = assemble([r[direction]["loaded"] for r in crossed])
    assert saved.keys() == loaded.keys()
    assert [n for n in saved if ".experts." in n and ".adapter." in n]
    for n in saved:
        torch.testing.assert_close(loaded[n], saved[n], rtol=0, atol=0, msg=lambda m: f"{direction} {n}")
