"""Early re-gather (gather started when dout arrives, dA after the base dgrad) on two gloo
ranks: bit-exact with the gather path and with plain regather, fused main_grad, grad-ready
hooks after main_grad is complete, interleaved micro-batches, a real megatron-core GPT.
One spawn for everything."""

import functools

import pytest
import torch

from regather.testing.dist import run_ranks

from workers_early import early_suite

T = 2
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]
ORDERS = ["seq", "f1 f2 b2 b1", "f1 f2 b1 b2", "joint"]


@functools.lru_cache(maxsize=1)
def suite():
    return run_ranks(early_suite, T, timeout=200)


def same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype and a.shape == b.shape, what
    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def _check_identical(g, r, what):
    for mb in range(2):
        same(g["out"][mb], r["out"][mb], f"{what} mb {mb} output")
        same(g["dx"][mb], r["dx"][mb], f"{what} mb {mb} input grad")
    same(g["dA"], r["dA"], f"{what} dA")
    same(g["dB"], r["dB"], f"{what} dB")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("order", ORDERS)
def test_early_regather_bit_exact_interleaved(dtype, fuse, order):
    for rank, res in enumerate(suite()):
        runs = {v: res["adapter"][(dtype, fuse, order, v)] for v in ("gather", "plain", "early")}
        for v in ("plain", "early"):
            _check_identical(runs["gather"], runs[v], f"rank {rank} {order} {v}")
        assert runs["gather"]["dA"].abs().max() > 0
        early = runs["early"]
        assert early["leased_after"] == 0, "every scratch lease was released"
        for ptrs in early["overlapping_ptrs"]:  # two gathers in flight never share a buffer
            assert len(set(ptrs)) == len(ptrs)
        if order == "joint":
            assert early["max_in_flight"] == 2, "both micro-batches' gathers were in flight together"
        if fuse:
            assert early["A_grad_none"], "fused: dA went to main_grad only"


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("order", ORDERS)
def test_grad_ready_hook_sees_complete_gradient(fuse, order):
    for res in suite():
        run = res["adapter"][("float32", fuse, order, "early")]
        seen, after = run["hook_seen"], run["after_backward"]
        assert len(seen) == len(after) >= 1, "one grad-ready hook per backward"
        for s, a in zip(seen, after):  # a deferral firing the hook before dA would differ
            same(s, a, f"{order}: LoRA-A gradient at its grad-ready hook")


def test_early_gather_without_input_grad():
    for res in suite():
        runs = {v: res["adapter"][("float32", True, "no_x_grad", v)] for v in ("gather", "plain", "early")}
        _check_identical(runs["gather"], runs["early"], "x.requires_grad=False")
        assert runs["early"]["dx"] == [None, None]
        assert runs["early"]["leased_after"] == 0


def test_gpt_losses_and_grads_bit_exact():
    for rank, res in enumerate(suite()):
        gpt = res["gpt"]
        assert gpt["early"]["used"] == ["gather", "regather"]  # row-parallel bases stay on gather
        for v in ("plain", "early"):
            for step, (lg, lv) in enumerate(zip(gpt["gather"]["losses"], gpt[v]["losses"])):
                same(lg, lv, f"rank {rank} {v} loss step {step}")
            assert gpt["gather"]["grads"].keys() == gpt[v]["grads"].keys()
            for name, g in gpt["gather"]["grads"].items():
                same(g, gpt[v]["grads"][name], f"rank {rank} {v} {name}")
