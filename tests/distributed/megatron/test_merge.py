"""Merge LoRA into the TP-sharded base weights and unmerge it (TP=2, GQA, gated MLP, fp32).

Tolerance: merged/unmerged logits within rtol=1e-5, atol=1e-5 of the adapter model's
(W + scale*B@A is one fp32 rounding away from W x + scale*B(A x)); unmerge by subtraction
restores the weights to 1e-6; keep_original=True restores them exactly."""

import pytest
import torch
from workers_peft import merge_roundtrip

from regather import Strategy
from regather.tools.cpu.dist import run_ranks

T = 2
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def mr():
    return run_ranks(merge_roundtrip, T, timeout=240)


@pytest.mark.parametrize("strategy", [s.value for s in Strategy])
def test_merge_then_unmerge_keeps_outputs(mr, strategy):
    for rank in range(T):
        r = mr[rank][strategy]
        assert len(r["paths"]) == 8 and r["lora_left_when_merged"] == 0
        torch.testing.assert_close(r["merged"], r["before"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["after"], r["before"], rtol=1e-5, atol=1e-5)
        assert r["weight_err"] <= 1e-6
        assert r["exact_restore"] and r["still_merged"] == [] and r["lora_after"] == 8


def test_merge_refuses_active_dropout_and_changes_nothing(mr):
    for rank in range(T):
        msg = mr[rank]["dropout_error"]
        assert msg and "p=0.1" in msg and "eval" in msg, msg
        assert mr[rank]["dropout_unchanged"]
