"""Adapter level: regather against the gather path, bit for bit, on two gloo ranks."""

import pytest
import torch
from tests.harness.numerics import check_rounding
from workers_adapter import count_collectives, run_adapter

from regather import Strategy
from regather.tools.cpu.dist import run_ranks

T = 2
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _both(**kw):
    gather = run_ranks(run_adapter, T, Strategy.GATHER, timeout=120, **kw)
    regather = run_ranks(run_adapter, T, Strategy.REGATHER, timeout=120, **kw)
    return gather, regather


def _assert_identical(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_regather_bit_exact_without_fusion(dtype):
    gather, regather = _both(dtype=dtype)
    for rank in range(T):
        g, r = gather[rank], regather[rank]
        assert r["decision"].used == Strategy.REGATHER, r["decision"]
        assert g["decision"].used == Strategy.GATHER
        _assert_identical(g["out"][0], r["out"][0], f"rank {rank} output")
        _assert_identical(g["dx"][0], r["dx"][0], f"rank {rank} input grad")
        _assert_identical(g["dA"], r["dA"], f"rank {rank} dA")
        _assert_identical(g["dB"], r["dB"], f"rank {rank} dB")
        assert g["dA"].abs().sum() > 0 and g["dx"][0].abs().sum() > 0  # a non-trivial check


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_regather_bit_exact_with_grad_accumulation_fusion(dtype):
    gather, regather = _both(dtype=dtype, fuse=True, micro_batches=2)
    for rank in range(T):
        g, r = gather[rank], regather[rank]
        for res in (g, r):
            # accumulated into main_grad; .grad got megatron's placeholder (DDP's hook needs one)
            assert res["A_grad_shape"] == res["A_shape"] and res["B_grad_shape"] == res["B_shape"]
            assert res["A_flag"] is True
            assert res["dA"].dtype == torch.float32
        for mb in range(2):
            _assert_identical(g["out"][mb], r["out"][mb], f"rank {rank} mb {mb} output")
            _assert_identical(g["dx"][mb], r["dx"][mb], f"rank {rank} mb {mb} input grad")
        _assert_identical(g["dA"], r["dA"], f"rank {rank} main_grad of A")
        _assert_identical(g["dB"], r["dB"], f"rank {rank} main_grad of B")


def test_fused_main_grad_accumulates_over_micro_batches():
    one = run_ranks(run_adapter, T, Strategy.REGATHER, timeout=120, fuse=True, micro_batches=1)
    two = run_ranks(run_adapter, T, Strategy.REGATHER, timeout=120, fuse=True, micro_batches=2, fp64=True)
    unfused = run_ranks(run_adapter, T, Strategy.REGATHER, timeout=120, fuse=False, micro_batches=2)
    for rank in range(T):
        # micro-batch 1 is the same in both runs; the second adds a non-zero amount
        assert not torch.equal(one[rank]["dA"], two[rank]["dA"])
        # the same fp32 products summed in another order (the second micro-batch's GEMM accumulates
        # into main_grad, where unfused adds two GEMM results): how the BLAS adds into its output
        # decides the last bits, so both are held against the fp64 sum (a lost micro-batch is O(1))
        for key in ("dA", "dB"):
            check_rounding(two[rank][key], unfused[rank][key], two[rank]["fp64"][key], f"rank {rank} {key}")


@pytest.mark.parametrize("position", ["pre", "post"])
def test_regather_bit_exact_with_dropout(position):
    gather, regather = _both(dropout=0.25, dropout_position=position)
    for rank in range(T):
        _assert_identical(gather[rank]["out"][0], regather[rank]["out"][0], "output")
        _assert_identical(gather[rank]["dA"], regather[rank]["dA"], "dA")
        _assert_identical(gather[rank]["dx"][0], regather[rank]["dx"][0], "input grad")


def test_saved_adapter_input_bytes_drop_by_tp():
    s, b, h = 16, 2, 32
    gather, regather = _both(s=s, b=b, h=h)
    for rank in range(T):
        assert gather[rank]["saved_adapter_input"] == s * b * h * 4
        assert regather[rank]["saved_adapter_input"] == s * b * h * 4 // T


def test_regather_adds_exactly_one_backward_gather():
    s, b, h, r = 16, 2, 32, 8
    g = run_ranks(count_collectives, T, Strategy.GATHER, timeout=120, s=s, b=b, h=h, r=r)[0]
    rg = run_ranks(count_collectives, T, Strategy.REGATHER, timeout=120, s=s, b=b, h=h, r=r)[0]
    x_gather = s * b * h * 4 * (T - 1) // T
    assert g["forward"] == rg["forward"]
    assert rg["backward"]["all_gather"] == g["backward"].get("all_gather", 0) + x_gather
    assert rg["backward"]["reduce_scatter"] == g["backward"]["reduce_scatter"] == x_gather


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_torch_checkpoint_falls_back_consistently(reentrant):
    from workers_adapter import run_checkpointed

    ref = run_ranks(run_checkpointed, T, Strategy.GATHER, reentrant=reentrant, timeout=120)
    got = run_ranks(run_checkpointed, T, Strategy.REGATHER, reentrant=reentrant, timeout=120)
    for rank in range(T):
        assert got[rank]["reason"] == (
            "running inside activation checkpointing (its recompute must save what forward saved)")
        for key in ("out", "dx", "dA", "dB"):
            _assert_identical(ref[rank][key], got[rank][key], f"rank {rank} {key}")
