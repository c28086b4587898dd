"""The kernels TE's attention calls, on torch: what the model's attention Functions run per tile.

- :func:`tile_forward` / :func:`tile_backward`: cuDNN's fused attention (``fused_attn_fwd`` /
  ``fused_attn_bwd``, backend ``F16_arbitrary_seqlen``) for one tile — a query block against a
  key/value block. Forward returns the output and the softmax statistics ``lse`` (log-sum-exp of the
  scaled scores per query row, what cuDNN returns as ``aux_ctx_tensors[0]``); backward is the
  flash-attention backward from ``(q, k, v, out, dout, lse)``: the probabilities recomputed with the
  *given* ``lse``, ``D = rowsum(dout * out)``. With context parallelism ``out`` and ``lse`` are the
  merged ones over all tiles, so each tile's partial ``dq, dk, dv`` are exact parts of the whole
  gradient (TE passes the merged ``out`` / ``softmax_lse`` to every step's ``fused_attn_bwd``,
  ``context_parallel.py`` v2.18:2514-2550). The maths is plain matmul-softmax in the input dtype.
- masks: none (``no_mask``), ``causal`` aligned bottom-right (a query row ``i`` of ``n_q`` sees keys
  ``j <= i + n_k - n_q``: top-left when the block is square, TE's ``causal_bottom_right`` for the
  shorter query chunks of the all-gather path), and segments (THD: a query sees keys of its own
  sequence only, ``padding`` / ``padding_causal`` with ``cu_seqlens``).
- THD half-sequence helpers (TE's ``tex.thd_read_half_tensor``, ``thd_second_half_lse_correction``,
  ``thd_out_correction``, ``thd_read_second_half_lse``, ``thd_grad_correction``, CUDA kernels in TE):
  per sequence of a CP rank's ``cu_seqlens_padded``, its first and second half (the rank's two
  chunks of that sequence) as token index lists.

Layouts: ``q [n_q, b, h, d]``, ``k / v [n_k, b, h_kv, d]`` (sbhd; THD is ``b = 1`` with segment ids),
``out`` like ``q``, ``lse [b, h, n_q]``. GQA: ``h`` a multiple of ``h_kv`` (keys repeated per group,
their gradient summed back).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[n, b, h, d] -> [b, h, n, d]`` (a view)."""
    return x.permute(1, 2, 0, 3)


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, h_kv, n, d]`` repeated to ``heads`` (GQA: each key head serves ``heads / h_kv`` query heads)."""
    groups = heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_groups(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, n, d = dx.shape
    return dx if h == kv_heads else dx.view(b, kv_heads, h // kv_heads, n, d).sum(2)


def tile_mask(n_q: int, n_k: int, causal: bool, seg_q: torch.Tensor | None = None,
              seg_k: torch.Tensor | None = None) -> torch.Tensor | None:
    """The allowed ``[n_q, n_k]`` (True: attend), or None when every pair is allowed. Causal is
    bottom-right aligned per segment (module doc); segments are contiguous runs of equal ids."""
    if not causal and seg_q is None:
        return None
    if seg_q is None:
        i = torch.arange(n_q).unsqueeze(1)
        j = torch.arange(n_k).unsqueeze(0)
        return j <= i + (n_k - n_q)
    same = seg_q.unsqueeze(1) == seg_k.unsqueeze(0)
    if not causal:
        return same
    pos_q, len_q = _position_in_segment(seg_q)
    pos_k, len_k = _position_in_segment(seg_k)
    return same & ((pos_k - len_k).unsqueeze(0) <= (pos_q - len_q).unsqueeze(1))


def _position_in_segment(seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's index inside its segment and its segment's length."""
    _, counts = torch.unique_consecutive(seg, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    lengths = torch.repeat_interleave(counts, counts)
    return torch.arange(seg.numel()) - torch.repeat_interleave(starts, counts), lengths


def _scores(q, k, scale, mask):
    s = torch.matmul(_heads_first(q), _expand_kv(_heads_first(k), q.shape[2]).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def tile_forward(q, k, v, scale: float, mask: torch.Tensor | None):
    """``(out [n_q, b, h, d_v], lse [b, h, n_q])`` of ``softmax(q k^T * scale) v`` under ``mask``."""
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p, _expand_kv(_heads_first(v), q.shape[2]))
    return out.permute(2, 0, 1, 3).contiguous(), lse


def tile_backward(q, k, v, out, dout, lse, scale: float, mask: torch.Tensor | None):
    """``(dq, dk, dv)`` of one tile from the (merged) ``out`` and ``lse`` (module doc)."""
    heads = q.shape[2]
    p = torch.exp(_scores(q, k, scale, mask) - lse.unsqueeze(-1))
    do, o = _heads_first(dout), _heads_first(out)
    vh = _expand_kv(_heads_first(v), heads)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vh.transpose(-1, -2))
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    dq = torch.matmul(ds, _expand_kv(_heads_first(k), heads)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), _heads_first(q)) * scale
    kv_heads = k.shape[2]
    return (dq.permute(2, 0, 1, 3).contiguous(), _sum_groups(dk, kv_heads).permute(2, 0, 1, 3).contiguous(),
            _sum_groups(dv, kv_heads).permute(2, 0, 1, 3).contiguous())


# -- THD: a CP rank's two chunks of every sequence ------------------------------------------------


def segment_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each token's sequence index, from ``cu_seqlens`` (``[0, s_0, s_0 + s_1, ...]``)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel()), lengths)


@dataclass(frozen=True)
class THDHalves:
    """For a CP rank's ``cu_seqlens_padded`` (its tokens of each sequence: the sequence's chunk ``r``
    then chunk ``2·cp − 1 − r``), the token indices of every sequence's first and second half, and
    each token's sequence id."""

    first: torch.Tensor
    second: torch.Tensor
    seg: torch.Tensor

    @staticmethod
    def of(cu_seqlens_padded: torch.Tensor) -> THDHalves:
        cu = cu_seqlens_padded.tolist()
        first, second, seg = [], [], []
        for i, (start, end) in enumerate(itertools.pairwise(cu)):
            if (end - start) % 2:
                raise ValueError(f"THD: sequence {i} has {end - start} tokens on this CP rank (cu_seqlens_padded "
                                 f"{cu}); context parallelism needs every sequence padded to a multiple of 2·cp")
            mid = (start + end) // 2
            first.append(torch.arange(start, mid))
            second.append(torch.arange(mid, end))
            seg.append(torch.full((end - start,), i))
        return THDHalves(torch.cat(first), torch.cat(second), torch.cat(seg))

    def index(self, half: int) -> torch.Tensor:
        return self.first if half == 0 else self.second

    def read(self, x: torch.Tensor, half: int) -> torch.Tensor:
        """``tex.thd_read_half_tensor(x, cu_seqlens_padded, half)``: a new tensor of that half's tokens."""
        return x.index_select(0, self.index(half))

    def read_lse(self, lse: torch.Tensor, half: int) -> torch.Tensor:
        """``tex.thd_read_second_half_lse`` (half 1): the statistics of that half's tokens."""
        return lse.index_select(-1, self.index(half))

    def seg_of(self, half: int | None) -> torch.Tensor:
        return self.seg if half is None else self.seg.index_select(0, self.index(half))

    def correct(self, grad: torch.Tensor, part: torch.Tensor, first: str, second: str) -> None:
        """``tex.thd_grad_correction(grad, part, cu_seqlens_padded, first, second)``: per half
        ``"copy"``, ``"add"`` or ``"none"``; ``part`` holds the tokens of the halves that are not "none"."""
        halves = [h for h, op in ((0, first), (1, second)) if op != "none"]
        if len(halves) == 2:
            pieces = {0: part.index_select(0, self.first), 1: part.index_select(0, self.second)}
        else:
            pieces = {halves[0]: part} if halves else {}
        for h, op in ((0, first), (1, second)):
            if op == "copy":
                grad.index_copy_(0, self.index(h), pieces[h])
            elif op == "add":
                grad.index_add_(0, self.index(h), pieces[h])

    def merge_lse_(self, lse: torch.Tensor, part: torch.Tensor, half: int | None) -> None:
        """``flash_attn_fwd_softmax_lse_correction`` (all tokens) / ``tex.thd_second_half_lse_correction``."""
        if half is None:
            lse.copy_(merged_lse(lse, part))
        else:
            idx = self.index(half)
            lse.index_copy_(-1, idx, merged_lse(lse.index_select(-1, idx), part))

    def add_corrected_(self, out, part, lse, lse_part, half: int | None) -> None:
        """``tex.thd_out_correction``: ``out += part * exp(lse_part - lse)`` on the tokens of ``half``."""
        if half is None:
            out.add_(corrected(part, lse_part, lse))
        else:
            idx = self.index(half)
            out.index_add_(0, idx, corrected(part, lse_part, lse.index_select(-1, idx)))


@dataclass(frozen=True)
class SBHDHalves:
    """The same operations for sbhd (every sequence of the batch the same length ``n``): the halves
    are views ``x.view(2, n // 2, ...)[half]``, as TE's ``[2, s//2, b, h, d]`` views (v2.18:1572-1578)."""

    n: int

    @staticmethod
    def _split(x, dim=0):
        return x.view(*x.shape[:dim], 2, x.shape[dim] // 2, *x.shape[dim + 1:])

    def read(self, x: torch.Tensor, half: int) -> torch.Tensor:
        return self._split(x)[half]

    def read_lse(self, lse: torch.Tensor, half: int) -> torch.Tensor:
        return self._split(lse, lse.dim() - 1)[..., half, :]

    def seg_of(self, half: int | None) -> None:
        return None

    def correct(self, grad: torch.Tensor, part: torch.Tensor, first: str, second: str) -> None:
        halves = [h for h, op in ((0, first), (1, second)) if op != "none"]
        pieces = ({0: self.read(part, 0), 1: self.read(part, 1)} if len(halves) == 2
                  else {halves[0]: part} if halves else {})
        for h, op in ((0, first), (1, second)):
            if op == "copy":
                self.read(grad, h).copy_(pieces[h])
            elif op == "add":
                self.read(grad, h).add_(pieces[h])

    def merge_lse_(self, lse: torch.Tensor, part: torch.Tensor, half: int | None) -> None:
        """``flash_attn_fwd_softmax_lse_correction`` / ``..._second_half_...`` (v2.18:185-207)."""
        target = lse if half is None else self.read_lse(lse, half)
        target.copy_(merged_lse(target, part))

    def add_corrected_(self, out, part, lse, lse_part, half: int | None) -> None:
        """``flash_attn_fwd_out_correction`` / ``..._second_half_out_correction`` (v2.18:139-182)."""
        target = out if half is None else self.read(out, half)
        target.add_(corrected(part, lse_part, lse if half is None else self.read_lse(lse, half)))


def merged_lse(lse: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``max + log1p(exp(min - max))``: the log-sum-exp over both sets of keys (TE's formula)."""
    hi, lo = torch.max(lse, part), torch.min(lse, part)
    return hi + torch.log1p(torch.exp(lo - hi))


def corrected(part: torch.Tensor, lse_part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """A tile's output rescaled to the merged statistics: ``part * exp(lse_part - lse)`` (``[b, h, n]``
    moved to ``[n, b, h, 1]``)."""
    return part * torch.exp(lse_part - lse).movedim(2, 0).unsqueeze(-1)
