"""Early re-gather (gather started when dout arrives, dA after the base dgrad) on two gloo
ranks: bit-exact with the gather path and with plain regather, fused main_grad, grad-ready
hooks after main_grad is complete, interleaved micro-batches, a real megatron-core GPT.
One spawn for everything."""

import functools

import pytest
import torch
from workers_early import early_suite

from regather.tools.cpu.dist import run_ranks

T = 2
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
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
        if fuse:  # dA went to main_grad; autograd handed megatron's placeholder to the hook
            assert early["grad_none_at_hook"] and not any(early["grad_none_at_hook"])


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


def test_shared_sequence_gather_bit_exact_and_saves_one_gather_and_one_reduce_scatter():
    for rank, res in enumerate(suite()):
        gpt = res["gpt"]
        s, b, h, layers = gpt["shape"]
        base = gpt["gather_shared"]
        for v in ("plain_shared", "early_shared"):  # both sides share: numerics match bit for bit
            for step, (lg, lv) in enumerate(zip(base["losses"], gpt[v]["losses"])):
                same(lg, lv, f"rank {rank} {v} loss step {step}")
            for name, g in base["grads"].items():
                same(g, gpt[v]["grads"][name], f"rank {rank} {v} {name}")
        # against the unshared path only the input-gradient summation order differs
        torch.testing.assert_close(base["losses"][-1], gpt["gather"]["losses"][-1], rtol=1e-5, atol=0)
        # counted bytes: per eligible adapter (linear_qkv, linear_fc1 per layer) one all-gather
        # of x in forward and one reduce-scatter in backward fewer, s*b*h*(t-1)/t fp32 each
        x_bytes = s * b * h * 4 * (T - 1) // T
        n = 2 * layers
        for v in ("gather", "plain", "early"):
            un, sh = gpt[v]["comm"], gpt[v + "_shared"]["comm"]
            assert un["forward"]["all_gather"] - sh["forward"]["all_gather"] == n * x_bytes, v
            # layer 0's linear_qkv input (norm of the frozen embedding) needs no gradient:
            # neither path reduce-scatters there
            assert un["backward"]["reduce_scatter"] - sh["backward"]["reduce_scatter"] == (n - 1) * x_bytes, v
            assert un["backward"].get("all_gather", 0) == sh["backward"].get("all_gather", 0), v
            assert gpt[v]["saved"] == gpt[v + "_shared"]["saved"], f"{v}: retained bytes unchanged"
        # regather keeps x_local instead of x_full for each eligible adapter (the row-parallel
        # adapters' inputs are counted under the same label on both)
        saving = gpt["gather_shared"]["saved"]["adapter_input"] - gpt["plain_shared"]["saved"]["adapter_input"]
        assert saving == n * s * b * h * 4 * (T - 1) // T
