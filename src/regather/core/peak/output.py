"""LoRA-B added into the base's output in place, one row chunk at a time (no full-width LoRA output).

The classic adapter returns its own output and the wrapper adds it: ``base(x) + scale * (mid B^T)``.
Three full-width tensors come and go on the way (per rank, ``W`` the base's output ``[s, b, o/t]``):
LoRA-B's output, its scaled copy (``mul`` holds input and output at once) and the sum; and in backward
the scale's gradient ``scale * dY``. With the base's own output that is up to ``3 W`` alive at once,
``2 W`` over the frozen model. Here the scale goes on the rank-``r`` side and LoRA-B's output is made
chunk by chunk (:mod:`.chunks`) into one buffer and added to the base's output where it lies::

    mid_s = scale * mid                                    [s, b, r]      (the adapter does this)
    out[rows, cols] += mid_s[rows] B^T    for each row chunk               (in place: marks ``out`` dirty)

    backward: d out   = dY                                 (passed on to the base, as is)
              d mid_s = dY[:, cols] B                       [s, b, r]
              dB      = dY[:, cols]^T mid_s                 through regather.core.wgrad

Saved: ``mid_s``, the rank-``r`` tensor the classic LoRA-B saves too; nothing full-width at any moment
but one chunk. ``cols`` is where the adapter's output columns lie in the base's output: all of them,
or a block (a row-parallel expert's partial output, :func:`regather.megatron.dense.adapter.forward`).

**Bits.** Each output element is the same dot product over ``r`` as the classic GEMM's (a row chunk of
a GEMM with the same ``K``), and ``base + delta`` the same addition. Moving the scale to the rank-``r``
side (Megatron Bridge #5906 does the same, after 0.6.2) changes nothing when ``scale = alpha / dim`` is a
power of two — multiplying by ``2^k`` is exact, so ``(2^k mid) B^T = 2^k (mid B^T)`` and
``dY^T (2^k mid) = (2^k dY)^T mid`` bit for bit (Bridge's defaults and recipes: ``alpha / dim`` = 1 or
2) — and rounds otherwise (an fp64 bound: tests.harness.numerics). :func:`lora_into_output_ref` is the
plain expression, for tests.
"""

from __future__ import annotations

import torch

from regather.core.peak.chunks import row_chunks
from regather.core.wgrad import main_grad_placeholder, weight_grad


def flat_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, last dim]`` (a view when it is contiguous)."""
    return t.view(-1, t.shape[-1]) if t.is_contiguous() else t.reshape(-1, t.shape[-1])


def add_rows_(dst: torch.Tensor, left: torch.Tensor, right_t: torch.Tensor, reduce=None) -> None:
    """``dst += left @ right_t`` chunk by chunk over the rows (``dst [N, n]``, ``left [N, k]``,
    ``right_t [k, n]``), one chunk buffer for all (:mod:`.chunks`); ``reduce(part)``, when given, is
    applied to each chunk's product in place before it is added (an all-reduce over TP)."""
    chunks = row_chunks(dst.shape[0], dst.shape[1] * dst.element_size())
    if not chunks:  # no rows (an expert that got no tokens)
        return
    if len(chunks) == 1:
        part = torch.matmul(left, right_t)
        if reduce is not None:
            reduce(part)
        dst.add_(part)
        return
    buf = torch.empty(chunks[0].stop - chunks[0].start, dst.shape[1], dtype=dst.dtype, device=dst.device)
    for rows in chunks:
        part = buf[: rows.stop - rows.start]
        torch.matmul(left[rows], right_t, out=part)
        if reduce is not None:
            reduce(part)
        dst[rows].add_(part)


def in_place_target(out: torch.Tensor) -> torch.Tensor:
    """What to add into: ``out`` itself, or for a view ``out.detach()`` (the same storage and version
    counter, so a saved copy of ``out`` that is read later still fails autograd's version check)."""
    return out.detach() if out._is_view() else out


def returned_in_place(ctx, out: torch.Tensor) -> torch.Tensor:
    """The forward's result after adding into :func:`in_place_target` (``out``): ``out`` marked dirty, as
    an in-place op returns it; a view can't be (autograd forbids an in-place op on a view that a custom
    Function returned — megatron's TP mappings return their input as is at one rank, Transformer
    Engine's LayerNormLinear returns views), so ``out.detach()`` is returned: the same storage and version
    counter, not a view, so the caller may modify it in place as it could the classic ``base + LoRA``
    (megatron's expert MLP adds its bias into ``linear_fc2``'s output, ``output += ...``, which at
    TP = EP = 1 is the view its TP mapping returned); a new view would forbid that."""
    if out._is_view():
        return out.detach()
    ctx.mark_dirty(out)
    return out


def blocks_of(cols, rows: int) -> tuple:
    """``cols`` as ``((output columns, LoRA-B rows), ...)``: None (all columns, all rows), one slice of the
    output (all rows), or the pairs themselves (an adapter whose output lies in several blocks of a fused
    base's, CanonicalLoRA's q heads per query group); the rows must cover LoRA-B's ``rows`` in order."""
    if cols is None or isinstance(cols, slice):
        return ((slice(None) if cols is None else cols, slice(0, rows)),)
    blocks = tuple(cols)
    covered = [i for _, r in blocks for i in range(*r.indices(rows))]
    if covered != list(range(rows)):
        raise ValueError(f"LoRA-B output blocks {blocks} do not cover its {rows} rows in order")
    return blocks


class LoraIntoOutput(torch.autograd.Function):
    """``out[..., cols] += mid_s B^T`` in place (module doc); returns ``out``."""

    @staticmethod
    def forward(ctx, out, mid_s, weight, fuse, cols, on_grad):
        if not out.is_contiguous():
            raise ValueError(f"LoRA's output is added in place into the base's output, which must be contiguous "
                             f"(got shape {tuple(out.shape)}, strides {out.stride()})")
        blocks = blocks_of(cols, weight.shape[0])
        flat = in_place_target(out).view(-1, out.shape[-1])
        width = sum(flat[:1, c].shape[-1] for c, _ in blocks)
        if width != weight.shape[0]:
            raise ValueError(f"LoRA-B has {weight.shape[0]} output features, the base's output columns "
                             f"{cols} hold {width}")
        mid = flat_rows(mid_s)
        for c, r in blocks:
            add_rows_(flat[:, c], mid, weight[r].t())
        ctx.save_for_backward(mid_s)
        ctx.weight, ctx.fuse, ctx.blocks, ctx.on_grad = weight, fuse, blocks, on_grad
        return returned_in_place(ctx, out)

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.on_grad is not None:  # early re-gather starts here, before LoRA-B's dgrad
            ctx.on_grad()
        (mid_s,) = ctx.saved_tensors
        weight, blocks = ctx.weight, ctx.blocks
        g = flat_rows(grad_out)
        grad_mid = grad_w = None
        if ctx.needs_input_grad[1]:
            grad_mid = _grad_mid(g, weight, blocks).view(mid_s.shape)
        if ctx.needs_input_grad[2]:
            if len(blocks) == 1:
                grad_w = weight_grad(weight, g[:, blocks[0][0]], mid_s, ctx.fuse)
            else:
                grad_w = block_weight_grad(weight, [(g[:, c], r) for c, r in blocks], flat_rows(mid_s), ctx.fuse)
        return grad_out, grad_mid, grad_w, None, None, None


def _grad_mid(g: torch.Tensor, weight: torch.Tensor, blocks: tuple) -> torch.Tensor:
    """``dY[:, cols] B``: one GEMM over the adapter's columns, as the classic LoRA-B's backward; with
    several blocks their columns are copied side by side one row chunk at a time, so the GEMM is the
    same (its sum over the output features in one piece)."""
    if len(blocks) == 1:
        return g[:, blocks[0][0]].matmul(weight)
    out = torch.empty(g.shape[0], weight.shape[1], dtype=g.dtype, device=g.device)
    for rows in row_chunks(g.shape[0], weight.shape[0] * g.element_size()):
        side_by_side = torch.cat([g[rows, c] for c, _ in blocks], dim=1)
        torch.matmul(side_by_side, weight, out=out[rows])
    return out


def block_weight_grad(weight: torch.Tensor, parts, mid: torch.Tensor, fuse: bool):
    """``dB`` one row block at a time, ``dB[rows] = dY_block^T mid`` for ``(dY_block, rows)`` in ``parts``:
    each element the same sum over the tokens as one GEMM's; into ``main_grad``'s rows under
    gradient-accumulation fusion (megatron's placeholder returned, regather.core.wgrad)."""
    main_grad = getattr(weight, "main_grad", None) if fuse else None
    if main_grad is not None:
        from regather.ops import wgrad_accumulate_

        for g_block, rows in parts:
            wgrad_accumulate_(main_grad[rows], g_block, mid)
        return main_grad_placeholder(weight)
    grad = torch.empty_like(weight)
    for g_block, rows in parts:
        grad[rows] = g_block.t().matmul(mid)
    return grad


def lora_into_output_(out: torch.Tensor, mid_s: torch.Tensor, weight: torch.Tensor, fuse: bool = False,
                      cols=None, on_grad=None) -> torch.Tensor:
    """``out[..., cols] += mid_s @ weight^T`` in place, chunked (``cols``: see :func:`blocks_of`;
    ``on_grad``: called first in backward)."""
    return LoraIntoOutput.apply(out, mid_s, weight, fuse, cols, on_grad)


def lora_into_output_ref(out: torch.Tensor, mid: torch.Tensor, weight: torch.Tensor, scale: float,
                         cols: slice | None = None) -> torch.Tensor:
    """The classic expression it replaces: ``out + scale * (mid B^T)`` (placed at ``cols``)."""
    delta = (mid @ weight.t()) * scale
    if cols is None:
        return out + delta
    full = torch.zeros_like(out)
    full[..., cols] = delta
    return out + full
