"""regather.megatron.dense.te: Transformer Engine bases.

CPU part: the pure-Python routing with stand-in classes (``tests.harness.fake_te``).
GPU part (``TestRealTE``): a real ``TELayerNormColumnParallelLinear``; skips
unless transformer_engine imports and CUDA is available. Transformer Engine is
never installed on CPU machines (it breaks ``import megatron.core`` there,
docs/design.md §6), so on CPU those tests always skip with that reason.
The two-rank routing check (gathered vs local LayerNorm output, all three
strategies) is ``tests/distributed/megatron/test_te_routing.py``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from tests.harness.fake_te import TEColumnParallelLinear, TELayerNormColumnParallelLinear
from torch import nn

from regather.core.strategies import Strategy
from regather.megatron.dense import te

TE_SKIP = ("transformer_engine is not installed: it is never installed on CPU machines "
           "(docs/design.md §6); run on a CUDA machine with Transformer Engine")


# ---------------------------------------------------------------- recognition and sizes


def test_recognition_by_class_name():
    ln = TELayerNormColumnParallelLinear(16, 24, tp_group=None, sequence_parallel=False)
    col = TEColumnParallelLinear(16, 24, tp_group=None, sequence_parallel=False)
    assert te.is_te_linear(ln) and te.is_te_linear(col)
    assert te.fuses_layernorm(ln) and not te.fuses_layernorm(col)
    assert not te.is_te_linear(nn.Linear(2, 3)) and not te.fuses_layernorm(nn.Linear(2, 3))

    class Sub(TELayerNormColumnParallelLinear):  # subclasses are recognised through the MRO
        pass

    assert te.fuses_layernorm(Sub(16, 24, tp_group=None, sequence_parallel=False))


def test_column_parallel_from_parallel_mode():
    from regather.megatron.dense.linears import is_column_parallel

    col = TEColumnParallelLinear(16, 24, tp_group=None, sequence_parallel=False)
    assert is_column_parallel(col)
    col.parallel_mode = "row"  # TE's own record wins over the class name
    assert not is_column_parallel(col)


@pytest.mark.parametrize("mode,t,expect", [("column", 4, (16, 24 * 4)), ("row", 4, (16 * 4, 24)), (None, 4, (16, 24))])
def test_linear_sizes_from_te_weight(mode, t, expect):
    base = SimpleNamespace(weight=torch.empty(24, 16), parallel_mode=mode)  # TE: per-rank weight
    assert te.linear_sizes(base, column_parallel=True, tp_size=t) == expect


def test_linear_sizes_prefers_megatron_attributes():
    base = SimpleNamespace(input_size=64, output_size=96, weight=torch.empty(48, 64))
    assert te.linear_sizes(base, column_parallel=True, tp_size=2) == (64, 96)
    with pytest.raises(TypeError, match="cannot read its sizes"):
        te.linear_sizes(SimpleNamespace(weight=None), column_parallel=True, tp_size=1)


# ---------------------------------------------------------------- return forms and flags


def test_split_output_forms():
    out, bias, ln = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    assert te.split_output(((out, ln), None)) == (out, None, ln)
    assert te.split_output((out, bias, ln)) == (out, bias, ln)
    for bad in ((out, None), out, (out,)):
        with pytest.raises(TypeError, match="did not return its LayerNorm output"):
            te.split_output(bad)


@pytest.mark.parametrize("bias,skip", [(False, False), (True, True), (True, False)])
def test_call_with_layernorm_output_sets_flags_for_one_call(bias, skip):
    base = TELayerNormColumnParallelLinear(16, 24, tp_group=None, sequence_parallel=False, bias=bias,
                                           skip_bias_add=skip)
    x = torch.randn(4, 2, 16)
    out, b, ln = te.call_with_layernorm_output(base, x, gathered=False)
    assert (base.return_layernorm_output, base.return_layernorm_output_gathered) == (False, False)
    torch.testing.assert_close(ln, base.layer_norm(x))
    plain_out, plain_bias = base(x)  # flags restored: megatron's usual (out, bias)
    torch.testing.assert_close(out, plain_out)
    assert (b is None) == (not (bias and skip)) and (plain_bias is None) == (b is None)


def test_flags_restored_when_base_raises():
    class Boom(TELayerNormColumnParallelLinear):
        def forward(self, x):
            assert self.return_layernorm_output and self.return_layernorm_output_gathered
            raise RuntimeError("boom")

    base = Boom(16, 24, tp_group=None, sequence_parallel=False)
    base.return_layernorm_output_gathered = False
    with pytest.raises(RuntimeError, match="boom"):
        te.call_with_layernorm_output(base, torch.randn(4, 2, 16), gathered=True)
    assert (base.return_layernorm_output, base.return_layernorm_output_gathered) == (False, False)


def _fake_adapter(strategy=Strategy.GATHER, column=True, sp=True, t=2):
    return SimpleNamespace(column_parallel=column, sequence_parallel=sp, tp_size=t,
                           facts=SimpleNamespace(base_name="linear_qkv"), qualified_name="layers.0.linear_qkv")


@pytest.mark.parametrize(
    "used,column,sp,ub,expect",
    [
        (Strategy.GATHER, True, True, False, True),
        (Strategy.REGATHER, True, True, False, False),   # regather gathers its own local copy
        (Strategy.LOWRANK, True, True, False, False),    # lowrank never gathers x
        (Strategy.GATHER, True, False, False, False),    # no SP: nothing to gather
        (Strategy.GATHER, True, True, True, False),      # userbuffers: TE's gathered buffer is shared
    ],
)
def test_wants_gathered(used, column, sp, ub, expect):
    base = SimpleNamespace(ub_overlap_ag_fprop=ub)
    decision = SimpleNamespace(used=used)
    assert te.wants_gathered(base, _fake_adapter(column=column, sp=sp), decision) is expect


def test_received_gathered_checks_rows(caplog):
    adapter = _fake_adapter(t=2)
    x = torch.zeros(4, 2, 8)
    assert te._received_gathered(torch.zeros(8, 2, 8), x, True, adapter) is True
    assert te._received_gathered(torch.zeros(4, 2, 8), x, False, adapter) is False
    te._warned_ignored.clear()
    with caplog.at_level(logging.INFO, logger="regather"):  # an old TE ignored the request
        assert te._received_gathered(torch.zeros(4, 2, 8), x, True, adapter) is False
        assert te._received_gathered(torch.zeros(4, 2, 8), x, True, adapter) is False
    assert sum("gathering it here" in r.message for r in caplog.records) == 1  # logged once
    with pytest.raises(RuntimeError, match="6 rows for an input of 4 rows"):
        te._received_gathered(torch.zeros(6, 2, 8), x, False, adapter)


# ---------------------------------------------------------------- LoRA on a TE-style base, one rank


def test_lora_feeds_layernorm_output_to_adapter(single_rank_group):
    """TP=1: the adapter must see LN(x), not the pre-norm x; output = base + scale * B A LN(x)."""
    from regather import LoRA

    torch.manual_seed(0)
    base = TELayerNormColumnParallelLinear(16, 24, tp_group=single_rank_group, sequence_parallel=False,
                                           bias=True, skip_bias_add=True)
    model = nn.Module()
    model.linear_qkv = base
    LoRA(target_modules=["linear_qkv"], dim=4, alpha=8, lora_B_init_method="normal")(model)
    lora = model.linear_qkv
    adapter = lora.adapter
    assert lora.te_layernorm and (adapter.linear_in.weight.shape, adapter.linear_out.weight.shape) == (
        (4, 16), (24, 4))
    x = (torch.randn(6, 2, 16) * 3 + 1).requires_grad_()
    out, bias = lora(x)
    a, b = adapter.linear_in.weight, adapter.linear_out.weight
    with torch.no_grad():
        plain_out, plain_bias = base(x)
        expect = plain_out + (base.layer_norm(x) @ a.t() @ b.t()) * 2.0
        wrong = plain_out + (x @ a.t() @ b.t()) * 2.0  # what feeding the pre-norm input would give
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, wrong, atol=1e-3)
    assert torch.equal(bias, plain_bias)
    out.sum().backward()
    assert a.grad is not None and a.grad.abs().sum() > 0 and x.grad is not None
    assert (base.return_layernorm_output, base.return_layernorm_output_gathered) == (False, False)


def test_adapter_rejects_input_gathered_off_the_gather_path(single_rank_group):
    from regather import ParallelLinearAdapter

    adapter = ParallelLinearAdapter(16, 24, 4, column_parallel=True, base_name="linear_qkv",
                                    tp_group=single_rank_group, sequence_parallel=True)
    with pytest.raises(ValueError, match="input_gathered=True needs a column-parallel base with sequence"):
        adapter(torch.randn(4, 2, 16), input_gathered=True)  # t == 1: SP comm is off


def test_te_column_parallel_base_uses_plain_path(single_rank_group):
    from regather import LoRA

    model = nn.Module()
    model.linear_fc1 = TEColumnParallelLinear(16, 24, tp_group=single_rank_group, sequence_parallel=False)
    LoRA(target_modules=["linear_fc1"], dim=4, lora_B_init_method="normal")(model)
    assert not model.linear_fc1.te_layernorm
    x = torch.randn(3, 2, 16)
    out, _ = model.linear_fc1(x)
    assert out.shape == (3, 2, 24)


# ---------------------------------------------------------------- real Transformer Engine (GPU)


@pytest.fixture
def real_te(tmp_path):
    """megatron + TE on one CUDA device, TP=1 (NCCL cannot run two ranks on one GPU)."""
    pytest.importorskip("transformer_engine", reason=TE_SKIP)
    if not torch.cuda.is_available():
        pytest.skip("Transformer Engine tests need a CUDA device")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    model_parallel_cuda_manual_seed(123)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _te_base(bias: bool, skip_bias_add: bool, h=64, o=96):
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear as Real
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=4, bf16=True,
                               params_dtype=torch.bfloat16, sequence_parallel=False)
    init = lambda w: torch.nn.init.normal_(w, std=0.02)
    return Real(h, o, config=config, init_method=init, gather_output=False, bias=bias,
                skip_bias_add=skip_bias_add, is_expert=False, tp_comm_buffer_name="qkv")


class TestRealTE:
    @pytest.mark.parametrize("bias,skip", [(False, False), (True, True)])
    def test_return_forms(self, real_te, bias, skip):
        base = _te_base(bias, skip)
        x = torch.randn(8, 2, 64, device="cuda", dtype=torch.bfloat16)
        out, b, ln = te.call_with_layernorm_output(base, x, gathered=False)
        assert ln.shape == x.shape and out.shape == (8, 2, 96)
        assert (b is not None) == (bias and skip)
        ref = torch.nn.functional.layer_norm(x.float(), (64,), base.layer_norm_weight.float(),
                                             base.layer_norm_bias.float(), base.eps)
        torch.testing.assert_close(ln.float(), ref, rtol=2e-2, atol=2e-2)
        assert (base.return_layernorm_output, base.return_layernorm_output_gathered) == (False, False)

    def test_lora_on_real_te_layernorm_linear(self, real_te):
        from regather import LoRA

        base = _te_base(True, False)
        model = nn.Module()
        model.linear_qkv = base
        LoRA(target_modules=["linear_qkv"], dim=8, alpha=16, lora_B_init_method="normal")(model)
        lora = model.linear_qkv
        assert lora.te_layernorm
        x = torch.randn(8, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out, _ = lora(x)
        a, b = lora.adapter.linear_in.weight, lora.adapter.linear_out.weight
        with torch.no_grad():
            plain, _ = base(x)
            ln = torch.nn.functional.layer_norm(x.float(), (64,), base.layer_norm_weight.float(),
                                                base.layer_norm_bias.float(), base.eps)
            expect = plain.float() + (ln @ a.float().t() @ b.float().t()) * 2.0
        torch.testing.assert_close(out.float(), expect, rtol=3e-2, atol=3e-2)
        out.float().square().mean().backward()
        assert a.grad is not None and torch.isfinite(a.grad).all() and a.grad.abs().sum() > 0
        assert torch.isfinite(x.grad).all()
