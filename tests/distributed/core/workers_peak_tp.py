"""Rank bodies for test_peak_tp.py: a row-parallel LoRA-B on the rows this rank outputs, and the input
junction, against the classic compositions they replace, on two gloo ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from regather.core import mappings
from regather.core.allocated import AllocatedBytes
from regather.core.peak.junction import InputGradParts, attach
from regather.core.peak.row import row_lora_into_output_
from regather.core.wgrad import linear

S, B, OUT, R, H = 32, 2, 48, 4, 40
SCALE = 2.0


def _full(seed, *shape, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _row_inputs(rank, t, sp, dtype):
    """This rank's TP-partial ``x_i A_i^T`` (whole sequence), LoRA-B rows, the base's output and its
    gradient (the sequence shard under SP, else whole), from full tensors seeded alike on every rank."""
    partial = _full(10 + rank, S, B, R, dtype=dtype)
    b_i = _full(20, OUT, R, dtype=dtype).chunk(t, 0)[rank].contiguous()
    base, dy = _full(30, S, B, OUT, dtype=dtype), _full(40, S, B, OUT, dtype=dtype)
    if sp:
        base, dy = base.chunk(t, 0)[rank].contiguous(), dy.chunk(t, 0)[rank].contiguous()
    return partial, b_i, base, dy


def row_classic(rank, t, sp, dtype):
    """The classic row adapter's LoRA-B: mid all-reduced for the whole sequence, output columns gathered,
    the sequence shard kept, the scale on the output."""
    group = dist.group.WORLD
    partial, b_i, base, dy = _row_inputs(rank, t, sp, dtype)
    partial, b_i = partial.requires_grad_(), b_i.requires_grad_()
    mid = mappings.copy_to_group(mappings.reduce_from_group(partial, group), group)
    out = mappings.gather_last_dim(linear(mid, b_i), group)
    if sp:
        out = mappings.scatter_seq(out, group)
    y = base.requires_grad_() * 1 + torch.ops.aten.mul.Scalar(out, SCALE)
    y.backward(dy)
    return {"y": y.detach(), "d_partial": partial.grad, "dB": b_i.grad}


def row_lean(rank, t, sp, dtype):
    group = dist.group.WORLD
    partial, b_i, base, dy = _row_inputs(rank, t, sp, dtype)
    partial, b_i = partial.requires_grad_(), b_i.requires_grad_()
    mid = mappings.reduce_scatter_seq(partial, group) if sp else mappings.reduce_from_group(partial, group)
    out = base.requires_grad_() * 1
    y = row_lora_into_output_(out, torch.ops.aten.mul.Scalar(mid, SCALE), b_i, group, sp)
    y.backward(dy)
    return {"y": y.detach(), "d_partial": partial.grad, "dB": b_i.grad, "in_place": y is out}


def row_cases(rank, world) -> dict:
    """Classic and lean, fp32 and (classic) fp64, with and without SP; and the peak of each over the
    base alone (allocator bytes, every collective settled)."""
    out = {}
    for sp in (True, False):
        for name, fn in (("classic", row_classic), ("lean", row_lean)):
            out[(sp, name)] = fn(rank, world, sp, torch.float32)
        out[(sp, "fp64")] = row_classic(rank, world, sp, torch.float64)
        for name, fn in (("classic", row_classic), ("lean", row_lean)):
            peaks = []
            for _ in range(3):
                with AllocatedBytes(settle_each_collective=True) as a:
                    fn(rank, world, sp, torch.float32)
                peaks.append(a.peak)
            out[(sp, name, "peak")] = min(peaks)
    return out


def _junction_inputs(rank, t, dtype):
    x = _full(50, S, B, H, dtype=dtype)
    w = _full(60, H, H, dtype=dtype)  # the frozen base: y = x W^T, its dgrad dy W
    a_i = _full(70, 2 * R, H, dtype=dtype).chunk(t, 0)[rank].contiguous()
    dy, dmid = _full(80, S, B, H, dtype=dtype), _full(90 + rank, S, B, R, dtype=dtype)
    return x, w, a_i, dy, dmid


def junction_case(rank, world, replicated: bool, with_junction: bool) -> dict:
    """A base and a LoRA-A on one input (``replicated``: LoRA-A's input gradient summed over TP, as a
    column-parallel adapter's without SP): autograd's sum, or the junction's in-place one."""
    group = dist.group.WORLD
    x, w, a_i, dy, dmid = _junction_inputs(rank, world, torch.float32)
    x, a_i = x.requires_grad_(), a_i.requires_grad_()
    parts = InputGradParts() if with_junction else None
    inp = attach(x, a_i, parts=parts) if with_junction else x
    base = inp @ w.t()
    if with_junction:
        mid = linear(inp, a_i, into=(parts, group if replicated else None))
    else:
        mid = linear(mappings.copy_to_group(inp, group) if replicated else inp, a_i)
    torch.autograd.backward([base, mid], [dy, dmid])
    return {"dx": x.grad, "dA": a_i.grad}


def junction_cases(rank, world) -> dict:
    return {(rep, j): junction_case(rank, world, rep, j) for rep in (False, True) for j in (False, True)}
