"""Transformer Engine routing on two gloo ranks, with a CPU stand-in for TE's LayerNorm linear.

What TE itself does is emulated by ``tests.harness.fake_te``; the real-TE
checks are in ``tests/unit/megatron/test_te.py`` and skip without TE and a GPU.
"""

import pytest
import torch
from workers_te import run_te_route

from regather import Strategy
from regather.tools.cpu.dist import run_ranks

T = 2
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _same(a, b, what):
    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("strategy", ["gather", "regather", "lowrank"])
def test_te_layernorm_base_matches_reference(strategy):
    res = run_ranks(run_te_route, T, strategy, timeout=200)
    for rank, r in enumerate(res):
        assert r["decision"].used == Strategy.parse(strategy), r["decision"]
        assert r["flags_after"] == (False, False)  # restored after the call
        assert r["same_init"]
        exact = _same if strategy != "lowrank" else _close  # lowrank: other summation order
        exact(r["out"], r["out_ref"], f"rank {rank} out")
        exact(r["dA"], r["dA_ref"], f"rank {rank} dA")
        exact(r["dB"], r["dB_ref"], f"rank {rank} dB")
        # dX: TE sums the gathered LayerNorm output's grad before its reduce-scatter, the
        # reference after its own: same terms, other order -> close, not bit-equal
        _close(r["dx"], r["dx_ref"], f"rank {rank} dx")
        assert r["dA"].abs().sum() > 0 and r["dx"].abs().sum() > 0
        ag, ref_ag = r["fwd_bytes"].get("all_gather", 0), r["ref_fwd_bytes"].get("all_gather", 0)
        if strategy == "gather":
            # TE's gathered LayerNorm output is used: the adapter's own s*b*h gather is gone
            s, b, h, t = 8, 2, 16, T
            assert ref_ag - ag == s * b * h * 4 * (t - 1) // t, (ag, ref_ag)


def test_te_layernorm_base_bias_forms():
    """megatron's (out, bias, ln_out) form (skip_bias_add with a bias) is unpacked too."""
    res = run_ranks(run_te_route, T, "regather", bias=True, skip_bias_add=True, timeout=200)
    for rank, r in enumerate(res):
        assert r["bias"] is not None and torch.equal(r["bias"], r["bias_ref"])
        _same(r["out"], r["out_ref"], f"rank {rank} out")
        _close(r["dx"], r["dx_ref"], f"rank {rank} dx")
