"""regather.core.peak on one process: the chunk rule, LoRA-B added into the base's output in place
(bit for bit the classic expression when alpha/dim is a power of two, within the fp64 rule otherwise),
gradient-accumulation fusion, bad input, and the bytes: one chunk at most, counted by the allocator."""

import pytest
import torch
from tests.harness.numerics import check_rounding

from regather.core.allocated import AllocatedBytes
from regather.core.peak import chunks
from regather.core.peak.output import lora_into_output_, lora_into_output_ref

N, OUT, R = 64, 48, 4


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 1 KiB: 8 chunks of a [64, 48] fp32 output (12 KiB), so the loop runs."""
    monkeypatch.setenv("REGATHER_MIN_CHUNK_BYTES", "1024")


def test_chunk_rule_covers_the_rows_in_at_most_eight_chunks(monkeypatch):
    monkeypatch.setenv("REGATHER_MIN_CHUNK_BYTES", "1024")
    for rows, row_bytes in ((64, 192), (7, 4096), (1, 10), (1000, 4)):
        parts = chunks.row_chunks(rows, row_bytes)
        covered = [i for s in parts for i in range(s.start, s.stop)]
        assert covered == list(range(rows)), (rows, parts)
        assert len(parts) <= chunks.MAX_CHUNKS
        if rows * row_bytes >= 2 * 1024 * chunks.MAX_CHUNKS and rows >= chunks.MAX_CHUNKS:
            assert len(parts) == chunks.MAX_CHUNKS  # large: 1/8 of the tensor per chunk
    monkeypatch.delenv("REGATHER_MIN_CHUNK_BYTES")
    # Qwen3-8B's fc1 at TP2 (gate and up: 12,288 columns), bf16: 201 MB at 8k tokens, eight 25 MB chunks;
    # at 1k tokens 25 MB, under two 16 MiB chunks: one piece
    assert chunks.row_chunks(8192, 12288 * 2) == [slice(i, i + 1024) for i in range(0, 8192, 1024)]
    assert chunks.row_chunks(1024, 12288 * 2) == [slice(0, 1024)]


def test_a_bad_minimum_chunk_size_is_refused(monkeypatch):
    monkeypatch.setenv("REGATHER_MIN_CHUNK_BYTES", "-3")
    with pytest.raises(ValueError, match="REGATHER_MIN_CHUNK_BYTES must be a positive number of bytes, got '-3'"):
        chunks.row_chunks(64, 192)


def _operands(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(N // 2, 2, OUT, generator=g).to(dtype)
    mid = torch.randn(N // 2, 2, R, generator=g).to(dtype)
    b = torch.randn(OUT, R, generator=g).to(dtype)
    dy = torch.randn(N // 2, 2, OUT, generator=g).to(dtype)
    return base, mid, b, dy


def _classic(base, mid, b, scale, dy, cols=None):
    base, mid, b = (t.clone().requires_grad_() for t in (base, mid, b))
    y = lora_into_output_ref(base * 1, mid, b, scale, cols)
    y.backward(dy)
    return y.detach(), base.grad, mid.grad, b.grad


def _lean(base, mid, b, scale, dy, cols=None, fuse=False):
    base, mid, b = (t.clone().requires_grad_() for t in (base, mid, b))
    if fuse:
        b.main_grad = torch.zeros(b.shape, dtype=torch.float32)
    out = base * 1  # a non-leaf, as a base layer's output is
    y = lora_into_output_(out, torch.ops.aten.mul.Scalar(mid, scale), b, fuse, cols=cols)
    assert y is out  # in place
    y.backward(dy)
    return y.detach(), base.grad, mid.grad, (b.main_grad if fuse else b.grad)


@pytest.mark.parametrize("scale", [1.0, 2.0, 0.25])
@pytest.mark.parametrize("cols", [None, slice(16, 40)])
def test_bit_for_bit_the_classic_expression_when_the_scale_is_a_power_of_two(small_chunks, scale, cols):
    base, mid, b, dy = _operands()
    if cols is not None:
        b = b[: cols.stop - cols.start].contiguous()
    for got, want, what in zip(_lean(base, mid, b, scale, dy, cols), _classic(base, mid, b, scale, dy, cols),
                               ("out", "d base", "d mid", "dB")):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, w=what: f"{w}: {m}")


def test_another_scale_rounds_within_the_fp64_rule(small_chunks):
    scale = 16 / 6  # alpha 16, dim 6: not a power of two, so the rank-r side rounds otherwise
    base, mid, b, dy = _operands()
    ref64 = _classic(*(t.double() for t in (base, mid, b)), scale, dy.double())
    ref32 = _classic(base, mid, b, scale, dy)
    for got, r32, r64, what in zip(_lean(base, mid, b, scale, dy), ref32, ref64, ("out", "d base", "d mid", "dB")):
        check_rounding(got, r32, r64, what)


def test_fused_accumulation_matches_the_classic_fused_path(small_chunks):
    from regather.core.wgrad import linear

    base, mid, b, dy = _operands(torch.bfloat16)
    got = _lean(base, mid, b, 2.0, dy, fuse=True)[3]
    w = b.clone().requires_grad_()
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    out = torch.ops.aten.mul.Scalar(linear(mid.clone().requires_grad_(), w, True), 2.0)
    (base + out).backward(dy)
    torch.testing.assert_close(got, w.main_grad, rtol=0, atol=0)


def test_bad_outputs_are_refused_before_anything_changes():
    base, mid, b, _ = _operands()
    out = base.transpose(0, 1)  # not contiguous
    before = out.clone()
    with pytest.raises(ValueError, match=r"must be contiguous \(got shape \(2, 32, 48\)"):
        lora_into_output_(out, mid.transpose(0, 1), b)
    with pytest.raises(ValueError, match=r"LoRA-B has 48 output features, the base's output columns slice\(0, 8, None\) hold 8"):
        lora_into_output_(base.clone(), mid, b, cols=slice(0, 8))
    torch.testing.assert_close(out, before, rtol=0, atol=0)


def test_the_step_holds_one_chunk_of_lora_output_at_most(small_chunks):
    """Allocator bytes of forward + backward over the base alone: the classic expression holds LoRA's
    output, its scaled copy and the sum (and the scale's gradient); the lean one a chunk and the rank-r
    tensors."""
    base, mid, b, dy = _operands()
    w_bytes = base.numel() * base.element_size()

    def step(fn):
        peaks = []
        for _ in range(3):
            with AllocatedBytes() as a:
                fn()
            peaks.append(a.peak)
        return min(peaks)

    def frozen():
        (base.clone().requires_grad_() * 1).backward(dy)

    over_classic = step(lambda: _classic(base, mid, b, 2.0, dy)) - step(frozen)
    over_lean = step(lambda: _lean(base, mid, b, 2.0, dy)) - step(frozen)
    chunk = chunks.row_chunks(N, OUT * 4)[0]
    rank_r = 3 * mid.numel() * 4 + 2 * b.numel() * 4  # mid, its scaled copy and gradient; B's copy and gradient
    print(f"over the base alone: classic {over_classic} B, lean {over_lean} B (W = {w_bytes} B)")
    assert over_classic >= w_bytes, (over_classic, w_bytes)  # at least one full-width LoRA tensor at once
    assert over_lean <= (chunk.stop - chunk.start) * OUT * 4 + rank_r, (over_lean, w_bytes)
