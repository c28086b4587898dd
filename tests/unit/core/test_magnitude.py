"""regather.core.peak.magnitude and .rebuild on one process: DoRA's magnitude against Megatron Bridge's
expression (fp64 bit-close, fp32 within the fp64 rule), the norm without the merged weight, when a gradient
may be scaled in place, and the bytes: the rebuild keeps no full-width tensor, scales ``z`` in place."""

import typing

import pytest
import torch
from tests.harness.numerics import check_rounding

from regather.core.allocated import AllocatedBytes
from regather.core.peak.magnitude import (
    exclusive,
    row_norm_direct,
    row_norm_lean,
    scale_by_magnitude,
    scale_by_magnitude_ref,
)
from regather.core.peak.rebuild import LOCAL, OutputRebuild

S, B, H, OUT, R, SCALE = 32, 2, 16, 24, 4, 2.0


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setenv("REGATHER_MIN_CHUNK_BYTES", "512")  # several chunks of [64, 24]


def _operands(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    w0 = torch.randn(OUT, H, generator=g, dtype=torch.float64) * 0.3
    a = torch.randn(R, H, generator=g, dtype=torch.float64) * 0.3
    b = torch.randn(OUT, R, generator=g, dtype=torch.float64) * 0.3
    m = torch.rand(OUT, generator=g, dtype=torch.float64) + 0.5
    dy = torch.randn(S, B, OUT, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (x, w0, a, b, m, dy))


def _dora(dtype, mode):
    """``(y, dm, dx, dB)`` of one DoRA linear: Bridge's expression (``mode="ref"``), ``z`` kept or rebuilt."""
    x, w0, a, b, m, dy = _operands(dtype)
    x, b, m = x.requires_grad_(), b.requires_grad_(), m.requires_grad_()
    n = row_norm_direct(w0, a, b.detach(), SCALE)
    mid_s = (x @ a.t()) * SCALE
    z = x @ w0.t() + mid_s @ b.t()
    if mode == "ref":
        y = scale_by_magnitude_ref(z, m, n)
    else:
        rebuild = OutputRebuild(LOCAL, w0, b.detach(), mid_s, x=x) if mode == "rebuild" else None
        y = scale_by_magnitude(z, m, n, rebuild)
    (y * dy).sum().backward()
    return y.detach(), m.grad, x.grad, b.grad


@pytest.mark.parametrize("mode", ["keep", "rebuild"])
def test_magnitude_against_bridges_expression(small_chunks, mode):
    ref64, ref32 = _dora(torch.float64, "ref"), _dora(torch.float32, "ref")
    got64, got32 = _dora(torch.float64, mode), _dora(torch.float32, mode)
    for what, g64, r64, g32, r32 in zip(("y", "dm", "dx", "dB"), got64, ref64, got32, ref32):
        torch.testing.assert_close(g64, r64, rtol=1e-12, atol=1e-12, msg=what)  # the same function
        check_rounding(g32, r32, r64, f"{mode} {what}")  # dm's token sum in chunks: another order


def test_lean_norm_is_the_direct_norm():
    _, w0, a, b, _, _ = _operands(torch.float64)
    torch.testing.assert_close(row_norm_lean(w0, a, b, SCALE), row_norm_direct(w0, a, b, SCALE), rtol=1e-12, atol=0)
    lean32 = row_norm_lean(w0.float(), a.float(), b.float(), SCALE)
    check_rounding(lean32, row_norm_direct(w0.float(), a.float(), b.float(), SCALE), row_norm_direct(w0, a, b, SCALE))


class _Probe(torch.autograd.Function):
    seen: typing.ClassVar[list] = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _Probe.seen.append(exclusive(grad))
        return grad


def _exclusive_when(make_loss) -> bool:
    _Probe.seen.clear()
    x = torch.randn(4, 3, requires_grad=True)
    make_loss(_Probe.apply(x), x)
    return _Probe.seen[-1]


def test_a_gradient_is_changed_in_place_only_when_nothing_else_holds_it():
    held = torch.randn(4, 3)
    other = torch.randn(4, 3, requires_grad=True)
    assert _exclusive_when(lambda y, x: (y * 2).sum().backward())  # fresh from the next op's backward
    assert not _exclusive_when(lambda y, x: y.backward(held))  # the caller holds it
    assert not _exclusive_when(lambda y, x: (y + x * 3).backward(held.clone()))  # the other branch's too
    assert not _exclusive_when(lambda y, x: (y + other).backward(held.clone()))  # a leaf's .grad-to-be
    assert not _exclusive_when(lambda y, x: (y.view(12) * 2).sum().backward())  # a view of another's storage
    assert not _exclusive_when(lambda y, x: torch.autograd.grad((y * 2).sum(), x, create_graph=True))


def test_the_rebuild_keeps_nothing_full_width_and_scales_in_place():
    x, w0, a, b, m, dy = _operands(torch.float32)
    x, m = x.requires_grad_(), m.requires_grad_()
    with torch.no_grad():
        n = row_norm_lean(w0, a, b, SCALE)
    mid_s = (x @ a.t()) * SCALE
    z = torch.addmm(torch.zeros(()), x.view(-1, H), w0.t()).view(S, B, OUT) + (mid_s @ b.t())
    with AllocatedBytes() as counted:
        y = scale_by_magnitude(z, m, n, OutputRebuild(LOCAL, w0, b, mid_s, x=x))
    assert y.data_ptr() == z.data_ptr()  # z scaled where it lies
    assert counted.alive < OUT * 4 * 4  # magnitude-sized only (the scale); no [s, b, o] tensor
    (y * dy).sum().backward()  # backward's bytes: tests/distributed/megatron/test_peak_dora.py
    assert m.grad is not None and x.grad is not None


def test_a_bad_rebuild_is_refused():
    _, w0, _, b, _, _ = _operands(torch.float32)
    with pytest.raises(ValueError, match="unknown output rebuild 'nope'"):
        OutputRebuild("nope", w0, b, b, x=b)
    with pytest.raises(ValueError, match="the regather slot goes with 'slot' only"):
        OutputRebuild(LOCAL, w0, b, b)
