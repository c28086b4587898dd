"""ParallelLinearAdapter on one rank: run-time decisions, logging once, input errors."""

import logging

import pytest
import torch
import torch.utils.checkpoint

from regather import ParallelLinearAdapter, Strategy


def make(group, **kw):
    args = dict(column_parallel=True, base_name="linear_qkv", tp_group=group, sequence_parallel=True,
                strategy="regather", lora_B_init_method="normal")
    args.update(kw)
    return ParallelLinearAdapter(16, 24, 4, **args)


def test_tp1_falls_back_with_reason_and_logs_once(single_rank_group, caplog):
    adapter = make(single_rank_group)
    x = torch.randn(8, 2, 16, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="regather"):
        adapter(x).sum().backward()
        adapter(x).sum().backward()
    d = adapter.last_decision
    assert (d.requested, d.used, d.reason) == (Strategy.REGATHER, Strategy.GATHER, "sequence parallelism is off for 'linear_qkv'")
    records = [r for r in caplog.records if r.name == "regather"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "sequence parallelism is off" in records[0].getMessage()


def test_runtime_state_reasons(single_rank_group):
    adapter = make(single_rank_group)
    x = torch.randn(8, 2, 16, requires_grad=True)
    adapter.eval()
    adapter(x)
    assert adapter.last_decision.reason == "module is in eval mode"
    adapter.train()
    with torch.no_grad():
        adapter(x)
    assert adapter.last_decision.reason == "autograd is disabled (torch.no_grad / inference_mode)"
    for reentrant in (False, True):
        # the recompute in backward is the adapter's last forward
        torch.utils.checkpoint.checkpoint(adapter, x, use_reentrant=reentrant).sum().backward()
        assert adapter.last_decision.reason == "running inside activation checkpointing (its recompute must save what forward saved)"
    adapter.linear_in.weight.requires_grad_(False)
    adapter(x)
    assert adapter.last_decision.reason == "LoRA-A weight is frozen (requires_grad=False)"


def test_gather_request_has_no_reason(single_rank_group):
    adapter = make(single_rank_group, strategy="gather")
    adapter(torch.randn(4, 1, 16))
    assert adapter.last_decision.reason is None and adapter.last_decision.used == Strategy.GATHER


@pytest.mark.parametrize(
    "x, match",
    [
        (torch.randn(4, 1, 16, dtype=torch.float64), r"input is torch.float64 on cpu, but the adapter weights are torch.float32 on cpu"),
        (torch.randn(4, 1, 15), r"input shape \(4, 1, 15\) does not end in 16 features"),
    ],
)
def test_bad_input_is_named(single_rank_group, x, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make(single_rank_group)(x)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(dim=0), "LoRA dim must be a positive integer, got 0"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
        (dict(dropout_position="mid"), "dropout_position must be one of .* got 'mid'"),
        (dict(lora_A_init_method="orthogonal"), "lora_A_init_method must be one of .* got 'orthogonal'"),
        (dict(strategy="fast"), "unknown strategy 'fast'"),
    ],
)
def test_bad_construction_is_named(single_rank_group, kw, match):
    dim = kw.pop("dim", 4)
    args = dict(column_parallel=True, base_name="linear_qkv", tp_group=single_rank_group)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        ParallelLinearAdapter(16, 24, dim, **args)


def test_xavier_a_zero_b_defaults_give_zero_output(single_rank_group):
    adapter = ParallelLinearAdapter(16, 24, 4, column_parallel=True, base_name="linear_qkv",
                                    tp_group=single_rank_group)
    assert adapter.scale == 1.0
    assert torch.count_nonzero(adapter.linear_out.weight) == 0
    assert torch.count_nonzero(adapter.linear_in.weight) == adapter.linear_in.weight.numel()
    assert torch.count_nonzero(adapter(torch.randn(4, 1, 16))) == 0
