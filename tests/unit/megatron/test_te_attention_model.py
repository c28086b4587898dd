"""The TE model's attention on one process (tests.harness.te_model.attention, .attention_kernels):
TE's FusedAttention without context parallelism against torch's SDPA, THD's per-sequence masks, the
facts LoRA's byte counts rest on (the output is a view of what TE saves), and the refusals. The
context-parallel Functions run on gloo ranks: tests/distributed/megatron/test_te_context_parallel.py."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from tests.harness.numerics import check_rounding
from tests.harness.te_model.attention import FusedAttnFunc, TEDotProductAttention
from tests.harness.te_model.attention_kernels import SBHDHalves, THDHalves, segment_ids, tile_mask

S, B, H, HK, D = 12, 2, 4, 2, 8
CU = torch.tensor([0, 4, 10, 12], dtype=torch.int32)


def inputs(b=B, dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(S, b, n, D, generator=g, dtype=torch.float64).to(dtype) for n in (H, HK, HK, H)]


def sdpa(q, k, v):
    """Causal attention ``[s, b, h, d]`` by torch (keys repeated per GQA group)."""
    k, v = (x.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for x in (k, v))
    return F.scaled_dot_product_attention(*(x.permute(1, 2, 0, 3) for x in (q, k, v)), is_causal=True).permute(2, 0, 1, 3)


def sdpa_per_sequence(q, k, v):
    bounds = CU.tolist()
    return torch.cat([sdpa(q[a:e], k[a:e], v[a:e]) for a, e in itertools.pairwise(bounds)])


def run(fn, q, k, v, dout):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach(), *(x.grad for x in leaves)]


@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
def test_fused_attention_against_sdpa(fmt):
    """fp32 model against fp64 SDPA, within 3x fp32 SDPA's own error: out, dq, dk, dv (GQA)."""
    b = 1 if fmt == "thd" else B
    scale = D ** -0.5
    seg = segment_ids(CU) if fmt == "thd" else None
    mask = tile_mask(S, S, True, seg, seg)
    ref = sdpa_per_sequence if fmt == "thd" else sdpa
    got = run(lambda q, k, v: FusedAttnFunc.apply(q, k, v, scale, mask), *inputs(b, torch.float32))
    ref32, ref64 = run(ref, *inputs(b, torch.float32)), run(ref, *inputs(b))
    for name, g, r32, r64 in zip(("out", "dq", "dk", "dv"), got, ref32, ref64):
        check_rounding(g, r32, r64, f"{fmt} {name}")


def test_masks():
    causal = tile_mask(4, 4, True)
    assert torch.equal(causal, torch.ones(4, 4, dtype=torch.bool).tril())
    bottom_right = tile_mask(2, 6, True)  # the all-gather path's shorter query chunk
    assert torch.equal(bottom_right, torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool))
    seg = segment_ids(torch.tensor([0, 2, 5], dtype=torch.int32))
    assert seg.tolist() == [0, 0, 1, 1, 1]
    block = tile_mask(5, 5, True, seg, seg)
    expect = torch.zeros(5, 5, dtype=torch.bool)
    expect[:2, :2] = torch.ones(2, 2, dtype=torch.bool).tril()
    expect[2:, 2:] = torch.ones(3, 3, dtype=torch.bool).tril()
    assert torch.equal(block, expect)
    assert tile_mask(3, 3, False) is None


def test_thd_halves_are_the_rank_chunks_of_each_sequence():
    """A CP rank's THD tokens: per sequence, its chunk r then chunk 2·cp − 1 − r; the halves are those."""
    halves = THDHalves.of(torch.tensor([0, 4, 6, 10], dtype=torch.int32))
    assert halves.first.tolist() == [0, 1, 4, 6, 7] and halves.second.tolist() == [2, 3, 5, 8, 9]
    x = torch.arange(10.0).view(10, 1)
    one = THDHalves.of(torch.tensor([0, 10], dtype=torch.int32))  # one sequence: the sbhd views
    for h in (0, 1):
        assert torch.equal(one.read(x, h), SBHDHalves(10).read(x, h))
    grad, part = torch.zeros(10, 1), torch.ones(5, 1)
    halves.correct(grad, part, "none", "add")
    assert grad.view(-1).tolist() == [0, 0, 1, 1, 0, 1, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="multiple of 2·cp"):
        THDHalves.of(torch.tensor([0, 3], dtype=torch.int32))


def attention(**overrides):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**{"num_layers": 1, "hidden_size": H * D, "num_attention_heads": H,
                                  "num_query_groups": HK, "use_cpu_initialization": True, "attention_dropout": 0.0,
                                  **overrides})
    return TEDotProductAttention(config, 1, AttnMaskType.causal, "self"), AttnMaskType.causal


def test_module_returns_a_view_of_the_output_te_saves():
    """megatron's ``linear_proj`` gets ``out.view(..., h·d)`` of the tensor TE saved for backward: a
    LoRA adapter keeping that input adds no bytes."""
    module, mask_type = attention()
    q, k, v, _ = (x.float().requires_grad_() for x in inputs())
    out = module(q, k, v, None, mask_type)
    assert out.shape == (S, B, H * D)
    node = out.grad_fn.next_functions[0][0]  # the view's input: the model's FusedAttnFunc
    assert type(node).__name__ == "FusedAttnFuncBackward"
    saved_out = node.saved_tensors[3]
    assert saved_out.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    torch.testing.assert_close(out.view(S, B, H, D), sdpa(q.detach(), k.detach(), v.detach()))


def test_module_thd_through_packed_seq_params():
    from megatron.core.packed_seq_params import PackedSeqParams

    module, mask_type = attention()
    q, k, v, _ = (x[:, 0].float() for x in inputs(1))
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=CU, cu_seqlens_kv=CU, max_seqlen_q=6, max_seqlen_kv=6)
    out = module(q, k, v, None, mask_type, packed_seq_params=packed)
    assert out.shape == (S, H * D)
    expect = sdpa_per_sequence(*(x.unsqueeze(1) for x in (q, k, v))).squeeze(1)
    torch.testing.assert_close(out.view(S, H, D), expect)


def test_refusals_name_the_value():
    from megatron.core.packed_seq_params import PackedSeqParams

    module, mask_type = attention(attention_dropout=0.1)
    q, k, v, _ = (x.float() for x in inputs())
    with pytest.raises(NotImplementedError, match=r"dropout 0\.1"):
        module.train()(q, k, v, None, mask_type)
    module, mask_type = attention()
    with pytest.raises(NotImplementedError, match="bias"):
        module(q, k, v, None, mask_type, attention_bias=torch.zeros(1))
    padded = PackedSeqParams(qkv_format="thd", cu_seqlens_q=CU, cu_seqlens_kv=CU, cu_seqlens_q_padded=CU * 2,
                             max_seqlen_q=6, max_seqlen_kv=6)
    with pytest.raises(NotImplementedError, match="padding between sequences"):
        module(q[:, 0], k[:, 0], v[:, 0], None, mask_type, packed_seq_params=padded)
    with pytest.raises(NotImplementedError, match="window_size"):
        attention(window_size=(4, 0))
