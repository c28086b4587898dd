"""Rank bodies for LoRA under context parallelism: megatron-core's GPT on the TE spec with the TE
model's attention (tests.harness.te_model.attention), TP2 x CP2 + SP on four gloo ranks.

Global rank ``g`` is TP rank ``g % 2``, CP rank ``g // 2`` (megatron's order, TP fastest); the one-CP
references re-initialise megatron's parallel state on the same ranks as TP2 x DP2 (each DP replica
runs the whole batch), so a rank holds the same TP shard of every weight in both.

- :func:`sbhd_runs` (the ``sbhd`` group): every strategy with and without
  ``recompute_adapter_inputs`` at CP2 (``p2p``); the allocator's bytes of the frozen model and of each
  strategy with recompute; the gather path at CP2 ``all_gather``; the one-CP references
  (:data:`REFERENCES`); the attention alone against full-sequence attention.
- :func:`thd_runs` (the ``thd`` group): a packed batch of unequal sequences (THD) at CP2 per strategy
  and at CP1 (the gather path), and the same sequences one by one, unpacked, at CP1 (:data:`REFERENCES`).

A run's result: the per-token loss of this rank's tokens, the loss, LoRA's gradients summed over the
CP group (megatron's DDP reduces over data x context parallel ranks), LoRA's weights, the decisions.
"""

from __future__ import annotations

import gc
import inspect
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from regather.core.allocated import AllocatedBytes

TP, CP = 2, 2
STRATEGIES = ("gather", "regather", "lowrank")
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
MICRO_BATCH, DIM, SEED = 2, 8, 5
REPEATS = 2  # bytes: the smallest of this many steps after a discarded first one (measured_bytes)
#: The one-CP references: fp32 (the reference computation's own rounding) and fp64, for the gather
#: path (regather is compared with it bit for bit) and lowrank (its LoRA-A replicated: other shapes).
REFERENCES = [(s, d) for s in ("gather", "lowrank") for d in (torch.float32, torch.float64)]
#: THD: sequences of unequal lengths, each a multiple of 2·cp (TE's load balance) and of TP (SP).
THD_LENGTHS = (12, 4, 8, 8)


def shape():
    from regather.tools.cpu.models import TinyGPT

    return TinyGPT(hidden=32, ffn=64, vocab=128, seq=16, layers=2, heads=4, kv_heads=2)


def build(cp: int, dtype, strategy: str | None, recompute: bool = True, comm_type: str = "p2p"):
    """The tiny GPT on the TE spec with the TE model's attention, frozen; LoRA on every linear unless
    ``strategy`` is None. Every call re-initialises megatron's parallel state (TP2 x CP ``cp``)."""
    from tests.harness.te_model import build_te_gpt

    from regather import LoRA

    model = build_te_gpt(shape(), TP, True, dtype=dtype, te_attention=True, cp=cp, cp_comm_type=comm_type)
    for p in model.parameters():
        p.requires_grad_(False)
    if strategy is not None:
        torch.manual_seed(SEED)
        # every strategy lean (the gather path too): the comparisons are like for like, and the peak is the
        # lean output path's (docs/design.md §3.7)
        LoRA(target_modules=TARGETS, dim=DIM, alpha=2 * DIM, lora_B_init_method="normal",
             sequence_parallel_input_strategy=strategy, recompute_adapter_inputs=recompute,
             lean_transients=True)(model)
    return model


def cp_group():
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def batch_on_this_cp_rank(batch: dict) -> dict:
    """megatron's ``get_batch_on_this_cp_rank`` (``megatron/core/utils.py``): chunks ``r`` and
    ``2·cp − 1 − r`` of ``2·cp``. 0.19 takes ``is_hybrid_cp`` and the group too."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(dict(batch), False, cp_group())
    return get_batch_on_this_cp_rank(dict(batch))


def thd_on_this_cp_rank(x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """TE's ``get_batch_on_this_cp_rank`` for THD (``context_parallel.py`` v2.18:5257-5342; megatron
    0.19 calls TE's ``thd_get_partitioned_indices``, a CUDA kernel, for the same split): of every
    sequence, chunks ``r`` and ``2·cp − 1 − r`` of ``2·cp``, along dim 1."""
    if cp == 1:
        return x
    slices: list[torch.Tensor] = []
    for start, end in zip(cu_seqlens_padded[:-1].tolist(), cu_seqlens_padded[1:].tolist()):
        size = (end - start) // (2 * cp)
        slices += [torch.arange(start + rank * size, start + (rank + 1) * size),
                   torch.arange(start + (2 * cp - rank - 1) * size, start + (2 * cp - rank) * size)]
    return x.index_select(1, torch.cat(slices))


def lora_params(model) -> dict:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def step(model, tokens, position_ids, labels, total_tokens: int, packed=None, input_grad: bool = True):
    """One forward + backward of ``sum(per-token loss) / total_tokens`` (megatron's loss over the whole
    batch, this rank's share of it); the decoder input requires grad (Bridge's
    ``maybe_enable_recompute_inputs_grad``). Returns the per-token loss (detached)."""
    hook = model.embedding.register_forward_hook(lambda m, a, out: out.detach().requires_grad_(True)) \
        if input_grad else None
    try:
        per_token = model(tokens, position_ids, None, labels=labels, packed_seq_params=packed)
        (per_token.sum() / total_tokens).backward()
    finally:
        if hook is not None:
            hook.remove()
    return per_token.detach()


def result(model, per_token, total_tokens: int, cp: int) -> dict:
    """The loss (summed over CP), LoRA's gradients summed over CP, weights and decisions."""
    from regather import decisions

    loss = per_token.sum().reshape(1) / total_tokens
    grads = {n: p.grad.detach().clone() for n, p in lora_params(model).items()}
    if cp > 1:
        dist.all_reduce(loss, group=cp_group())
        for g in grads.values():
            dist.all_reduce(g, group=cp_group())
    return {"per_token": per_token, "loss": loss, "grads": grads,
            "weights": {n: p.detach().clone() for n, p in lora_params(model).items()},
            "decisions": {p: str(d) for p, d in decisions(model).items()}}


def measured_bytes(model, tokens, position_ids, labels, total_tokens: int) -> dict:
    """Allocator bytes of one step: alive after the forward and the step's peak, the smallest of
    :data:`REPEATS` steps after a discarded first one (every collective settled, so both are exact
    under gloo). Measured here: a model's first measured step peaks higher (by 5 to 7 KiB: a first
    use), a stray allocation now and then adds to a later one, and a garbage collection inside a step
    frees blocks of earlier steps, which lowers its running sum (gather's peak 8 KiB low, on every
    rank at the same step): Python's collector runs before each step, never inside one."""
    alive, peak = [], []
    hook = model.embedding.register_forward_hook(lambda m, a, out: out.detach().requires_grad_(True))
    try:
        for i in range(1 + REPEATS):
            model.zero_grad(set_to_none=True)
            gc.collect()
            with AllocatedBytes(settle_each_collective=True) as region:
                per_token = model(tokens, position_ids, None, labels=labels)
                loss = per_token.sum() / total_tokens
                region.mark("forward")
                loss.backward()
            if i:
                alive.append(region.alive_at("forward"))
                peak.append(region.peak)
            del per_token, loss
    finally:
        hook.remove()
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"alive": min(alive), "peak": min(peak), "grad_bytes": trainable}  # the weight gradients backward makes


def sbhd_batch():
    from regather.tools.cpu.models import gpt_batch

    tokens, labels, position_ids, _ = gpt_batch(shape(), MICRO_BATCH, seed=3)
    return {"tokens": tokens, "labels": labels, "position_ids": position_ids}


def on_te(body, rank):
    """``body(rank)`` with the TE model's linears and regather reading TE 2.8-2.20 (read at v2.18, as the
    attention model) as the installed TE (tests.harness.te_model.te_behaviour)."""
    from tests.harness.te_model import TE_2_8, te_behaviour

    from regather.tools.cpu.megatron_cpu import enable_megatron_cpu

    enable_megatron_cpu()
    with te_behaviour(TE_2_8):
        return body(rank)


GROUPS = {"sbhd": "sbhd_runs", "thd": "thd_runs"}


def run_group(rank, world, group) -> dict:
    """The runs of ``group`` (``("sbhd",)`` or ``("thd",)``: tests.harness.spawn_groups), by name."""
    (name,) = group
    return {name: on_te(globals()[GROUPS[name]], rank)}


def sbhd_runs(rank) -> dict:
    full = sbhd_batch()
    total = full["tokens"].numel()
    out = {"tp_rank": rank % TP, "cp_rank": rank // TP, "cp2": {}, "cp1": {}, "bytes": {}}
    for strategy, recompute in [(None, False)] + [(s, rc) for s in STRATEGIES for rc in (False, True)]:
        model = build(CP, torch.float32, strategy, recompute)
        local = batch_on_this_cp_rank(full)
        args = (local["tokens"], local["position_ids"], local["labels"], total)
        per_token = step(model, *args)
        if strategy is not None:
            out["cp2"][("p2p", strategy, recompute)] = result(model, per_token, total, CP)
        if recompute or strategy is None:  # what long-context LoRA runs; measured in CP1 tests without
            out["bytes"][strategy] = measured_bytes(model, *args)
    model = build(CP, torch.float32, "gather", True, comm_type="all_gather")
    per_token = step(model, *args)
    out["cp2"][("all_gather", "gather", True)] = result(model, per_token, total, CP)
    out["attention"] = attention_alone()  # while megatron's parallel state is CP2
    for strategy, dtype in REFERENCES:
        model = build(1, dtype, strategy, True)
        per_token = step(model, full["tokens"], full["position_ids"], full["labels"], total)
        out["cp1"][(strategy, dtype)] = result(model, per_token, total, 1)
    return out


# -- packed sequences (THD) ---------------------------------------------------------------------------


def thd_batch():
    """The packed sequences: tokens, labels, position ids ``[1, T]`` and ``cu_seqlens`` (int32)."""
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, shape().vocab, (n + 1,), generator=g) for n in THD_LENGTHS]
    tokens = torch.cat([s[:-1] for s in seqs]).unsqueeze(0)
    labels = torch.cat([s[1:] for s in seqs]).unsqueeze(0)
    position_ids = torch.cat([torch.arange(n) for n in THD_LENGTHS]).unsqueeze(0)
    cu = torch.tensor([0, *torch.tensor(THD_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return tokens, labels, position_ids, cu


def packed_params(cu):
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = max(THD_LENGTHS)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def thd_runs(rank) -> dict:
    tokens, labels, position_ids, cu = thd_batch()
    total = tokens.numel()
    out = {"tp_rank": rank % TP, "cp_rank": rank // TP, "packed": {}, "one_by_one": {}, "cu": cu}
    for cp, strategy in [(CP, s) for s in STRATEGIES] + [(1, "gather")]:
        model = build(cp, torch.float32, strategy, True)
        local = [thd_on_this_cp_rank(x, cu, cp, rank // TP) for x in (tokens, labels, position_ids)]
        per_token = step(model, local[0], local[2], local[1], total, packed=packed_params(cu))
        out["packed"][(cp, strategy)] = result(model, per_token, total, cp)
    bounds = cu.tolist()
    for strategy, dtype in REFERENCES:
        model = build(1, dtype, strategy, True)
        per_token = [step(model, tokens[:, a:e], position_ids[:, a:e], labels[:, a:e], total)
                     for a, e in itertools.pairwise(bounds)]  # one unpacked batch row per sequence
        out["one_by_one"][(strategy, dtype)] = result(model, torch.cat(per_token, dim=1), total, 1)
    return out


# -- the attention alone --------------------------------------------------------------------------------


def attention_alone() -> dict:
    """The TE model's attention at CP2 (``p2p`` and ``all_gather`` sbhd, ``p2p`` THD) on this rank's
    chunks, fp32, and what fp32 and fp64 full-sequence attention (``F.scaled_dot_product_attention``,
    causal, per sequence for THD) give for them. Needs megatron's parallel state at CP2 (the last
    :func:`build` at CP2 leaves it)."""
    from tests.harness.te_model.context_parallel import CPArgs, attn_forward_func_with_cp

    group = cp_group_cp2()
    ranks = tuple(dist.get_process_group_ranks(group))
    r = dist.get_rank(group)
    g = torch.Generator().manual_seed(21)
    s, b, h, hk, d = 16, 2, 4, 2, 8
    q, k, v, dout = (torch.randn(s, b, n, d, generator=g, dtype=torch.float64) for n in (h, hk, hk, h))
    cu = torch.tensor([0, 4, 12, 16], dtype=torch.int32)  # THD: b = 1, three sequences
    out = {}
    for name, fmt, comm_type in (("p2p", "sbhd", "p2p"), ("all_gather", "sbhd", "all_gather"),
                                 ("thd_p2p", "thd", "p2p")):
        qf, kf, vf, df = (x[:, :1] if fmt == "thd" else x for x in (q, k, v, dout))

        def split(x, fmt=fmt):
            return rank_chunks(x, fmt, cu, r)

        refs = {}
        for dtype in (torch.float64, torch.float32):
            leaves = [x.detach().to(dtype).clone().requires_grad_() for x in (qf, kf, vf)]
            o = full_attention(*leaves, fmt, cu)
            o.backward(df.to(dtype))
            refs[str(dtype)] = [split(x) for x in (o.detach(), *(t.grad for t in leaves))]
        leaves = [split(x).float().clone().requires_grad_() for x in (qf, kf, vf)]
        args = CPArgs(group, ranks, d ** -0.5, True, fmt, cu if fmt == "thd" else None)
        o = attn_forward_func_with_cp(*leaves, args, comm_type)
        o.backward(split(df).float())
        out[name] = {"got": [o.detach(), *(t.grad for t in leaves)], "ref32": refs["torch.float32"],
                     "ref64": refs["torch.float64"]}
    return out


def rank_chunks(x: torch.Tensor, fmt: str, cu, r: int) -> torch.Tensor:
    """CP rank ``r``'s tokens of ``[s, b, ...]``: megatron's split (TE's, per sequence, for THD)."""
    if fmt == "thd":
        return thd_on_this_cp_rank(x.transpose(0, 1), cu, CP, r).transpose(0, 1)
    return x.view(2 * CP, x.shape[0] // (2 * CP), *x.shape[1:])[[r, 2 * CP - 1 - r]].flatten(0, 1)


def cp_group_cp2():
    group = cp_group()
    assert dist.get_world_size(group) == CP, "attention_alone needs the CP2 parallel state"
    return group


def full_attention(q, k, v, fmt: str, cu) -> torch.Tensor:
    """Causal attention over the whole sequence(s), ``[s, b, h, d]`` (GQA by repeating k / v)."""
    groups = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(groups, dim=2) for x in (k, v))
    if fmt != "thd":
        o = F.scaled_dot_product_attention(*(x.permute(1, 2, 0, 3) for x in (q, k, v)), is_causal=True)
        return o.permute(2, 0, 1, 3)
    bounds = cu.tolist()
    parts = [full_attention(q[a:e], k[a:e], v[a:e], "sbhd", None) for a, e in itertools.pairwise(bounds)]
    return torch.cat(parts)
