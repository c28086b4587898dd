"""TE's attention with context parallelism on CPU ranks (``transformer_engine/pytorch/attention/
dot_product_attention/context_parallel.py``, read at v2.18, "v2.18:N"): the ``p2p`` and
``all_gather`` communication types, high precision, the FusedAttention backend (TE's only backend for
sbhd under CP, v2.18:5043-5045), no bias, no dropout, no sliding window.

Tokens arrive load-balanced: a CP rank holds chunks ``r`` and ``2·cp − 1 − r`` of ``2·cp`` (megatron's
``get_batch_on_this_cp_rank``; for THD, of every sequence). Per rank, "first half" / "second half"
below are those two chunks (:mod:`.attention_kernels`' ``SBHDHalves`` / ``THDHalves``).

:class:`AttnFuncWithCPAndKVP2P` (v2.18:1356-2975), causal, ``cp`` steps: at step ``i`` a rank holds
the keys / values of rank ``r − i``, sent round a ring with ``isend`` / ``irecv``, even ranks sending
first (``flash_attn_p2p_communicate``, v2.18:96-136, unbatched: TE batches the same tensors only with
``NVTE_BATCH_MHA_P2P_COMM`` set or below compute capability 10 at ``cp = 2``, v2.18:1421-1423). Step 0
is the *diagonal* tile (its own keys, causal), steps ``1 <= i <= r`` the *lower triangle* (all its
queries against the first half of the keys, no mask), later steps the *upper triangle* (the second
half of its queries against all the keys). Each tile gives an output and its log-sum-exp; the
statistics are merged as they come (v2.18:1913-1978) and the outputs rescaled and summed after the
loop (v2.18:1980-2029). It saves ``q``, the **last received** key/value buffer (not its own), the
merged ``out`` and ``softmax_lse`` (v2.18:2087, 2131-2142), and returns ``out`` itself (the tensor it
saved). Backward sends the keys / values the other way round with their gradient accumulated on the
way (each rank adds its part and passes it on, v2.18:2396-2810): after ``cp`` steps a rank holds its
own keys' gradient.

:class:`AttnFuncWithCPAndKVAllGather` (v2.18:3014-4166), sbhd: keys / values all-gathered over CP and
put in sequence order (v2.18:3213-3231), then per local chunk ``c`` one tile of its queries against
keys ``[0, (c + 1)·n)`` with a bottom-right causal mask (``get_kv_seq_info_after_all_gather``). Saves
``q``, its own ``k``, ``v``, ``out`` and the two statistics; backward all-gathers the keys again and
reduce-scatters their gradient (v2.18:4110-4121).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tests.harness.te_model import comm
from tests.harness.te_model.attention_kernels import SBHDHalves, THDHalves, tile_backward, tile_forward, tile_mask


@dataclass(frozen=True)
class CPArgs:
    cp_group: object
    cp_global_ranks: tuple[int, ...]
    softmax_scale: float
    causal: bool
    qkv_format: str  # "sbhd" | "thd" (THD: q / k / v [t, 1, h, d], one batch row)
    cu_seqlens_padded: torch.Tensor | None  # THD: the whole sequences' offsets (every CP rank's tokens)


def _halves(args: CPArgs, n: int, cp: int):
    """This rank's halves: v2.18:1447 divides the padded offsets by ``cp`` for THD; sbhd needs an even
    local length (v2.18:1568-1571)."""
    if args.qkv_format == "thd":
        return THDHalves.of(args.cu_seqlens_padded // cp)
    if n % 2:
        raise ValueError(f"TE: sequence length per GPU needs to be divisible by 2 (got {n} tokens at cp {cp})")
    return SBHDHalves(n)


def p2p_communicate(rank, send, send_dst, recv, recv_src, group) -> list:
    """``flash_attn_p2p_communicate`` unbatched (v2.18:123-134): even ranks send first."""
    if rank % 2 == 0:
        return [dist.isend(send, send_dst, group), dist.irecv(recv, recv_src, group)]
    return [dist.irecv(recv, recv_src, group), dist.isend(send, send_dst, group)]


def wait(reqs) -> None:
    """``for req in reqs: req.wait()`` as TE does, skipping a request already completed: TE waits on
    the same requests twice per backward step (a no-op on NCCL), and a second ``wait`` on a gloo
    send / recv blocks for ever (measured, torch 2.13); so does one after the allocator accounting's
    dispatch mode has waited on it (``regather.core.allocated``, ``settle_each_collective``)."""
    for req in reqs:
        if not req.is_completed():
            req.wait()


def _section(causal: bool, step: int, rank: int, cp: int, backward: bool) -> str:
    """Which tile a step computes (forward v2.18:1796-1910; backward v2.18:2580-2632)."""
    if not causal:
        return "all"
    if backward:
        return "diagonal" if step == cp - 1 else "lower-triangle" if step >= cp - rank - 1 else "upper-triangle"
    return "diagonal" if step == 0 else "lower-triangle" if step <= rank else "upper-triangle"


class _Tiles:
    """Per section: which halves of q / k enter the tile, and its mask (THD: same-sequence pairs)."""

    def __init__(self, halves, n: int):
        self.halves, self.n, self._masks = halves, n, {}

    def q_half(self, section):
        return 1 if section == "upper-triangle" else None

    def k_half(self, section):
        return 0 if section == "lower-triangle" else None

    def part(self, x, half):
        return x if half is None else self.halves.read(x, half)

    def mask(self, section):
        if section not in self._masks:
            qh, kh = self.q_half(section), self.k_half(section)
            n_q, n_k = (self.n if h is None else self.n // 2 for h in (qh, kh))
            self._masks[section] = tile_mask(n_q, n_k, section == "diagonal",
                                             self.halves.seg_of(qh), self.halves.seg_of(kh))
        return self._masks[section]


class AttnFuncWithCPAndKVP2P(torch.autograd.Function):
    """``p2p``: ``forward(ctx, q, k, v, args) -> out`` (module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, args: CPArgs):
        group = args.cp_group
        cp, rank = comm.size(group), dist.get_rank(group)
        send_dst = args.cp_global_ranks[(rank + 1) % cp]  # v2.18:1418-1419
        recv_src = args.cp_global_ranks[(rank - 1) % cp]
        n = q.shape[0]
        halves = _halves(args, n, cp)
        tiles = _Tiles(halves, n)
        k_shape, v_shape, k_numel = k.shape, v.shape, k.numel()
        buffers = [None] * cp
        buffers[0] = torch.cat((k.view(-1), v.view(-1)), dim=-1)  # v2.18:1690: its own k / v, one buffer
        reqs = [[], []]
        out_per_step, lse_per_step = [None] * cp, [None] * cp
        lse = out = None
        for i in range(cp + 1):
            if i < cp:
                wait(reqs[(i + 1) % 2])  # v2.18:1702-1703
                if i < cp - 1:
                    buffers[i + 1] = torch.empty_like(buffers[i])
                    reqs[i % 2] = p2p_communicate(rank, buffers[i], send_dst, buffers[i + 1], recv_src, group)
                k_part = buffers[i][:k_numel].view(k_shape)
                v_part = buffers[i][k_numel:].view(v_shape)
                section = _section(args.causal, i, rank, cp, backward=False)
                kh = tiles.k_half(section)
                out_per_step[i], lse_per_step[i] = tile_forward(
                    tiles.part(q, tiles.q_half(section)), tiles.part(k_part, kh), tiles.part(v_part, kh),
                    args.softmax_scale, tiles.mask(section))
            if i > 0:  # v2.18:1913-1978: merge the statistics of step i - 1
                if i == 1:
                    lse = torch.clone(lse_per_step[0])
                    if args.qkv_format == "thd":
                        out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
                else:
                    half = None if (i - 1) <= rank or not args.causal else 1
                    halves.merge_lse_(lse, lse_per_step[i - 1], half)
        for i in range(cp):  # v2.18:1980-2029: the outputs rescaled to the merged statistics
            half = None if i <= rank or not args.causal else 1
            if i == 0 and args.qkv_format != "thd":
                out = out_per_step[0] * torch.exp(lse_per_step[0] - lse).movedim(2, 0).unsqueeze(-1)
            else:
                halves.add_corrected_(out, out_per_step[i], lse, lse_per_step[i], half)
        kv = buffers[-1]  # v2.18:2087: the last received buffer
        ctx.save_for_backward(q, kv, out, lse)  # v2.18:2131-2142
        ctx.args, ctx.k_shape, ctx.v_shape, ctx.k_numel = args, k_shape, v_shape, k_numel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        args = ctx.args
        group = args.cp_group
        cp, rank = comm.size(group), dist.get_rank(group)
        send_dst = args.cp_global_ranks[(rank - 1) % cp]  # v2.18:2229-2230: the other way round
        recv_src = args.cp_global_ranks[(rank + 1) % cp]
        n = q.shape[0]
        halves = _halves(args, n, cp)
        tiles = _Tiles(halves, n)
        lse_second = halves.read_lse(lse, 1) if args.causal and rank < cp - 1 else None  # v2.18:2278-2297
        dout = dout.view(out.shape)
        dq = torch.empty_like(q)  # v2.18:2396-2401
        buffers = [torch.empty((2, *kv.shape), dtype=kv.dtype, device=kv.device) for _ in range(2)]
        buffers[0][0].copy_(kv)
        k_numel = ctx.k_numel
        reqs = []
        for i in range(cp):
            wait(reqs)
            send, recv = buffers[i % 2], buffers[(i + 1) % 2]
            if i == 0:  # v2.18:2487-2492: keys first, their gradient last, both between
                send, recv = send[0], recv[0]
            if i == cp - 1:
                send, recv = send[1], recv[1]
            reqs = p2p_communicate(rank, send, send_dst, recv, recv_src, group)

            kv_i = buffers[i % 2][0]
            k_part = kv_i[:k_numel].view(ctx.k_shape)
            v_part = kv_i[k_numel:].view(ctx.v_shape)
            section = _section(args.causal, i, rank, cp, backward=True)
            qh, kh = tiles.q_half(section), tiles.k_half(section)
            dq_, dk_, dv_ = tile_backward(
                tiles.part(q, qh), tiles.part(k_part, kh), tiles.part(v_part, kh), tiles.part(out, qh),
                tiles.part(dout, qh), lse if qh is None else lse_second, args.softmax_scale, tiles.mask(section))

            _dq_correction(halves, dq, dq_, i, rank, cp, args.causal)  # v2.18:2643-2698
            wait(reqs)  # v2.18:2717-2719
            dkv = buffers[(i + 1) % 2][1]  # v2.18:2721-2729: the gradient received, ours added
            dk = dkv[:k_numel].view(ctx.k_shape)
            dv = dkv[k_numel:].view(ctx.v_shape)
            _dkv_correction(halves, dk, dk_, i, rank, cp, args.causal)  # v2.18:2731-2810
            _dkv_correction(halves, dv, dv_, i, rank, cp, args.causal)
        return dq, dk, dv, None


def _dq_correction(halves, dq, dq_, i, rank, cp, causal) -> None:
    if not causal:
        (dq.copy_ if i == 0 else dq.add_)(dq_)
    elif i > cp - rank - 1:
        dq.add_(dq_)
    elif i == cp - rank - 1:
        if rank == cp - 1:
            dq.copy_(dq_)
        else:
            halves.correct(dq, dq_, "copy", "add")
    else:  # upper triangle: the second half only
        halves.correct(dq, dq_, "none", "add" if i > 0 else "copy")


def _dkv_correction(halves, dk, dk_, i, rank, cp, causal) -> None:
    if not causal:
        (dk.copy_ if i == 0 else dk.add_)(dk_)
    elif i == cp - 1:  # diagonal
        if rank == 0:
            halves.correct(dk, dk_, "add", "copy")
        else:
            dk.add_(dk_)
    elif i >= cp - rank - 1:  # lower triangle: the first half of the keys only
        halves.correct(dk, dk_, "copy" if i == 0 and rank == cp - 1 else "add", "none")
    else:
        (dk.add_ if i > 0 else dk.copy_)(dk_)


# -- all_gather --------------------------------------------------------------------------------------


def _chunk_ids(cp: int, before: bool) -> torch.Tensor:
    """``get_seq_chunk_ids_for_reordering_before_attn`` / ``..._after_attn`` (v2.18:236-268)."""
    ids = torch.empty(2 * cp, dtype=torch.long)
    for r in range(cp):
        if before:
            ids[r], ids[r + cp] = 2 * r, 2 * cp - 2 * r - 1
        else:
            ids[2 * r], ids[2 * r + 1] = r, 2 * cp - r - 1
    return ids


def _gathered_in_sequence_order(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """v2.18:3213-3231: ``[n, ...]`` of every rank, its chunks put in sequence order ``[cp·n, ...]``."""
    total = comm.gather_along_first_dim(x, group)
    total = total.view(2 * cp, x.shape[0] // 2, *x.shape[1:]).index_select(0, _chunk_ids(cp, before=True))
    return total.view(-1, *x.shape[1:])


class AttnFuncWithCPAndKVAllGather(torch.autograd.Function):
    """``all_gather``, sbhd: ``forward(ctx, q, k, v, args) -> out`` (module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, args: CPArgs):
        if args.qkv_format != "sbhd":
            raise NotImplementedError(f"TE model: cp_comm_type='all_gather' with qkv_format={args.qkv_format!r} "
                                      "is not modelled (sbhd only)")
        group = args.cp_group
        cp, rank = comm.size(group), dist.get_rank(group)
        n = q.shape[0]
        if n % 2:  # v2.18:3139-3141
            raise ValueError(f"TE: sequence length per GPU needs to be divisible by 2 (got {n} tokens)")
        chunk = n // 2
        q = q.view(2, chunk, *q.shape[1:])  # v2.18:3204-3206
        k, v = k.contiguous(), v.contiguous()
        k_ag, v_ag = _gathered_in_sequence_order(k, group, cp), _gathered_in_sequence_order(v, group, cp)
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        lse_per_step, ends = [], []
        for i, c in enumerate((rank, 2 * cp - rank - 1)):  # v2.18:3252, 3337
            end = (c + 1) * chunk if args.causal else 2 * cp * chunk  # get_kv_seq_info_after_all_gather
            out_i, lse_i = tile_forward(q[i].contiguous(), k_ag[:end], v_ag[:end], args.softmax_scale,
                                        tile_mask(chunk, end, args.causal))
            out[i].copy_(out_i)
            lse_per_step.append(lse_i)
            ends.append(end)
        ctx.save_for_backward(q, k, v, out, *lse_per_step)  # v2.18:3611-3621
        ctx.args, ctx.ends = args, ends
        return out.view(n, *out.shape[2:])

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, *lse_per_step = ctx.saved_tensors
        args = ctx.args
        group = args.cp_group
        cp = comm.size(group)
        chunk = q.shape[1]
        dout = dout.view(out.shape)
        dq = torch.empty_like(q)
        dk = torch.zeros((k.shape[0] * cp, *k.shape[1:]), dtype=k.dtype, device=k.device)
        dv = torch.zeros((v.shape[0] * cp, *v.shape[1:]), dtype=v.dtype, device=v.device)
        k_ag, v_ag = _gathered_in_sequence_order(k, group, cp), _gathered_in_sequence_order(v, group, cp)
        for i, end in enumerate(ctx.ends):  # v2.18:3843-4093
            dq_i, dk_i, dv_i = tile_backward(q[i].contiguous(), k_ag[:end], v_ag[:end], out[i].contiguous(),
                                             dout[i].contiguous(), lse_per_step[i], args.softmax_scale,
                                             tile_mask(chunk, end, args.causal))
            dq[i].copy_(dq_i)
            dk[:end].add_(dk_i)
            dv[:end].add_(dv_i)
        after = _chunk_ids(cp, before=False)  # v2.18:4110-4121: back to rank order, summed over CP
        dk = dk.view(2 * cp, -1, *dk.shape[1:]).index_select(0, after).view(-1, *dk.shape[1:])
        dv = dv.view(2 * cp, -1, *dv.shape[1:]).index_select(0, after).view(-1, *dv.shape[1:])
        dk = comm.reduce_scatter_along_first_dim(dk, group)
        dv = comm.reduce_scatter_along_first_dim(dv, group)
        return dq.view(-1, *dq.shape[2:]), dk, dv, None


def attn_forward_func_with_cp(q, k, v, args: CPArgs, cp_comm_type: str):
    """v2.18:4921-5141 for the modelled types."""
    if cp_comm_type == "p2p":
        return AttnFuncWithCPAndKVP2P.apply(q, k, v, args)
    if cp_comm_type == "all_gather":
        return AttnFuncWithCPAndKVAllGather.apply(q, k, v, args)
    raise NotImplementedError(f"TE model: cp_comm_type={cp_comm_type!r} is not modelled ('p2p', 'all_gather')")
