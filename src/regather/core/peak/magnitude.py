"""DoRA's magnitude: ``y = m / ||W0 + s·B A||_row ⊙ z`` with ``z = W0 x + s·B A x``, and no full-width copy.

DoRA (Liu et al. 2024; Megatron Bridge's ``DoRALinear``, PEFT's ``use_dora``) scales each output feature
``j`` of a LoRA linear by ``g_j = m_j / n_j``: ``m`` a trainable magnitude, ``n_j`` the norm of row ``j`` of
the merged weight ``V = W0 + s·B A``, detached (the paper's §4.3). Per rank, with ``W`` the base's output
``[s, b, o/t]`` (a row-parallel base: its sequence shard ``[s/t, b, o]``):

===================== =================================== =================================================
                      Megatron Bridge 0.6.2               here
===================== =================================== =================================================
``z``                 ``linear_output + adapter_output``: LoRA added into the base's output in place
                      a fresh sum, **kept** for ``dm``     (:mod:`.output`); not kept with ``rebuild``
``y = g ⊙ z``         a fresh product (``W``)             ``keep``: the same product, ``z`` kept;
                                                          ``rebuild``: ``z`` scaled in place (nothing new)
``dz = g ⊙ dy``       a fresh tensor                      ``dy`` scaled in place when autograd hands over its
                                                          only reference (:func:`exclusive`), else a copy
``dm = Σ dy ⊙ z / n`` ``dy ⊙ z`` whole (``W``), then      one row chunk of ``dy ⊙ z`` at a time (fp32 sums);
                      summed                              ``z``'s rows rebuilt from the input LoRA-A keeps
                                                          (:mod:`.rebuild`) with ``rebuild``
the norm ``n``        ``W0 + s·B A`` made each forward    :func:`row_norm_lean`: ``||W0_j||² + 2s (W0 Aᵀ)_j·B_j
                      (two ``[o/t, h]`` weights)          + s² B_j (A Aᵀ) B_jᵀ``, rank-``r`` transients
===================== =================================== =================================================

**Whole rows.** A row-parallel base (``linear_proj``, ``linear_fc2``) holds ``W0_i [o, h/t]``: its rows
are split over TP. Bridge takes each rank's slice norm (``||W0_i + s·B A_i||``, no TP sum), so its
function depends on the TP size; here the squares are summed over TP (``sum_group``), so a model means
the same at any TP. The slice norm is still available (``per_rank_slice``), for checkpoints trained
with it.

**Bits.** :func:`row_norm_direct` is Bridge's expression (``linalg.norm`` of ``W0 + (s·B) @ A``) where
Bridge is right (column bases; every base at TP1), so the classic path stays Bridge's bit for bit;
:func:`row_norm_lean` sums in another order (fp32, an fp64 bound). ``dm`` is summed over the tokens in
row chunks (another order than autograd's one reduction: an fp64 bound); ``y`` and ``dz`` are the same
products as Bridge's.
"""

from __future__ import annotations

import torch

from regather.core import comm
from regather.core.peak.chunks import row_chunks
from regather.core.peak.output import flat_rows, in_place_target, returned_in_place

#: The ways to take a row's norm over a TP-split row (a row-parallel base).
WHOLE_ROW, PER_RANK_SLICE = "whole_row", "per_rank_slice"
NORMS = (WHOLE_ROW, PER_RANK_SLICE)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def exclusive(grad: torch.Tensor) -> bool:
    """Whether autograd handed this backward the only reference to ``grad``, so it may be changed in place:
    no other tensor object (``_use_count() == 1``: no other node's pending input, no caller's
    ``backward(dy)``, no hook's copy) and no other view of its storage. It is the test autograd makes
    before it steals a gradient into ``.grad`` (``AccumulateGrad``: ``use_count() <= 1``). Anything else —
    also a torch without these counters, or a backward that records a graph — answers False: a copy."""
    use_count = getattr(grad, "_use_count", None)
    storage_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or storage_count is None or torch.is_grad_enabled() or grad._is_view():
        return False
    storage = grad.untyped_storage()
    refs = storage_count(storage._cdata)  # the storage object made here holds one reference too
    del storage
    return use_count() == 1 and refs == 2


def scale_grad(grad: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``grad * g`` (``g`` broadcast over the last dim): in place when :func:`exclusive`, else a new tensor."""
    if exclusive(grad) and grad.is_contiguous():
        return grad.mul_(g)
    return grad * g


# -- the norm ------------------------------------------------------------------------------------------


def row_norm_direct(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, sum_group=None) -> torch.Tensor:
    """``||W0 + (s·B) @ A||`` per row of this rank's ``W0 [o_l, h_l]``, as Megatron Bridge computes it
    (``linalg.norm(dim=1)`` in the weight's dtype; a weight-sized ``V`` and ``B @ A`` made for it).
    ``sum_group``: the row is split over this group (a row-parallel base): the squares are summed over it
    (fp32), then the root taken; None: this rank's rows are whole (or Bridge's per-slice norm)."""
    v = w0 + (scale * b) @ a
    if sum_group is None or comm.world_size(sum_group) == 1:
        return torch.linalg.norm(v, dim=1).to(v.dtype).detach()
    sq = torch.linalg.vector_norm(v, dim=1, dtype=_acc_dtype(v.dtype)).square_()
    return comm.all_reduce_(sq, sum_group).sqrt_().to(v.dtype).detach()


def row_norm_lean(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, sum_group=None) -> torch.Tensor:
    """The same norm without the merged weight: ``n_j² = ||W0_j||² + 2s (W0 Aᵀ)_j·B_j + s² B_j (A Aᵀ) B_jᵀ``
    (fp32), ``W0`` read in row chunks (:mod:`.chunks`); transients ``[o_l, r]``, ``[r, r]`` and one chunk of
    ``W0`` in fp32 instead of two ``[o_l, h_l]`` weights. ``a [r, h_l]`` (a column base: all of LoRA-A),
    ``b [o_l, r]`` (a row base: all of LoRA-B). ``sum_group`` as :func:`row_norm_direct`."""
    acc = _acc_dtype(w0.dtype)
    with torch.no_grad():
        a32, b32 = a.detach().to(acc), b.detach().to(acc)
        sq = torch.empty(w0.shape[0], dtype=acc, device=w0.device)
        cross = torch.empty(w0.shape[0], a.shape[0], dtype=acc, device=w0.device)
        for rows in row_chunks(w0.shape[0], w0.shape[1] * torch.finfo(acc).bits // 8):
            part = w0[rows].to(acc)
            torch.linalg.vector_norm(part, dim=1, out=sq[rows]).square_()
            torch.matmul(part, a32.t(), out=cross[rows])  # (W0 A^T) rows
        gram = a32 @ a32.t()
        sq.add_((cross * b32).sum(1), alpha=2 * scale)
        sq.add_(((b32 @ gram) * b32).sum(1), alpha=scale * scale)
        if sum_group is not None:
            comm.all_reduce_(sq, sum_group)
        return sq.clamp_min_(0).sqrt_().to(w0.dtype)


# -- y = g ⊙ z -----------------------------------------------------------------------------------------


class MagnitudeScale(torch.autograd.Function):
    """``y = (m / n) ⊙ z`` over the last dim; backward ``dz = g ⊙ dy`` and ``dm = Σ_tokens dy ⊙ z / n``.

    ``rebuild`` None: ``y`` is a new tensor and ``z`` is kept (Bridge's bytes, without its transients).
    Else ``z`` is scaled in place and nothing full-width is kept: backward takes ``z``'s rows from
    ``rebuild.chunks(saved)`` (:class:`regather.core.peak.rebuild.OutputRebuild`), whose tensors are
    saved here (``rebuild.save()``: what LoRA keeps anyway). ``sum_group``: ``dm``'s token sum is split
    over this group (a row-parallel base under SP: each rank holds its sequence shard), all-reduced.
    """

    @staticmethod
    def forward(ctx, z, magnitude, norm, rebuild, sum_group, *rebuild_tensors):
        g = magnitude.detach() / norm
        ctx.rebuild, ctx.group = rebuild, sum_group
        ctx.n_rebuild = len(rebuild_tensors)
        if rebuild is None:  # what backward reads, saved as Bridge's expression saves it: z, the scale, the norm
            ctx.save_for_backward(z, g, norm)
            return z * g
        ctx.save_for_backward(*rebuild_tensors, g, norm)
        in_place_target(z).mul_(g)
        return returned_in_place(ctx, z)

    @staticmethod
    def backward(ctx, dy):
        *saved, g, norm = ctx.saved_tensors
        grad_m = _magnitude_grad(ctx, saved, norm, dy) if ctx.needs_input_grad[1] else None  # its views of dy: gone
        grad_z = scale_grad(dy, g) if ctx.needs_input_grad[0] else None
        return (grad_z, grad_m.to(g.dtype) if grad_m is not None else None, None, None, None) + (None,) * ctx.n_rebuild


def _magnitude_grad(ctx, saved, norm: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """``dm = Σ_tokens dy ⊙ z / n``, one row chunk of ``dy ⊙ z`` at a time (fp32 sums), all-reduced over
    ``ctx.group`` when the tokens are split over it."""
    d = flat_rows(dy)
    acc = torch.zeros(d.shape[-1], dtype=_acc_dtype(dy.dtype), device=dy.device)
    if ctx.rebuild is None:
        z = flat_rows(saved[0])
        for rows in row_chunks(d.shape[0], d.shape[1] * d.element_size()):
            acc.add_(torch.mul(d[rows], z[rows]).sum(0, dtype=acc.dtype))
    else:
        for out_rows, z_rows in ctx.rebuild.chunks(saved):
            start = 0
            for rows in out_rows:
                n = rows.stop - rows.start
                acc.add_(torch.mul(d[rows], z_rows[start:start + n]).sum(0, dtype=acc.dtype))
                start += n
    if ctx.group is not None:
        comm.all_reduce_(acc, ctx.group)
    return acc.div_(norm)


def scale_by_magnitude(z: torch.Tensor, magnitude: torch.Tensor, norm: torch.Tensor, rebuild=None,
                       sum_group=None) -> torch.Tensor:
    """``(magnitude / norm) ⊙ z`` (:class:`MagnitudeScale`; ``rebuild``: see there, its tensors saved)."""
    tensors = rebuild.save() if rebuild is not None else ()
    return MagnitudeScale.apply(z, magnitude, norm, rebuild, sum_group, *tensors)


def scale_by_magnitude_ref(z: torch.Tensor, magnitude: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """Megatron Bridge's expression, ``(m / n).view(1, .., -1) * z`` (autograd keeps ``z``), for tests and
    the classic path."""
    return (magnitude / norm).view(*([1] * (z.dim() - 1)), -1) * z
